"""numba-vllm: LLM inference in Python with Numba CUDA kernels.

    from numba_vllm import LLM, SamplingParams
    llm = LLM()                                    # SmolLM2-135M-Instruct; backend: GPU if usable
    out = llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0))
    print(out[0].outputs[0].text)
"""

from numba_vllm.engine.llm_engine import LLM, LLMEngine
from numba_vllm.engine.output import RequestOutput
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.engine.structured import StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
