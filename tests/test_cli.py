"""The `numba-vllm` command through click's CliRunner: output formats and one-line errors."""

import json
import socket
from pathlib import Path

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


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "2"], "--top-p"),
        (["--top-k", "-5"], "--top-k"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--seed", "-1"], "--seed"),
        (["--num-pages", "1"], "--num-pages"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
        (["--max-model-len", "1"], "--max-model-len"),
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
        (["--model", ""], "--model"),
        (["", "--prompt-ids", "1"], "PROMPTS"),
    ],
)
def test_bad_option_values_exit_2_naming_the_flag(tiny_dir, args, flag):
    r = run("--model", str(tiny_dir), *args) if "--model" not in args else run(*args)
    assert r.exit_code == 2 and "Invalid value for" in r.output and flag in r.output, r.output
    assert "model tiny" not in r.output and "Traceback" not in r.output  # refused before the model loads


def test_prompt_longer_than_the_model_limit(tiny_dir):
    ids = ",".join(["3"] * 256)  # the tiny model's max_position_embeddings is 256
    r = run("--model", str(tiny_dir), "--prompt-ids", ids)
    assert r.exit_code == 1 and "the prompt has 256 tokens; this model's maximum context length is 256" in r.output
    assert "prompts," not in r.output  # no summary of nothing


def test_an_explicit_max_tokens_must_fit_and_the_default_is_shortened(tiny_dir):
    ids = ",".join(["3"] * 200)  # 200 + 128 > 256
    r = run("--model", str(tiny_dir), "--prompt-ids", ids, "--ignore-eos", "--json")
    assert r.exit_code == 0 and len(json.loads(r.stdout)["token_ids"]) == 56
    r = run("--model", str(tiny_dir), "--prompt-ids", ids, "--prompt-ids", "5", "--max-tokens", "100", "--ignore-eos", "--json")
    assert r.exit_code == 1 and "prompt 1: max_tokens is too large: 100" in r.output and "(--max-tokens)" in r.output
    first, second = (json.loads(line) for line in r.stdout.splitlines())
    assert "error" in first and len(second["token_ids"]) == 100  # the other prompt still ran


def test_tiny_dummy_model_in_the_repository():
    r = run("--model", "tests/data/tiny-llama", "--load-format", "dummy", "--prompt-ids", "1,2,3", "--max-tokens", "2", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["prompt_token_ids"] == [1, 2, 3]
    r = run("--load-format", "dummy", "--prompt-ids", "1")
    assert r.exit_code == 2 and "--load-format dummy needs --model" in r.output


def test_several_prompts_are_separated_and_stop_strings_apply(tiny_dir, monkeypatch):
    class Words:  # a tokenizer of its own: token t is the word "w{t} "
        eos_token_id = None
        stop_token_ids = ()
        has_chat_template = False

        def encode(self, text):
            return [int(w[1:]) for w in text.split()]

    class Detok:  # its incremental detokenizer
        def __init__(self, tok, prompt_ids, skip_special_tokens=True):
            pass

        def add(self, token):
            return f"w{token} "

        def flush(self):
            return ""

    monkeypatch.setattr("numba_vllm.engine.output.IncrementalDetokenizer", Detok)
    monkeypatch.setattr("numba_vllm.cli.load_model", lambda model, load_format: _with_tokenizer(tiny_dir, Words()))
    r = run("--model", "x", "w5 w6", "w7", "--max-tokens", "3", "--ignore-eos")
    assert r.exit_code == 0, r.output
    first, second = r.stdout.split("\n\n")
    assert len(first.split()) == 3 and len(second.split()) == 3
    stop = first.split()[1]
    r = run("--model", "x", "w5 w6", "--max-tokens", "3", "--ignore-eos", "--stop", stop)
    assert r.stdout == first.split(stop)[0] + "\n"


def _with_tokenizer(tiny_dir, tokenizer):
    from numba_vllm.loading.checkpoint import load_checkpoint

    ckpt = load_checkpoint(tiny_dir)
    return type(ckpt)(ckpt.config, ckpt.weights, tokenizer, ckpt.source)


def test_ctrl_c_ends_the_line_prints_the_summary_and_exits_130(tiny_dir, monkeypatch):
    from numba_vllm.engine.llm_engine import LLMEngine

    step = LLMEngine.step
    calls = []

    def interrupted(self):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", interrupted)
    r = run("--model", str(tiny_dir), "--prompt-ids", "5,6", "--max-tokens", "10", "--ignore-eos")
    assert r.exit_code == 130
    assert "[1 prompts (interrupted)" in r.stderr and r.stderr.rstrip().endswith("interrupted")


def test_convert_interrupted_leaves_nothing_behind(tmp_path, monkeypatch):
    from numba_vllm.cli import main as cli_main

    out = tmp_path / "out"

    def interrupted_save(arrays, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise KeyboardInterrupt

    def convert(gguf, out_dir):
        from numba_vllm.loading.weights import save_safetensors

        Path(out_dir).mkdir()
        save_safetensors(Path(out_dir) / "model.safetensors", {})

    monkeypatch.setattr("safetensors.numpy.save_file", interrupted_save)
    monkeypatch.setattr("numba_vllm.loading.gguf.importer.convert_gguf", convert)
    r = CliRunner().invoke(cli_main, ["convert", str(tmp_path / "model.gguf"), str(out)])
    assert r.exit_code == 130 and not out.exists()


def test_serve_reports_a_port_in_use_before_loading_the_model():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = CliRunner().invoke(main, ["serve", "--model", "/no/such/dir", "--port", str(port)])
    assert r.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in r.output and "no such file" not in r.output


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


def test_run_takes_its_sampling_defaults_from_generation_config(tmp_path):
    """The file's top_k 1 makes an unseeded run greedy; a value given on the command line wins, and
    --generation-config vllm ignores the file. The reference: the same prompt run with --temperature 0."""
    path = tiny_checkpoint(tmp_path / "suggesting")
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.9, "top_k": 1}))
    base = ["--model", str(path), "--backend", "numpy", "--prompt-ids", "5,6,7", "--max-tokens", "8", "--ignore-eos", "--json"]

    def ids(*extra):
        r = run(*base, *extra)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["token_ids"], r.stderr

    greedy, _ = ids("--temperature", "0")
    from_file, log = ids()
    assert from_file == greedy and "sampling defaults from generation_config.json: temperature=0.9, top_k=1" in log
    assert ids("--top-k", "0", "--seed", "1")[0] != greedy  # sampled at the file's temperature 0.9
    assert ids("--generation-config", "vllm")[0] == greedy  # run's own default: greedy
    assert ids("--generation-config", "vllm", "--temperature", "1", "--seed", "1")[0] != greedy
    help_text = CliRunner().invoke(main, ["run", "--help"]).output
    assert "generation_config.json" in help_text and "--generation-config [auto|vllm]" in help_text


@pytest.mark.slow  # runs the tiny model's request through the simulated kernels
def test_kernel_options_choose_the_kernels_and_a_kernel_that_cannot_run_is_one_line(tiny_dir):
    """--prefill-gemm, --prefill-attention and --decode-attention reach EngineConfig: the readable kernels
    run a request in the simulator; the Hopper attention on a head dim it cannot take (the tiny model's
    16) is refused when the model is built, in one line naming the kernel to use instead."""
    args = ["--model", str(tiny_dir), "--backend", "sim", "--prompt-ids", "5,6,7", "--max-tokens", "2", "--ignore-eos",
            "--json", "--max-num-seqs", "1"]  # fmt: skip
    readable = run(*args, "--prefill-gemm", "fp32", "--prefill-attention", "cuda_cores", "--decode-attention", "reference")
    assert readable.exit_code == 0, readable.output
    assert len(json.loads(readable.stdout)["token_ids"]) == 2
    r = run(*args, "--prefill-attention", "wgmma")
    assert r.exit_code != 0 and "head_dim 16 not supported" in r.output and "'tensor_cores'" in r.output, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    r = run(*args, "--decode-attention", "fastest")
    assert r.exit_code == 2 and "--decode-attention" in r.output
