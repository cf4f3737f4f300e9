"""Pictures of the engine at work, written to files: a timeline of batch slots and KV-cache pages step
by step (`timeline`: HTML or PNG, from `numba-vllm run --timeline` and `examples/continuous_batching.py`),
and the benchmarks' plots (`bench_plots`: `numba-vllm bench ... --plot`).

The HTML needs nothing; PNG (and the plots) need matplotlib, the optional `plot` extra
(`pip install 'numba-vllm[plot]'`), imported only when a picture is drawn (`mpl`). The live page of the
server is elsewhere: `numba_vllm/server/dashboard.py`.
"""
