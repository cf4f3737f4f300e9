"""Host-side engine: requests, the paged KV-cache allocator and the continuous-batching scheduler.

Everything here is plain Python + NumPy with no GPU import, so the policy (who runs, which pages
they hold, who is preempted) is tested exactly on the CPU. The runner turns a scheduler's
`StepPlan` into device arrays.
"""

from numba_vllm.engine.kv_cache import (
    NULL_PAGE_ID,
    OutOfPagesError,
    PageAllocator,
    PageFreeError,
    block_table_array,
    kv_indices,
    num_pages_for_memory,
    page_bytes,
    pages_for_tokens,
)
from numba_vllm.engine.request import Request, RequestStatus
from numba_vllm.engine.scheduler import RequestTooLongError, ScheduledSequence, Scheduler, SchedulerStalledError, StepPlan

__all__ = [
    "NULL_PAGE_ID",
    "OutOfPagesError",
    "PageAllocator",
    "PageFreeError",
    "Request",
    "RequestStatus",
    "RequestTooLongError",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerStalledError",
    "StepPlan",
    "block_table_array",
    "kv_indices",
    "num_pages_for_memory",
    "page_bytes",
    "pages_for_tokens",
]
