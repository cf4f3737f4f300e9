"""The benchmarks' results as pictures (`numba-vllm bench latency|throughput|kernels --plot FILE.png`).

Each function takes the JSON-ready result a benchmark returns (the same dict `--json` writes, so a
saved run can be drawn again later, and `bench kernels --from-json` draws one without a GPU):

- latency: decode ms per step, decode tokens/s and time to first token against batch size (log 2),
  with the batch-1 floor (weight bytes / bandwidth) and transformers beside it when it was run;
- throughput: continuous and static batching side by side: generated tokens over time (the slope is
  the throughput; the run that ends first is faster), tokens per step over time (static batching's
  steps thin out as a batch drains), ms per step against tokens in the step, and output tokens/s;
- kernels: a roofline (achieved TFLOP/s against arithmetic intensity, under the measured copy
  bandwidth and the fp32 and bf16 matmul ceilings) for every kernel that computes, and every kernel's
  share of its own ceiling (GB/s or TFLOP/s) as a bar.
"""

from __future__ import annotations

from pathlib import Path

from numba_vllm.viz.mpl import new_figure, save

MODE_COLORS = {"continuous": "#2563eb", "static": "#ea580c", "transformers": "#6b7280"}
BOUND_COLORS = {"memory": "#2563eb", "fp32": "#dc2626"}


def plot_result(result: dict, path: str | Path) -> Path:
    """Draw any benchmark's result (by its "benchmark" key) to `path`."""
    kind = result.get("benchmark")
    plot = {"latency": plot_latency, "throughput": plot_throughput, "kernels": plot_kernels}.get(kind)
    if plot is None:
        raise ValueError(f"cannot plot a result of benchmark {kind!r}: expected latency, throughput or kernels")
    return plot(result, path)


def _title(result: dict) -> str:
    device = result.get("environment", {}).get("device", "")
    return f"{result['benchmark']}: {result['model']}, backend {result['backend']}" + (f" ({device})" if device else "")


# ---- latency -------------------------------------------------------------------------------------------
def plot_latency(result: dict, path: str | Path) -> Path:
    rows = result["results"]
    batches = [r["batch_size"] for r in rows]
    hf = {r["batch_size"]: r for r in result["hf"]["results"]} if result.get("hf") else None
    fig = new_figure(12, 3.8)
    fig.suptitle(_title(result), fontsize=10)
    ax_ms, ax_tps, ax_ttft = fig.subplots(1, 3)
    panels = [
        (ax_ms, "decode ms per step", "decode_ms_median"),
        (ax_tps, "decode tokens/s", "decode_tokens_per_s"),
        (ax_ttft, "time to first token, ms", "ttft_ms"),
    ]
    for ax, label, key in panels:
        ax.plot(batches, [r[key] for r in rows], "o-", color=MODE_COLORS["continuous"], label="numba-vllm")
        if hf is not None and all(b in hf and hf[b].get(key) is not None for b in batches):
            ax.plot(batches, [hf[b][key] for b in batches], "s--", color=MODE_COLORS["transformers"], label="transformers")
        ax.set_title(label, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
    ax_ms.plot(batches, [r["decode_ms_p90"] for r in rows], "o:", color=MODE_COLORS["continuous"], alpha=0.5, label="p90")
    ax_ms.axhline(result["batch1_floor_ms"], color="#16a34a", linestyle=":", label="batch-1 floor (weights / bandwidth)")
    ax_ms.legend(fontsize=7)
    if hf is not None:
        ax_tps.legend(fontsize=7)
    for ax, _, _ in panels:  # after every line is in: fixing a limit stops autoscaling
        ax.set_ylim(bottom=0)
    return save(fig, path)


# ---- throughput ----------------------------------------------------------------------------------------
def plot_throughput(result: dict, path: str | Path) -> Path:
    runs = result["runs"]
    w = result["workload"]
    fig = new_figure(11, 7)
    fig.suptitle(
        f"{_title(result)}\n{w['num_requests']} requests, prompts {w['prompt_len_range'][0]}-{w['prompt_len_range'][1]}, "
        f"outputs {w['output_len_range'][0]}-{w['output_len_range'][1]} tokens, all submitted at once",
        fontsize=10,
    )
    (ax_total, ax_fill), (ax_step, ax_bar) = fig.subplots(2, 2)
    for mode, run in runs.items():
        steps = run.get("per_step")
        if not steps:  # a result saved before per-step figures were kept
            continue
        color = MODE_COLORS.get(mode, "#000")
        total, cumulative = 0, []
        for n in steps["generated"]:
            total += n
            cumulative.append(total)
        ax_total.plot(steps["end_s"], cumulative, color=color, label=f"{mode} ({run['elapsed_s']:.3g} s)")
        ax_fill.plot(steps["end_s"], steps["generated"], ".", markersize=2, color=color, label=mode)
        ax_step.plot(steps["generated"], steps["ms"], ".", markersize=3, alpha=0.5, color=color, label=mode)
    ax_total.set_title("tokens generated so far (slope: throughput)", fontsize=9)
    ax_total.set_xlabel("seconds", fontsize=8)
    ax_fill.set_title("tokens generated in each step", fontsize=9)
    ax_fill.set_xlabel("seconds", fontsize=8)
    ax_step.set_title("ms per step against tokens generated in it", fontsize=9)
    ax_step.set_xlabel("tokens in the step (about the running batch)", fontsize=8)
    ax_step.set_ylabel("ms", fontsize=8)
    columns = [(mode, run["output_tokens_per_s"]) for mode, run in runs.items()]
    if result.get("hf"):
        columns.append(("transformers", result["hf"]["output_tokens_per_s"]))
    names = [name for name, _ in columns]
    values = [value for _, value in columns]
    bars = ax_bar.bar(names, values, color=[MODE_COLORS.get(name, "#000") for name in names])
    ax_bar.bar_label(bars, [f"{v:,.0f}" for v in values], fontsize=8)
    ax_bar.set_title("output tokens/s", fontsize=9)
    for ax in (ax_total, ax_fill, ax_step):
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=7)
    for ax in (ax_total, ax_fill, ax_step, ax_bar):
        ax.tick_params(labelsize=8)
        ax.set_ylim(bottom=0)
    return save(fig, path)


# ---- kernels -------------------------------------------------------------------------------------------
def roofline_points(result: dict) -> list[tuple[str, float, float, str]]:
    """(label, arithmetic intensity in FLOP/byte, achieved TFLOP/s, bound) of every kernel row that
    computes: intensity = flops / bytes, which is TFLOP/s over GB/s (both are per the same time)."""
    points = []
    for row in result["rows"]:
        if row["TFLOPs"] > 0 and row["GBps"] > 0:
            points.append((f"{row['name']} {row['shape']}", 1e3 * row["TFLOPs"] / row["GBps"], row["TFLOPs"], row["bound"]))
    return points


def plot_kernels(result: dict, path: str | Path) -> Path:
    rows = result["rows"]
    ceilings = result["ceilings"]
    points = roofline_points(result)
    fig = new_figure(13, max(5.0, 0.24 * len(rows) + 1.5))
    fig.suptitle(f"kernels on {result['device']} ({result['timing']})", fontsize=10)
    ax_roof, ax_bars = fig.subplots(1, 2, width_ratios=[1.1, 1])

    bandwidth_tbs = ceilings["copy_GBps"] / 1e3  # TB/s = TFLOP/s per FLOP/byte of intensity
    roofs = [("fp32 FMA", ceilings["fp32_TFLOPs"], "-")]
    if "bf16_mma_TFLOPs" in ceilings:
        roofs.append(("bf16 matmul (torch)", ceilings["bf16_mma_TFLOPs"], "--"))
    intensities = [p[1] for p in points] or [1.0]
    lo = min(min(intensities) / 2, 0.05)
    hi = max(max(intensities) * 2, 2 * max(r[1] for r in roofs) / bandwidth_tbs)
    ax_roof.plot([lo, hi], [bandwidth_tbs * lo, bandwidth_tbs * hi], color="#2563eb", linewidth=1,
                 label=f"copy bandwidth {ceilings['copy_GBps']:,.0f} GB/s")  # fmt: skip
    for label, peak, style in roofs:
        ax_roof.axhline(peak, color="#dc2626", linestyle=style, linewidth=1, label=f"{label} {peak:,.0f} TFLOP/s")
    for label, intensity, tflops, bound in points:
        ax_roof.plot(intensity, tflops, "o", color=BOUND_COLORS.get(bound, "#000"), markersize=5)
        ax_roof.annotate(label, (intensity, tflops), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax_roof.set_xscale("log")
    ax_roof.set_yscale("log")
    ax_roof.set_xlim(lo, hi)
    top = max([r[1] for r in roofs] + [p[2] for p in points])
    ax_roof.set_ylim(min([p[2] for p in points] + [bandwidth_tbs * lo]) / 2, top * 2)
    ax_roof.set_xlabel("arithmetic intensity, FLOP/byte", fontsize=8)
    ax_roof.set_ylabel("achieved TFLOP/s", fontsize=8)
    ax_roof.set_title("roofline (kernels that compute)", fontsize=9)
    ax_roof.grid(alpha=0.3, which="both")
    ax_roof.legend(fontsize=7, loc="lower right")
    ax_roof.tick_params(labelsize=8)

    labels = [f"{r['name']} {r['shape']}" for r in rows]
    shares = [100 * r["of_ceiling"] for r in rows]
    y = list(range(len(rows)))[::-1]  # the first row on top
    bars = ax_bars.barh(y, shares, color=[BOUND_COLORS.get(r["bound"], "#000") for r in rows])
    achieved = [f"{r['GBps']:,.0f} GB/s" if r["bound"] == "memory" else f"{r['TFLOPs']:.1f} TFLOP/s" for r in rows]
    ax_bars.bar_label(bars, achieved, fontsize=6, padding=2)
    ax_bars.set_yticks(y, labels, fontsize=6)
    ax_bars.axvline(100, color="#444", linewidth=0.8)
    ax_bars.set_xlim(0, max(shares + [100]) * 1.25)
    ax_bars.set_xlabel("% of the ceiling (blue: memory-bound, of copy GB/s; red: of fp32 TFLOP/s)", fontsize=8)
    ax_bars.set_title("each kernel against its ceiling", fontsize=9)
    ax_bars.tick_params(axis="x", labelsize=8)
    return save(fig, path)
