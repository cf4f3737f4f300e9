"""The `numba-vllm` command through click's CliRunner: output formats and one-line errors."""

import json

import pytest
from click.testing import CliRunner

from numba_vllm.cli import main
from tests.helpers.smollm2 import REF, needs_smollm2
from tests.helpers.tiny_llama import tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


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
    assert r.exit_code == 1 and "the prompt has 256 tokens; the model's limit is 256" in r.output


def test_corrupt_checkpoint(tiny_dir, tmp_path):
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes((tiny_dir / "model.safetensors").read_bytes()[:1000])
    r = run("--model", str(tmp_path), "--prompt-ids", "1")
    assert r.exit_code == 1 and "truncated" in r.output and "Traceback" not in r.output


@pytest.mark.slow  # runs SmolLM2 on the NumPy backend twice, 48 tokens each
@needs_smollm2
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


@pytest.mark.slow  # runs SmolLM2 on the NumPy backend twice
@needs_smollm2
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
