"""GPU kernels (Numba CUDA). Importing the package installs the simulator's warp intrinsics
and pooled block manager when ``NUMBA_ENABLE_CUDASIM=1`` (see ``simulator.py`` and ``sim_blocks.py``)."""

from numba_vllm.sim import warp as simulator

simulator.install()
