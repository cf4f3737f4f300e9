"""The app's OpenAPI schema (`GET /openapi.json`), complete enough to test the server against.

The generation routes read their bodies themselves (`protocol.parse_body`: strict JSON checks and
errors that name the field), so FastAPI cannot see their request models; here the schema is given
them: the request bodies (from the pydantic models, which refuse unknown fields), the answers
(JSON, or server-sent events when `stream` is true) and every error status a route can give, each
with the OpenAI-style error body. A fuzzer (`make fuzz`: schemathesis) then checks the server keeps
to it: no 5xx, and no status, content type or body the schema does not declare.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from numba_vllm.server.protocol import ChatCompletionRequest, CompletionRequest
from numba_vllm.server.tokenize import DetokenizeRequest, TokenizeRequest

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

# status -> when; every route under /v1 may also answer 400 (bad Host), 401 (API key)
ERRORS = {
    "400": "A malformed or unsupported request (the message and `param` say what)",
    "401": "The API key is missing or wrong",
    "404": "An unknown model",
    "405": "Another method than the route takes",
    "408": "The body took too long to arrive",
    "413": "The body is over the size limit",
    "415": "The body is not sent as application/json",
    "500": "The engine failed the request (the message carries an id to find in the log)",
    "503": "Shutting down, the engine cannot serve, or the waiting queue is full (with Retry-After)",
}
GENERATION_ERRORS = ("400", "401", "404", "405", "408", "413", "415", "500", "503")
READ_ERRORS = ("400", "401", "404", "405")
TOKENIZE_ERRORS = ("400", "404", "405", "408", "413")  # not under /v1: no API key, any content type

_STREAM = {"text/event-stream": {"schema": {"type": "string"}}}


def _errors(statuses) -> dict:
    return {s: {"description": ERRORS[s], "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            for s in statuses}  # fmt: skip


def document_errors(app: FastAPI) -> None:
    """Make `app.openapi()` return the full schema described in the module docstring."""

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["Error"] = ERROR_SCHEMA
        paths = schema["paths"]
        for path, model, obj in (
            ("/v1/completions", CompletionRequest, "text_completion"),
            ("/v1/chat/completions", ChatCompletionRequest, "chat.completion"),
        ):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            names = app.state.numba_vllm.model_names  # `model` is one of the served names (404 otherwise)
            body["properties"]["model"] = {"anyOf": [{"enum": names}, {"type": "null"}], "default": None}
            components[model.__name__] = body
            answer = {
                "type": "object",
                "required": ["id", "object", "created", "model", "choices", "usage"],
                "properties": {"object": {"const": obj}, "choices": {"type": "array"}, "usage": {"type": "object"}},
            }
            operation = paths[path]["post"]
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
            }
            operation["responses"] = {
                "200": {"description": "The answer; with `stream`, server-sent events ending in `data: [DONE]`",
                        "content": {"application/json": {"schema": answer}, **_STREAM}},
                **_errors(GENERATION_ERRORS),
            }  # fmt: skip
        body = TokenizeRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components["TokenizeRequest"] = body
        tokens = {"type": "array", "items": {"type": "integer"}}
        answer = {
            "type": "object",
            "required": ["count", "max_model_len", "tokens", "token_strs"],
            "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"}, "tokens": tokens},
        }
        operation = paths["/tokenize"]["post"]
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TokenizeRequest"}}},
        }
        operation["responses"] = {
            "200": {"description": "The ids generation would run", "content": {"application/json": {"schema": answer}}},
            **_errors(TOKENIZE_ERRORS),
        }  # fmt: skip
        body = DetokenizeRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        components["DetokenizeRequest"] = body
        answer = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
        paths["/detokenize"]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/DetokenizeRequest"}}},
        }
        paths["/detokenize"]["post"]["responses"] = {
            "200": {"description": "The ids as text", "content": {"application/json": {"schema": answer}}},
            **_errors(TOKENIZE_ERRORS),
        }  # fmt: skip
        info = {"type": "object", "required": ["tokenizer_class", "eos_token"],
                "properties": {"tokenizer_class": {"type": "string"}}}  # fmt: skip
        paths["/tokenizer_info"]["get"]["responses"] = {
            "200": {"description": "The tokenizer's special tokens, chat template and length limit",
                    "content": {"application/json": {"schema": info}}},
            **_errors(("400", "405")),
        }  # fmt: skip
        for path in ("/v1/models", "/v1/models/{model}"):
            paths[path]["get"]["responses"].update(_errors(READ_ERRORS))
            paths[path]["get"]["responses"].pop("422", None)  # FastAPI's validation error: answered as 400 here
        paths["/health"]["get"]["responses"] = {
            "200": {"description": "The engine serves"},
            "503": {"description": "Shutting down, or the engine cannot serve"},
        }
        paths["/metrics"]["get"]["responses"] = {
            "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
        }
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
