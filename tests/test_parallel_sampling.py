"""`n` > 1: one request, n sequences that share the prompt's KV pages (numpy backend, tiny model).

The expected page ids follow from the allocator alone: with prefix caching the free pages are handed
out lowest first from page 1, a 39-token prompt fills pages 1 and 2 and 7 tokens of a third, so the
first child holds [1, 2, 3] and its siblings, admitted once its prompt is computed, find pages 1 and
2 in the cache and take one page of their own each (4, then 5). The expected tokens come from single
requests (n = 1) with the seeds the children are documented to use (seed + i).
"""

from __future__ import annotations

import pytest

from numba_vllm import LLM, SamplingParams
from numba_vllm.engine.config import EngineConfig
from numba_vllm.engine.llm_engine import LLMEngine, StepFailedError
from numba_vllm.loading.checkpoint import load_checkpoint
from tests.helpers.tiny_llama import tiny_checkpoint

PROMPT = list(range(1, 40))  # 39 tokens: two full pages of 16 and 7 tokens of a third


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def engine(tiny_dir, **kw) -> LLMEngine:
    return LLMEngine(load_checkpoint(tiny_dir), EngineConfig(backend="numpy", num_pages=32, **kw))


def steps(e: LLMEngine) -> list[list[tuple]]:
    """Run to the end; per step launched, each sequence as (request id, phase, first position, tokens,
    page ids). (With overlapped scheduling a call may only collect the step launched before it.)"""
    out = []
    while e.has_unfinished_requests():
        launched = e.num_steps
        e.step()
        if e.num_steps == launched:
            continue
        seqs = e.last_step().sequences
        out.append([(s.request_id, s.phase, s.start_position, s.num_new_tokens, s.page_ids) for s in seqs])
    return out


def test_the_children_share_the_prompts_full_pages_and_compute_only_its_last_page(tiny_dir):
    e = engine(tiny_dir)
    out = e.add_request("r", PROMPT, SamplingParams(n=3, seed=1, max_tokens=3, ignore_eos=True))
    plan = steps(e)
    assert plan[0] == [("0_r", "prefill", 0, 39, (1, 2, 3))]  # the siblings wait for child 0's prompt
    assert plan[1] == [
        ("0_r", "decode", 39, 1, (1, 2, 3)),
        ("1_r", "prefill", 32, 7, (1, 2, 4)),  # pages 1 and 2 from the cache: only the last 7 tokens computed
        ("2_r", "prefill", 32, 7, (1, 2, 5)),
    ]
    assert plan[2] == [
        ("0_r", "decode", 40, 1, (1, 2, 3)), ("1_r", "decode", 39, 1, (1, 2, 4)), ("2_r", "decode", 39, 1, (1, 2, 5))
    ]  # fmt: skip
    assert plan[3] == [("1_r", "decode", 40, 1, (1, 2, 4)), ("2_r", "decode", 40, 1, (1, 2, 5))]
    assert len(plan) == 4 and out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 3 and c.finish_reason == "length" for c in out.outputs)
    assert e.stats().num_pages_used == 0


def test_without_prefix_caching_every_child_computes_the_prompt_at_once(tiny_dir):
    e = engine(tiny_dir, enable_prefix_caching=False)
    e.add_request("r", PROMPT, SamplingParams(n=2, seed=1, max_tokens=1, ignore_eos=True))
    plan = steps(e)
    assert [(rid, start, num) for rid, _, start, num, _ in plan[0]] == [("0_r", 0, 39), ("1_r", 0, 39)]
    assert not set(plan[0][0][4]) & set(plan[0][1][4])


def test_child_i_samples_as_a_single_request_with_seed_plus_i(tiny_dir):
    llm = LLM(str(tiny_dir), backend="numpy", num_pages=32)
    params = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate([PROMPT], SamplingParams(n=3, seed=7, **params), use_tqdm=False)
    alone = [llm.generate([PROMPT], SamplingParams(seed=7 + i, **params), use_tqdm=False)[0].outputs[0].token_ids
             for i in range(3)]  # fmt: skip
    assert [c.token_ids for c in out.outputs] == alone
    assert alone[0] != alone[1] != alone[2]  # different draws
    (again,) = llm.generate([PROMPT], SamplingParams(n=3, seed=7, **params), use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == alone  # reproducible


def test_greedy_children_are_the_greedy_answer_and_prompts_keep_their_order(tiny_dir):
    llm = LLM(str(tiny_dir), backend="numpy", num_pages=64)
    greedy = dict(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [PROMPT, [5, 6, 7]]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(**greedy), use_tqdm=False)]
    outs = llm.generate(prompts, SamplingParams(n=2, **greedy), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[w, w] for w in want]
    assert [o.prompt_token_ids for o in outs] == prompts


def test_abort_ends_every_child_held_or_running(tiny_dir):
    e = engine(tiny_dir)
    out = e.add_request("r", PROMPT, SamplingParams(n=3, max_tokens=10, ignore_eos=True))
    e.abort_request("r")  # before child 0's prompt is computed: two children are still held
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3 and not e.has_unfinished_requests()
    out = e.add_request("s", PROMPT, SamplingParams(n=3, max_tokens=10, ignore_eos=True))
    e.step()
    e.step()  # all three run now
    e.abort_request("s")
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3 and not e.has_unfinished_requests()
    assert e.stats().num_pages_used == 0 and e.stats().num_running == 0


def test_a_failed_step_fails_every_sibling(tiny_dir):
    llm = LLM(str(tiny_dir), backend="numpy", num_pages=32)
    launch = llm.engine.runner.launch
    calls = []

    def fail_second(plan, previous=None):
        calls.append(plan)
        if len(calls) == 2:
            raise FloatingPointError("NaN in the sampler")
        return launch(plan, previous)

    llm.engine.runner.launch = fail_second
    with pytest.raises(StepFailedError, match="NaN in the sampler"):
        llm.generate([PROMPT], SamplingParams(n=3, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.stats().num_pages_used == 0
    llm.engine.runner.launch = launch
    (out,) = llm.generate([PROMPT], SamplingParams(n=2, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert [len(c.token_ids) for c in out.outputs] == [2, 2]


def test_n_must_be_a_positive_integer():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n must be an integer >= 1"):
            SamplingParams(n=bad)


def test_held_siblings_go_ahead_of_requests_that_arrived_after_theirs(tiny_dir):
    e = engine(tiny_dir, max_num_seqs=2, async_scheduling=False)  # serial: a finished request frees its slot at once
    e.add_request("r", PROMPT, SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    e.add_request("later", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    plan = steps(e)
    assert [s[0] for s in plan[0]] == ["0_r", "later"]  # two slots: child 0 and the next arrival
    assert [s[0] for s in plan[3]] == ["1_r"]  # the sibling took the first slot freed, once child 0 and "later" ended
    e.add_request("r2", PROMPT, SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    e.add_request("a", [5, 6], SamplingParams(max_tokens=1, ignore_eos=True))
    e.add_request("b", [7, 8], SamplingParams(max_tokens=1, ignore_eos=True))
    plan = steps(e)
    assert [s[0] for s in plan[1]] == ["0_r2", "1_r2"]  # "a" ran beside child 0; "b" waits behind the sibling


def test_one_sequence_aborted_frees_its_pages_while_its_sibling_runs_on(tiny_dir):
    """`abort_sequence`: what a server's front end sends when a stop string ends one of n sequences."""
    e = engine(tiny_dir, async_scheduling=False)
    e.add_request("r", PROMPT, SamplingParams(n=2, max_tokens=8, ignore_eos=True))
    out = None
    for _ in range(10):  # until both sequences have a token (child 1 waits for child 0's prompt)
        out = (e.step() or [out])[0]
        if out is not None and all(c.token_ids for c in out.outputs):
            break
    assert all(c.token_ids for c in out.outputs) and not out.finished
    used = e.stats().num_pages_used
    e.abort_sequence("r", 1)
    assert out.outputs[1].finish_reason == "abort" and not out.finished
    assert [r.request_id for r in e.stats(requests=True).running] == ["0_r"]
    assert e.stats().num_pages_used < used  # child 1's own page (the shared prompt pages stay, child 0 holds them)
    tokens_of_1 = list(out.outputs[1].token_ids)
    while e.has_unfinished_requests():
        e.step()
    assert out.finished and len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
    assert out.outputs[1].token_ids == tokens_of_1  # nothing more for the aborted one
    assert not e.has_unfinished_requests()
    e.abort_sequence("r", 0)  # finished: ignored
    e.abort_sequence("nobody", 0)


def test_a_held_sibling_aborted_is_never_admitted(tiny_dir):
    e = engine(tiny_dir, async_scheduling=False)
    (out,) = [e.add_request("r", PROMPT, SamplingParams(n=3, max_tokens=2, ignore_eos=True))]
    e.abort_sequence("r", 2)  # held: child 0's prompt is not computed yet
    admitted = {s[0] for plan in steps(e) for s in plan}
    assert admitted == {"0_r", "1_r"} and out.finished
    assert [c.finish_reason for c in out.outputs] == ["length", "length", "abort"]
    assert not e.has_unfinished_requests()
