"""The front end's side of the engine core: requests out, each step's tokens in, text and stops here.

The engine core (`engine_core.py`) runs in a process of its own, or a thread (`core_process.py`);
this object, on the server's event loop, is all the HTTP handlers see of it:

    event loop (HTTP handlers)                      engine core
    --------------------------                      -----------
    EngineLoop.add(id, ids, params, sink)  ──► AddRequest  ──► engine.add_request
    EngineLoop.abort(id)                   ──► AbortRequests (pages freed before the next step)
    a stop string in one of n sequences    ──► AbortSequence (that sequence's pages freed)
    sink: accepted / refused, Delta(text, ids, finish) ◄── StepOutputs: one per step, every request's new tokens

Detokenization and stop strings are done here, with each request's own `OutputBuilder` fed the
token ids the core sends; the core stops on stop tokens and lengths by the same rules, and a stop
string found here is sent back as an abort, so the core frees the request's pages at once. The
metrics of events (tokens, latencies, finishes) are counted here; the engine's state arrives with
every StepOutputs and is published to /metrics and the dashboard as it comes.

Failures: a failed step ends its requests with a 500. When the core ends (its last message says
why, or its process is found dead), every request is answered: those accepted get a 500 (or
"abort" on a normal stop), every add not yet accepted a 503; `add` refuses from then on (503), and
`/health` answers 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from numba_vllm.engine.output import CompletionOutput, OutputBuilder, RequestOutput
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.server.core_protocol import (
    AbortAll,
    AbortRequests,
    AbortSequence,
    AddRequest,
    CoreStopped,
    ModelInfo,
    Shutdown,
    StepOutputs,
    WatchDetail,
    encoder,
    event_decoder,
)
from numba_vllm.server.dashboard import WATCH_SECONDS, DashboardFeed
from numba_vllm.server.metrics import ServerMetrics
from numba_vllm.server.protocol import APIError

logger = logging.getLogger("uvicorn.error")  # printed by uvicorn's handler, like its own messages

EXIT_GRACE_SECONDS = 0.5  # after the core process ends, its last messages may still be arriving

# The fields of a request's news folded in generically, so that fields added later pass through:
# request-level ones (set when given), and a sequence's others (per-token lists are extended token
# by token, other values replaced); text, token ids and the finish are built here.
_REQUEST_FIELDS = [
    f for f in dataclasses.fields(RequestOutput) if f.name not in ("request_id", "prompt", "prompt_token_ids", "outputs")
]
_SEQUENCE_FIELDS = [
    f.name
    for f in dataclasses.fields(CompletionOutput)
    if f.name not in ("index", "text", "token_ids", "finish_reason", "stop_reason")
]


def internal_error(request_id: str) -> APIError:
    """The 500 a client sees when the engine failed its request: no internals, an id to find the log line by."""
    return APIError(500, f"internal server error (request {request_id}); the server log has the details", code="internal_error")


def not_running() -> APIError:
    return APIError(503, "the engine is not running", code="service_unavailable")


@dataclass
class Sink:
    """Where one engine request's news goes, on the event loop that waits for it."""

    loop: asyncio.AbstractEventLoop
    index: int  # the choice index of the request's first sequence within its HTTP request (sequence i: index + i)
    accepted: asyncio.Future  # None once the engine took it; an APIError if it refused
    queue: asyncio.Queue  # Deltas (shared by the choices of one HTTP request)


@dataclass
class Delta:
    """What one request produced since its last Delta (one or more tokens)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort"; None while it runs (or when `error` ends it)
    error: APIError | None = None  # the engine failed: the request is over
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied (known once a token is out)
    logprobs: list | None = None  # one entry per token of token_ids, if asked for
    prompt_logprobs: list | None = None  # the prompt's, with the sequence's first tokens, if asked for

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class _Live:
    """One request between its add and its end: its sink, its output as built here (a builder per
    sequence), what it has sent, and its latencies."""

    sink: Sink
    output: RequestOutput
    builders: list[OutputBuilder]  # builder i fills output.outputs[i]
    arrival: float  # time.perf_counter() when the HTTP request came in
    sent_final: list[bool] = field(init=False)  # per sequence: its last Delta went out
    last_token_at: float | None = None

    def __post_init__(self) -> None:
        self.sent_final = [False] * len(self.builders)


class EngineLoop:
    """The engine core's client, used on the server's event loop. `core` is a `CoreThread` or a
    started `CoreProcess`; `info` what the front end knows of its model; `model_name` labels the
    vllm: metrics."""

    def __init__(self, core, info: ModelInfo, model_name: str):
        self.core = core
        self.info = info
        self.lengths = info.lengths
        self.metrics = ServerMetrics(info.stats, model_name)
        self.dashboard = DashboardFeed(info.stats, on_watch=self._watch)
        self._pending: dict[str, _Live] = {}  # adds sent, not yet accepted or refused
        self._live: dict[str, _Live] = {}  # accepted, unfinished
        self._encoder = encoder()
        self._decoder = event_decoder()
        self._started = False
        self._closed = False
        self._receiver: asyncio.Task | None = None
        self.error: str | None = None  # why the core ended, if it did

    # ---- life ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Open the channel and start listening (on the event loop); the core starts if it is a thread."""
        loop = asyncio.get_running_loop()
        self._context = zmq.asyncio.Context()
        self._events = self._context.socket(zmq.PULL)
        self._commands = self._context.socket(zmq.PUSH)
        for sock in (self._events, self._commands):
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # a send never waits: the core reads between steps
            sock.setsockopt(zmq.LINGER, 0)
        self._events.bind(self.core.addresses.events)
        self._commands.connect(self.core.addresses.commands)
        self.core.start()
        self.core.watch(loop, self._core_exited)
        self._receiver = asyncio.ensure_future(self._receive())
        self._started = True

    @property
    def alive(self) -> bool:
        """The core runs and takes requests."""
        return self._started and not self._closed

    @property
    def num_queued_adds(self) -> int:
        """Adds the core has not answered yet."""
        return len(self._pending)

    def num_waiting(self) -> int:
        """Requests waiting for a batch slot: queued in the engine at its last step, plus adds not yet taken."""
        return self.metrics.engine_state.stats.num_waiting + len(self._pending)

    async def stop(self, timeout: float) -> None:
        """Tell the core to abort what runs (finish_reason "abort") and end; wait for its last news
        and its end at most `timeout` s in all, then kill it. Whatever is still open is answered."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._started and not self._closed:
            self._send(Shutdown())
            await asyncio.wait({self._receiver}, timeout=timeout)  # the aborted requests' news, then CoreStopped
        await asyncio.to_thread(self.core.join, max(0.0, deadline - loop.time()))
        self.core.kill()
        self._core_ended("the server is shutting down", failed=False)
        if self._started:
            self._events.close()
            self._commands.close()
            self._context.term()
        self.core.close()

    # ---- requests -----------------------------------------------------------------------------
    def add(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, sink: Sink, arrival: float) -> None:
        """Send a request to the core; its sink hears whether the engine took it. APIError(503) if the core has ended."""
        if self._closed or not self._started:
            raise not_running()
        ids = list(prompt_ids)
        output = RequestOutput(request_id, None, ids, [CompletionOutput(i) for i in range(params.n)])
        budget = self.lengths.max_new_tokens(len(ids), params.max_tokens)
        config, tokenizer = self.info.config, self.info.tokenizer
        builders = [OutputBuilder(output, c, params, config, tokenizer, budget) for c in output.outputs]
        self._pending[request_id] = _Live(sink, output, builders, arrival)
        self._send(AddRequest(request_id, ids, params))

    def abort(self, request_id: str) -> None:
        """Abort a request (no news is sent back): its slot and pages are freed before the core's next step."""
        live = self._live.pop(request_id, None)
        if live is not None:
            self.metrics.finished.labels("abort").inc(live.sent_final.count(False))
        if (live or self._pending.pop(request_id, None)) is not None:
            self._send(AbortRequests([request_id]))

    def abort_all(self) -> None:
        """Abort every request; each gets a final Delta with finish_reason "abort"."""
        if not self._closed:
            self._send(AbortAll())

    def _watch(self) -> None:
        """The dashboard is watched: the core puts per-request detail in its stats for a while."""
        if not self._closed:
            self._send(WatchDetail(WATCH_SECONDS))

    def _send(self, command) -> None:
        self._commands.send(self._encoder.encode(command), zmq.NOBLOCK)

    # ---- news from the core -------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            frame = await self._events.recv(copy=False)
            try:
                event = self._decoder.decode(frame.buffer)
                if isinstance(event, CoreStopped):
                    if event.error is not None:
                        self._core_ended(f"the engine core stopped: {event.error}", failed=True)
                    else:
                        self._core_ended("the engine core stopped", failed=False)
                    return
                self._apply(event)
            except Exception:  # a bug here must not silence every later message
                logger.exception("handling the engine core's news failed")

    def _apply(self, event: StepOutputs) -> None:
        now = time.perf_counter()
        for request_id in event.accepted:
            live = self._pending.pop(request_id, None)
            if live is None:  # aborted meanwhile (the abort follows the add to the core)
                continue
            self._live[request_id] = live
            self.metrics.prompt_tokens.inc(len(live.output.prompt_token_ids))
            if not live.sink.accepted.done():
                live.sink.accepted.set_result(None)
        for refused in event.refused:
            live = self._pending.pop(refused.request_id, None)
            if live is not None and not live.sink.accepted.done():
                error = APIError(400, refused.message, param=refused.param)
                live.sink.accepted.set_exception(error if refused.status == 400 else internal_error(refused.request_id))
        for news in event.outputs:
            live = self._live.get(news.request_id)
            if live is not None:
                self._take(news.request_id, live, news, now)
        self.metrics.set_engine_stats(event.stats)
        self.dashboard.publish(event.stats)

    def _take(self, request_id: str, live: _Live, news: RequestOutput, now: float) -> None:
        """Fold a request's news into its output (detokenizing, checking stop strings), then hand each
        sequence's new text and tokens to the sink; record the latencies (a request's time to first
        token is its first sequence's, its time per token the mean over its sequences' new tokens)."""
        out = live.output
        for f in _REQUEST_FIELDS:
            value = getattr(news, f.name)
            if value != f.default:
                setattr(out, f.name, value)
        m = self.metrics
        num_new = 0
        stopped_here = []  # sequences a stop string ended here, which the core still runs
        for sequence in news.outputs:
            i = sequence.index
            if live.sent_final[i]:  # a stop string ended it; the core runs it on until told
                continue
            text, new_tokens = self._fold(out, live.builders[i], sequence)
            if sequence.finish_reason is None and out.outputs[i].finish_reason is not None:
                stopped_here.append(i)
            num_new += len(new_tokens)
            c = out.outputs[i]
            if c.finish_reason == "error":
                delta = Delta(live.sink.index + i, "", [], None, internal_error(request_id))
            elif new_tokens or c.finish_reason is not None:
                delta = Delta(live.sink.index + i, text, new_tokens, c.finish_reason, num_cached_tokens=out.num_cached_tokens)
                if c.logprobs is not None:
                    delta.logprobs = c.logprobs[len(c.token_ids) - len(new_tokens) :]
                if new_tokens and len(c.token_ids) == len(new_tokens):
                    delta.prompt_logprobs = out.prompt_logprobs
                if c.finish_reason is not None:
                    m.finished.labels(c.finish_reason).inc()
            else:
                continue
            live.sent_final[i] = delta.final
            live.sink.queue.put_nowait(delta)
        if num_new:
            m.generation_tokens.inc(num_new)
            if live.last_token_at is None:
                m.ttft.observe(now - live.arrival)
            else:
                m.tpot.observe((now - live.last_token_at) * len(out.outputs) / num_new)
            live.last_token_at = now
        if out.error is not None:
            m.finished.labels("error").inc()
        if out.finished:
            m.e2e.observe(now - live.arrival)
            del self._live[request_id]
            if not news.finished:  # stop strings ended it here: the core frees it now
                self._send(AbortRequests([request_id]))
        else:  # n > 1: the core frees a stopped sequence's pages while its siblings go on
            for i in stopped_here:
                self._send(AbortSequence(request_id, i))

    def _fold(self, out: RequestOutput, builder: OutputBuilder, sequence: CompletionOutput) -> tuple[str, list[int]]:
        """One sequence's news into its CompletionOutput: its tokens through the builder (text, stop
        strings) up to a stop, per-token lists (logprobs) with them, other values as they come, and the
        core's finish where the builder saw none. Returns the new text and token ids."""
        c = builder.completion
        lists = {name: v for name in _SEQUENCE_FIELDS if isinstance(v := getattr(sequence, name), list)}
        for name in _SEQUENCE_FIELDS:
            if name not in lists:
                setattr(c, name, getattr(sequence, name))
        text, new_tokens = "", []
        for i, token in enumerate(sequence.token_ids):
            if c.finish_reason is not None:  # a stop string ended it; the core has not heard yet
                break
            for name, values in lists.items():
                if getattr(c, name) is None:
                    setattr(c, name, [])
                getattr(c, name).append(values[i])
            text += builder.add(token)
            new_tokens.append(token)
        if c.finish_reason is None and sequence.finish_reason == "error":
            builder.fail(out.error or "the engine step failed")
        elif c.finish_reason is None and sequence.finish_reason is not None:  # "abort" (an abort-all), or a stop seen there
            c.finish_reason, c.stop_reason = sequence.finish_reason, sequence.stop_reason
        return text, new_tokens

    # ---- the core's end -----------------------------------------------------------------------
    def _core_exited(self, why: str) -> None:
        """The core's process has ended; its last messages may still be on their way."""
        asyncio.get_running_loop().call_later(EXIT_GRACE_SECONDS, self._core_ended, why, True)

    def _core_ended(self, why: str, failed: bool) -> None:
        """Refuse new adds, answer every add still pending (503) and every request still open (a 500
        if the core `failed`, else "abort"): after this, nobody waits on the core."""
        if self._closed:
            return
        self._closed = True
        if self._started:
            self.error = why if failed else None
            if failed:
                logger.error("%s; every open request fails", why)
        for live in self._pending.values():
            if not live.sink.accepted.done():
                live.sink.accepted.set_exception(not_running())
        for request_id, live in self._live.items():
            if failed:
                self.metrics.finished.labels("error").inc()
            for i, final in enumerate(live.sent_final):
                if not final:
                    if not failed:
                        self.metrics.finished.labels("abort").inc()
                    error = internal_error(request_id) if failed else None
                    live.sink.queue.put_nowait(Delta(live.sink.index + i, "", [], None if failed else "abort", error))
        self._pending.clear()
        self._live.clear()
        if self._receiver is not None and asyncio.current_task() is not self._receiver:
            self._receiver.cancel()
