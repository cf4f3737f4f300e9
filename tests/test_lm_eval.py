"""lm-evaluation-harness's `local-completions` model against the server, scored by the NumPy reference.

The default model (SmolLM2-135M-Instruct, numpy backend) serves in an engine core process of its
own, as `numba-vllm serve` runs it. lm_eval (`simple_evaluate`) runs two small tasks defined here,
their documents in local JSON lines files, nothing downloaded: a multiple-choice task (loglikelihood
requests: `echo` + `logprobs` + `max_tokens` 1 over token-id prompts, four to a request) and a
generate_until task (greedy, stop strings, the same batched token-id prompts). lm_eval tokenizes through the
server (its `remote` tokenizer backend, picked because /tokenizer_info and /tokenize answer).

The reference is `ReferenceModel` in float32 on the same weights, driven here token by token: the
log-softmax of its logits gives each (context, continuation) loglikelihood and whether the
continuation is greedy, the argmax of the summed loglikelihoods each document's choice (so the
accuracy), and its greedy continuation, decoded and cut at the task's stop strings, each generation
(so the exact-match score).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

pytest.importorskip("fastapi")
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm_eval's API models need its `api` extra

import datasets.config  # noqa: E402  (lm_eval's dependencies)
import huggingface_hub.constants  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from numba_vllm.loading.checkpoint import load_checkpoint  # noqa: E402
from numba_vllm.model.reference import KVCache, ReferenceModel  # noqa: E402
from tests.helpers.server import ServerThread  # noqa: E402
from tests.helpers.smollm2 import needs_smollm2, smollm2_path  # noqa: E402

pytestmark = [needs_smollm2, pytest.mark.slow]  # SmolLM2 in a server process, loaded twice: 17-45 s on 2 cores

NAME = "smollm2"
MAX_LEN = 256
MAX_GEN = 12
UNTIL = ["\n", "."]
CHOICE_DOCS = [  # contexts end without a space, choices start with one: the pair tokenizes as the whole does
    {"question": "The capital of France is", "choices": [" Paris", " London", " Rome"], "label": 0},
    {"question": "The opposite of hot is", "choices": [" cold", " warm", " blue"], "label": 0},
    {"question": "Monday, Tuesday,", "choices": [" Friday", " Wednesday", " Sunday"], "label": 1},
    {"question": "Two plus two equals", "choices": [" four", " seven"], "label": 0},
]
GEN_DOCS = [
    {"question": "The capital of France is", "answer": " Paris"},
    {"question": "Q: What is 2 + 3?\nA:", "answer": " 5"},
    {"question": "The opposite of hot is", "answer": " cold"},
    {"question": "Monday, Tuesday, Wednesday,", "answer": " Thursday"},
]


def _task_dir(root, name: str, docs: list[dict], **config) -> None:
    """A task folder lm_eval's TaskManager finds: `name`.yaml over a JSON lines file of `docs`."""
    data = root / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    task = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(root / "hf_cache")},
        "test_split": "test",
        "doc_to_text": "{{question}}",
        **config,
    }
    (root / f"{name}.yaml").write_text(json.dumps(task), encoding="utf-8")  # JSON is YAML


@pytest.fixture(autouse=True)
def one_blas_thread():
    """The reference's small matrix products run several times faster on one BLAS thread than on two
    threads of a busy 2-core machine."""
    with threadpool_limits(1):
        yield


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """lm_eval's results (per-document samples logged) on both tasks, and the reference's tokenizer and model."""
    mp = pytest.MonkeyPatch()  # no network: the Hub's and datasets' offline switches (read once, at import) on
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        mp.setenv(var, "1")
    mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    tasks = tmp_path_factory.mktemp("tasks")
    _task_dir(tasks, "nv_choice", CHOICE_DOCS, output_type="multiple_choice", doc_to_choice="{{choices}}",
              doc_to_target="label", target_delimiter="", metric_list=[{"metric": "acc"}])  # fmt: skip
    _task_dir(tasks, "nv_gen", GEN_DOCS, output_type="generate_until", doc_to_target="{{answer}}",
              generation_kwargs={"until": UNTIL, "max_gen_toks": MAX_GEN, "do_sample": False},
              metric_list=[{"metric": "exact_match"}])  # fmt: skip
    server = ServerThread.spawn(smollm2_path(), [NAME], max_model_len=MAX_LEN, max_num_seqs=4)
    try:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"base_url": server.url + "/v1/completions", "model": NAME, "max_length": MAX_LEN, "batch_size": 4},
            tasks=["nv_choice", "nv_gen"],
            task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
            log_samples=True,
            bootstrap_iters=0,
        )
    finally:
        server.close()
        mp.undo()
    ckpt = load_checkpoint(smollm2_path())
    return results, ckpt.tokenizer, ReferenceModel(ckpt.config, ckpt.weights)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """(T, V) f32 logits -> (T, V) f64 log-probabilities."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _loglikelihood(model: ReferenceModel, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """Sum of the continuation's log-probabilities after the context, and whether each of its tokens is the argmax."""
    ids = np.array(context + continuation)
    logits = model.forward(ids, 0, KVCache(model.config, len(ids)), all_logits=True)  # (T, V)
    lp = _log_softmax(logits[len(context) - 1 : -1])  # (len(continuation), V): row i predicts continuation[i]
    return float(lp[np.arange(len(continuation)), continuation].sum()), bool((lp.argmax(axis=-1) == continuation).all())


def _greedy(model: ReferenceModel, prompt: list[int], max_tokens: int, stop_ids) -> list[int]:
    """The reference's greedy continuation: up to `max_tokens` ids, ending at (without) a stop id."""
    cache = KVCache(model.config, len(prompt) + max_tokens)
    logits = model.forward(np.array(prompt), 0, cache)  # (V,)
    out: list[int] = []
    while len(out) < max_tokens:
        token = int(logits.argmax())
        if token in stop_ids:
            break
        out.append(token)
        logits = model.forward(np.array([token]), len(prompt) + len(out) - 1, cache)
    return out


def _cut(text: str, until: list[str]) -> str:
    """`text` before the first occurrence of any stop string."""
    return text[: min((i for i in (text.find(s) for s in until) if i >= 0), default=len(text))]


def test_loglikelihoods_and_accuracy_match_the_reference(evaluated):
    results, tok, model = evaluated
    samples = sorted(results["samples"]["nv_choice"], key=lambda s: s["doc_id"])
    assert len(samples) == len(CHOICE_DOCS)
    correct = []
    for doc, sample in zip(CHOICE_DOCS, samples, strict=True):
        assert [tuple(a) for a in sample["arguments"]] == [(doc["question"], c) for c in doc["choices"]]
        context = tok.encode(doc["question"], add_special_tokens=False)
        want = []
        for choice, (got_ll, got_greedy) in zip(doc["choices"], sample["filtered_resps"], strict=True):
            continuation = tok.encode(choice, add_special_tokens=False)
            assert tok.encode(doc["question"] + choice, add_special_tokens=False) == context + continuation
            ll, greedy = _loglikelihood(model, context, continuation)
            assert got_ll == pytest.approx(ll, abs=2e-3), (doc["question"], choice)
            assert got_greedy == greedy, (doc["question"], choice)
            want.append(ll)
        correct.append(int(np.argmax(want)) == doc["label"])
    assert results["results"]["nv_choice"]["acc,none"] == pytest.approx(np.mean(correct))


def test_greedy_generations_and_exact_match_match_the_reference(evaluated):
    results, tok, model = evaluated
    samples = sorted(results["samples"]["nv_gen"], key=lambda s: s["doc_id"])
    assert len(samples) == len(GEN_DOCS)
    until = [*UNTIL, tok.eos_token]  # lm_eval adds the model's EOS text to the stop strings
    matches = []
    for doc, sample in zip(GEN_DOCS, samples, strict=True):
        prompt = tok.encode(doc["question"], add_special_tokens=False)
        ids = _greedy(model, prompt, MAX_GEN, set(tok.stop_token_ids))
        want = _cut(tok.decode(ids), until)
        assert sample["filtered_resps"] == [want], doc["question"]
        matches.append(want == doc["answer"])
    assert results["results"]["nv_gen"]["exact_match,none"] == pytest.approx(np.mean(matches))
    assert 0 < np.mean(matches) < 1  # the documents tell a right answer from a wrong one
