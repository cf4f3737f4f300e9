"""The OpenAI-compatible HTTP server behind `numba-vllm serve` (needs the `serve` extra: FastAPI, uvicorn).

    from numba_vllm.server import run_server
    run_server(engine, ["my-model"], host="127.0.0.1", port=8000)

`protocol` parses and checks request bodies and builds response bodies, `guard` checks host, API
key and content type before any route, `limits` bounds what one client may ask, `engine_loop` runs
the engine in its one thread, `streams` answers (collected or streamed), `metrics` renders /metrics,
`openapi` completes the schema, `http_protocol` and `log_limits` harden uvicorn's connection
handling and logs, `app` holds the routes and the server with its graceful shutdown.
docs/server.md describes the endpoints.
"""

from numba_vllm.server.app import Server, create_app, listen, run_server, server_config
from numba_vllm.server.limits import ServerLimits

__all__ = ["Server", "ServerLimits", "create_app", "listen", "run_server", "server_config"]
