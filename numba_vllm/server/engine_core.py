"""The engine core's loop: the only code that touches the `LLMEngine` while the server runs.

It runs in a process of its own (`core_process.py`) or, for tests and `--engine-in-process`, in a
thread of the server's; either way it talks to the front end only through the ZeroMQ channels of
`core_protocol.py`, so the step loop never waits on HTTP, tokenization or detokenization:

    while True:
        take every command waiting (block only while nothing runs): add, abort, abort all, ...
        step the engine if anything runs
        send one StepOutputs: the adds taken or refused, each request's new tokens, the stats

Between two steps the loop takes every command waiting, so a request that arrives while others
decode joins the running batch at the next step (continuous batching).

Failures: a step that fails ends the requests in it (their news says "error"; the front end answers
500), and the loop goes on. After `MAX_CONSECUTIVE_FAILED_STEPS` failed steps in a row the engine is
taken to be unable to serve (a broken device, say) and the loop ends, as it does on an error of its
own; its last message, `CoreStopped(error)`, tells the front end, which answers every request still
open. (A core killed outright sends nothing: the front end watches the process too.)
"""

from __future__ import annotations

import logging
import time
import traceback

import zmq

from numba_vllm.engine.llm_engine import LLMEngine
from numba_vllm.engine.output import RequestOutput
from numba_vllm.engine.structured import GrammarError
from numba_vllm.server.core_protocol import (
    AbortAll,
    AbortRequests,
    AbortSequence,
    AddRequest,
    CoreAddresses,
    CoreStopped,
    Refused,
    Shutdown,
    StepOutputs,
    WatchDetail,
    command_decoder,
    encoder,
    news_since,
)

logger = logging.getLogger("uvicorn.error")  # printed by uvicorn's handler in a server, like its own messages

MAX_CONSECUTIVE_FAILED_STEPS = 3  # failed steps in a row after which the engine is taken to be broken
LINGER_MS = 2000  # how long the last messages may wait for the front end once the loop has ended
_MODEL_FIELDS = ("logit_bias", "bad_words")  # sampling fields checked against the model when a request is added


class EngineBrokenError(RuntimeError):
    """Steps keep failing: the core stops serving."""


class EngineCore:
    """Steps `engine` and serves the commands arriving at `addresses.commands`, reporting to
    `addresses.events`. `run` returns when told to stop (or raises nothing: an error ends the loop
    with `CoreStopped(error)`)."""

    def __init__(self, engine: LLMEngine, addresses: CoreAddresses):
        self.engine = engine
        self.addresses = addresses
        self._live: dict[str, tuple[RequestOutput, dict[int, int]]] = {}  # id -> (output, tokens sent per sequence)
        self._accepted: list[str] = []
        self._refused: list[Refused] = []
        self._outputs: list[RequestOutput] = []
        self._watched_until = 0.0  # time.monotonic() until which the stats carry per-request detail
        self._failed_steps_in_a_row = 0
        self._encoder = encoder()
        self._decoder = command_decoder()

    def run(self) -> None:
        context = zmq.Context()
        commands = context.socket(zmq.PULL)
        events = context.socket(zmq.PUSH)
        for sock in (commands, events):
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow reader: queue instead
        events.setsockopt(zmq.LINGER, LINGER_MS)
        events.connect(self.addresses.events)
        self._events = events
        error = None
        try:
            commands.bind(self.addresses.commands)
            self._send_round()  # the first stats: the front end knows the core is there
            self._loop(commands)
        except BaseException as e:  # a bug, or a broken engine: the front end answers what is open
            error = f"{type(e).__name__}: {e}"
            if isinstance(e, EngineBrokenError):
                logger.error("engine stopped: %s", e)
            else:
                logger.error("engine core died:\n%s", traceback.format_exc())
            try:
                self._send_round()  # what this round had settled already
            except Exception:  # the engine cannot even give its stats: the front end fails what is open
                pass
        finally:
            events.send(self._encoder.encode(CoreStopped(error)))
            commands.close(linger=0)
            events.close()
            context.term()

    def _loop(self, commands: zmq.Socket) -> None:
        engine = self.engine
        while True:
            stop = False
            for command in self._take_commands(commands, block=not engine.has_unfinished_requests()):
                if isinstance(command, Shutdown):
                    stop = True
                else:
                    self._handle(command)
            if stop:
                self._abort_all()
                self._send_round()
                return
            if engine.has_unfinished_requests():
                self._step()
            self._send_round()

    def _take_commands(self, sock: zmq.Socket, block: bool) -> list:
        """Every command waiting; with `block`, wait for at least one."""
        frames = [sock.recv()] if block else []
        while True:
            try:
                frames.append(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return [self._decoder.decode(f) for f in frames]

    def _handle(self, command) -> None:
        engine = self.engine
        if isinstance(command, AddRequest):
            request_id = command.request_id
            try:
                output = engine.add_request(request_id, command.prompt_token_ids, command.params)
            except GrammarError as e:  # a constraint that does not compile here (the front end compiled it too)
                self._refused.append(Refused(request_id, 400, str(e), "structured_outputs"))
                return
            except ValueError as e:  # the prompt cannot run (the front end's checks should have caught it), or a
                field = str(e).split(":", 1)[0]  # sampling field needs the model (logit_bias ids, bad_words)
                self._refused.append(Refused(request_id, 400, str(e), field if field in _MODEL_FIELDS else "prompt"))
                return
            except Exception:
                logger.error("add_request failed (request %s):\n%s", request_id, traceback.format_exc())
                self._refused.append(Refused(request_id, 500, "the engine failed to add the request"))
                return
            self._live[request_id] = (output, {})
            self._accepted.append(request_id)
        elif isinstance(command, AbortRequests):
            for request_id in command.request_ids:
                if self._live.pop(request_id, None) is not None:
                    engine.abort_request(request_id)
        elif isinstance(command, AbortSequence):
            live = self._live.get(command.request_id)
            if live is not None:
                engine.abort_sequence(command.request_id, command.index)
                if live[0].finished:  # it was the last sequence running: the front end has its end
                    del self._live[command.request_id]
        elif isinstance(command, AbortAll):
            self._abort_all()
        elif isinstance(command, WatchDetail):
            self._watched_until = time.monotonic() + command.seconds

    def _abort_all(self) -> None:
        """Abort every request; each is reported with finish_reason "abort"."""
        for request_id, (output, _) in list(self._live.items()):
            self.engine.abort_request(request_id)
            self._add_news(output)

    def _step(self) -> None:
        engine = self.engine
        failed_before = engine.num_failed_steps
        outputs = engine.step()
        if engine.num_failed_steps == failed_before:
            self._failed_steps_in_a_row = 0
            for output in outputs:  # a request failed alone (its grammar rejected its token): the 500 points here
                if output.error is not None:
                    logger.error("request %s failed: %s", output.request_id, output.error)
        else:  # the step's requests failed (the engine is ready for the next step)
            self._failed_steps_in_a_row += 1
            error = engine.last_step_error
            ids = ", ".join(o.request_id for o in outputs)
            logger.error("engine step failed (requests %s):\n%s", ids, "".join(traceback.format_exception(error)).rstrip())
            if self._failed_steps_in_a_row >= MAX_CONSECUTIVE_FAILED_STEPS:
                last = f"{type(error).__name__}: {error}"
                raise EngineBrokenError(f"{self._failed_steps_in_a_row} steps in a row failed; the last: {last}")
        for output in outputs:
            if output.request_id in self._live:
                self._add_news(output)

    def _add_news(self, output: RequestOutput) -> None:
        final = output.finished
        self._outputs.append(news_since(output, self._live[output.request_id][1], final))
        if final:
            del self._live[output.request_id]

    def _send_round(self) -> None:
        """One StepOutputs with this round's news and the engine's state (per-request detail only
        while the dashboard watches)."""
        detail = time.monotonic() < self._watched_until
        stats = self.engine.stats(requests=detail, pages=detail)
        message = StepOutputs(self._accepted, self._refused, self._outputs, stats)
        self._accepted, self._refused, self._outputs = [], [], []
        self._events.send(self._encoder.encode(message), copy=False)
