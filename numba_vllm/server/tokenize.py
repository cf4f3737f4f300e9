"""Conversations to token ids (`chat_prompt_ids`, for /v1/chat/completions), and vLLM's
`POST /tokenize`: a prompt or a conversation in, its token ids out, as the generation endpoints
would tokenize it.

Prefix-aware routers ask for it: vllm-router's `cache_aware` policy tokenizes a text request on the
replicas before it picks one, and keys its prefix tree on the ids, the same key as the replicas'
KV caches. Without this endpoint it cannot learn text prefixes at all, and every text request goes
to the least loaded replica. The body is one of vLLM's two forms:

    {"prompt": "text", "add_special_tokens": true}                        -> what /v1/completions runs
    {"messages": [...], "add_generation_prompt": true, "chat_template_kwargs": {...}}  -> /v1/chat/completions

and the answer `{"count": n, "max_model_len": m, "tokens": [ids], "token_strs": null}` (the
vocabulary strings with `"return_token_strs": true`).

`POST /detokenize` is the way back, as vLLM's: `{"tokens": [ids]}` in, `{"prompt": text}` out (the
ids decoded with their special tokens, as vLLM's tokenizer decodes them).

`GET /tokenizer_info` describes the tokenizer, as vLLM's: its special tokens, BOS policy, chat
template and length limit. Clients that tokenize through the server read it first:
lm-evaluation-harness's `local-completions` model picks its `remote` tokenizer backend when this
route and /tokenize answer, and then needs no tokenizer files of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from numba_vllm.loading.tokenizer import Tokenizer
from numba_vllm.server.core_protocol import ModelInfo
from numba_vllm.server.protocol import ChatMessage, bad_request, chat_messages, parse_body


class TokenizeRequest(BaseModel):
    """vLLM's two forms in one: exactly one of `prompt` and `messages`."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True  # prompt form: BOS first when the tokenizer asks for it
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # messages form
    chat_template_kwargs: dict[str, Any] | None = None  # messages form
    return_token_strs: bool = False


async def chat_prompt_ids(tok: Tokenizer | None, req: Any, model: str) -> list[int]:
    """The conversation of a chat request (`messages`, `add_generation_prompt`, `chat_template_kwargs`)
    through the model's chat template, as token ids; APIError(400) if it cannot be rendered."""
    if tok is None or not tok.has_chat_template:
        raise bad_request(f"the model '{model}' has no chat template; use /v1/completions", "messages")
    messages = chat_messages(req)
    kwargs = req.chat_template_kwargs or {}
    reserved = {"messages", "add_generation_prompt", "tokenize"} & set(kwargs)
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}", "chat_template_kwargs")
    try:
        return await run_in_threadpool(
            tok.apply_chat_template, messages, add_generation_prompt=req.add_generation_prompt, **kwargs
        )
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), "messages") from None


async def tokenize(model_info: ModelInfo, raw: bytes, resolve_model: Callable[[str | None], str]) -> dict:
    """The answer body for a /tokenize request; APIError for a bad body (400), an unknown model
    (`resolve_model` raises), text for a model without a tokenizer or chat for one without a template."""
    req = parse_body(raw, TokenizeRequest)
    model = resolve_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give either 'prompt' or 'messages'")
    tok = model_info.tokenizer
    if req.messages is not None:
        if not req.messages:
            raise bad_request("'messages' must hold at least one message", "messages")
        ids = await chat_prompt_ids(tok, req, model)
    elif tok is None:
        raise bad_request("this model has no tokenizer: it takes prompts as token ids", "prompt")
    else:
        ids = await run_in_threadpool(tok.encode, req.prompt, add_special_tokens=req.add_special_tokens)
    strs = [tok.id_to_token(i) for i in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": model_info.max_model_len, "tokens": ids, "token_strs": strs}


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize body."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int]


async def detokenize(model_info: ModelInfo, raw: bytes, resolve_model: Callable[[str | None], str]) -> dict:
    """The answer body for a /detokenize request; APIError(400) for a bad body, an id outside the
    vocabulary or a model without a tokenizer; an unknown model as `resolve_model` raises."""
    req = parse_body(raw, DetokenizeRequest)
    resolve_model(req.model)
    tok = model_info.tokenizer
    if tok is None:
        raise bad_request("this model has no tokenizer: there is no text to decode to", "tokens")
    vocab = model_info.config.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (0 .. {vocab - 1})", "tokens")
    text = await run_in_threadpool(tok.decode, req.tokens, skip_special_tokens=False)
    return {"prompt": text}


def tokenizer_info(model_info: ModelInfo) -> dict:
    """The answer body for GET /tokenizer_info; APIError(400) for a model without a tokenizer."""
    tok = model_info.tokenizer
    if tok is None:
        raise bad_request("this model has no tokenizer: it takes prompts as token ids")
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",  # what transformers builds from a tokenizer.json
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": None,
        "add_bos_token": tok.add_bos_token,
        "chat_template": tok.chat_template,
        "model_max_length": model_info.max_model_len,
    }
