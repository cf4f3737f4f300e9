"""Overlapped scheduling (EngineConfig.async_scheduling) against the serial order, on the CPU.

A fake device stands in front of the NumPy runner: steps run in launch order, as a GPU stream runs
them, but on a worker thread after random delays (so a step may finish long before or after the
host collects the one before it), or lazily, only when collected. The K/V writes of a step happen
when it runs, so pages the host has already freed and handed out again are still written by the
steps in flight: the tokens show whether that is safe. Greedy tokens must be the serial engine's,
with preemptions, aborts, stop tokens and staggered arrivals; pages and slots must add up after
every step and all come back at the end.
"""

import queue
import re
import threading
import time

import numpy as np
import pytest

from numba_vllm.engine.config import EngineConfig
from numba_vllm.engine.kv_cache import PageAllocator
from numba_vllm.engine.llm_engine import LLMEngine
from numba_vllm.engine.request import Request
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.engine.scheduler import Scheduler
from numba_vllm.engine.structured import StructuredOutputsParams
from numba_vllm.executor.numpy_runner import prompt_logprob_targets
from numba_vllm.loading.checkpoint import load_checkpoint
from tests.helpers.tiny_llama import tiny_checkpoint, write_chat_checkpoint

PROMPTS = [[5], list(range(3, 18)), list(range(3, 19)), list(range(3, 20)), list(range(1, 34)), [7, 8, 9], list(range(40, 61))]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=128)


class FakeStep:
    def __init__(self, plan, previous, feeds_next):
        self.plan, self.previous, self.feeds_next = plan, previous, feeds_next
        self.inner = None  # the NumPy runner's step, once run
        self.done = threading.Event()

    @property
    def logprobs(self):
        return self.inner.logprobs

    @property
    def prompt_logprobs(self):
        return self.inner.prompt_logprobs


def _feeds_next(plan) -> bool:
    """The GPU's rule: a step feeds the next unless a row is sampled on the host (top-k, top-p,
    min-p), edits its logits (penalties, bias, ...), wants logprobs or has a structured-output
    constraint (its grammar must see the token before the next mask), or a chunk wants prompt logprobs."""
    for s in plan.sequences:
        p = s.request.sampling_params
        if prompt_logprob_targets(s) is not None:
            return False
        if s.samples and (p.logprobs is not None or s.request.logits_edits is not None or s.request.grammar is not None):
            return False
        if s.samples and not p.greedy and (p.top_k or p.top_p < 1 or p.min_p > 0):
            return False
    return True


class FakeDevice:
    """The NumPy runner behind a queue: `mode` "thread" runs steps on a worker after random delays,
    "lazy" only when a step is collected (then every step launched before it first). Steps with a
    top-k or top-p row, logits edits, logprobs or a structured-output row do not feed the next one
    (`_feeds_next`), and run as they are launched (as the kernel runner works out the edits and the
    token masks at launch)."""

    def __init__(self, runner, mode: str, seed: int = 0):
        self.runner, self.mode = runner, mode
        self.rng = np.random.default_rng(seed)
        self.pending: list = []  # launched, not run yet (in order)
        self.uncollected: list[FakeStep] = []
        self.launched: list[FakeStep] = []
        self.queue: queue.Queue = queue.Queue()
        self.interrupt_next_collect = False
        self.abandoned: list[FakeStep] = []  # launched, never collected (dropped after an interrupt)
        if mode == "thread":
            threading.Thread(target=self._work, daemon=True).start()

    def launch(self, plan, previous=None):
        # Steps the engine will not collect: all launched before, when it feeds from none; any whose
        # requests have all finished (nothing of it is used).
        dropped = [s for s in self.uncollected if previous is None or all(q.request.is_finished for q in s.plan.sequences)]
        self.abandoned += dropped
        self.uncollected = [s for s in self.uncollected if s not in dropped]
        assert len(self.uncollected) < 2, "more than two steps outstanding"
        assert previous is None or previous is self.launched[-1], "fed from a step other than the one just before"
        assert previous is None or previous.feeds_next, "fed from a step whose tokens the host samples"
        assert all(s.feeds_next for s in self.uncollected), "launched before collecting a step that does not feed"
        step = FakeStep(plan, previous, feeds_next=_feeds_next(plan))
        self.uncollected.append(step)
        self.launched.append(step)
        self._enqueue(("step", step))
        if not step.feeds_next:  # run now: its host-side work (logits edits) reads the requests as they are at launch
            self._wait(step)
        return step

    def collect(self, step):
        if self.interrupt_next_collect:
            self.interrupt_next_collect = False
            raise KeyboardInterrupt
        assert step is self.uncollected[0], "collected out of launch order"
        self._wait(step)
        self.uncollected.pop(0)
        return self.runner.collect(step.inner)

    def _wait(self, step):
        """Until `step` has run (lazily: it and every step launched before it, now)."""
        if self.mode == "lazy":
            while not step.done.is_set():
                self._run(self.pending.pop(0))
        assert step.done.wait(30)

    def release(self, request_id):
        self._enqueue(("release", request_id))  # in stream order: steps in flight may still sample for it

    def execute(self, plan):
        return self.collect(self.launch(plan))

    def _enqueue(self, item):
        if self.mode == "thread":
            self.queue.put(item)
        else:
            self.pending.append(item)

    def _work(self):
        while True:
            time.sleep(float(self.rng.exponential(0.002)))
            self._run(self.queue.get())

    def _run(self, item):
        kind, what = item
        if kind == "release":
            self.runner.release(what)
            return
        what.inner = self.runner.launch(what.plan, what.previous.inner if what.previous is not None else None)
        assert what.inner.feeds_next or not what.feeds_next, "the runner feeds from a step the fake device would not"
        what.done.set()


def run(engine, arrivals, abort_at=None):
    """Step until done; `arrivals`: (request id, prompt, params) added one per step() call;
    `abort_at`: {call index: request id}. Checks the scheduler's accounting after every call.
    Returns each request's (only) sequence, its CompletionOutput."""
    outputs, arrivals, call = {}, list(arrivals), 0
    while arrivals or engine.has_unfinished_requests():
        if arrivals:
            rid, prompt, params = arrivals.pop(0)
            outputs[rid] = engine.add_request(rid, prompt, params)
        if abort_at and call in abort_at:
            engine.abort_request(abort_at[call])
        engine.step()
        engine.scheduler.check_invariants()
        call += 1
    return {rid: o.outputs[0] for rid, o in outputs.items()}


def engines(tiny_dir, modes=("thread", "lazy"), **config):
    """The serial engine, then an overlapped one per fake device mode."""
    serial = LLMEngine(load_checkpoint(tiny_dir), EngineConfig(backend="numpy", async_scheduling=False, **config))
    overlapped = []
    for i, mode in enumerate(modes):
        engine = LLMEngine(load_checkpoint(tiny_dir), EngineConfig(backend="numpy", **config))
        engine.runner = FakeDevice(engine.runner, mode, seed=i)
        overlapped.append(engine)
    return serial, overlapped


def _all_pages_back(engine):
    allocator = engine.scheduler.allocator
    return allocator.num_free_pages == allocator.num_usable_pages


def test_overlapped_steps_give_the_serial_tokens_with_chunks_preemptions_and_stop_tokens(tiny_dir):
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 2, 12, 1, 7, 5, 10)]
    arrivals = [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, greedy, strict=True))]
    config = dict(max_num_seqs=4, max_num_batched_tokens=16, num_pages=5)  # 4 usable pages: preemptions
    serial, overlapped = engines(tiny_dir, **config)
    want = {rid: o.token_ids for rid, o in run(serial, arrivals).items()}
    # A stop token met mid-way by r2: a finish the host learns only when it collects the step.
    stop = want["r2"][4]
    stopping = [(rid, p, SamplingParams(temperature=0, max_tokens=sp.max_tokens, stop_token_ids=[stop] if rid == "r2" else []))
                for rid, p, sp in arrivals]  # fmt: skip
    serial_stop, overlapped_stop = engines(tiny_dir, **config)
    want_stop = {rid: (o.token_ids, o.finish_reason) for rid, o in run(serial_stop, stopping).items()}
    assert want_stop["r2"][1] == "stop" and serial.num_preemptions > 0
    for engine, engine_stop in zip(overlapped, overlapped_stop, strict=True):
        assert {rid: o.token_ids for rid, o in run(engine, arrivals).items()} == want
        assert {rid: (o.token_ids, o.finish_reason) for rid, o in run(engine_stop, stopping).items()} == want_stop
        assert engine.num_preemptions > 0
        assert _all_pages_back(engine) and _all_pages_back(engine_stop)
        # Requests finishing by their budget are held out of the step after their last token: the
        # device computed exactly one token per generated token (prefill chunks aside).
        sampled = [s.request.request_id for step in engine.runner.launched for s in step.plan.sequences if s.samples]
        assert {rid: sampled.count(rid) for rid in want} == {rid: len(t) for rid, t in want.items()}
        assert sum(step.previous is not None for step in engine.runner.launched) > len(engine.runner.launched) / 2
        # r2's stop token is seen one step late: one more token was computed for it, and dropped.
        sampled = [s.request.request_id for step in engine_stop.runner.launched for s in step.plan.sequences if s.samples]
        assert sampled.count("r2") == len(want_stop["r2"][0]) + 1


def test_aborts_mid_run_free_everything_and_leave_the_others_alone(tiny_dir):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    arrivals = [(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    config = dict(max_num_seqs=3, max_num_batched_tokens=16, num_pages=12)
    serial, overlapped = engines(tiny_dir, **config)
    want = {rid: o.token_ids for rid, o in run(serial, arrivals).items()}
    aborts = {3: "r1", 5: "r4", 6: "r0"}  # r4 while still waiting or prefilling, the others while decoding
    for engine in overlapped:
        outputs = run(engine, arrivals, abort_at=aborts)
        for rid, out in outputs.items():
            if rid in aborts.values():
                assert out.finish_reason == "abort" and want[rid][: len(out.token_ids)] == out.token_ids
            else:
                assert out.token_ids == want[rid]
        assert _all_pages_back(engine)


def test_host_sampled_steps_are_collected_before_the_next_is_scheduled(tiny_dir):
    """Top-k rows are sampled on the host: such a step cannot feed the next one, which then waits
    (the fake device asserts it). Seeded tokens are the serial engine's."""
    params = [SamplingParams(temperature=0.8, top_k=5, seed=3, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=1.1, seed=4, max_tokens=4, ignore_eos=True)]  # fmt: skip
    arrivals = [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS[:3], params, strict=True))]
    serial, overlapped = engines(tiny_dir, modes=("lazy",), max_num_seqs=4)
    want = {rid: o.token_ids for rid, o in run(serial, arrivals).items()}
    engine = overlapped[0]
    assert {rid: o.token_ids for rid, o in run(engine, arrivals).items()} == want
    assert any(not s.feeds_next for s in engine.runner.launched) and any(s.previous for s in engine.runner.launched)


def test_steps_with_constrained_rows_are_collected_before_the_next_is_scheduled(tmp_path):
    """A structured-output row's next mask needs its token advanced through its grammar: a step with
    one cannot feed the next (the fake device asserts that nothing is launched before it is collected,
    and runs each step's masks when the step runs, on its own thread). Staggered arrivals put
    constrained and free requests in one batch; their tokens are the serial engine's, every
    constrained text matches, and the free requests' steps still overlap."""
    path = write_chat_checkpoint(tmp_path)
    regex = r"(ab|b[a-c]?){1,3}-[0-9]{2}"
    choices = ["hello", "hi", "the world"]
    params = [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(temperature=1.0, seed=7, max_tokens=24, structured_outputs=StructuredOutputsParams(choice=choices)),
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=4, seed=5, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    ]
    arrivals = [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS[:6], params, strict=True))]
    serial, overlapped = engines(path, max_num_seqs=3, max_num_batched_tokens=16)
    want = {rid: (o.token_ids, o.finish_reason) for rid, o in run(serial, arrivals).items()}
    for rid in ("r1", "r4"):
        assert want[rid][1] == "stop"
    for engine in overlapped:
        outputs = run(engine, arrivals)
        assert {rid: (o.token_ids, o.finish_reason) for rid, o in outputs.items()} == want
        assert re.fullmatch(regex, outputs["r1"].text) and re.fullmatch(regex, outputs["r4"].text)
        assert outputs["r2"].text in choices and outputs["r2"].finish_reason == "stop"
        launched = engine.runner.launched
        constrained = [s for s in launched if any(q.request.grammar is not None for q in s.plan.sequences if q.samples)]
        assert constrained and not any(s.feeds_next for s in constrained)
        assert not any(s.previous in constrained for s in launched)  # never fed from one
        assert any(s.previous is not None for s in launched)  # the free requests' steps overlap
        assert _all_pages_back(engine)
def test_steps_with_logits_edits_or_logprobs_are_collected_before_the_next_is_scheduled(tiny_dir):
    """Edits count the output on the host and logprobs read the step's logits when it is collected:
    such steps do not feed the next one (the fake device asserts the engine waits). Tokens, logprobs
    and prompt logprobs (of a prompt in chunks) are the serial engine's."""
    params = [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, presence_penalty=1.5, logit_bias={3: 2.0}),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)]  # fmt: skip
    arrivals = [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS[1:5], params, strict=True))]
    config = dict(max_num_seqs=4, max_num_batched_tokens=16)
    serial, overlapped = engines(tiny_dir, **config)

    def results(engine):
        outs = {rid: engine.add_request(rid, p, sp) for rid, p, sp in arrivals}
        while engine.has_unfinished_requests():
            engine.step()
        lps = {rid: _values(o.outputs[0].logprobs or []) for rid, o in outs.items()}
        return {rid: o.outputs[0].token_ids for rid, o in outs.items()}, lps, _values(outs["r1"].prompt_logprobs[1:])

    want = results(serial)
    assert len(want[2]) == len(PROMPTS[2]) - 1 and len(want[1]["r1"]) == 5
    for engine in overlapped:
        assert results(engine) == want
        launched = engine.runner.launched
        assert any(not s.feeds_next for s in launched) and any(s.previous for s in launched)  # r0 and r3 go on alone


def _values(logprobs) -> list:
    """Logprob dicts as comparable values: each position's sorted (token, logprob) pairs."""
    return [sorted((t, lp.logprob) for t, lp in d.items()) for d in logprobs]


def test_the_first_call_launches_and_the_next_returns_its_outputs(tiny_dir):
    _, (engine,) = engines(tiny_dir, modes=("lazy",))
    out = engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert engine.step() == [] and engine.num_steps == 1  # launched, in flight
    assert engine.step() == [out] and len(out.outputs[0].token_ids) == 1 and engine.num_steps == 2
    assert engine.step() == [out] and engine.num_steps == 3
    assert engine.step() == [out] and out.outputs[0].finish_reason == "length" and engine.num_steps == 3  # held: nothing launched
    assert not engine.has_unfinished_requests() and _all_pages_back(engine)


# ---- the scheduler's side ------------------------------------------------------------------------


def _scheduler(num_pages=8):
    return Scheduler(max_num_seqs=2, max_num_batched_tokens=16, allocator=PageAllocator(num_pages), max_model_len=64)


def test_update_with_unknown_tokens_then_fill():
    sched = _scheduler()
    a = Request("a", [1, 2, 3], SamplingParams(), 0)
    sched.add(a)
    plan = sched.schedule()
    assert sched.update(plan, {"a": None}) == [a] and a.output_token_ids == [None]
    following = sched.schedule()  # planned with the token unknown: it decodes None
    assert [s.token_ids for s in following.sequences] == [[None]]
    assert sched.fill(plan, {"a": 42}) == [a] and a.output_token_ids == [42]
    with pytest.raises(ValueError, match="already known"):
        sched.fill(plan, {"a": 43})
    sched.update(following, {"a": None})
    sched.finish(a, a.status.FINISHED_STOPPED)
    assert sched.fill(following, {"a": 7}) == [] and a.output_token_ids == [42, None]  # finished since: skipped
    sched.check_invariants()


def test_held_requests_get_no_tokens_and_an_all_held_step_is_empty():
    sched = _scheduler()
    a, b = Request("a", [1, 2], SamplingParams(), 0), Request("b", [3], SamplingParams(), 1)
    sched.add(a)
    sched.add(b)
    sched.update(sched.schedule(), {"a": 5, "b": 6})
    plan = sched.schedule(hold={"a"})
    assert [s.request.request_id for s in plan.sequences] == ["b"]
    sched.update(plan, {"b": 7})
    plan = sched.schedule(hold={"a", "b"})
    assert plan.is_empty and not plan.preempted_request_ids and len(sched.running) == 2  # no stall error
    sched.update(plan, {})
    sched.check_invariants()


def test_async_scheduling_is_a_bool():
    with pytest.raises(ValueError, match="async_scheduling: 'yes' must be True or False"):
        EngineConfig(async_scheduling="yes")


def test_an_interrupt_while_collecting_keeps_the_step_in_flight_and_loses_no_token(tiny_dir):
    """Ctrl-C while the engine waits for a step's tokens: the step stays in flight and is collected
    by the next call, the step launched after it is dropped (and recomputed), nobody fails."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    arrivals = [(f"r{i}", p, params) for i, p in enumerate(PROMPTS[:4])]
    serial, (engine,) = engines(tiny_dir, modes=("lazy",), max_num_seqs=4, max_num_batched_tokens=16)
    want = {rid: o.token_ids for rid, o in run(serial, arrivals).items()}
    outputs = {rid: engine.add_request(rid, p, sp) for rid, p, sp in arrivals}
    for _ in range(3):
        engine.step()
    engine.runner.interrupt_next_collect = True
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    engine.scheduler.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_invariants()
    assert {rid: o.outputs[0].token_ids for rid, o in outputs.items()} == want
    assert len(engine.runner.abandoned) == 1 and engine.num_failed_steps == 0 and _all_pages_back(engine)


def test_stop_strings_stop_where_the_serial_engine_stops(tmp_path):
    """A stop string is found in the text only once the step that completes it is collected: by then
    the next step has a token for the request in flight, which is dropped."""
    path = write_chat_checkpoint(tmp_path)
    prompts = ["hello there", "a b c d e f", "xyz"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    serial, _ = engines(path, modes=(), max_num_seqs=2)
    texts = [o.text for o in run(serial, [(f"r{i}", p, greedy) for i, p in enumerate(prompts)]).values()]
    stops = [t[len(t) // 2 : len(t) // 2 + 2] for t in texts]  # two characters from the middle of each output
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]) for stop in stops]
    arrivals = [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    serial_stop, (engine_stop,) = engines(path, modes=("thread",), max_num_seqs=2)
    want = {rid: (o.text, o.token_ids, o.finish_reason) for rid, o in run(serial_stop, arrivals).items()}
    assert [reason for _, _, reason in want.values()] == ["stop"] * 3
    assert {rid: (o.text, o.token_ids, o.finish_reason) for rid, o in run(engine_stop, arrivals).items()} == want
    assert _all_pages_back(engine_stop)
