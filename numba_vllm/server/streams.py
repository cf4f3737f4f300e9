"""One HTTP request's life after validation: its engine requests, and the answer, collected or streamed.

A `Submission` holds the engine requests of one HTTP request (one per prompt, each with `n`
sequences; choice i is sequence i % n of prompt i // n, OpenAI's order) and the asyncio queue their
`Delta`s arrive on. `collect` gathers them into one answer;
`stream_completion` and `stream_chat` turn them into server-sent events: every Delta that carries
tokens becomes a chunk (Deltas that queued up while the event loop was busy are merged, as vLLM
does), then an optional usage chunk, then `data: [DONE]`. `EventStream` and `unless_disconnected`
race the answer against the client's disconnect; `Submission.close` then aborts what is unfinished.
A stream whose client stops reading is aborted the same way once one write has waited
`write_timeout` seconds (its connection is closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import StreamingResponse

from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.server.engine_loop import Delta, Sink
from numba_vllm.server.logprobs import ChoiceLogprobs, prompt_logprobs_field
from numba_vllm.server.protocol import APIError, envelope, sse, usage

if TYPE_CHECKING:
    from numba_vllm.server.app import ServerState

logger = logging.getLogger("uvicorn.error")


class Submission:
    """The engine requests of one HTTP request (one per prompt, `n` choices each), and their shared
    queue of Deltas."""

    def __init__(self, state: ServerState, request_ids: list[str], prompts: list[list[int]], n: int = 1):
        self.state = state
        self.request_ids = request_ids
        self.prompts = prompts
        self.n = n
        self.num_choices = len(prompts) * n
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.unfinished = set(range(self.num_choices))
        self.sinks: list[Sink] = []
        self.closed = False
        state.submissions.add(self)

    async def start(self, params: SamplingParams, arrival: float) -> None:
        """Hand every prompt to the engine; return once all are accepted (APIError if one is not)."""
        loop = asyncio.get_running_loop()
        self.sinks = [Sink(loop, i * self.n, loop.create_future(), self.queue) for i in range(len(self.prompts))]
        try:
            for request_id, prompt, sink in zip(self.request_ids, self.prompts, self.sinks, strict=True):
                self.state.engine_loop.add(request_id, prompt, params, sink, arrival)
            for sink in self.sinks:
                await sink.accepted
        except BaseException:
            self.close()
            raise

    def end_now(self) -> None:
        """The server stops at once: every unfinished choice ends with finish_reason "abort" now,
        without waiting for the engine thread (which may be in the middle of a long step)."""
        stopping = APIError(503, "the server is shutting down", code="service_unavailable")
        for sink in self.sinks:
            if not sink.accepted.done():
                sink.accepted.set_exception(stopping)
        for i in sorted(self.unfinished):
            self.queue.put_nowait(Delta(i, "", [], "abort"))

    async def batches(self) -> AsyncIterator[list[Delta]]:
        """Every Delta until all choices are final, batched as they queued up (one step's worth or more)."""
        while self.unfinished:
            batch = [await self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            for d in batch:
                if d.final:
                    self.unfinished.discard(d.index)
            yield batch

    def close(self) -> None:
        """Abort what has not finished (a no-op for finished requests); idempotent."""
        if self.closed:
            return
        self.closed = True
        for p in sorted({i // self.n for i in self.unfinished}):
            self.state.engine_loop.abort(self.request_ids[p])
        self.state.submissions.discard(self)


def _merge(batch: list[Delta]) -> list[Delta]:
    """Deltas of the same choice joined, in choice order."""
    merged: dict[int, Delta] = {}
    for d in batch:
        m = merged.get(d.index)
        if m is None:
            merged[d.index] = Delta(d.index, d.text, list(d.token_ids), d.finish_reason, d.error, d.num_cached_tokens,
                                    None if d.logprobs is None else list(d.logprobs), d.prompt_logprobs)  # fmt: skip
        else:
            m.text += d.text
            m.token_ids += d.token_ids
            if d.logprobs is not None:
                m.logprobs = (m.logprobs or []) + d.logprobs
            m.prompt_logprobs = m.prompt_logprobs or d.prompt_logprobs
            m.finish_reason = d.finish_reason or m.finish_reason
            m.error = d.error or m.error
            m.num_cached_tokens = max(m.num_cached_tokens, d.num_cached_tokens)
    return [merged[i] for i in sorted(merged)]


class EventStream(StreamingResponse):
    """SSE response raced against the client's disconnect, which aborts the submission."""

    def __init__(self, content: AsyncIterator[bytes], submission: Submission, write_timeout: float):
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.submission = submission
        self.write_timeout = write_timeout

    async def __call__(self, scope, receive, send) -> None:
        async def send_in_time(message) -> None:  # a client that stops reading stalls send(): give up on it
            # asyncio.wait, not asyncio.wait_for: before Python 3.12 wait_for can swallow a cancellation
            # that arrives as the send completes, and the stream would never learn that it was cancelled
            sending = asyncio.ensure_future(send(message))
            try:
                await asyncio.wait({sending}, timeout=self.write_timeout)
            finally:
                sending.cancel()  # a no-op once sent
            if not sending.done() or sending.cancelled():
                logger.info("a stream's client stopped reading for %g s; aborted", self.write_timeout)
                raise TimeoutError
            sending.result()

        stream = asyncio.ensure_future(self.stream_response(send_in_time))
        listen = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, listen}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # abort first: the engine stops generating for a client that is gone, whatever the
            # cancelled tasks still do while they unwind
            self.submission.close()
            for task in (stream, listen):
                task.cancel()
            await asyncio.gather(stream, listen, return_exceptions=True)
            error = None if stream.cancelled() else stream.exception()
            if error is not None and not isinstance(error, OSError):
                logger.error("streaming a response failed", exc_info=error)
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()


async def unless_disconnected(request: Request, work):
    """Await `work` unless the client disconnects first (then cancel it and return None)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()
        watch.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


async def collect(submission: Submission) -> tuple[list[Delta], int]:
    """Every choice's whole answer as one Delta (text, token ids, finish reason, logprobs), in choice
    order, and the prompt tokens the prefix cache supplied (counted once per prompt, as its prompt
    tokens are)."""
    batches = [d async for batch in submission.batches() for d in batch]
    for d in batches:
        if d.error is not None:
            raise d.error
    choices = _merge(batches)
    cached = [0] * len(submission.prompts)
    for d in choices:
        cached[d.index // submission.n] = max(cached[d.index // submission.n], d.num_cached_tokens)
    return choices, sum(cached)


async def stream_completion(
    sub: Submission, base_id: str, model: str, with_ids: bool, include_usage: bool, view: ChoiceLogprobs
):
    """Completion chunks; with echo, each choice's first chunk is its prompt (and its logprobs)."""
    created = int(time.time())
    completion_tokens = 0
    cached = [0] * len(sub.prompts)
    started = set()

    def chunk(choice: dict) -> bytes:
        c = envelope(base_id, "text_completion", model, created)
        c["choices"] = [choice]
        return sse(c)

    async for batch in sub.batches():
        for d in _merge(batch):
            if d.error is not None:
                yield sse(d.error.body())
                yield sse("[DONE]")
                return
            cached[d.index // sub.n] = max(cached[d.index // sub.n], d.num_cached_tokens)
            if not (d.text or d.token_ids or d.finish_reason):
                continue
            if d.index not in started and view.echo_texts is not None:
                text, logprobs = view.prefix(d.index, d.prompt_logprobs)
                yield chunk({"index": d.index, "text": text, "logprobs": logprobs, "finish_reason": None})
            text, token_ids, logprobs = view.output(d.index, d.text, d.token_ids, d.logprobs)
            completion_tokens += len(token_ids)
            choice = {"index": d.index, "text": text, "logprobs": logprobs, "finish_reason": d.finish_reason}
            if view.prompt_field and d.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_field(d.prompt_logprobs)
            if with_ids:
                choice["token_ids"] = token_ids
                if d.index not in started:
                    choice["prompt_token_ids"] = sub.prompts[d.index // sub.n]
            started.add(d.index)
            yield chunk(choice)
    if include_usage:
        chunk = envelope(base_id, "text_completion", model, created)
        chunk.update(choices=[], usage=usage(sum(map(len, sub.prompts)), completion_tokens, sum(cached)))
        yield sse(chunk)
    yield sse("[DONE]")


async def stream_chat(sub: Submission, base_id: str, model: str, with_ids: bool, include_usage: bool, view: ChoiceLogprobs):
    created = int(time.time())

    def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None, **extra) -> bytes:
        c = envelope(base_id, "chat.completion.chunk", model, created)
        c["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, **extra}]
        return sse(c)

    first = {"prompt_token_ids": sub.prompts[0]} if with_ids else {}
    for i in range(sub.num_choices):  # every choice opens with its role, as vLLM's do
        yield chunk(i, {"role": "assistant", "content": ""}, **first)
    completion_tokens = 0
    cached = 0
    async for batch in sub.batches():
        for d in _merge(batch):
            if d.error is not None:
                yield sse(d.error.body())
                yield sse("[DONE]")
                return
            completion_tokens += len(d.token_ids)
            cached = max(cached, d.num_cached_tokens)
            if not (d.text or d.token_ids or d.finish_reason):
                continue
            extra = {"token_ids": d.token_ids} if with_ids else {}
            _, _, logprobs = view.output(d.index, d.text, d.token_ids, d.logprobs)
            content = {"content": d.text} if d.text or not d.finish_reason else {}
            yield chunk(d.index, content, d.finish_reason, logprobs, **extra)
    if include_usage:
        c = envelope(base_id, "chat.completion.chunk", model, created)
        c.update(choices=[], usage=usage(len(sub.prompts[0]), completion_tokens, cached))
        yield sse(c)
    yield sse("[DONE]")
