"""Structured output (engine/structured.py through the engine and both runners): what comes out
matches its constraint, checked by independent tools (Python's `json` and `re`, jsonschema-rs).

A tiny random model with a byte-level tokenizer (268 ids: not a multiple of 32) is the strictest
case: it follows no instruction, so only the mask keeps its output inside the constraint. SmolLM2
on the NumPy backend answers real prompts with several schemas, sampled at temperature 1 with
several seeds and greedily. The simulator runs the kernel runner's paths (eager, and steps replayed
from emulated CUDA graphs: decode steps whole, prefill steps in pieces with the head and sampler one
graph) and must give the NumPy backend's constrained greedy tokens.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from numba_vllm.engine import structured as structured_module
from numba_vllm.engine.llm_engine import LLM
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.engine.structured import GrammarError, StructuredOutputsParams
from numba_vllm.executor.cuda_graph import DecodeGraphs
from numba_vllm.executor.piecewise_graphs import PiecewiseGraphs
from tests.helpers import GPU_TEST_MEMORY_SHARE
from tests.helpers.smollm2 import needs_smollm2
from tests.helpers.tiny_llama import write_chat_checkpoint

REPO = Path(__file__).parents[1]
SEEDS = (0, 1, 2)
REGEX = r"(ab|b[a-c]?){1,3}-[0-9]{2}"
CHOICES = ["hello", "hi", "the world"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(write_chat_checkpoint(tmp_path_factory.mktemp("tiny-chat")))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return LLM(tiny_dir, backend="numpy")


def _first(outputs) -> list:
    """Each request's sequence (n = 1): its CompletionOutput."""
    return [o.outputs[0] for o in outputs]


def _params(constraint: StructuredOutputsParams, seed: int | None, max_tokens: int = 24) -> SamplingParams:
    if seed is None:
        return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint)
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=constraint)


# ---- the parameters --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
        ({"regex": "a", "choice": ["a"]}, r"got 2 \(regex, choice\)"),
        ({"json": 3}, "must be a JSON schema"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"choice": "ab"}, "choice must be a non-empty list of strings"),
        ({"choice": []}, "choice must be a non-empty list of strings"),
        ({"choice": ["a", 1]}, "choice must be a non-empty list of strings"),
        ({"json_object": False}, "got none"),
    ],
)
def test_a_constraint_takes_exactly_one_kind(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_sampling_params_take_only_the_params_object():
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


# ---- compiling ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, message",
    [
        ({"json": {"type": "nonsense"}}, "JSON schema: .*nonsense"),
        ({"json": "{not json"}, "JSON schema: "),
        ({"regex": "(ab"}, "(?s)regex: .*unclosed group"),
        ({"grammar": 'start: "a" b'}, "grammar: "),
    ],
)
def test_a_constraint_that_does_not_compile_is_a_grammar_error_naming_it(tiny, fields, message):
    with pytest.raises(GrammarError, match=message):
        tiny.engine.structured.compile(StructuredOutputsParams(**fields))


def test_a_bad_constraint_leaves_no_request_behind(tiny):
    params = _params(StructuredOutputsParams(regex="(ab"), None)
    with pytest.raises(ValueError, match="unclosed group"):
        tiny.engine.add_request("bad", [1, 2, 3], params)
    assert not tiny.engine.has_unfinished_requests()
    tiny.engine.add_request("bad", [1, 2, 3], _params(StructuredOutputsParams(regex="ab"), None))  # the id is free
    tiny.engine.abort_request("bad")


def test_compiled_constraints_are_cached_by_kind_and_text(tiny, monkeypatch):
    structured = tiny.engine.structured
    a = structured.compile(StructuredOutputsParams(json={"type": "object", "required": ["x"]}))
    assert structured.compile(StructuredOutputsParams(json='{"type":"object","required":["x"]}')) is not a  # other text
    assert structured.compile(StructuredOutputsParams(json={"required": ["x"], "type": "object"})) is a  # same dict
    monkeypatch.setattr(structured_module, "GRAMMAR_CACHE_SIZE", 2)
    structured.compile(StructuredOutputsParams(regex="x"))
    structured.compile(StructuredOutputsParams(regex="y"))
    assert len(structured._cache) == 2
    assert structured.compile(StructuredOutputsParams(json={"type": "object", "required": ["x"]})) is not a  # evicted


def test_an_llguidance_that_takes_one_eos_id_gets_the_first():
    """llguidance releases before 1.9 take a single EOS id (a list is their TypeError, as 1.6 raises
    it): the tokenizer is built with the first; later releases get them all."""
    calls = []

    class OneEosId:  # LLTokenizer as llguidance 1.6 has it
        @staticmethod
        def LLTokenizer(text, n_vocab, eos_token):  # noqa: N802 - llguidance's name
            calls.append(eos_token)
            if isinstance(eos_token, list):
                raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")
            return ("one", eos_token)

    class EveryEosId:
        @staticmethod
        def LLTokenizer(text, n_vocab, eos_token):  # noqa: N802
            return ("every", eos_token)

    assert structured_module._ll_tokenizer(OneEosId, "{}", 300, [7, 9]) == ("one", 7)
    assert calls == [[7, 9], 7]
    assert structured_module._ll_tokenizer(EveryEosId, "{}", 300, [7, 9]) == ("every", [7, 9])


# ---- generating on the tiny random model ---------------------------------------------------------
@pytest.mark.parametrize("seed", [None, *SEEDS])
def test_a_random_model_follows_a_regex_and_a_choice(tiny, seed):
    outs = _first(tiny.generate(
        [[5, 6, 7], [8, 9]],
        [_params(StructuredOutputsParams(regex=REGEX), seed), _params(StructuredOutputsParams(choice=CHOICES), seed)],
        use_tqdm=False,
    ))
    assert re.fullmatch(REGEX, outs[0].text), outs[0].text
    assert outs[1].text in CHOICES
    assert [o.finish_reason for o in outs] == ["stop", "stop"]


@pytest.mark.parametrize("seed", [None, *SEEDS])
def test_a_random_model_follows_a_lark_and_a_gbnf_grammar(tiny, seed):
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,2}/'
    gbnf = 'root ::= "x" [a-c]+ "y"'
    outs = _first(tiny.generate(
        [[5, 6, 7], [8, 9]],
        [_params(StructuredOutputsParams(grammar=lark), seed, 40), _params(StructuredOutputsParams(grammar=gbnf), seed, 40)],
        use_tqdm=False,
    ))
    assert re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", outs[0].text) or outs[0].finish_reason == "length", outs[0].text
    assert re.fullmatch(r"x[a-c]+y", outs[1].text) or outs[1].finish_reason == "length", outs[1].text
    for out in outs:
        if out.finish_reason == "length":  # a random model may go on; what it wrote is still a prefix
            assert out.text and len(out.token_ids) == 40


def test_each_of_n_sequences_follows_the_constraint_with_its_own_state(tiny):
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=REGEX))
    (out,) = tiny.generate([[5, 6, 7]], params, use_tqdm=False)
    assert len(out.outputs) == 4
    for seq in out.outputs:
        assert re.fullmatch(REGEX, seq.text) and seq.finish_reason == "stop", seq.text


def test_unconstrained_rows_beside_constrained_ones_are_unchanged(tiny):
    free = SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    alone = _first(tiny.generate([[3, 4]], free, use_tqdm=False))[0].token_ids
    mixed = _first(tiny.generate([[3, 4], [5, 6]], [free, _params(StructuredOutputsParams(regex=REGEX), 1)], use_tqdm=False))
    assert mixed[0].token_ids == alone


def _logprob_values(positions) -> list[dict[int, float]]:
    return [{t: round(lp.logprob, 4) for t, lp in d.items()} for d in positions]


def test_logprobs_of_constrained_and_edited_rows_are_the_models_own(tiny):
    """vLLM's logprobs are the model's raw ones, before edits and the mask: a constrained greedy
    request with a logit bias gives, for each of its tokens, what the same text fed back as a prompt
    gives as prompt logprobs (the top 3 of the whole vocabulary, most of them outside the grammar)."""
    prompt = [5, 6, 7]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, logit_bias={ord("b"): 3.0},
                            structured_outputs=StructuredOutputsParams(regex=REGEX))  # fmt: skip
    (out,) = _first(tiny.generate([prompt], params, use_tqdm=False))
    assert re.fullmatch(REGEX, out.text) and len(out.logprobs) == len(out.token_ids)
    fed_params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    (fed,) = tiny.generate([prompt + out.token_ids], fed_params, use_tqdm=False)
    want = _logprob_values(fed.prompt_logprobs[len(prompt) :])
    assert _logprob_values(out.logprobs) == want
    allowed = set(out.token_ids)
    assert any(set(d) - allowed for d in want)  # the top tokens are not only the grammar's


def test_the_cost_benchmark_runs(tiny_dir):
    """benchmarks/structured_output.py on the tiny model and NumPy: a row per constraint."""
    args = ["--model", tiny_dir, "--backend", "numpy", "--batch", "2", "--steps", "5"]
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "structured_output.py"), *args], capture_output=True, text=True,
                       cwd=REPO, timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert [line.split()[0] for line in r.stdout.splitlines()[2:]] == ["none", "json", "regex"], r.stdout
    assert r.stdout.splitlines()[-1].endswith("2/2 texts match"), r.stdout


# ---- the kernel runner in the simulator --------------------------------------------------------
@pytest.fixture(scope="module")
def one_layer_dir(tmp_path_factory):
    """The tiny chat model with one layer: half the simulated work a step."""
    return str(write_chat_checkpoint(tmp_path_factory.mktemp("one-layer"), num_hidden_layers=1))


@pytest.mark.slow  # a tiny model in the simulator: two steps, tens of seconds each on 2 cores
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "emulated-graph"])
def test_the_simulated_kernels_mask_as_numpy_does(one_layer_dir, graphs):
    prompts = [[5, 6, 7], [8, 9], [10], [11, 12]]
    params = [  # the first: masked, its logprobs the model's raw ones (copied before the mask)
        SamplingParams(temperature=0, max_tokens=4, logprobs=2, structured_outputs=StructuredOutputsParams(regex=r"[a-c][0-9]")),
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),  # unconstrained, beside
        _params(StructuredOutputsParams(choice=["hi", "ab", "x"]), 3, 4),
        SamplingParams(temperature=1.0, top_k=3, seed=2, max_tokens=4,  # sampled on the host, from the masked row
                       structured_outputs=StructuredOutputsParams(regex=r"[a-c][0-9]")),
    ]
    want = _first(LLM(one_layer_dir, backend="numpy").generate(prompts[:2], params[:2], use_tqdm=False))
    sim = LLM(one_layer_dir, backend="sim", max_num_seqs=4, num_pages=8)
    runner = sim.engine.runner
    if graphs:
        runner.decode_graphs, runner.piecewise_graphs = DecodeGraphs(runner.model), PiecewiseGraphs(runner.model)
    outs = _first(sim.generate(prompts, params, use_tqdm=False))
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in want]  # greedy: the same tokens as NumPy
    for token, got, expected in zip(outs[0].token_ids, outs[0].logprobs, want[0].logprobs, strict=True):
        assert got[token].logprob == pytest.approx(expected[token].logprob, abs=0.05)  # raw: masked would be ~4 higher
    assert re.fullmatch(r"[a-c][0-9]", outs[0].text)
    assert outs[2].text in ["hi", "ab", "x"]  # sampled on the device (another noise than NumPy's): in the choice
    assert re.fullmatch(r"[a-c][0-9]", outs[3].text)
    if graphs:  # decode steps took the decode graphs' path, prefill steps the piecewise one
        assert runner.decode_graphs._graphs and runner.piecewise_graphs.token_counts


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_on_cuda_every_sequence_follows_its_constraint(tiny_dir, enforce_eager):
    """The cuda backend (bf16: its tokens need not be NumPy's): greedy, device-sampled and host-sampled
    (top-k) rows under each kind of constraint, with unconstrained rows beside, eager and replayed."""
    gpu = LLM(tiny_dir, backend="cuda", max_num_seqs=8, enforce_eager=enforce_eager, gpu_memory_utilization=GPU_TEST_MEMORY_SHARE)
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,2}/'
    checks = {  # the pattern the text must match: its constraint
        REGEX: StructuredOutputsParams(regex=REGEX),
        "|".join(map(re.escape, CHOICES)): StructuredOutputsParams(choice=CHOICES),
        r"\([0-9]{1,2}(,[0-9]{1,2})*\)": StructuredOutputsParams(grammar=lark),  # unbounded: "length" is possible
    }
    for seed in (None, *SEEDS):
        params, patterns = [], []
        for pattern, constraint in checks.items():
            params.append(_params(constraint, seed, 40))
            patterns.append(pattern)
        params.append(SamplingParams(temperature=1.0, top_k=4, seed=seed, max_tokens=40, structured_outputs=checks[REGEX]))
        patterns.append(REGEX)
        params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True))  # unconstrained
        outs = _first(gpu.generate([[5 + i, 6, 7] for i in range(len(params))], params, use_tqdm=False))
        for pattern, out in zip(patterns, outs, strict=False):
            assert re.fullmatch(pattern, out.text) or out.finish_reason == "length", (pattern, out.text)
        assert len(outs[-1].token_ids) == 8


# ---- SmolLM2 ---------------------------------------------------------------------------------
SCHEMAS = {
    "required fields": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "sure": {"type": "boolean"}},
        "required": ["color", "sure"],
        "additionalProperties": False,
    },
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    "nested": {
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 16}, "country": {"enum": ["FR", "DE", "US"]}},
                "required": ["name", "country"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"enum": ["big", "old", "cold"]}, "maxItems": 2},
        },
        "required": ["city", "tags"],
        "additionalProperties": False,
    },
}
QUESTION = "Answer in JSON. Describe a person, a color, a list of numbers or a city, whichever fits."


@pytest.fixture(scope="module")
def smollm2():
    return LLM(None, backend="numpy")


@needs_smollm2
@pytest.mark.slow  # SmolLM2 on NumPy: ~30 constrained answers of up to 80 tokens
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_smollm2_output_parses_and_validates_against_its_schema(smollm2, name):
    import jsonschema_rs  # a test dependency (dev extra), not needed by the GPU tests of this file

    schema = SCHEMAS[name]
    constraint = StructuredOutputsParams(json=schema)
    params = [_params(constraint, seed, 80) for seed in (None, *SEEDS)]
    outs = _first(smollm2.chat([[{"role": "user", "content": QUESTION}]] * len(params), params, use_tqdm=False))
    validator = jsonschema_rs.validator_for(schema)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        validator.validate(json.loads(out.text))


@needs_smollm2
@pytest.mark.slow
def test_smollm2_follows_a_json_object_a_regex_and_a_choice(smollm2):
    constraints = {  # name: (constraint, question, seeds)
        # Any JSON object is unbounded: sampled at temperature 1 this small model nests objects in
        # objects past any budget (a schema bounds it, above), so only greedily.
        "json_object": (StructuredOutputsParams(json_object=True), "Reply with a JSON object with two keys, name and age.", ()),
        "regex": (StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3} years old\."), "How old is Anna?", SEEDS),
        "choice": (StructuredOutputsParams(choice=["Paris", "Berlin", "Rome"]), "What is the capital of France?", SEEDS),
    }
    names = [n for n in constraints for _ in (None, *constraints[n][2])]
    params = [_params(constraints[n][0], seed, 80) for n in constraints for seed in (None, *constraints[n][2])]
    outs = _first(smollm2.chat([[{"role": "user", "content": constraints[n][1]}] for n in names], params, use_tqdm=False))
    for name, out in zip(names, outs, strict=True):
        assert out.finish_reason == "stop", (name, out.text)
        if name == "json_object":
            assert isinstance(json.loads(out.text), dict)
        elif name == "regex":
            assert re.fullmatch(constraints["regex"][0].regex, out.text), out.text
        else:
            assert out.text in constraints["choice"][0].choice
