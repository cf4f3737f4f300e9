"""The OpenAI-compatible HTTP server behind `numba-vllm serve` (needs the `serve` extra: FastAPI, uvicorn).

    from numba_vllm.server import run_server
    run_server(engine, ["my-model"], host="127.0.0.1", port=8000)

`protocol` parses and checks request bodies and builds response bodies, `engine_loop` runs the
engine in its one thread, `metrics` renders /metrics, `app` holds the routes and the server with
its graceful shutdown. docs/server.md describes the endpoints.
"""

from numba_vllm.server.app import DEFAULT_MAX_REQUEST_BYTES, Server, create_app, run_server

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "Server", "create_app", "run_server"]
