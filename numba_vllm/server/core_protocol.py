"""The messages between the HTTP front end and the engine core, and how they travel (ZeroMQ, msgpack).

Two one-way ZeroMQ PUSH -> PULL channels over Unix sockets (`ipc://`), one per direction. Each side
binds the socket it reads and connects the one it writes, so whichever side starts first, what it
sends is queued until the other end is there. Messages are msgspec Structs encoded as msgpack; the
engine's own dataclasses (`SamplingParams`, `RequestOutput`, `EngineStats`) travel as they are and
arrive typed, so a field added to them later (logprobs, say) passes through without a change here.

    front end -> core (`Command`)                 core -> front end (`Event`)
    -----------------------------                 ---------------------------
    AddRequest(id, prompt ids, params)            StepOutputs: after each round of the core's loop
    AbortRequests(ids)   (freed, no news back)        accepted / refused adds, every request's news
    AbortSequence(id, i) (one of n sequences)         of that step (new tokens, finish), the stats
    AbortAll             (each ends with "abort")
    WatchDetail          (the dashboard watches)  CoreStopped(error): the core's loop has ended
    Shutdown

A request's news is a `RequestOutput` holding only what is new: each sequence's token ids (and any
other per-token list, such as logprobs) since the last message, with its finish reason; no text
(the front end detokenizes). Request-level fields (prompt logprobs, cached tokens, the error) come
with a request's first news and its last.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid
from dataclasses import dataclass

import msgspec

from numba_vllm.engine.lengths import LengthPolicy
from numba_vllm.engine.output import CompletionOutput, RequestOutput
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.engine.stats import EngineStats
from numba_vllm.loading.tokenizer import Tokenizer
from numba_vllm.model.config import ModelConfig


# ---- front end -> core --------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """Free these requests (a client went away, or the front end found a stop string); no news comes back."""

    request_ids: list[str]


class AbortSequence(msgspec.Struct, tag="abort_sequence", array_like=True):
    """Stop one sequence of a request with several (n > 1): the front end found a stop string in it;
    its siblings go on (its "abort" in their later news is not the front end's concern: it has
    ended the sequence already)."""

    request_id: str
    index: int


class AbortAll(msgspec.Struct, tag="abort_all", array_like=True):
    """End every request with finish_reason "abort" (reported in the next StepOutputs)."""


class WatchDetail(msgspec.Struct, tag="watch", array_like=True):
    """Someone watches the dashboard: put each request's slot and pages in the stats for `seconds`."""

    seconds: float


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Abort what runs (reported), then end the loop."""


Command = AddRequest | AbortRequests | AbortSequence | AbortAll | WatchDetail | Shutdown


# ---- core -> front end --------------------------------------------------------------------------
class Refused(msgspec.Struct, array_like=True):
    """An add the engine did not take: `status` 400 (the request cannot run: `param` says which field)
    or 500 (the engine failed)."""

    request_id: str
    status: int
    message: str
    param: str | None = None


class StepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """One round of the core's loop: adds taken or refused, each request's news, the engine's state after."""

    accepted: list[str]
    refused: list[Refused]
    outputs: list[RequestOutput]  # news only (see the module docstring)
    stats: EngineStats


class CoreStopped(msgspec.Struct, tag="stopped", array_like=True):
    """The core's loop has ended: on a Shutdown (`error` None) or on an error (what it was, one line)."""

    error: str | None


Event = StepOutputs | CoreStopped


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def command_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Command)


def event_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Event)


# RequestOutput's own fields (not its prompt or sequences) at their defaults: a middle message's.
_REQUEST_DEFAULTS = {
    f.name: f.default
    for f in dataclasses.fields(RequestOutput)
    if f.name not in ("request_id", "prompt", "prompt_token_ids", "outputs") and f.default is not dataclasses.MISSING
}


def news_since(output: RequestOutput, sent: dict[int, int], final: bool) -> RequestOutput:
    """What `output` gained since its last message: each sequence's per-token lists past `sent[index]`
    (tokens already sent; updated here), its other fields as they are, and no text. Request-level
    fields ride only on the first and the last message of a request (`final`).

    Built field by field from the objects' `__dict__` rather than with `dataclasses.replace`: the
    core does this for every running request every step (a few microseconds each, not ten)."""
    first = not sent
    completions = []
    for c in output.outputs:
        start = sent.get(c.index, 0)
        news = object.__new__(CompletionOutput)
        news.__dict__.update({k: v[start:] if type(v) is list else v for k, v in c.__dict__.items()})
        news.text = ""
        completions.append(news)
        sent[c.index] = len(c.token_ids)
    news = object.__new__(RequestOutput)
    news.__dict__.update(output.__dict__)
    news.prompt, news.prompt_token_ids, news.outputs = None, [], completions
    if not (first or final):
        news.__dict__.update(_REQUEST_DEFAULTS)
    return news


# ---- the channel and the model ------------------------------------------------------------------
@dataclass(frozen=True)
class CoreAddresses:
    """The two ZeroMQ endpoints: `commands` (the core binds and reads), `events` (the front end binds and reads)."""

    commands: str
    events: str

    @classmethod
    def new(cls) -> CoreAddresses:
        """Unix sockets in the temporary directory, named so two servers never share one."""
        base = os.path.join(tempfile.gettempdir(), f"numba-vllm-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        return cls(f"ipc://{base}-commands", f"ipc://{base}-events")

    def remove_files(self) -> None:
        """Delete the socket files (ZeroMQ leaves them behind)."""
        for address in (self.commands, self.events):
            try:
                os.unlink(address.removeprefix("ipc://"))
            except OSError:
                pass


@dataclass
class ModelInfo:
    """What the front end knows of the model the core runs: enough to tokenize, check lengths,
    detokenize and stop, and to describe the server (handed over once, when the core is ready)."""

    config: ModelConfig
    tokenizer: Tokenizer | None
    max_model_len: int
    backend: str
    stats: EngineStats  # the engine's state when it became ready
    source: str  # the checkpoint's path
    sampling_defaults: dict  # what a request's absent sampling fields take (the model's generation_config.json)

    @property
    def lengths(self) -> LengthPolicy:
        return LengthPolicy(self.max_model_len, self.config.vocab_size)
