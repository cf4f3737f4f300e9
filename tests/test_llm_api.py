"""`LLM` as vLLM users call it: prompt forms, constructor keywords, get_tokenizer, and the sampling
defaults from the model's generation_config.json (numpy backend, tiny models).

References: prompt forms against the same prompts given as token ids encoded by the `tokenizers`
library itself; defaults against the values the test writes into generation_config.json.
"""

from __future__ import annotations

import json

import pytest

from numba_vllm import LLM, SamplingParams
from numba_vllm.engine.config import EngineConfig
from numba_vllm.engine.llm_engine import LLMEngine
from numba_vllm.loading.checkpoint import load_checkpoint
from tests.helpers.tiny_llama import tiny_checkpoint, write_chat_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def llm(chat_dir):
    return LLM(str(chat_dir), backend="numpy")


@pytest.fixture(scope="module")
def hf(chat_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(chat_dir / "tokenizer.json"))


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_every_prompt_form_of_generate(llm, hf):
    a, b = hf.encode("hi the world").ids, hf.encode("once upon").ids
    want = _ids(llm.generate([a, b], GREEDY, use_tqdm=False))
    forms = [
        ("hi the world", [want[0]]),
        (["hi the world", "once upon"], want),
        (a, [want[0]]),
        ([a, b], want),
        ({"prompt": "hi the world"}, [want[0]]),
        ({"prompt_token_ids": a}, [want[0]]),
        ([{"prompt": "hi the world"}, {"prompt_token_ids": b}], want),
        (["hi the world", b], want),
    ]
    for prompts, expected in forms:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert _ids(outs) == expected, prompts
    text, ids = llm.generate([{"prompt": "hi the world"}, {"prompt_token_ids": b}], GREEDY, use_tqdm=False)
    assert (text.prompt, text.prompt_token_ids) == ("hi the world", a)
    assert (ids.prompt, ids.prompt_token_ids) == (None, b)


def test_bad_prompt_forms_are_refused_in_one_line(llm):
    for prompts, match in [
        ({"prompt": "a", "prompt_token_ids": [1]}, "alone"),
        ({"text": "a"}, "alone"),
        ([[1, "x"]], "prompt 0"),
        (5, "prompts must be"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompts, GREEDY, use_tqdm=False)


def test_get_tokenizer(llm, hf):
    tok = llm.get_tokenizer()
    assert tok is llm.tokenizer and tok.encode("hi the world") == hf.encode("hi the world").ids


def test_vllm_keywords_are_mapped(chat_dir):
    llm = LLM(
        str(chat_dir), backend="numpy", dtype="auto", seed=0, max_model_len=256, gpu_memory_utilization=0.5,
        enforce_eager=True, max_num_seqs=3, max_num_batched_tokens=64, enable_prefix_caching=False,
        trust_remote_code=True, tensor_parallel_size=1, tokenizer=str(chat_dir), generation_config="vllm",
    )  # fmt: skip
    ec = llm.engine.engine_config
    assert (ec.max_model_len, ec.gpu_memory_utilization, ec.enforce_eager, ec.max_num_seqs) == (256, 0.5, True, 3)
    assert (ec.max_num_batched_tokens, ec.enable_prefix_caching, ec.generation_config) == (64, False, "vllm")
    assert llm.engine.max_model_len == 256 and LLM(str(chat_dir), backend="numpy", dtype="float32") is not None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tensor_parallel_size": 2}, ValueError, r"^LLM: tensor_parallel_size=2 is not supported .*one GPU"),
        ({"dtype": "float16"}, ValueError, r"^LLM: dtype='float16' is not supported on the numpy backend"),
        ({"dtype": "bfloat16"}, ValueError, r"^LLM: dtype='bfloat16'"),
        ({"quantization": "awq"}, ValueError, r"^LLM: quantization='awq'"),
        ({"tokenizer": "other/tokenizer"}, ValueError, r"^LLM: tokenizer='other/tokenizer'"),
        ({"seed": -1}, ValueError, r"^LLM: seed=-1"),
        ({"max_num_seqs": 0}, ValueError, r"^LLM: max_num_seqs"),
        ({"generation_config": "/some/dir"}, ValueError, r"^LLM: generation_config"),
        ({"swap_spacee": 4}, TypeError, r"^LLM: unknown keyword argument 'swap_spacee'"),
    ],
)
def test_keywords_that_cannot_be_honoured_are_refused_naming_llm(chat_dir, kwargs, error, match):
    with pytest.raises(error, match=match):
        LLM(str(chat_dir), backend="numpy", **kwargs)


def test_llm_seed_makes_unseeded_sampling_repeat(chat_dir):
    sampled = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    runs = [_ids(LLM(str(chat_dir), backend="numpy", seed=3).generate(["hi", "hi"], sampled, use_tqdm=False)) for _ in range(2)]
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1]  # repeatable across runs, a fresh draw per request


# ---- generation_config.json defaults ---------------------------------------------------------------
@pytest.fixture(scope="module")
def suggesting_dir(tmp_path_factory):
    """A tiny model whose generation_config.json suggests sampling values (do_sample is not read, as in vLLM)."""
    path = tiny_checkpoint(tmp_path_factory.mktemp("suggesting"))
    gen = {"do_sample": False, "temperature": 0.7, "top_p": 0.85, "top_k": 1, "bos_token_id": 1, "eos_token_id": 2}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def test_the_models_values_are_the_defaults_unless_generation_config_is_vllm(suggesting_dir):
    auto = LLM(str(suggesting_dir), backend="numpy")
    d = auto.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k) == (0.7, 0.85, 1)
    neutral = LLM(str(suggesting_dir), backend="numpy", generation_config="vllm").get_default_sampling_params()
    assert neutral == SamplingParams()
    # top_k 1 from the file: sampling with no SamplingParams given is the greedy answer (16 tokens, vLLM's default)
    greedy = auto.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert _ids(auto.generate([[5, 6, 7]], use_tqdm=False)) == _ids(greedy)


def test_engine_defaults_follow_the_mode(suggesting_dir):
    ckpt = load_checkpoint(suggesting_dir)
    assert LLMEngine(ckpt, EngineConfig(backend="numpy")).sampling_defaults == {"temperature": 0.7, "top_p": 0.85, "top_k": 1}
    assert LLMEngine(ckpt, EngineConfig(backend="numpy", generation_config="vllm")).sampling_defaults == {}
