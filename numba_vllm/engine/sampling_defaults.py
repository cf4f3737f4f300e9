"""Requests' sampling defaults from the model, as vLLM sets them.

A checkpoint's `generation_config.json` may suggest sampling values (Llama 3.2 Instruct: temperature
0.6, top_p 0.9). With `generation_config="auto"` (the default, as in vLLM) they are the defaults of
every request: a value the request (or the user) sets explicitly wins, a value it leaves out takes
the model's, and what the model does not set keeps SamplingParams' own default. With "vllm" the
model's values are ignored and SamplingParams' neutral defaults (temperature 1, no top-p / top-k cut)
apply. The file's `do_sample` is not read, as in vLLM.
"""

from __future__ import annotations

from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.model.config import ModelConfig


def model_sampling_defaults(config: ModelConfig, generation_config: str) -> dict[str, float | int]:
    """SamplingParams keyword values the model suggests (empty with "vllm", or when it suggests none).

    Only the values SamplingParams has a field for are taken."""
    if generation_config == "vllm":
        return {}
    fields = SamplingParams.__dataclass_fields__
    return {name: value for name, value in config.generation.values().items() if name in fields}
