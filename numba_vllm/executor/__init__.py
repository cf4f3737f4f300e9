"""Executors: a scheduler's `StepPlan` -> device inputs -> one forward pass -> sampled tokens.

`inputs.py` builds a step's arrays (kv indices, block tables, positions) for eager and graph steps
alike; `capacity.py` decides the KV-cache size and `max_model_len` once, before the scheduler is
built; `numpy_runner.py` and `kernel_runner.py` run the model; `cuda_graph.py` replays decode steps;
`backend.py` picks the backend.
"""
