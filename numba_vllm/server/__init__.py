"""The OpenAI-compatible HTTP server behind `numba-vllm serve` (needs the `serve` extra: FastAPI,
uvicorn, pyzmq, msgspec).

    from numba_vllm.engine.config import EngineConfig
    from numba_vllm.server import run_server
    from numba_vllm.server.core_process import CoreProcess, CoreSpec

    if __name__ == "__main__":  # the core process is spawned: it imports this module again
        core = CoreProcess(CoreSpec("path/to/model", "auto", EngineConfig()))
        core.start()  # loads the model in the engine-core process
        run_server(core, ["my-model"], host="127.0.0.1", port=8000)

(`run_server(llm_engine, ...)` steps an engine of this process in a thread instead.) The engine core
(`engine_core`: its loop; `core_process`: its process or thread; `core_protocol`: the messages)
steps the engine; `engine_loop` is the front end's side of it (requests out, tokens in, text and
stop strings here). `protocol` parses and checks request bodies and builds response bodies, `guard`
checks host, API key and content type before any route, `limits` bounds what one client may ask,
`streams` answers (collected or streamed), `metrics` renders /metrics,
`openapi` completes the schema, `http_protocol` and `log_limits` harden uvicorn's connection
handling and logs, `app` holds the routes and the server with its graceful shutdown.
docs/server.md describes the endpoints.
"""

from numba_vllm.server.app import Server, create_app, listen, run_server, server_config
from numba_vllm.server.limits import ServerLimits

__all__ = ["Server", "ServerLimits", "create_app", "listen", "run_server", "server_config"]
