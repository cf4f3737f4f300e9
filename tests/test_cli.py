"""The `numba-vllm` command through click's CliRunner: output formats and one-line errors."""

import json

import pytest
from click.testing import CliRunner
from test_smollm2 import HAVE_MODEL, REF
from tiny_llama import random_weights, tiny_config_dict, write_checkpoint

from numba_vllm.cli import main
from numba_vllm.model.config import ModelConfig


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cfg = tiny_config_dict()
    path = tmp_path_factory.mktemp("tiny")
    return write_checkpoint(path, cfg, random_weights(ModelConfig.from_dict(cfg), dtype="bf16"))


def run(*args):
    return CliRunner().invoke(main, ["run", *args])


def test_token_id_prompts_on_a_checkpoint_without_tokenizer(tiny_dir):
    r = run("--model", str(tiny_dir), "--prompt-ids", "5,6,7", "--prompt-ids", "9", "--max-tokens", "4", "--ignore-eos", "--json")
    assert r.exit_code == 0, r.output
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [o["prompt_token_ids"] for o in lines] == [[5, 6, 7], [9]]
    assert all(len(o["token_ids"]) == 4 and o["finish_reason"] == "length" and o["text"] == "" for o in lines)


def test_text_prompt_without_tokenizer_is_a_clear_error(tiny_dir):
    r = run("--model", str(tiny_dir), "hello")
    assert r.exit_code == 2 and "has no tokenizer; give prompts as token ids with --prompt-ids" in r.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/no/such/dir"], "/no/such/dir: no such file or directory"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "2"], "top_p must be in (0, 1]"),
        (["--max-tokens", "0"], "max_tokens must be an integer >= 1"),
        (["--backend", "cuda"], "backend 'cuda' "),
        (["--prompt-ids", "1,x"], "is not a comma-separated list of token ids"),
        (["--prompt-ids", "1,100000"], "token id 100000 is outside the vocabulary"),
    ],
)
def test_user_mistakes_give_one_line_errors(tiny_dir, args, message):
    base = [] if "--model" in args else ["--model", str(tiny_dir)]
    r = run(*base, *args)
    assert r.exit_code != 0 and message in r.output, r.output
    assert "Traceback" not in r.output


def test_prompt_longer_than_the_model_limit(tiny_dir):
    ids = ",".join(["3"] * 256)  # the tiny model's max_position_embeddings is 256
    r = run("--model", str(tiny_dir), "--prompt-ids", ids)
    assert r.exit_code == 1 and "the prompt has 256 tokens; this model's maximum context length is 256" in r.output


def test_corrupt_checkpoint(tiny_dir, tmp_path):
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes((tiny_dir / "model.safetensors").read_bytes()[:1000])
    r = run("--model", str(tmp_path), "--prompt-ids", "1")
    assert r.exit_code == 1 and "truncated" in r.output and "Traceback" not in r.output


@pytest.mark.skipif(not HAVE_MODEL, reason="default model not installed")
def test_default_model_streams_the_answer_and_json_matches_transformers():
    r = run("--max-tokens", "48")
    assert r.exit_code == 0, r.output
    assert "Paris" in r.stdout
    assert "prompt tokens" in r.stderr and "tokens/s" in r.stderr
    case = REF["prompts"][0]
    r = run(case["prompt"], "--json", "--max-tokens", "48")
    out = json.loads(r.stdout)
    assert out["prompt_token_ids"] == case["prompt_ids"] and out["token_ids"] == case["greedy_ids"]
    assert out["text"] == "The answer to this classic math problem is 4." and out["finish_reason"] == "stop"


@pytest.mark.skipif(not HAVE_MODEL, reason="default model not installed")
def test_no_chat_and_system_prompt(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("The capital of France is\n\n")
    r = run("--no-chat", "--prompt-file", str(prompts), "--max-tokens", "3", "--json")
    out = json.loads(r.stdout)
    assert r.exit_code == 0 and out["prompt_token_ids"][0] != 1  # no <|im_start|>: raw text
    r = run("--system", "You answer in French.", "--max-tokens", "3", "--json", "Hi")
    assert r.exit_code == 0 and json.loads(r.stdout)["finish_reason"] in ("stop", "length")


def test_scheduling_option(tiny_dir):
    args = ["--model", str(tiny_dir), "--prompt-ids", "5,6,7", "--prompt-ids", "9", "--max-tokens", "3", "--ignore-eos", "--json"]
    continuous = run(*args, "--max-num-seqs", "1")
    static = run(*args, "--max-num-seqs", "1", "--scheduling", "static")
    assert continuous.exit_code == 0 and static.exit_code == 0, static.output
    assert static.stdout == continuous.stdout and len(static.stdout.splitlines()) == 2
    r = run(*args, "--scheduling", "dynamic")
    assert r.exit_code == 2 and "'dynamic' is not one of 'continuous', 'static'" in r.output


def test_prefix_caching_option_and_verbose_shared_pages(tiny_dir):
    prompt = ",".join(str(t) for t in range(3, 43))  # 40 tokens: 2 full pages
    args = ["--model", str(tiny_dir), "--prompt-ids", prompt, "--prompt-ids", prompt, "--max-tokens", "3", "--ignore-eos",
            "--json", "--max-num-batched-tokens", "20", "-v"]  # fmt: skip
    cached, uncached = run(*args), run(*args, "--no-enable-prefix-caching")
    assert cached.exit_code == 0 and uncached.exit_code == 0, cached.output + uncached.output
    on = [json.loads(line) for line in cached.stdout.splitlines()]
    off = [json.loads(line) for line in uncached.stdout.splitlines()]
    assert [o["token_ids"] for o in on] == [o["token_ids"] for o in off]
    # The first prompt takes the 20-token budget for two steps; the second, admitted in the third,
    # finds the first's 2 full pages, which both block tables then hold.
    assert [o["num_cached_tokens"] for o in on] == [0, 32] and [o["num_cached_tokens"] for o in off] == [0, 0]
    assert "prefill     8 tok  pos 32..39  pages 3 (2 shared)" in cached.stderr and "cached pages" in cached.stderr
    assert "shared" not in uncached.stderr and "(32 cached)" in cached.stderr
