"""The OpenAI wire format: request bodies in (validated), error bodies and response bodies out.

Requests are parsed by pydantic in strict mode: a JSON string is not a number, `true` is not 1.
Every field is honoured or refused, never silently dropped: fields the OpenAI API (or vLLM's
extensions) define but this engine cannot honour (tools, `suffix`, `best_of` other than n, ...) get
a 400 naming the field, and so does a field nobody here knows (as the OpenAI API answers). The
sampling fields (penalties, `logit_bias`, `min_p`, `min_tokens`, `bad_words`, ...) and logprobs
(completions' `logprobs: k` and `echo`, chat's `logprobs` with `top_logprobs`) are honoured as vLLM
does; a value `SamplingParams` refuses is a 400 naming the field. Before validation the body is
checked as JSON: at most `MAX_JSON_DEPTH` levels of nesting, and no lone UTF-16 surrogate
(`"\\ud800"`) in any string, which no tokenizer or encoder can take.
Every error leaves as `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from numba_vllm.engine.lengths import LengthPolicy, MaxTokensError, PromptError
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.engine.structured import StructuredOutputsParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the length limit
MAX_JSON_DEPTH = 64  # nesting levels of a request body (a chat body needs ~5; deeper only serves to exhaust the stack)
CHAT_ROLES = ("system", "developer", "user", "assistant")  # tool messages need tools, which are not supported
# Template variables the server sets itself (or that would smuggle in what a request field refuses).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "add_generation_prompt", "tokenize", "tools", "documents", "bos_token", "eos_token"}
)


class APIError(Exception):
    """An error answered to the client with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers  # extra response headers (WWW-Authenticate, Retry-After, Allow)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- request bodies -------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """`response_format.json_schema`: OpenAI's named schema (`strict` is accepted; the schema is always enforced)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching `json_schema.schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Body):
    """vLLM's `structured_outputs` (engine.structured.StructuredOutputsParams): exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class _GenerationRequest(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # None: the served model
    temperature: float | None = None  # None: the model's default (generation_config.json), else 1.0 (OpenAI's)
    top_p: float | None = None  # None: the model's default, else 1.0
    top_k: int | None = None  # extension (vLLM's): 0 or -1 = no limit; None: the model's default, else no limit
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    n: int | None = 1  # choices per prompt
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias in [-100, 100]
    user: str | None = None  # the end user's id, for the client's records: accepted, no effect on generation
    return_token_ids: bool = False  # extension: token ids alongside the text (prompt and output)
    repetition_penalty: float | None = None  # vLLM's extensions, as SamplingParams takes them
    min_p: float | None = None
    min_tokens: int | None = None
    # Structured output (at most one of these fields): OpenAI's, vLLM's, and vLLM's older names.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # extension: top logprobs of every prompt token
    # What routers (vllm-router) add to every request they forward, at these values: accepted there,
    # since they are what this server does anyway (stop strings cut, no hidden states); any other
    # value is refused.
    no_stop_trim: bool = False
    return_hidden_states: bool = False


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal[CHAT_ROLES]
    content: str | list[dict[str, Any]]  # a string, or text parts
    name: str | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # the newer name; wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True  # extension, as in vLLM
    chat_template_kwargs: dict[str, Any] | None = None  # extension: extra template variables
    # routers' additions again (see _GenerationRequest): this model has no reasoning parser, so
    # reasoning is neither split out nor streamed apart; the last message is never continued
    continue_final_message: bool = False
    include_reasoning: bool = True
    separate_reasoning: bool = True
    stream_reasoning: bool = True

ROUTER_CHAT_FIELDS = (("continue_final_message", False), ("include_reasoning", True), ("separate_reasoning", True),
                      ("stream_reasoning", True))  # fmt: skip


# What a field must look like, for the union-typed ones whose pydantic errors are unreadable.
_SHAPES = {
    "prompt": "a string, a list of token ids, or a list of strings or of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of {'type': 'text', 'text': ...} parts",
    "tool_choice": "a string or an object",
}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def parse_body(raw: bytes, model: type[_Body]) -> _Body:
    """JSON bytes -> a validated request, or an APIError(400) naming the first bad field."""
    too_deep = bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        obj = json.loads(raw)
    except RecursionError:  # the C parser stops at the interpreter's recursion limit
        raise too_deep from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request("the request body must be a JSON object")
    check_json_values(obj)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise _validation_error(e) from None


def check_json_values(obj: dict) -> None:
    """APIError(400) for nesting deeper than MAX_JSON_DEPTH or a string (key or value) that is not
    valid Unicode (a lone surrogate). Iterative: a deep body cannot exhaust the stack here."""
    stack: list[tuple[dict | list, int, str]] = [(obj, 1, "")]
    while stack:
        container, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", where or None)
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, value in items:
            if isinstance(key, str):
                _check_text(key, where or None)
                param = f"{where}.{key}" if where else key
            else:
                param = f"{where}[{key}]"
            if isinstance(value, str):
                _check_text(value, param)
            elif isinstance(value, (dict, list)):
                stack.append((value, depth + 1, param))


def _check_text(text: str, param: str | None) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            where = f"'{param}'" if param else "a key of the request body"
            raise bad_request(f"{where} holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text", param) from None


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    param, field = _param_of(err["loc"])
    if err["type"] == "missing":
        return bad_request(f"'{param}' is required", param)
    if err["type"] == "extra_forbidden":
        return bad_request(f"'{param}' is not a field this endpoint takes (unknown fields are refused, not ignored)", param)
    if err["type"] == "literal_error" and field == "role":
        return bad_request(f"'{param}' must be one of {', '.join(map(repr, CHAT_ROLES))}", param)
    union = any(isinstance(p, str) and (p in _TYPE_TAGS or not p.isidentifier()) for p in err["loc"])
    if field in _SHAPES and union:
        return bad_request(f"'{param}' must be {_SHAPES[field]}", param)
    msg = err["msg"]
    if err["type"] == "too_short" and field == "messages":
        msg = "must hold at least one message"
    return bad_request(f"'{param}': {msg}", param)


def _param_of(loc: tuple) -> tuple[str, str]:
    """pydantic's error location -> ('messages[0].content', 'content'), dropping union tags."""
    param, field = "", ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS:
            param += ("." if param else "") + part
            field = part
        else:
            break
    return param or "body", field


# ---- request -> engine inputs ---------------------------------------------------------------------
def check_supported(req: _GenerationRequest) -> None:
    """Reject OpenAI fields this engine cannot honour, naming the field."""
    for name, neutral in (("no_stop_trim", False), ("return_hidden_states", False)):
        if getattr(req, name) != neutral:
            raise bad_request(f"{name} is not supported (only {str(neutral).lower()})", name)
    if isinstance(req, ChatCompletionRequest):
        for name, neutral in ROUTER_CHAT_FIELDS:
            if getattr(req, name) != neutral:
                raise bad_request(f"{name} is not supported (only {str(neutral).lower()})", name)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    if isinstance(req, CompletionRequest):
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens must be an integer >= 1 (0 only with echo: the prompt alone)", "max_tokens")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise bad_request(f"best_of is not supported (only equal to n, {req.n or 1})", "best_of")
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
    else:
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if req.tools:
            raise bad_request("tools are not supported", "tools")
        if req.tool_choice not in (None, "none"):
            raise bad_request("tool_choice is not supported (tools are not); only 'none'", "tool_choice")
        reserved = RESERVED_TEMPLATE_KWARGS & set(req.chat_template_kwargs or {})
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}", "chat_template_kwargs")


def requested_max_tokens(req: _GenerationRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def echo_only(req: _GenerationRequest) -> bool:
    """A completions request for the prompt alone (echo with max_tokens 0): the engine runs the prompt
    and samples one token, which the answer leaves out."""
    return isinstance(req, CompletionRequest) and bool(req.echo) and req.max_tokens == 0


def _logprobs_fields(req: _GenerationRequest) -> tuple[int | None, int | None, str]:
    """(logprobs, prompt_logprobs, the request field logprobs came from) for SamplingParams:
    completions' `logprobs: k` (and `echo`: the prompt's too), chat's `logprobs` + `top_logprobs`."""
    if isinstance(req, CompletionRequest):
        prompt = req.prompt_logprobs
        if req.echo and req.logprobs is not None and prompt is None:
            prompt = req.logprobs
        return req.logprobs, prompt, "logprobs"
    k = (req.top_logprobs or 0) if req.logprobs else None
    return k, req.prompt_logprobs, "top_logprobs"


def sampling_params(req: _GenerationRequest, defaults: dict[str, Any] | None = None) -> SamplingParams:
    """The request's SamplingParams; a value SamplingParams refuses becomes a 400 naming the field.

    `defaults` (the model's, `LLMEngine.sampling_defaults`) fill what the request leaves out (a field
    absent or null), as in vLLM; a value given explicitly wins; the rest take SamplingParams' own."""
    logprobs, prompt_logprobs, logprobs_field = _logprobs_fields(req)
    optional = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
    given = {k: getattr(req, k) for k in optional if getattr(req, k) is not None}
    try:
        return SamplingParams(
            **{**(defaults or {}), **given},
            n=1 if req.n is None else req.n,
            seed=req.seed,
            max_tokens=1 if echo_only(req) else requested_max_tokens(req),
            stop=[] if req.stop is None else req.stop,
            stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos,
            structured_outputs=structured_outputs(req),
            logit_bias=req.logit_bias,
            min_tokens=req.min_tokens or 0,
            bad_words=req.bad_words or [],
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
    except ValueError as e:
        message = str(e)
        param = message.split(" ", 1)[0].rstrip(":")
        if param not in SamplingParams.__dataclass_fields__:
            param = None
        elif param == "max_tokens" and isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
            param = "max_completion_tokens"
        elif param == "logprobs":
            param = logprobs_field
        raise bad_request(message, param) from None


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # vLLM's older names


def constraint_field(req: _GenerationRequest) -> str | None:
    """The field that carries the request's structured-output constraint (None: unconstrained);
    a 400 if several do."""
    given = [name for name in ("response_format", "structured_outputs", *GUIDED_FIELDS) if getattr(req, name) is not None]
    if req.response_format is not None and req.response_format.type == "text":
        given.remove("response_format")  # plain text: no constraint
    if len(given) > 1:
        raise bad_request(f"give at most one structured-output field; got {', '.join(given)}", given[1])
    return given[0] if given else None


def structured_outputs(req: _GenerationRequest) -> StructuredOutputsParams | None:
    """The request's constraint as the engine takes it; a 400 naming the field if it is malformed.
    (Whether it compiles is checked against the engine's tokenizer: `GrammarError`.)"""
    name = constraint_field(req)
    if name is None:
        return None
    try:
        if name == "response_format":
            fmt = req.response_format
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ValueError("response_format of type 'json_schema' needs json_schema.schema")
            return StructuredOutputsParams(json=fmt.json_schema.schema_)
        if name == "structured_outputs":
            so = req.structured_outputs
            fields = so.model_dump(exclude={"json_"})
            return StructuredOutputsParams(json=so.json_, **fields)
        return StructuredOutputsParams(**{name.removeprefix("guided_"): getattr(req, name)})
    except ValueError as e:
        raise bad_request(f"{name}: {e}" if name in GUIDED_FIELDS else str(e), name) from None


def check_length(lengths: LengthPolicy, ids: list[int], req: _GenerationRequest, explicit_max_tokens: bool, param: str) -> None:
    """A prompt the model cannot run, or an explicit max_tokens beyond what is left, is a 400
    (the engine's length policy decides; vLLM's server answers the same way)."""
    try:
        lengths.check_prompt(ids)
    except PromptError as e:
        code = "context_length_exceeded" if len(ids) >= lengths.max_model_len else None
        raise bad_request(str(e), param, code) from None
    max_tokens = requested_max_tokens(req)
    if explicit_max_tokens and max_tokens is not None:
        name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        try:
            lengths.check_max_tokens(len(ids), max_tokens, name)
        except MaxTokensError as e:
            raise bad_request(str(e), name, "context_length_exceeded") from None


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template wants them; content parts must be text (joined with newlines)."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(
                        f"messages[{i}].content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                        f"messages[{i}].content[{j}]",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        msg = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


# ---- response bodies ------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens served from the prefix cache (as
    OpenAI and vLLM report them, in `prompt_tokens_details`)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def envelope(request_id: str, obj: str, model: str, created: int | None = None) -> dict:
    return {"id": request_id, "object": obj, "created": int(time.time()) if created is None else created, "model": model}


def sse(obj: dict | str) -> bytes:
    """One server-sent event."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
