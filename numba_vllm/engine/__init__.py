"""The engine: host policy only. Requests, the paged KV-cache allocator and its prefix cache, the
continuous-batching scheduler, stop rules and the length policy, and `LLMEngine` / `LLM` on top.

Everything here is plain Python + NumPy: importing it imports no numba (tested), so the policy (who
runs, which pages they hold, who is preempted) is tested exactly on the CPU. The executor
(`numba_vllm.executor`) turns a scheduler's `StepPlan` into device work.
"""

from numba_vllm.engine.kv_cache import NULL_PAGE_ID, OutOfPagesError, PageAllocator, PageFreeError, pages_for_tokens
from numba_vllm.engine.lengths import LengthPolicy, MaxTokensError, PromptError
from numba_vllm.engine.prefix_cache import PrefixCache
from numba_vllm.engine.request import Request, RequestStatus
from numba_vllm.engine.scheduler import ScheduledSequence, Scheduler, SchedulerStalledError, StepPlan

__all__ = [
    "NULL_PAGE_ID",
    "LengthPolicy",
    "MaxTokensError",
    "OutOfPagesError",
    "PageAllocator",
    "PageFreeError",
    "PrefixCache",
    "PromptError",
    "Request",
    "RequestStatus",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerStalledError",
    "StepPlan",
    "pages_for_tokens",
]
