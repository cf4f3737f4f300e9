"""The FastAPI application, and the uvicorn server that shuts it down gracefully.

A POST is handled on the event loop: `guard.py` has checked the host, the API key and the content
type; read the body (size- and time-limited), validate it (`protocol`), tokenize in a worker thread
(templates and long prompts take a while), check lengths and the waiting queue, then hand each prompt
to the engine core (`EngineLoop.add`: it runs in a process of its own, `core_process.py`) and wait
until the engine has accepted it, so that a prompt the engine refuses still gets a 4xx. The answer is
either collected (plain JSON) or streamed as server-sent events ending in `data: [DONE]`. Either way
the request is raced against the client's disconnect: a client that goes away aborts its engine
request, which frees its slot and its KV pages before the next step. `limits.py` lists every bound
on a client; an unexpected error is logged with an id and answered with a 500 that carries the id
and nothing else.

Shutdown (SIGINT or SIGTERM, or `Server.begin_shutdown()`): new generation requests get 503 and
/health turns 503; in-flight requests run to completion for up to `shutdown_timeout` seconds, then
the rest are aborted (they end with finish_reason "abort"); then uvicorn closes and the process exits
with status 0. A second signal stops at once: every open response ends now with finish_reason
"abort" (streams with their final chunk and `[DONE]`), whatever the engine core is doing (a core
process that does not end at once is killed), and the process exits within a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from numba_vllm.engine.llm_engine import LLMEngine
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.engine.structured import GrammarError, StructuredOutputs
from numba_vllm.server.core_process import CoreProcess, CoreThread
from numba_vllm.server.core_protocol import ModelInfo
from numba_vllm.server.dashboard import dashboard_routes
from numba_vllm.server.engine_loop import EngineLoop
from numba_vllm.server.guard import Guard
from numba_vllm.server.http_protocol import with_header_timeout
from numba_vllm.server.limits import ServerLimits
from numba_vllm.server.log_limits import limit_server_logs
from numba_vllm.server.logprobs import ChoiceLogprobs, join_completion_logprobs, prompt_logprobs_field
from numba_vllm.server.metrics import CONTENT_TYPE
from numba_vllm.server.openapi import document_errors
from numba_vllm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    check_length,
    check_supported,
    constraint_field,
    echo_only,
    envelope,
    parse_body,
    sampling_params,
    usage,
)
from numba_vllm.server.streams import EventStream, Submission, collect, stream_chat, stream_completion, unless_disconnected
from numba_vllm.server.tokenize import chat_prompt_ids, detokenize, tokenize, tokenizer_info

logger = logging.getLogger("uvicorn.error")

RETRY_AFTER_SECONDS = 1  # the Retry-After of a 503 for a full waiting queue


class ServerState:
    """What the handlers share: the engine core's client, the model, the settings, and the shutdown state."""

    def __init__(
        self, core: CoreThread | CoreProcess, served_model_names: Sequence[str], api_key: str | None, limits: ServerLimits
    ):
        if not served_model_names:
            raise ValueError("at least one served model name is needed")
        self.core = core
        self.model: ModelInfo = core.info
        self.structured = StructuredOutputs.for_model(core.info.config, core.info.tokenizer)  # for the 400s
        self.model_names = list(served_model_names)
        self.engine_loop = EngineLoop(core, core.info, self.model_names[0])
        self.api_key = api_key or None
        self.limits = limits
        self.created = int(time.time())
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        self.stopping_now = False  # a second signal: end every response now, do not wait for the engine core
        self.submissions: set[Submission] = set()  # generation requests between submission and their response's end

    @property
    def active(self) -> int:
        return len(self.submissions)

    def resolve_model(self, name: str | None) -> str:
        if name is None:
            return self.model_names[0]
        if name not in self.model_names:
            raise APIError(
                404,
                f"the model '{name}' does not exist; this server serves {', '.join(map(repr, self.model_names))}",
                param="model",
                code="model_not_found",
            )
        return name

    async def drain(self, timeout: float) -> None:
        """Wait for in-flight requests to end (at most `timeout` s), then abort the rest."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self.active:
            logger.info("shutting down: waiting up to %.0f s for %d in-flight requests", timeout, self.active)
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.active:
            logger.info("shutting down: aborting %d requests", self.active)
            self.engine_loop.abort_all()
            deadline = loop.time() + 5.0
            while self.active and loop.time() < deadline:
                await asyncio.sleep(0.02)

    def end_all_now(self) -> None:
        """Every open response ends now with finish_reason "abort" (runs on the event loop)."""
        for submission in list(self.submissions):
            submission.end_now()


# ---- the app ------------------------------------------------------------------------------------
def create_app(
    engine: LLMEngine | CoreProcess,
    served_model_names: Sequence[str],
    api_key: str | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """The OpenAI-compatible app around an engine core: a started `CoreProcess`, or an `LLMEngine`
    of this process (its core loop then runs in a thread). The core runs while the app's lifespan does."""
    core = CoreThread(engine) if isinstance(engine, LLMEngine) else engine
    state = ServerState(core, served_model_names, api_key, limits or ServerLimits())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        state.engine_loop.start()
        try:
            yield
        finally:
            state.draining = True
            # After a second signal the core (maybe mid-step) is not waited for: a process is killed, a thread is a daemon.
            await state.engine_loop.stop(0.0 if state.stopping_now else 30.0)

    app = FastAPI(title="numba-vllm", lifespan=lifespan)
    app.state.numba_vllm = state
    app.add_middleware(Guard, state=state)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = f"no route {request.method} {request.url.path}" if e.status_code in codes else str(e.detail)
        body = APIError(e.status_code, message, code=codes.get(e.status_code)).body()
        return JSONResponse(body, status_code=e.status_code, headers=e.headers)  # 405 carries Allow

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return JSONResponse(bad_request(str(e)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):  # a bug: the details go to the log only
        error_id = uuid.uuid4().hex[:16]
        logger.error("internal error %s on %s %s", error_id, request.method, request.url.path, exc_info=e)
        error = APIError(500, f"internal server error (id {error_id}); the server log has the details", code="internal_error")
        return JSONResponse(error.body(), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine serves; 503 while shutting down or once the engine cannot serve."""
        ok = state.engine_loop.alive and not state.draining
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.engine_loop.metrics.render(), media_type=CONTENT_TYPE)

    app.include_router(dashboard_routes(state))  # GET /dashboard, GET /v1/dashboard/state

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "numba-vllm",
            "max_model_len": state.model.max_model_len,
        }

    @app.post("/tokenize")
    async def tokenize_prompt(request: Request) -> dict:  # vLLM's; prefix-aware routers call it
        return await tokenize(state.model, await _read_body(request, state.limits), state.resolve_model)

    @app.post("/detokenize")
    async def detokenize_ids(request: Request) -> dict:  # vLLM's: token ids back to text
        return await detokenize(state.model, await _read_body(request, state.limits), state.resolve_model)

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> dict:  # vLLM's: special tokens and chat template, for clients tokenizing here
        return tokenizer_info(state.model)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(n) for n in state.model_names]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict:
        return model_card(state.resolve_model(model))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req = parse_body(await _read_body(request, state.limits), CompletionRequest)
        model = state.resolve_model(req.model)
        check_supported(req)
        params = sampling_params(req, state.model.sampling_defaults)
        await _compile_constraint(state.structured, params, req)
        prompts = await _completion_prompts(state.model, req, state.limits.max_prompts_per_request)
        echo_texts = None
        if req.echo:  # the prompt as given, or decoded from its ids
            given = [req.prompt] if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int)) else req.prompt
            echo_texts = [p if isinstance(p, str) else _decode(state.model, ids) for p, ids in zip(given, prompts, strict=True)]
        return await _generate(state, request, "cmpl", prompts, params, req, model, arrival, "prompt", echo_texts)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req = parse_body(await _read_body(request, state.limits), ChatCompletionRequest)
        model = state.resolve_model(req.model)
        check_supported(req)
        params = sampling_params(req, state.model.sampling_defaults)
        await _compile_constraint(state.structured, params, req)
        ids = await chat_prompt_ids(state.model.tokenizer, req, model)
        return await _generate(state, request, "chatcmpl", [ids], params, req, model, arrival, "messages")

    document_errors(app)
    return app


async def _read_body(request: Request, limits: ServerLimits) -> bytes:
    """The body, at most `limits.max_request_bytes` (413), all of it within `limits.body_timeout` s (408)."""
    limit = limits.max_request_bytes
    too_large = APIError(413, f"the request body is larger than the limit of {limit} bytes", code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large

    async def read() -> bytes:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        return bytes(body)

    try:
        return await asyncio.wait_for(read(), limits.body_timeout)
    except ClientDisconnect:  # nobody will read the answer
        raise bad_request("the client disconnected while sending the body") from None
    except TimeoutError:
        message = f"the request body took longer than {limits.body_timeout:g} s to arrive"
        raise APIError(408, message, code="request_timeout") from None


async def _compile_constraint(structured: StructuredOutputs, params: SamplingParams, req: Any) -> None:
    """Compile the request's structured-output constraint now, in a worker thread, against the
    model's tokenizer: one that cannot compile is a 400 naming the problem before anything reaches
    the engine core (which compiles it again, in its own process, as it admits the request)."""
    if params.structured_outputs is None:
        return
    try:
        await run_in_threadpool(structured.compile, params.structured_outputs)
    except GrammarError as e:
        raise bad_request(str(e), constraint_field(req)) from None


async def _completion_prompts(model: ModelInfo, req: CompletionRequest, max_prompts: int) -> list[list[int]]:
    """The prompt field as token-id lists (text encoded in a worker thread)."""
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        p = [p]
    if not p:
        raise bad_request("'prompt' is empty", "prompt")
    if len(p) > max_prompts:
        raise bad_request(f"'prompt' holds {len(p)} prompts; at most {max_prompts} are taken in one request", "prompt")
    texts = [x for x in p if isinstance(x, str)]
    if texts:
        if model.tokenizer is None:
            raise bad_request("this model has no tokenizer: give the prompt as a list of token ids", "prompt")
        encoded = iter(await run_in_threadpool(lambda: [model.tokenizer.encode(t) for t in texts]))
        p = [next(encoded) if isinstance(x, str) else x for x in p]
    return [list(x) for x in p]


def _decode(model: ModelInfo, ids: list[int]) -> str:
    """Token ids as text, special tokens included (echoed prompts, logprobs' tokens); "" without a tokenizer."""
    return "" if model.tokenizer is None else model.tokenizer.decode(ids, skip_special_tokens=False)


async def _generate(
    state: ServerState,
    request: Request,
    prefix: str,
    prompts: list[list[int]],
    params: SamplingParams,
    req: Any,
    model: str,
    arrival: float,
    prompt_param: str,
    echo_texts: list[str] | None = None,
) -> Response:
    """Run the prompts; answer with their choices, whole or streamed. `echo_texts`: completions'
    `echo`, each prompt's text to put before its output."""
    explicit = bool({"max_tokens", "max_completion_tokens"} & req.model_fields_set)
    for i, ids in enumerate(prompts):
        param = prompt_param if len(prompts) == 1 else f"{prompt_param}[{i}]"
        check_length(state.engine_loop.lengths, ids, req, explicit, param)
    if state.draining:
        raise APIError(503, "the server is shutting down", code="service_unavailable")
    n = params.n
    if len(prompts) * n > state.limits.max_prompts_per_request:
        most = state.limits.max_prompts_per_request
        raise bad_request(f"{len(prompts)} prompts x n={n} choices is more than the {most} one request may ask for", "n")
    limit = state.limits.max_waiting_requests
    if state.engine_loop.num_waiting() + len(prompts) * n > limit:
        raise APIError(
            503,
            f"the server is busy: {limit} requests are waiting already; retry later",
            code="service_unavailable",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
    base_id = f"{prefix}-{uuid.uuid4().hex}"
    ids = [base_id] if len(prompts) == 1 else [f"{base_id}-{i}" for i in range(len(prompts))]
    submission = Submission(state, ids, prompts, n)
    await submission.start(params, arrival)  # closes the submission itself if it raises
    chat = prefix == "chatcmpl"
    view = ChoiceLogprobs(chat, params.logprobs is not None, params.logprobs or 0, prompts, n, echo_texts, echo_only(req),
                          lambda t: _decode(state.model, [t]), req.prompt_logprobs is not None)  # fmt: skip
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        body = stream_chat if chat else stream_completion
        stream = body(submission, base_id, model, req.return_token_ids, include_usage, view)
        return EventStream(stream, submission, state.limits.write_timeout)
    try:
        result = await unless_disconnected(request, collect(submission))
    finally:
        submission.close()
    if result is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    answers, cached_tokens = result
    choices = []
    for d in answers:  # choice i: prompt i // n, its sequence i % n (OpenAI's order)
        echoed, prompt_logprobs = view.prefix(d.index, d.prompt_logprobs)
        text, token_ids, logprobs = view.output(d.index, d.text, d.token_ids, d.logprobs)
        if echoed:
            text = echoed + text
            logprobs = join_completion_logprobs(prompt_logprobs, logprobs) if logprobs is not None else prompt_logprobs
        if chat:
            choice = {"index": d.index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": d.finish_reason}  # fmt: skip
        else:
            choice = {"index": d.index, "text": text, "logprobs": logprobs, "finish_reason": d.finish_reason}
        if req.return_token_ids:
            choice.update(prompt_token_ids=prompts[d.index // n], token_ids=token_ids)
        if req.prompt_logprobs is not None and d.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_field(d.prompt_logprobs)
        choices.append(choice)
    body = envelope(base_id, "chat.completion" if chat else "text_completion", model)
    completion_tokens = 0 if view.echo_only else sum(len(d.token_ids) for d in answers)
    body.update(choices=choices, usage=usage(sum(map(len, prompts)), completion_tokens, cached_tokens))
    return JSONResponse(body)


# ---- the server -----------------------------------------------------------------------------------
class Server(uvicorn.Server):
    """uvicorn's server with a graceful drain on the first SIGINT/SIGTERM and exit status 0."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float = 30.0):
        super().__init__(config)
        self.state: ServerState = config.app.state.numba_vllm
        self.shutdown_timeout = shutdown_timeout
        self._drain_task: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn's own re-raises the signal after shutdown (the process would die of it); we exit 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.loop is None or not self.started:
            super().handle_exit(sig, frame)  # not serving yet: stop now
        elif self.state.draining:
            self.stop_now()  # a second signal
        else:
            self.begin_shutdown()

    def stop_now(self) -> None:
        """End every open response now (finish_reason "abort"), then exit without waiting for the engine."""
        if self.state.stopping_now:
            return
        self.state.draining = self.state.stopping_now = True
        logger.info("stopping now")
        self.config.timeout_graceful_shutdown = 1  # a response that still does not end is cut after 1 s
        self.state.loop.call_soon_threadsafe(self.state.end_all_now)
        self.should_exit = True

    def begin_shutdown(self) -> None:
        """Start the graceful drain (thread-safe): 503 to new requests, in-flight ones finish, then exit."""
        if self.state.draining:
            return
        self.state.draining = True
        if self.state.loop is None:  # not serving yet
            self.should_exit = True
            return
        logger.info("shutting down: no new requests")
        self.state.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.state.drain(self.shutdown_timeout)
        finally:
            self.should_exit = True


def server_config(app: FastAPI, host: str, port: int, **uvicorn_args) -> uvicorn.Config:
    """uvicorn's settings for `app`: the header deadline of the app's limits (`http_protocol.py`)."""
    limits: ServerLimits = app.state.numba_vllm.limits
    return uvicorn.Config(
        app, host=host, port=port, http=with_header_timeout(limits.header_timeout), lifespan="on",
        timeout_graceful_shutdown=5, **uvicorn_args,
    )  # fmt: skip


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port), made before the model loads so a port in use is
    reported at once; OSError (one line) if it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def run_server(
    engine: LLMEngine | CoreProcess,
    served_model_names: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    shutdown_timeout: float = 30.0,
    log_level: str = "info",
    access_log: bool = True,
    sock: socket.socket | None = None,
) -> None:
    """Serve `engine` (a started `CoreProcess`, or an `LLMEngine` stepped in a thread) until
    SIGINT/SIGTERM; returns after a clean shutdown. `sock`: a socket from `listen` (else one is
    opened on host:port)."""
    limit_server_logs()
    app = create_app(engine, served_model_names, api_key, limits)
    config = server_config(app, host, port, log_level=log_level, access_log=access_log)
    Server(config, shutdown_timeout).run(sockets=[sock if sock is not None else listen(host, port)])
