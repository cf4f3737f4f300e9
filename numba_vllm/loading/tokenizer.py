"""Text <-> token ids: a Hugging Face `tokenizer.json`, its chat template, and streaming detokenization.

The tokenization itself is the `tokenizers` library's, from a `tokenizer.json` (a model directory's
own, or one built from GGUF metadata by `gguf_tokenizer.py`). Around it this module adds what
`tokenizer_config.json` says: the BOS/EOS strings, whether a plain encode starts with BOS, and the
chat template, rendered with Jinja2 the way Hugging Face transformers renders it (sandboxed,
`trim_blocks` and `lstrip_blocks`, `raise_exception`, `tojson`, `strftime_now`). The rendered prompt
already holds its special tokens, so it is encoded without adding any.

`IncrementalDetokenizer` turns generated ids into text as they arrive. Decoding one token alone is
wrong twice over: a character may span several byte-level tokens (decode shows U+FFFD until the last
byte arrives), and SentencePiece decoders drop the leading space of the first token they see. So, as
vLLM does, it decodes a short window of already-emitted tokens plus the new ones and emits only the
text past the window's, holding back anything that still ends in U+FFFD.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # newer transformers save the template here
REPLACEMENT_CHAR = "\ufffd"  # what a decoder shows for an incomplete UTF-8 sequence
DETOKENIZE_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first new one, for its spacing


class TokenizerError(ValueError):
    """A tokenizer file is missing or invalid, or a token is not in the vocabulary."""


class ChatTemplateError(ValueError):
    """The chat template is missing, does not parse, or refused the messages (`raise_exception`)."""


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens, BOS policy and chat template of its model."""

    def __init__(
        self,
        hf: HFTokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
    ):
        self._hf = hf
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = self._special_id("bos_token", bos_token)
        self.eos_token_id = self._special_id("eos_token", eos_token)
        self.add_bos_token = add_bos_token
        # A tokenizer.json may add BOS itself (a post-processor, as Llama 3's does): never add a second.
        self._post_processor_adds_bos = self.bos_token_id is not None and hf.encode("", add_special_tokens=True).ids[:1] == [
            self.bos_token_id
        ]
        self._template: jinja2.Template | None = None

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_json(
        cls,
        json_str: str,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
    ) -> Tokenizer:
        """Build from the text of a `tokenizer.json` and the settings `tokenizer_config.json` holds."""
        try:
            hf = HFTokenizer.from_str(json_str)
        except Exception as e:  # noqa: BLE001 - the Rust side raises a bare Exception
            raise TokenizerError(f"invalid tokenizer.json ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        return cls(hf, chat_template, bos_token, eos_token, add_bos_token)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` from a model directory."""
        model_dir = Path(model_dir)
        path = model_dir / TOKENIZER_FILE
        if not path.is_file():
            raise TokenizerError(f"{model_dir}: no {TOKENIZER_FILE}")
        cfg: dict[str, Any] = {}
        cfg_path = model_dir / TOKENIZER_CONFIG_FILE
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise TokenizerError(f"{cfg_path}: not valid JSON ({e})") from None
            if not isinstance(cfg, dict):
                raise TokenizerError(f"{cfg_path}: expected a JSON object")
        template_path = model_dir / CHAT_TEMPLATE_FILE
        template = (
            template_path.read_text(encoding="utf-8") if template_path.is_file() else _config_template(cfg.get("chat_template"))
        )
        try:
            json_str = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{path}: cannot read ({e})") from None
        try:
            return cls.from_json(
                json_str,
                template,
                _token_str(cfg.get("bos_token")),
                _token_str(cfg.get("eos_token")),
                bool(cfg.get("add_bos_token", False)),
            )
        except TokenizerError as e:
            raise TokenizerError(f"{path}: {e}") from None

    def _special_id(self, field: str, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self._hf.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{field} {token!r} is not in the vocabulary")
        return token_id

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (for libraries that build their own view of the
        vocabulary, as llguidance does for structured output)."""
        return self._hf.to_str()

    # ---- ids <-> text ------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generation by the tokenizer's own account (its EOS); the model config may add more."""
        return () if self.eos_token_id is None else (self.eos_token_id,)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of an id (byte-level or '▁' form), None if out of range."""
        return self._hf.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary string, None if it is not one."""
        return self._hf.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS first when the tokenizer config asks for it."""
        ids = self._hf.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None and not self._post_processor_adds_bos:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens (BOS, EOS, chat markers) are dropped unless asked for."""
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ---- chat --------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        """Whether `apply_chat_template` can be used."""
        return self.chat_template is not None

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **template_vars: Any,
    ) -> list[int] | str:
        """Render a conversation with the chat template; token ids, or the text if `tokenize` is False.

        `messages` are `{"role": ..., "content": ...}` dicts. `add_generation_prompt` appends the
        opening of the assistant's turn. Extra keyword arguments become template variables
        (`tools`, `date_string`, ...), as in transformers.
        """
        if self.chat_template is None:
            raise ChatTemplateError("this tokenizer has no chat template; encode the prompt as plain text instead")
        turns = (
            [] if isinstance(messages, (str, bytes, Mapping)) else [m for m in messages if isinstance(m, Mapping) and "role" in m]
        )
        if not turns or len(turns) != len(messages):
            raise ChatTemplateError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        context = {"tools": None, "documents": None, **template_vars}
        context.update(
            messages=[dict(m) for m in turns],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        try:
            text = self._template.render(**context)
        except ChatTemplateError:  # raise_exception's message, already clear
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        return self.encode(text, add_special_tokens=False) if tokenize else text


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The tokenizer of a model directory, or None if it has no tokenizer.json (token-id prompts only)."""
    if not (Path(model_dir) / TOKENIZER_FILE).is_file():
        return None
    return Tokenizer.from_dir(model_dir)


def _token_str(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config_template(value: Any) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named templates (use 'default')."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        value = named.get("default")
    return value if isinstance(value, str) else None


# ---- Jinja environment, as transformers sets it up ------------------------------------------------
def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; prompts need the plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse (line {e.lineno}: {e.message})") from None


# ---- streaming ------------------------------------------------------------------------------------
class IncrementalDetokenizer:
    """Text of generated tokens, one token at a time, never splitting a character or losing a space.

    The ids seen so far are split by two offsets: `[prefix_offset, read_offset)` is the window of
    tokens whose text was already emitted (decoded again only as context), `[read_offset, end)` are
    tokens not yet emitted. Each step decodes window and window + new tokens; the difference is the
    new text, emitted unless it ends in U+FFFD (an unfinished UTF-8 sequence), in which case the
    tokens wait for the next step. `flush()` emits whatever is left at the end of a generation.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = [int(t) for t in prompt_ids]
        self._prefix_offset = max(len(self._ids) - DETOKENIZE_CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Take one generated id; return the text it completes (often all of it, sometimes '')."""
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """Text still held back (an unfinished character shows as U+FFFD); call once at the end."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        full = decode(self._ids[self._prefix_offset :], self.skip_special_tokens)
        if len(full) <= len(prefix) or (full.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]
