"""Step inputs on their way to the device and sampled tokens on their way back, queued on one stream.

A step's int32 inputs are packed (`inputs.StepLayout.pack`) into a pinned host buffer and copied to
one device buffer, whose address never changes (CUDA graphs read it), by one asynchronous copy; the
step's sampled tokens, written by the sampler into one device array, come back the same way into
pinned memory. Nothing here waits for the GPU: the host can pack step n+1 while step n runs.

Two host slots are used in turn. With overlapped scheduling at most two steps are outstanding (the
one being collected and the one just launched), so the slot a new step takes belonged to the step
before the previous one, already collected; the slot's event (recorded after its step's download)
is waited on anyway before the slot is written again. The one device buffer needs no second copy:
the stream runs a step's upload only after the previous step's kernels, which read the buffer, are
done.

numba's `copy_to_device` / `copy_to_host` spend ~90 / ~16 us in Python per call (they slice and check
the arrays) and wait for the copy; the driver-level copies below them take ~4 us and return at once,
so the copies here call them directly. In the simulator they are plain copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import cuda

from numba_vllm.executor.inputs import PackedStep, SamplerInputs, StepLayout, StepShape
from numba_vllm.model.llama import StepInputs
from numba_vllm.sim.warp import simulator_enabled

MAX_CACHED_VIEWS = 1024  # step shapes whose device views are kept (slicing a device array costs tens of us)


@dataclass(eq=False)
class StagingSlot:
    """One step's host side: its packed inputs, its sampled tokens, the event after its last copy."""

    host: np.ndarray  # (num_words,) int32, pinned
    tokens: np.ndarray  # (max_num_seqs,) int32, pinned: the step's sampled tokens, once its event has passed
    event: object  # numba event, recorded after the step's download
    owner: object = field(default=None)  # the step using the slot (a new step takes it over)


class StepStaging:
    """The packed step buffer on the device, two host slots, the sampled tokens, on `stream`."""

    def __init__(self, layout: StepLayout, stream):
        self.layout = layout
        self.stream = stream  # a numba stream: the copies and events
        self._simulated = simulator_enabled()
        # The same stream as cuda.core sees it, for the launches (and graph recording): numba would
        # otherwise wrap the numba stream anew at every launch. The simulator launches on numba's.
        self.launch_stream = stream if self._simulated else _core_stream(stream)
        self.device = cuda.device_array(layout.num_words, np.int32)  # (num_words,) the packed step, fixed address
        self.tokens = cuda.device_array(layout.max_num_seqs, np.int32)  # (max_num_seqs,) the latest step's samples
        self.tokens_2d = self.tokens.reshape(layout.max_num_seqs, 1)  # as rows, for feeding them to the next step
        pinned = cuda.pinned_array
        self.slots = [
            StagingSlot(pinned(layout.num_words, np.int32), pinned(layout.max_num_seqs, np.int32), self._event())
            for _ in range(2)
        ]
        self._turn = 0
        self._views: dict[StepShape, tuple[StepInputs, SamplerInputs]] = {}

    def take_slot(self, owner) -> StagingSlot:
        """The next host slot, once its previous step's copies are done."""
        slot = self.slots[self._turn]
        self._turn ^= 1
        slot.event.synchronize()
        slot.owner = owner
        return slot

    def upload(self, slot: StagingSlot, packed: PackedStep) -> None:
        """Queue the copy of the packed step's used words to the device buffer."""
        n = packed.num_words
        if self._simulated:
            self.device[:n].copy_to_device(slot.host[:n])
            return
        from numba.cuda.cudadrv import driver

        driver.host_to_device(self.device, slot.host, n * 4, stream=self.stream)

    def download(self, slot: StagingSlot, num_tokens: int) -> None:
        """Queue the copy of the first `num_tokens` sampled tokens to the slot, then its event."""
        if self._simulated:
            if num_tokens:
                self.tokens[:num_tokens].copy_to_host(slot.tokens[:num_tokens])
            return
        from numba.cuda.cudadrv import driver

        if num_tokens:
            driver.device_to_host(slot.tokens, self.tokens, num_tokens * 4, stream=self.stream)
        slot.event.record(self.stream)

    def _event(self):
        """An event without timing (cheaper to record); the simulator's takes no arguments."""
        return cuda.event() if self._simulated else cuda.event(timing=False)

    def views(self, shape: StepShape) -> tuple[StepInputs, SamplerInputs]:
        """The step's device views for `shape` (kept per shape)."""
        views = self._views.get(shape)
        if views is None:
            if len(self._views) >= MAX_CACHED_VIEWS:
                self._views.clear()
            views = self._views[shape] = self.layout.views(self.device, shape, self.tokens)
        return views


def _core_stream(stream):
    """A numba stream as a cuda.core stream (not owning it: the numba stream must outlive it)."""
    from cuda.core import Stream

    return Stream.from_handle(int(stream.handle))
