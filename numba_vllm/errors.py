"""Errors shared across layers, importable without touching numba (the CLI catches these before it
knows which backend runs)."""


class KernelError(RuntimeError):
    """A kernel launch failed, or a launcher was given arrays it cannot work on; names the kernel."""
