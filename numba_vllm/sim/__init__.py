"""The Numba CUDA simulator, completed: warp intrinsics (`warp.py`), a faster block manager
(`blocks.py`) and `break_in`, pdb at one simulated thread (`stepping.py`).

`import numba_vllm.kernels` installs the first two when ``NUMBA_ENABLE_CUDASIM=1``.
"""
