"""Bounded load test of a running `numba-vllm serve`: N streamed requests, C at a time, on loopback.

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 -n 256 -c 32 --prompt-len 128 --output-len 128

or let it start (and stop) the server itself, e.g. Llama 3.2 1B shapes with random weights on a GPU:

    python benchmarks/serve.py -n 256 -c 64 --prompt-len 256 --output-len 128 --start-server \
        "--model tests/data/llama-3.2-1b-instruct --load-format dummy --backend cuda --max-num-seqs 64"

Arrivals: by default a closed loop (C requests in flight, the next sent as one finishes); with
`--request-rate R` requests arrive as a Poisson process of R per second (exponential gaps, seeded),
at most C in flight, as traffic from many independent users does. `--goodput ttft=MS tpot=MS`
counts the requests that met those service-level objectives (goodput: such requests, and their
output tokens, per second).

Shared prefixes (prefix caching): every prompt starts with the same --shared-prefix-len random tokens,
then its own --prompt-len ones. With --start-server the server is started twice, as given and with
--no-enable-prefix-caching, and the two runs are printed side by side with their ratios:

    python benchmarks/serve.py -n 256 -c 256 --shared-prefix-len 1024 --prompt-len 64 --output-len 128 \
        --vocab-size 10000 --start-server \
        "--model tests/data/llama-3.2-1b-instruct --load-format dummy --backend cuda --max-num-seqs 256"

Each request is a /v1/completions call with a random token-id prompt (or --text, or --chat with a text
message), `stream: true`, `ignore_eos: true` (every request generates exactly --output-len tokens) and
`return_token_ids: true` (so tokens are counted even when several arrive in one event). Measured at
the client: time to first token (TTFT), time per output token after the first (TPOT, per request),
inter-token latency (ITL, per event, divided among the tokens it carries), end-to-end latency, and
throughput over the timed run; from the server's /metrics, its steps, preemptions and prefix-cache
hit rate over the run, and its own mean TTFT (from its handler's start, warm-up requests included:
the rest of the client's TTFT is the client and HTTP); with --start-server (on Linux), the CPU cores the server's front end, its
engine core and the client each kept busy over the run (a front end near 1.0 is saturated: one
Python thread detokenizes and writes every stream). Warm-up requests run first (on a GPU the first step compiles kernels); they
never carry the shared prefix, so the timed run's first requests compute it.
Everything is bounded: --num-requests, --max-time for the whole run (outstanding requests are then
cancelled, which aborts them on the server) and --request-timeout for each request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import aiohttp
import numpy as np

EVENT_BYTES = 1 << 22  # the longest event line read (the first event carries the prompt's token ids)


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def make_body(args, seed: int, rng: np.random.Generator, model: str, prefix: list[int]) -> dict:
    """One request; a token-id prompt is `prefix` followed by its own random ids."""
    body = {"model": model, "max_tokens": args.output_len, "temperature": args.temperature, "stream": True}
    body.update(ignore_eos=True, return_token_ids=True, seed=seed)
    if args.chat:
        body["messages"] = [{"role": "user", "content": args.text or "Tell me a long story."}]
    elif args.text:
        body["prompt"] = args.text
    else:
        lo, hi = args.prompt_len
        n = int(rng.integers(lo, hi + 1))
        body["prompt"] = prefix + rng.integers(args.min_token_id, args.vocab_size, n).tolist()
    return body


async def one_request(session: aiohttp.ClientSession, url: str, body: dict, timeout: float) -> Result:
    r = Result()
    try:
        await asyncio.wait_for(_stream_one(session, url, body, r), timeout)
    except asyncio.TimeoutError:  # noqa: UP041 (not the builtin before Python 3.11)
        r.ok, r.error = False, f"timed out after {timeout:.0f} s"
    except (aiohttp.ClientError, ValueError) as e:  # ValueError: an event line past read_bufsize
        r.ok, r.error = False, f"{type(e).__name__}: {e}"
    return r


async def _stream_one(session: aiohttp.ClientSession, url: str, body: dict, r: Result) -> None:
    t0 = time.perf_counter()
    last = None
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            r.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:200]}"
            return
        async for raw in resp.content:  # the event stream, a line at a time
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                r.error = event["error"].get("message", "error event")
                return
            if not event.get("choices"):
                continue
            choice = event["choices"][0]
            n = len(choice.get("token_ids") or [])
            if "prompt_token_ids" in choice:
                r.prompt_tokens = len(choice["prompt_token_ids"])
            if n == 0:
                continue
            now = time.perf_counter()
            if r.ttft is None:
                r.ttft = now - t0
                r.itl += [0.0] * (n - 1)  # tokens that came together with the first
            else:
                r.itl += [(now - last) / n] * n
            last = now
            r.output_tokens += n
    r.e2e = (last or time.perf_counter()) - t0
    r.ok = r.output_tokens > 0
    if not r.ok:
        r.error = "no tokens"


async def run_load(args, base_url: str, model: str) -> tuple[list[Result], float, int]:
    url = base_url + ("/v1/chat/completions" if args.chat else "/v1/completions")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=args.concurrency + 2)
    rng = np.random.default_rng(args.seed)
    session = aiohttp.ClientSession(headers=headers, connector=connector,
                                    timeout=aiohttp.ClientTimeout(total=None), read_bufsize=EVENT_BYTES)  # fmt: skip
    async with session as client:
        for i in range(args.warmup):
            w = await one_request(client, url, make_body(args, 1_000_000 + i, rng, model, []), args.request_timeout)
            if not w.ok:
                raise SystemExit(f"warm-up request failed: {w.error}")
        prefix = rng.integers(args.min_token_id, args.vocab_size, args.shared_prefix_len).tolist()
        bodies = [make_body(args, i, rng, model, prefix) for i in range(args.num_requests)]
        results: list[Result | None] = [None] * len(bodies)
        started = 0

        async def send(i: int) -> None:
            nonlocal started
            started += 1
            results[i] = await one_request(client, url, bodies[i], args.request_timeout)

        t0 = time.perf_counter()
        if args.request_rate == float("inf"):  # closed loop: C workers, each sends the next as one finishes
            next_index = iter(range(len(bodies)))

            async def worker() -> None:
                for i in next_index:
                    await send(i)

            tasks = [asyncio.create_task(worker()) for _ in range(args.concurrency)]
        else:  # open loop: Poisson arrivals, at most C in flight
            arrivals = np.cumsum(np.random.default_rng(args.seed + 1).exponential(1 / args.request_rate, len(bodies)))
            in_flight = asyncio.Semaphore(args.concurrency)

            async def arrive(i: int) -> None:
                await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
                async with in_flight:
                    await send(i)

            tasks = [asyncio.create_task(arrive(i)) for i in range(len(bodies))]
        done, pending = await asyncio.wait(tasks, timeout=args.max_time)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
    finished = [r for r in results if r is not None]
    cancelled = [Result(error=f"cancelled at --max-time {args.max_time:.0f} s") for _ in range(started - len(finished))]
    return finished + cancelled, wall, len(bodies) - started


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(results: list[Result], wall: float, not_run: int, slo_ms: dict[str, float] | None = None) -> dict:
    """Counts, throughput and latency percentiles; with `slo_ms` ({"ttft": ms, "tpot": ms}), goodput."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    out_tokens = sum(r.output_tokens for r in results)
    errors = [r.error for r in results if not r.ok]
    summary = {
        "requests_ok": len(ok),
        "requests_failed": len(errors),
        "requests_not_run": not_run,
        "wall_s": wall,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "output_tokens_per_s": out_tokens / wall if wall > 0 else 0.0,
        "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        summary[f"{name}_ms"] = {
            "mean": 1000 * statistics.fmean(values) if values else float("nan"),
            "p50": 1000 * pct(values, 50),
            "p90": 1000 * pct(values, 90),
            "p99": 1000 * pct(values, 99),
        }
    if slo_ms:
        def meets(r: Result) -> bool:
            return all(getattr(r, name) is not None and 1000 * getattr(r, name) <= ms for name, ms in slo_ms.items())

        good = [r for r in ok if meets(r)]
        summary["goodput"] = {
            "slo_ms": slo_ms,
            "requests": len(good),
            "requests_per_s": len(good) / wall if wall > 0 else 0.0,
            "output_tokens_per_s": sum(r.output_tokens for r in good) / wall if wall > 0 else 0.0,
        }
    if errors:
        summary["first_errors"] = sorted(set(errors))[:5]
    return summary


def parse_slos(specs: list[str]) -> dict[str, float]:
    """`ttft=600 tpot=12` -> {"ttft": 600.0, "tpot": 12.0} (milliseconds)."""
    slos = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or name not in ("ttft", "tpot", "e2e"):
            raise ValueError(f"--goodput: {spec!r} is not ttft=MS, tpot=MS or e2e=MS")
        slos[name] = float(value)
    return slos


def get(url: str, timeout: float, headers: dict | None = None) -> bytes:
    """GET url's body (the client's few synchronous calls, outside the timed run); OSError on failure."""
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as resp:
        return resp.read()


def metrics(base_url: str) -> dict[str, float]:
    """The server's /metrics as {'name{labels}': value}. Parsed here rather than with
    numba_vllm.server.metrics.parse_metrics, whose import pulls in the server and the engine: the
    load-test client needs only aiohttp and numpy."""
    try:
        text = get(base_url + "/metrics", 10).decode()
    except OSError:
        return {}
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def start_server(server_args: str, port: int, wait_s: float) -> tuple[subprocess.Popen, str]:
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "numba_vllm.cli", "serve", *server_args.split(), "--port", str(port), "--no-access-log"]
    print("starting:", " ".join(cmd), file=sys.stderr)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(cmd, cwd=root)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            get(base + "/health", 2)  # HTTPError (an OSError) unless 200
            return proc, base
        except OSError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise SystemExit(f"the server was not up after {wait_s:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time a process has used so far (Linux /proc), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_processes(pid: int) -> dict[str, int]:
    """The started server's processes by role: its own (the HTTP front end) and the engine core it
    spawned (multiprocessing's resource tracker left out); empty where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return {}
    roles = {"front end": pid}
    for child in children:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"resource_tracker" not in cmdline:
            roles["engine core" if "engine core" not in roles else f"child {child}"] = child
    return roles


def measure(args, server_args: str | None) -> dict:
    """One timed run against args.base_url, or against `numba-vllm serve server_args` started for it."""
    proc = None
    base_url = args.base_url.rstrip("/")
    if server_args is not None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc, base_url = start_server(server_args, port, args.server_start_timeout)
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        try:
            model = args.model or json.loads(get(base_url + "/v1/models", 10, headers))["data"][0]["id"]
        except OSError as e:
            raise SystemExit(f"cannot reach the server at {base_url}: {e}") from None
        before = metrics(base_url)
        processes = server_processes(proc.pid) if proc is not None else {}
        cpu_before = {role: cpu_seconds(pid) for role, pid in processes.items()}
        client_before = time.process_time()
        results, wall, not_run = asyncio.run(run_load(args, base_url, model))
        client_cpu = time.process_time() - client_before
        cpu_after = {role: cpu_seconds(pid) for role, pid in processes.items()}
        after = metrics(base_url)
    finally:
        if proc is not None:
            stop_server(proc)

    summary = summarize(results, wall, not_run, args.slos)
    # CPU cores each process kept busy over the run (1.0: one core all the time): a front end near 1.0
    # is the bound (one Python thread tokenizes, detokenizes and writes every stream).
    cores = {role: (cpu_after[role] - cpu_before[role]) / wall for role in processes
             if cpu_before[role] is not None and cpu_after[role] is not None and wall > 0}  # fmt: skip
    if wall > 0:
        cores["client"] = client_cpu / wall
    summary["cpu_cores_used"] = cores
    summary["config"] = {k: v for k, v in vars(args).items() if k not in ("api_key", "slos")} | {"model": model}
    if server_args is not None:
        summary["config"]["start_server"] = server_args
    for key in ("engine_steps_total", "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total"):
        name = "numba_vllm:" + key
        if name in before and name in after:
            summary[key.removesuffix("_total")] = after[name] - before[name]
    if summary.get("prefix_cache_queries"):
        summary["prefix_cache_hit_rate"] = summary["prefix_cache_hits"] / summary["prefix_cache_queries"]
    # The server's own TTFT (its handler's start to the first token in the front end): what the
    # client's TTFT adds to it is the client and HTTP (sending, parsing, the event's way back).
    ttft_sum, ttft_count = "numba_vllm:time_to_first_token_seconds_sum", "numba_vllm:time_to_first_token_seconds_count"
    if all(k in d for k in (ttft_sum, ttft_count) for d in (before, after)) and after[ttft_count] > before[ttft_count]:
        summary["server_ttft_mean_ms"] = 1000 * (after[ttft_sum] - before[ttft_sum]) / (after[ttft_count] - before[ttft_count])
    return summary


def report(args, summary: dict, title: str | None = None) -> None:
    if title:
        print(f"== {title}")
    shared = f"{args.shared_prefix_len} shared + " if args.shared_prefix_len else ""
    arrivals = "closed loop" if args.request_rate == float("inf") else f"Poisson {args.request_rate:g}/s"
    print(
        f"{summary['requests_ok']} ok, {summary['requests_failed']} failed, {summary['requests_not_run']} not run "
        f"in {summary['wall_s']:.1f} s (concurrency {args.concurrency}, prompt {shared}{args.prompt_len[0]}-"
        f"{args.prompt_len[1]} tokens, output {args.output_len} tokens, arrivals {arrivals})"
    )
    print(f"throughput: {summary['output_tokens_per_s']:.1f} output tokens/s, {summary['requests_per_s']:.2f} requests/s")
    print(f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = summary[f"{name}_ms"]
        print(f"{name:<6}{s['mean']:>10.1f}{s['p50']:>10.1f}{s['p90']:>10.1f}{s['p99']:>10.1f}")
    if "goodput" in summary:
        g = summary["goodput"]
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in g["slo_ms"].items())
        rates = f"{g['requests_per_s']:.2f} requests/s, {g['output_tokens_per_s']:.1f} output tokens/s"
        print(f"goodput ({slo}): {g['requests']} requests, {rates}")
    if summary.get("cpu_cores_used"):
        print("CPU cores used over the run: " + ", ".join(f"{k} {v:.2f}" for k, v in summary["cpu_cores_used"].items()))
    if "server_ttft_mean_ms" in summary:
        print(f"TTFT mean at the server (its handler to the first token): {summary['server_ttft_mean_ms']:.1f} ms, "
              f"at the client {summary['ttft_ms']['mean']:.1f} ms")  # fmt: skip
    if "engine_steps" in summary:
        hit_rate = f", prefix-cache hit rate {summary['prefix_cache_hit_rate']:.2f}" if "prefix_cache_hit_rate" in summary else ""
        print(f"server: {summary['engine_steps']:.0f} steps, {summary.get('num_preemptions', 0):.0f} preemptions{hit_rate}")
    for e in summary.get("first_errors", []):
        print("error:", e, file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--api-key", default=os.environ.get("NUMBA_VLLM_API_KEY"))
    ap.add_argument("-n", "--num-requests", type=int, default=64)
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[128], help="L, or MIN MAX (uniform) token-id prompt lengths")
    ap.add_argument("--shared-prefix-len", type=int, default=0,
                    help="every token-id prompt starts with the same N tokens, before its own --prompt-len; with "
                    "--start-server, run with prefix caching on and off side by side")  # fmt: skip
    ap.add_argument("--output-len", type=int, default=128, help="tokens generated per request (EOS ignored)")
    ap.add_argument("--vocab-size", type=int, default=128, help="random prompt ids are below this (the tiny test model has 128)")
    ap.add_argument("--min-token-id", type=int, default=3)
    ap.add_argument("--text", default=None, help="a text prompt instead of random token ids (needs a tokenizer)")
    ap.add_argument("--chat", action="store_true", help="use /v1/chat/completions with --text as the user message")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (default: closed loop of -c)"
    )
    ap.add_argument("--goodput", nargs="+", default=[], metavar="SLO", help="service-level objectives: ttft=MS tpot=MS e2e=MS")
    ap.add_argument("--warmup", type=int, default=2, help="requests run (one at a time) before timing")
    ap.add_argument(
        "--max-time", type=float, default=600.0, help="seconds for the timed run; then outstanding requests are cancelled"
    )
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--start-server", metavar="ARGS", default=None, help="start `numba-vllm serve ARGS` on a free port and stop it after"
    )
    ap.add_argument("--server-start-timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None, help="write the summary here")
    args = ap.parse_args()
    if len(args.prompt_len) == 1:
        args.prompt_len = [args.prompt_len[0]] * 2
    if len(args.prompt_len) != 2 or not 1 <= args.prompt_len[0] <= args.prompt_len[1]:
        ap.error("--prompt-len takes L or MIN MAX with 1 <= MIN <= MAX")
    if args.num_requests < 1 or args.concurrency < 1 or args.output_len < 1:
        ap.error("--num-requests, --concurrency and --output-len must be >= 1")
    if not args.request_rate > 0:
        ap.error("--request-rate must be > 0")
    try:
        args.slos = parse_slos(args.goodput)
    except ValueError as e:
        ap.error(str(e))
    if args.shared_prefix_len < 0 or (args.shared_prefix_len and (args.text or args.chat)):
        ap.error("--shared-prefix-len takes N >= 0, for token-id prompts (not --text or --chat)")

    compare = args.shared_prefix_len > 0 and args.start_server is not None
    if not compare:
        summary = measure(args, args.start_server)
        report(args, summary)
        ok = summary["requests_failed"] == 0 and summary["requests_not_run"] == 0
    else:
        runs = {
            "caching on": measure(args, args.start_server),
            "caching off": measure(args, args.start_server + " --no-enable-prefix-caching"),
        }
        for title, run in runs.items():
            report(args, run, f"prefix {title}")
        on, off = runs["caching on"], runs["caching off"]
        r = {
            "output_tokens_per_s": ratio(on["output_tokens_per_s"], off["output_tokens_per_s"]),
            "ttft_p50_lower": ratio(off["ttft_ms"]["p50"], on["ttft_ms"]["p50"]),
        }
        summary = {**runs, "caching_on_vs_off": r}
        print(f"== prefix caching on / off: output tokens/s {r['output_tokens_per_s']:.2f}x, "
              f"TTFT p50 {r['ttft_p50_lower']:.2f}x lower")  # fmt: skip
        ok = all(run["requests_failed"] == 0 and run["requests_not_run"] == 0 for run in runs.values())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
