"""The engine thread: the only code that touches the `LLMEngine` while the server runs.

The engine is not thread-safe, and a step is long (milliseconds on a GPU, up to seconds on NumPy),
so it runs in one background thread and everything reaches it as a command on a queue:

    event loop (HTTP handlers)                engine thread
    --------------------------                -------------
    EngineLoop.add(id, ids, params, sink) ──► engine.add_request  ──► sink: accepted / rejected
    EngineLoop.abort(id)                  ──► engine.abort_request (pages freed now)
                                              engine.step()       ──► sink: Delta(text, ids, finish)

Between two steps the thread takes every command waiting, so a request that arrives while others
decode joins the running batch at the next step (continuous batching); with nothing to run it
sleeps on the queue. Results go back to the event loop in one `call_soon_threadsafe` per step,
which resolves each request's `accepted` future or puts its `Delta` on its asyncio queue.

Failures: a step that fails ends the requests in it with a 500 (`LLMEngine.step` leaves the engine
ready for the next step), and the server goes on. After `MAX_CONSECUTIVE_FAILED_STEPS` failed steps
in a row the engine is taken to be unable to serve (a broken device, say): the thread ends, as it
does on an error of its own. Whenever the thread ends, every request is answered: those running or
queued get their final `Delta` (an error, or "abort" on a normal stop), and every `add` still in the
queue is refused; `add` refuses from then on (503), and `/health` answers 503.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field

from numba_vllm.engine.llm_engine import LLMEngine
from numba_vllm.engine.output import RequestOutput
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.server.dashboard import DashboardFeed
from numba_vllm.server.metrics import ServerMetrics
from numba_vllm.server.protocol import APIError

logger = logging.getLogger("uvicorn.error")  # printed by uvicorn's handler, like its own messages

MAX_CONSECUTIVE_FAILED_STEPS = 3  # failed steps in a row after which the engine is taken to be broken


class EngineBrokenError(RuntimeError):
    """Steps keep failing: the engine thread stops serving."""


def internal_error(request_id: str) -> APIError:
    """The 500 a client sees when the engine failed its request: no internals, an id to find the log line by."""
    return APIError(500, f"internal server error (request {request_id}); the server log has the details", code="internal_error")


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

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


_ACCEPTED = object()


@dataclass
class _Live:
    """Engine-thread bookkeeping of one running request (its sequences: what each has sent)."""

    sink: Sink
    output: RequestOutput
    arrival: float  # time.perf_counter() when the HTTP request came in
    sent_text: list[int] = field(init=False)  # per sequence: characters sent
    sent_tokens: list[int] = field(init=False)  # per sequence: token ids sent
    sent_final: list[bool] = field(init=False)  # per sequence: its last Delta went out
    last_token_at: float | None = None

    def __post_init__(self) -> None:
        n = len(self.output.outputs)
        self.sent_text, self.sent_tokens, self.sent_final = [0] * n, [0] * n, [False] * n


class EngineLoop:
    """Owns an LLMEngine and steps it in a daemon thread; the methods below are thread-safe.
    `model_name` labels its vllm: metrics."""

    def __init__(self, engine: LLMEngine, model_name: str):
        self.engine = engine
        self.metrics = ServerMetrics(engine.stats(), model_name)
        self.dashboard = DashboardFeed(self.metrics.engine_state.stats)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._outbox: list[tuple[Sink, object]] = []
        self._thread: threading.Thread | None = None
        # `add` and the thread's end agree under this lock: once `_closed` is set no command is
        # queued any more, so the thread can answer every one still queued.
        self._lock = threading.Lock()
        self._closed = False
        self.num_queued_adds = 0  # adds not yet taken by the thread (under _lock)
        self._failed_steps_in_a_row = 0
        self.error: BaseException | None = None  # why the thread died, if it did

    # ---- called from the event loop -----------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="numba-vllm-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The thread runs and takes requests."""
        return self._thread is not None and self._thread.is_alive() and not self._closed

    def num_waiting(self) -> int:
        """Requests waiting for a batch slot: queued in the engine at its last step, plus adds not yet taken."""
        return self.metrics.engine_state.stats.num_waiting + self.num_queued_adds

    def add(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, sink: Sink, arrival: float) -> None:
        """Queue a request; its sink hears whether the engine took it. APIError(503) if the thread has ended."""
        with self._lock:
            if self._closed or self._thread is None:
                raise APIError(503, "the engine is not running", code="service_unavailable")
            self.num_queued_adds += 1
            self._commands.put(("add", request_id, list(prompt_ids), params, sink, arrival))

    def abort(self, request_id: str) -> None:
        """Abort a request (no news is sent back): its slot and pages are freed before the next step."""
        self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        """Abort every request; each gets a final Delta with finish_reason "abort"."""
        self._commands.put(("abort_all",))

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort what still runs (finish_reason "abort") and end the thread."""
        if self._thread is not None:
            self._commands.put(("stop",))
            self._thread.join(timeout)

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                stop = False
                for command in self._take_commands(block=idle):
                    if command[0] == "stop":
                        stop = True
                    else:
                        self._handle(command)
                if stop:
                    self._abort_all()
                    self._snapshot()
                    self._flush()
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                self._snapshot()
                self._flush()
        except BaseException as e:  # a bug, or a broken engine: answer what is in flight rather than leave it hanging
            self.error = e
            if isinstance(e, EngineBrokenError):
                logger.error("engine stopped: %s", e)
            else:
                logger.error("engine thread died:\n%s", traceback.format_exc())
            self._fail_all()
        finally:
            self._close()

    def _close(self) -> None:
        """Refuse new adds, then answer the ones still queued (503): after this, nobody waits on the thread."""
        with self._lock:
            self._closed = True
        refused = APIError(503, "the engine is not running", code="service_unavailable")
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                self._outbox.append((command[4], refused))
        self._flush()

    def _take_commands(self, block: bool) -> list[tuple]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt_ids, params, sink, arrival = command
            with self._lock:
                self.num_queued_adds -= 1
            try:
                output = self.engine.add_request(request_id, prompt_ids, params)
            except ValueError as e:  # the prompt cannot run (the handler's checks should have caught it)
                self._outbox.append((sink, APIError(400, str(e), param="prompt")))
                return
            except Exception:
                logger.error("add_request failed (request %s):\n%s", request_id, traceback.format_exc())
                self._outbox.append((sink, internal_error(request_id)))
                return
            self._live[request_id] = _Live(sink, output, arrival)
            self.metrics.prompt_tokens.inc(len(prompt_ids))
            self._outbox.append((sink, _ACCEPTED))
        elif kind == "abort":
            live = self._live.pop(command[1], None)
            if live is not None:
                self.engine.abort_request(command[1])
                self.metrics.finished.labels("abort").inc()
        elif kind == "abort_all":
            self._abort_all()

    def _abort_all(self) -> None:
        for request_id, live in list(self._live.items()):
            self.engine.abort_request(request_id)
            self._emit(request_id, live, time.perf_counter())

    def _fail_all(self) -> None:
        """The thread is ending on an error: every running request gets a 500."""
        for request_id, live in list(self._live.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine is broken already; the client's answer matters more
                pass
            self.metrics.finished.labels("error").inc()
            for i, final in enumerate(live.sent_final):
                if not final:
                    self._outbox.append((live.sink, Delta(live.sink.index + i, "", [], None, internal_error(request_id))))
        self._live.clear()

    def _step(self) -> None:
        failed_before = self.engine.num_failed_steps
        outputs = self.engine.step()
        if self.engine.num_failed_steps == failed_before:
            self._failed_steps_in_a_row = 0
        else:  # the step's requests failed (the engine is ready for the next step)
            self._failed_steps_in_a_row += 1
            error = self.engine.last_step_error
            ids = ", ".join(o.request_id for o in outputs)
            logger.error("engine step failed (requests %s):\n%s", ids, "".join(traceback.format_exception(error)).rstrip())
            if self._failed_steps_in_a_row >= MAX_CONSECUTIVE_FAILED_STEPS:
                last = f"{type(error).__name__}: {error}"
                raise EngineBrokenError(f"{self._failed_steps_in_a_row} steps in a row failed; the last: {last}")
        now = time.perf_counter()
        for output in outputs:
            live = self._live.get(output.request_id)
            if live is not None:
                self._emit(output.request_id, live, now)

    def _emit(self, request_id: str, live: _Live, now: float) -> None:
        """Queue each of the request's sequences' news since its last Delta; record its latencies (a
        request's time to first token is its first sequence's, its time per token the mean over its
        sequences' new tokens)."""
        out = live.output
        m = self.metrics
        new_tokens = [c.token_ids[sent:] for c, sent in zip(out.outputs, live.sent_tokens, strict=True)]
        num_new = sum(map(len, new_tokens))
        if num_new:
            m.generation_tokens.inc(num_new)
            if live.last_token_at is None:
                m.ttft.observe(now - live.arrival)
            else:
                m.tpot.observe((now - live.last_token_at) * len(out.outputs) / num_new)
            live.last_token_at = now
        for i, c in enumerate(out.outputs):
            if live.sent_final[i] or not (new_tokens[i] or c.finished() or out.error is not None):
                continue
            if out.error is not None:
                delta = Delta(live.sink.index + i, "", [], None, internal_error(request_id))
            else:
                delta = Delta(live.sink.index + i, c.text[live.sent_text[i] :], list(new_tokens[i]), c.finish_reason,
                              num_cached_tokens=out.num_cached_tokens)  # fmt: skip
                if c.finished():
                    m.finished.labels(c.finish_reason).inc()
            live.sent_text[i], live.sent_tokens[i] = len(c.text), len(c.token_ids)
            live.sent_final[i] = delta.final
            self._outbox.append((live.sink, delta))
        if out.error is not None:
            m.finished.labels("error").inc()
        if out.finished:
            m.e2e.observe(now - live.arrival)
            del self._live[request_id]

    def _snapshot(self) -> None:
        """Publish the engine's state (requests, pages, steps) to the metrics and the dashboard; with
        each request's slot and pages only while the dashboard is watched."""
        detail = self.dashboard.wants_detail()
        stats = self.engine.stats(requests=detail, pages=detail)
        self.metrics.set_engine_stats(stats)
        self.dashboard.publish(stats)

    def _flush(self) -> None:
        """Hand this round's news to the event loop(s) that wait for it, one callback per loop."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for sink, item in self._outbox:
            by_loop.setdefault(sink.loop, []).append((sink, item))
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass


def _deliver(items: list[tuple[Sink, object]]) -> None:
    """Runs on the event loop: resolve acceptance futures, queue deltas."""
    for sink, item in items:
        if item is _ACCEPTED:
            if not sink.accepted.done():
                sink.accepted.set_result(None)
        elif isinstance(item, APIError):
            if not sink.accepted.done():
                sink.accepted.set_exception(item)
        else:
            sink.queue.put_nowait(item)
