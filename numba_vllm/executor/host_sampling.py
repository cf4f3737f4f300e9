"""Sampling on the host, per request: each request keeps its own random generator (seeded by its
`SamplingParams.seed`), so its tokens do not depend on what else shares the batch. The numpy runner
samples every row here; the kernel runner only the rows its device samplers do not cover (top-k,
top-p, min-p)."""

from __future__ import annotations

import numpy as np

from numba_vllm.engine.sampling import sample


class RequestSamplers:
    """Each request's random generator, created at its first sample and dropped when it finishes."""

    def __init__(self):
        self._rngs: dict[str, np.random.Generator] = {}

    def sample(self, request, logits: np.ndarray) -> int:
        """One token for `request` from its logits row (V,)."""
        params = request.sampling_params
        rng = self._rngs.get(request.request_id)
        if rng is None:
            rng = self._rngs[request.request_id] = params.make_rng()
        return sample(logits, params, rng)

    def release(self, request_id: str) -> None:
        self._rngs.pop(request_id, None)
