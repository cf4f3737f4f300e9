"""Structured output through the server: OpenAI's `response_format`, vLLM's `structured_outputs` and
its older `guided_*` fields on both routes, streamed and not, and a 400 naming the field for a
constraint that is malformed or does not compile.

The tiny random model with a byte-level tokenizer follows regexes and choices only because of the
mask. Its engine core runs in a process of its own, as `numba-vllm serve` runs it: the front end
compiles a constraint only to answer a bad one with a 400, the constraint crosses to the core in the
request's SamplingParams, and the core compiles it again as it admits the request; what the core
refuses or fails comes back in its messages (tested against the core's loop directly). SmolLM2
(skipped if absent) answers with JSON through the official `openai` client, checked with Python's
`json` and jsonschema-rs.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import jsonschema_rs  # noqa: E402

from numba_vllm import LLM  # noqa: E402
from tests.helpers.server import ServerThread  # noqa: E402
from tests.helpers.smollm2 import needs_smollm2  # noqa: E402
from tests.helpers.tiny_llama import write_chat_checkpoint  # noqa: E402

NAME = "tiny-chat"
REGEX = r"(ab|b[a-c]?){1,3}-[0-9]{2}"
CHOICES = ["hello", "hi", "the world"]
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def server(chat_dir):
    server = ServerThread.spawn(chat_dir, [NAME])
    yield server
    server.close()


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json={"model": NAME, **body}, timeout=60)


# ---- constraints that cannot run ---------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format", "JSON schema: .*nonsense"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
         "needs json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "Input should be"),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "regex: .*unclosed group"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
         "not a field"),
        ({"guided_json": '{"type": "object", "properties": 3}'}, "guided_json", "JSON schema: "),
        ({"guided_choice": []}, "guided_choice", "guided_choice: .*non-empty list"),
        ({"guided_grammar": 'start: "a" b'}, "guided_grammar", "grammar: "),
        ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex", "at most one structured-output field"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_bad_constraint_is_a_400_naming_its_field(server, route, fields, param, message):
    body = {"prompt": [5, 6, 7]} if route == "completions" else {"messages": MESSAGES}
    r = _post(server, route, {**body, "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and re.search(message, error["message"], re.S), error


# ---- constraints that run ----------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_completions_follow_a_regex_and_a_choice(server, stream):
    client = server.client()
    for seed in (0, 1):
        for extra, check in (
            ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
            ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
        ):
            r = client.completions.create(model=NAME, prompt=[5, 6, 7], max_tokens=24, seed=seed, stream=stream, extra_body=extra)
            if stream:
                chunks = [c.choices[0] for c in r if c.choices]
                text, reason = "".join(c.text for c in chunks), chunks[-1].finish_reason
            else:
                text, reason = r.choices[0].text, r.choices[0].finish_reason
            assert check(text) and reason == "stop", (extra, text)


def test_chat_follows_a_lark_grammar_and_plain_text_stays_free(server):
    client = server.client()
    lark = 'start: "<" /[a-c]{1,3}/ ">"'
    chat = {"model": NAME, "messages": MESSAGES, "temperature": 0}
    r = client.chat.completions.create(**chat, max_tokens=10, extra_body={"guided_grammar": lark})
    assert re.fullmatch(r"<[a-c]{1,3}>", r.choices[0].message.content) and r.choices[0].finish_reason == "stop"
    plain = client.chat.completions.create(**chat, max_tokens=5, response_format={"type": "text"})
    free = client.chat.completions.create(**chat, max_tokens=5)
    assert plain.choices[0].message.content == free.choices[0].message.content


# ---- SmolLM2 -----------------------------------------------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"enum": ["France", "Germany", "Italy"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 40},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def smol():
    server = ServerThread(LLM(backend="numpy").engine, ["smollm2"])
    yield server
    server.close()


@needs_smollm2
@pytest.mark.slow  # SmolLM2 on the NumPy backend: four JSON answers
@pytest.mark.timeout(900)
def test_openai_client_response_format_json_schema_on_smollm2(smol):
    client = smol.client()
    messages = [{"role": "user", "content": "Give the capital of France as JSON."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "capital", "schema": SCHEMA, "strict": True}}
    validator = jsonschema_rs.validator_for(SCHEMA)
    for seed in (None, 0, 1):
        temperature = 0 if seed is None else 1.0
        r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=80, temperature=temperature,
                                           seed=seed, response_format=response_format)  # fmt: skip
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        validator.validate(json.loads(r.choices[0].message.content))
    r = client.completions.create(model="smollm2", prompt="A JSON object about Paris:", max_tokens=80, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict), r.choices[0].text


# ---- the engine core's side ----------------------------------------------------------------------
class _CoreClient:
    """The front end's two ZeroMQ ends, without the front end: commands in, events out, in the test."""

    def __init__(self, engine):
        import zmq

        from numba_vllm.server.core_process import CoreThread

        self.core = CoreThread(engine)
        self.context = zmq.Context()
        self.events = self.context.socket(zmq.PULL)
        self.events.bind(self.core.addresses.events)
        self.commands = self.context.socket(zmq.PUSH)
        self.commands.connect(self.core.addresses.commands)
        self.core.start()

    def send(self, command) -> None:
        from numba_vllm.server.core_protocol import encoder

        self.commands.send(encoder().encode(command))

    def until(self, done, timeout: float = 60):
        """Read events until `done(outputs, refused)` holds for all read so far; returns them."""
        from numba_vllm.server.core_protocol import StepOutputs, event_decoder

        outputs, refused, decoder = [], [], event_decoder()
        assert self.events.poll(int(timeout * 1000)), "no word from the core"
        while not done(outputs, refused):
            assert self.events.poll(int(timeout * 1000)), "the core went quiet"
            event = decoder.decode(self.events.recv())
            assert isinstance(event, StepOutputs), event
            outputs += event.outputs
            refused += event.refused
        return outputs, refused

    def close(self) -> None:
        from numba_vllm.server.core_protocol import Shutdown

        self.send(Shutdown())
        assert self.core.join(30)
        self.commands.close(linger=0)
        self.events.close(linger=0)
        self.context.term()
        self.core.close()


def test_the_core_compiles_what_it_admits_and_reports_a_grammar_that_fails(chat_dir, monkeypatch):
    """A constraint that reached the core without the front end's check is refused there with a 400
    naming structured_outputs; a sampled token its grammar rejects ends the request with an error
    that says so, in the core's messages."""
    from numba_vllm.engine.sampling import SamplingParams
    from numba_vllm.engine.structured import GrammarMatcher, StructuredOutputsParams
    from numba_vllm.server.core_protocol import AddRequest

    client = _CoreClient(LLM(str(chat_dir), backend="numpy").engine)
    try:
        bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(ab"))
        client.send(AddRequest("bad", [5, 6, 7], bad))
        _, refused = client.until(lambda outputs, refused: refused)
        assert [(r.request_id, r.status, r.param) for r in refused] == [("bad", 400, "structured_outputs")]
        assert re.search("regex: .*unclosed group", refused[0].message, re.S), refused[0].message

        good = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=REGEX))
        client.send(AddRequest("good", [5, 6, 7], good))
        outputs, _ = client.until(lambda outputs, refused: any(o.finished for o in outputs))
        tokens = [t for o in outputs for t in o.outputs[0].token_ids]
        assert outputs[-1].outputs[0].finish_reason == "stop" and outputs[-1].error is None
        assert re.fullmatch(REGEX, client.core.engine.tokenizer.decode(tokens))

        monkeypatch.setattr(GrammarMatcher, "accept", lambda self, token_id: False)  # as if the mask had let it through
        client.send(AddRequest("rejected", [5, 6, 7], good))
        outputs, _ = client.until(lambda outputs, refused: any(o.finished for o in outputs))
        last = outputs[-1]
        assert last.request_id == "rejected" and last.outputs[0].finish_reason == "error"
        assert re.search(r"structured output: token \d+ does not fit the grammar", last.error), last.error
    finally:
        client.close()
