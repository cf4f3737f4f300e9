"""Structured output: a request's constraint (a JSON schema, a regex, a choice, a grammar) as a
token mask, through llguidance.

A constrained request carries a `StructuredOutputsParams` (vLLM's name and fields: exactly one of
`json`, `regex`, `choice`, `grammar`, `json_object`). The engine compiles it once, at admission, into
a `GrammarMatcher`: llguidance's `LLMatcher`, a parser state over the model's tokenizer. Each step,
before sampling, the runner asks every constrained row's matcher for its token bitmask and applies it
to that row's logits (masked tokens -> -inf: `kernels/logits_mask.py` on the device, `mask_logits`
here for NumPy); after sampling, the engine advances the matcher by the sampled token. A matcher that
has reached the end of its grammar (nothing but EOS could follow) ends its request with reason
"stop"; one that rejects a token (which the mask should make impossible) fails its request.

The bitmask: (rows, ceil(V / 32)) int32, bit ``v % 32`` of word ``v // 32`` set when token v is
allowed (llguidance's layout). V is the model's vocabulary (the logits' width); ids the tokenizer
does not have are never allowed.

Compiling: llguidance turns the constraint into its grammar text, then builds a matcher (its lexer and
parser tables; about a millisecond for a small schema, up to a second for a huge one). A compiled
matcher is kept per (kind, text) in a bounded LRU cache, and each request gets a copy of it (a few
microseconds). A constraint llguidance cannot compile raises `GrammarError` (a ValueError) naming the
problem; the server answers it with a 400. The llguidance tokenizer (the vocabulary as byte strings
and a token trie) is built once per engine, at the first constrained request, so an engine that never
sees one pays nothing and does not need llguidance at all.

JSON follows vLLM's llguidance defaults: any whitespace between JSON tokens (`disable_any_whitespace`
removes it, which keeps small models from drifting into runs of blank lines), and `json_object` means
the schema ``{"type": "object"}``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

GRAMMAR_CACHE_SIZE = 256  # compiled constraints kept per engine (LRU); a server sees many distinct schemas
BITS_PER_WORD = 32  # tokens per bitmask word


class GrammarError(ValueError):
    """A structured-output constraint that cannot be compiled (the message says why)."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's `StructuredOutputsParams`): set exactly one of
    `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice` (the output is one of these
    strings), `grammar` (Lark, or GBNF as llama.cpp writes it) or `json_object` (any JSON object)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON without whitespace between tokens

    def __post_init__(self) -> None:
        given = [name for name in _KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            named = f"{len(given)} ({', '.join(given)})" if given else "none"
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(_KINDS)}; got {named}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its JSON text), got {self.json!r:.80}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r:.80}")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r:.80}")
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object not in (None, True):
            raise ValueError(f"structured_outputs.json_object must be true when given, got {self.json_object!r}")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the constraint compiles from, and its cache key."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            return ("json", text) if not self.disable_any_whitespace else ("json_compact", text)
        if self.json_object:
            return ("json", '{"type": "object"}') if not self.disable_any_whitespace else ("json_compact", '{"type": "object"}')
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return "grammar", self.grammar


_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class GrammarMatcher:
    """One request's parser state: its next token mask, and the tokens it has consumed."""

    def __init__(self, matcher: Any, executor: Any):
        self._matcher = matcher  # llguidance.LLMatcher
        self._executor = executor  # the engine's llguidance.LLExecutor (masks of a batch in parallel)

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar does not allow it (the matcher is then
        in its error state, `error` says why)."""
        return self._matcher.consume_token(int(token_id))

    @property
    def is_finished(self) -> bool:
        """Whether the grammar is complete and nothing but EOS may follow: the request stops here."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


def fill_token_bitmasks(matchers: list[GrammarMatcher], bitmask: np.ndarray) -> None:
    """Write each matcher's next-token mask into its row of `bitmask` (len(matchers), ceil(V / 32))
    int32 (C-contiguous), computing them in parallel on llguidance's threads."""
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or not bitmask.flags.c_contiguous or bitmask.shape[0] != len(matchers):
        raise ValueError(f"bitmask must be a C-contiguous ({len(matchers)}, W) int32 array, got {bitmask.dtype} {bitmask.shape}")
    if not matchers:
        return
    row_bytes = bitmask.shape[1] * bitmask.itemsize
    pairs = [(m._matcher, i) for i, m in enumerate(matchers)]
    matchers[0]._executor.unsafe_compute_mask_ptr(pairs, bitmask.ctypes.data, row_bytes, len(matchers))


def bitmask_words(vocab_size: int) -> int:
    """Words of one bitmask row: ceil(V / 32)."""
    return -(-vocab_size // BITS_PER_WORD)


def mask_logits(logits: np.ndarray, bitmask: np.ndarray) -> None:
    """Set the logits of disallowed tokens to -inf, in place: logits (C, V) float32, bitmask
    (C, ceil(V / 32)) int32. The NumPy backend's mask; the device one is `kernels.logits_mask`."""
    if logits.ndim != 2 or bitmask.shape != (logits.shape[0], bitmask_words(logits.shape[1])):
        raise ValueError(f"bitmask {bitmask.shape} does not fit logits {logits.shape}: expected (C, ceil(V / 32))")
    vocab = np.arange(logits.shape[1])  # (V,)
    allowed = (bitmask[:, vocab // BITS_PER_WORD] >> (vocab % BITS_PER_WORD)) & 1  # (C, V)
    logits[allowed == 0] = -np.inf


class StructuredOutputs:
    """One engine's compiler of constraints: the llguidance tokenizer, the cache of compiled
    constraints, and the thread pool that computes a batch's masks. Thread-safe: the server compiles
    on its handler threads (to answer a bad schema with a 400) while the engine thread runs."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        """tokenizer: the model's `loading.tokenizer.Tokenizer` (None: constraints are refused);
        vocab_size: the logits' width; eos_token_ids: the ids that end a generation (allowed once
        the grammar is complete)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self._lock = threading.Lock()
        self._ll_tokenizer = None  # llguidance.LLTokenizer, built at the first constraint
        self._executor = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()  # (kind, text) -> pristine LLMatcher

    @classmethod
    def for_model(cls, config, tokenizer) -> StructuredOutputs:
        """The compiler for a model (its `ModelConfig` and `Tokenizer`, or None): the logits' width,
        and the ids that end a generation (the config's EOS ids and the tokenizer's stop tokens). The
        engine compiles with it; a server's front end too, to answer a bad constraint with a 400."""
        eos_ids = [*config.eos_token_ids, *(tokenizer.stop_token_ids if tokenizer is not None else ())]
        return cls(tokenizer, config.vocab_size, eos_ids)

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for one request (compiled, or copied from the cache); GrammarError if
        the constraint cannot be compiled."""
        return GrammarMatcher(self.compile(params).deep_copy(), self._executor)

    def compile(self, params: StructuredOutputsParams):
        """The compiled constraint (a pristine llguidance LLMatcher, shared: copy it before use)."""
        key = params.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiled = self._compile(*key)  # outside the lock: a large grammar takes a while
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, text: str):
        llg = _llguidance()
        tokenizer = self._tokenizer()
        try:
            if kind in ("json", "json_compact"):
                options = {"whitespace_flexible": kind == "json"}
                grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=options)
            elif kind == "grammar":
                grammar = llg.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
            else:
                grammar = llg.grammar_from(kind, text)
        except Exception as e:  # noqa: BLE001 - user text into a foreign compiler: not JSON, a GBNF that does not convert
            raise GrammarError(f"{_KIND_NAMES[kind]}: {_first_lines(str(e))}") from None
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{_KIND_NAMES[kind]}: {_first_lines(matcher.get_error())}")
        return matcher

    def _tokenizer(self):
        """The llguidance tokenizer (built once, under the lock: ~0.3 s for a 49k vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                if self.tokenizer is None:
                    raise GrammarError("structured output needs the model's tokenizer, and this model has none")
                llg = _llguidance()
                self._ll_tokenizer = _ll_tokenizer(llg, self.tokenizer.to_json(), self.vocab_size, self.eos_token_ids)
                self._executor = llg.LLExecutor()
            return self._ll_tokenizer


def _ll_tokenizer(llg, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
    """llguidance's tokenizer with every EOS id allowed at a grammar's end. Releases before 1.9 take
    a single EOS id (a list is a TypeError): there the first one, and a complete grammar ends on it
    (the engine stops the request on any EOS id alike, and on a grammar's end by itself)."""
    try:
        return llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids or None)
    except TypeError:
        return llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids[0])


_KIND_NAMES = {"json": "JSON schema", "json_compact": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
MAX_ERROR_LINES = 6  # llguidance's messages quote the grammar; a 400 keeps the first lines


def _first_lines(message: str) -> str:
    lines = message.strip().splitlines()
    return "\n".join(lines[:MAX_ERROR_LINES]) + (" ..." if len(lines) > MAX_ERROR_LINES else "")


def _llguidance():
    """The llguidance module, imported at the first constraint (only constrained requests need it)."""
    try:
        import llguidance
    except ImportError:
        raise GrammarError("structured output needs the llguidance package (pip install llguidance)") from None
    return llguidance
