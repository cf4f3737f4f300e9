"""The model: its configuration, the device forward pass (`llama.py`), the NumPy reference model and
RoPE frequencies. Importing the package imports nothing heavy; `llama` needs numba.cuda."""
