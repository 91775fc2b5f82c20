"""The training report: report.json, three PNG plots and report.md that ties them together.

Every file is written to a temporary name and renamed into place, and report.md is written last, so a report.md
that exists belongs to a finished set. Shape legend: L MoE layers, W ranks (modelled GPUs).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot is imported)
from matplotlib.ticker import MaxNLocator  # noqa: E402

FILES = ("report.json", "loss.png", "straggler.png", "loads.png", "timeline.png", "timeline.json", "report.md")


def _atomic_write(path: Path, write) -> None:
    """Call ``write(tmp_path)`` and rename the result onto ``path``; nothing is left behind on failure."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a report is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_text(path: Path, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    _atomic_write(path, write)


def _save_figure(fig, path: Path) -> None:
    _atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what exists so far)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def max_over_mean(loads_W: list[int]) -> float:
    mean = sum(loads_W) / len(loads_W)
    return max(loads_W) / mean if mean else 1.0


def summarize(steps: list[dict]) -> dict:
    """Headline numbers of a run: loss at start and end, mean straggler before/after and the reduction."""
    if not steps:
        return {"steps": 0}
    n = max(1, min(10, len(steps) // 10))
    first = sum(s["loss"] for s in steps[:n]) / n
    last = sum(s["loss"] for s in steps[-n:]) / n
    before = sum(s["token_straggler_before"] for s in steps) / len(steps)
    after = sum(s["token_straggler_after"] for s in steps) / len(steps)
    mom_before = [max_over_mean(w) for s in steps for w in s["loads_before_LW"]]
    mom_after = [max_over_mean(w) for s in steps for w in s["loads_after_LW"]]
    layers = len(steps[0]["layer_straggler_before"])
    per_layer = []
    for layer in range(layers):
        b = sum(s["layer_straggler_before"][layer] for s in steps) / len(steps)
        a = sum(s["layer_straggler_after"][layer] for s in steps) / len(steps)
        per_layer.append({"layer": layer, "token_straggler_before": b, "token_straggler_after": a,
                          "reduction": 1 - a / b if b else 0.0})
    rates = sorted(s["tokens_per_s"] for s in steps)
    return {
        "steps": len(steps),
        "first_step": steps[0]["step"],
        "last_step": steps[-1]["step"],
        "loss_first": first,
        "loss_last": last,
        "loss_window": n,
        "token_straggler_before": before,
        "token_straggler_after": after,
        "reduction": 1 - after / before if before else 0.0,
        "max_over_mean_before": sum(mom_before) / len(mom_before),
        "max_over_mean_after": sum(mom_after) / len(mom_after),
        "rows_moved_per_step": sum(s["rows_moved"] for s in steps) / len(steps),
        "layers_fell_back": sum(s.get("fell_back", 0) for s in steps),
        "tokens_per_s_median": rates[len(rates) // 2],
        "train_wall_s": sum(s["wall_s"] for s in steps),
        "per_layer": per_layer,
    }


def plot_loss(steps: list[dict], path: Path) -> None:
    x = [s["step"] for s in steps]
    y = [s["loss"] for s in steps]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, y, color="tab:blue", alpha=0.3, lw=1, label="per step")
    ax.plot(x, smooth(y, 10), color="tab:blue", lw=2, label="10-step average")
    ax.axhline(math.log(256), color="gray", ls=":", lw=1, label="uniform over 256 bytes (ln 256)")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title("Training loss (mean over ranks)")
    ax.grid(alpha=0.3)
    ax.legend()
    _save_figure(fig, path)


def plot_straggler(steps: list[dict], path: Path, summary: dict, policy: str) -> None:
    x = [s["step"] for s in steps]
    before = [s["token_straggler_before"] for s in steps]
    after = [s["token_straggler_after"] for s in steps]
    fig, ax = plt.subplots(figsize=(7, 4))
    for ys, color, label in ((before, "tab:red", "before balancing (plain EP)"),
                             (after, "tab:green", f"after balancing (policy {policy})")):
        ax.plot(x, ys, color=color, alpha=0.25, lw=1)
        ax.plot(x, smooth(ys, 10), color=color, lw=2, label=f"{label}, 10-step average")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("token straggler: max - mean rows per GPU")
    ax.set_title(f"Token straggler, mean over MoE layers: {summary['token_straggler_before']:.0f} -> "
                 f"{summary['token_straggler_after']:.0f} rows ({100 * summary['reduction']:.0f}% lower)")
    ax.grid(alpha=0.3)
    ax.legend()
    _save_figure(fig, path)


def plot_loads(rec: dict, gpus_per_node: int, path: Path) -> None:
    before_LW, after_LW = rec["loads_before_LW"], rec["loads_after_LW"]
    layers, world = len(before_LW), len(before_LW[0])
    cols = min(layers, 2)
    rows = math.ceil(layers / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.2 * rows), squeeze=False, sharey=True)
    xs = list(range(world))
    width = 0.4
    for layer in range(rows * cols):
        ax = axes[layer // cols][layer % cols]
        if layer >= layers:
            ax.axis("off")
            continue
        b, a = before_LW[layer], after_LW[layer]
        ax.bar([x - width / 2 for x in xs], b, width, color="tab:red", alpha=0.8, label="before")
        ax.bar([x + width / 2 for x in xs], a, width, color="tab:green", alpha=0.8, label="after")
        ax.axhline(sum(b) / world, color="black", ls="--", lw=1, label="mean")
        for node in range(1, world // gpus_per_node):
            ax.axvline(node * gpus_per_node - 0.5, color="gray", lw=1)
        ax.set_xticks(xs, [f"GPU {w}\nnode {w // gpus_per_node}" for w in xs], fontsize=8)
        ax.set_title(f"layer {layer}: straggler {max(b) - sum(b) / world:.0f} -> {max(a) - sum(a) / world:.0f}",
                     fontsize=10)
        if layer % cols == 0:
            ax.set_ylabel("rows computed")
    fig.suptitle(f"Rows each GPU computes at step {rec['step']}, before and after balancing "
                 f"(balancing moves rows only inside a node)", fontsize=11)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.tight_layout()
    fig.legend(handles, labels, loc="upper center", ncol=3, fontsize=9, bbox_to_anchor=(0.5, 0.0), frameon=False)
    _save_figure(fig, path)


def _md(meta: dict, summary: dict, load_step: int) -> str:
    cfg = meta["config"]
    s = summary
    lines = [
        "# FEPLB training report",
        "",
        f"`{meta['command']}`",
        "",
        f"{meta['world_size']} ranks modelled as {meta['world_size'] // cfg['gpus_per_node']} nodes x "
        f"{cfg['gpus_per_node']} GPUs ({meta['platform']}; torch {meta['torch']}, transport {meta['transport']}). "
        f"Model: {_layers_text(cfg)}, {cfg['experts']} experts, "
        f"top-{cfg['top_k']}, hidden {cfg['hidden']}, expert FFN {cfg['ffn']}, {cfg['dyn']} dynamic experts per GPU, "
        f"{cfg.get('router', 'softmax')} router with no auxiliary loss"
        + (f" (expert selection bias, step {cfg['bias_rate']:g})" if cfg.get("bias_rate") else "")
        + f"; policy `{cfg['policy']}`. Data: {cfg['text']} ({cfg['text_bytes']} bytes, byte-level "
        f"tokens), {cfg['batch']} x {cfg['seq_len']} tokens per rank per step.",
        "",
        "## Summary",
        "",
        "| | value |",
        "| --- | --- |",
        f"| steps in this report | {s['first_step']}..{s['last_step']} ({s['steps']})"
        + (f", resumed at step {meta['resumed_from']}" if meta.get("resumed_from") else "") + " |",
        f"| loss, first {s['loss_window']} steps -> last {s['loss_window']} | {s['loss_first']:.3f} -> "
        f"{s['loss_last']:.3f} nats/byte |",
        f"| token straggler (max - mean rows per GPU), mean over layers and steps | {s['token_straggler_before']:.1f}"
        f" -> {s['token_straggler_after']:.1f} ({100 * s['reduction']:.1f}% lower) |",
        f"| max / mean rows per GPU | {s['max_over_mean_before']:.3f} -> {s['max_over_mean_after']:.3f} |",
        f"| rows moved per step (all layers) | {s['rows_moved_per_step']:.0f} |",
        f"| layer-steps in which a node fell back to computing at home (plan late) | {s['layers_fell_back']} |",
        f"| throughput (median) | {s['tokens_per_s_median']:.0f} tokens/s |",
        f"| training time | {s['train_wall_s']:.0f} s |",
        "",
        "Token straggler: rows the busiest GPU computes above the mean, the time every other GPU waits for it in a "
        "synchronous MoE layer. \"Before\" is plain expert parallelism (each expert computed on its home GPU); "
        "\"after\" is where the balancing plan computed the rows. Balancing changes where a row is computed, never "
        "what is computed: each step's result equals plain expert parallelism's to floating-point rounding, whose "
        "differences (other summation orders) grow over training, so a loss curve of plain expert parallelism "
        "agrees for the first steps and then drifts apart, as any two runs that round differently do.",
        "",
        "## Loss",
        "",
        "![loss](loss.png)",
        "",
        "## Straggler before and after balancing",
        "",
        "![straggler](straggler.png)",
        "",
        "| layer | straggler before | after | reduction |",
        "| --- | --- | --- | --- |",
        *(f"| {p['layer']} | {p['token_straggler_before']:.1f} | {p['token_straggler_after']:.1f} | "
          f"{100 * p['reduction']:.1f}% |" for p in s["per_layer"]),
        "",
        f"## Per-GPU load at step {load_step}",
        "",
        "![loads](loads.png)",
        "",
        "Balancing moves dynamic experts (or chunks of their rows) only between GPUs of one node, so it evens the "
        "GPUs of each node; a gap between nodes stays.",
        "",
    ]
    if meta["platform"].startswith("CPU"):
        lines += ["Timings above come from CPU processes talking over gloo; they show the run works, not how fast "
                  "FEPLB is on GPUs.", ""]
    lines += ["`report.json` holds every step (loss, straggler before/after per layer, rows moved, per-GPU loads, "
              "wall time) and the full configuration.", ""]
    return "\n".join(lines)


def _layers_text(cfg: dict) -> str:
    """The model's layers, and which of them are FEPLB MoE layers (a model may keep dense MLPs in some)."""
    moe = cfg.get("moe_layers", cfg["layers"])
    if moe == cfg["layers"]:
        return f"{cfg['layers']} transformer layers whose MLPs are FEPLB MoE layers"
    return f"{cfg['layers']} transformer layers, {moe} of them with FEPLB MoE layers as MLPs (numbered 0.. below)"


def _timeline_text(spans, late=()) -> str:
    """What the timeline shows, read off its spans: whether planning and the copies ran beside the static GEMM
    (``late``: the spans that ended after the forward returned, a plan it stopped waiting for)."""
    def total(name: str) -> float:
        return sum(s.end_us - s.start_us for s in spans if s.name == name) / 1e3

    def overlaps(name: str) -> bool:
        return any(a.name == name and b.name == "static_gemm" and a.start_us < b.end_us and b.start_us < a.end_us
                   for a in spans for b in spans)

    text = ("The spans of the first MoE layer's last forward on rank 0, per lane: the main thread (compute), the "
            "planner thread and the copy thread (the CPU stand-in for a GPU's copy stream); `counts` includes the "
            "wait for the other ranks. `timeline.json` opens in Perfetto (ui.perfetto.dev) or chrome://tracing. ")
    if not any(s.name == "plan" for s in spans):
        if any(s.name == "plan" for s in late):
            return text + ("This forward's plan was not ready in time (the layer's plan_wait_ms): every rank of its "
                           "node computed its rows at home; the plan, which ended later, is not drawn.")
        return text + "This forward made no plan (its straggler was below the layer's threshold)."
    if any(s.name == "plan" and s.lane == "compute" for s in spans):
        # FasterMoE's and EPLB's path (feplb.direct): no static GEMM, no planner thread
        return text + (f"This policy plans on the main thread before phase 1 ({total('plan'):.2f} ms) and sends each "
                       "row straight to the GPU that computes it: there is no static GEMM for planning or copies to "
                       "hide behind.")
    beside = [n for n in ("plan", "agree", "copy_rows") if overlaps(n)]
    if beside:
        after = f"{', '.join(beside)} ran beside the static GEMM."
    else:
        # (read off the spans: which came first, not a guess from their lengths)
        plan = [s for s in spans if s.name == "plan"]
        gemm = [s for s in spans if s.name == "static_gemm"]
        order = ""
        if plan and gemm:
            if max(s.end_us for s in plan) <= min(s.start_us for s in gemm):
                order = ": planning ended before the static GEMM began"
            elif max(s.end_us for s in gemm) <= min(s.start_us for s in plan):
                order = ": the static GEMM ended before planning began"
        after = (f"nothing ran beside the static GEMM{order} (on a CPU the planner thread holds Python's GIL while "
                 "it plans, and the main thread's work waits for it; on a GPU the overlap condition is plan + copies "
                 "<= static GEMM).")
    return text + (f"Here the static experts' GEMM took {total('static_gemm'):.2f} ms and planning "
                   f"{total('plan'):.2f} ms; " + after)


def write_report(out: Path, meta: dict, steps: list[dict], timeline=None) -> dict:
    """Write report.json, loss.png, straggler.png, loads.png and report.md into ``out`` (and, given one forward's
    ``feplb.timeline`` Timeline or its spans, timeline.png and the Chrome-trace timeline.json); returns the
    summary.

    ``steps`` are the per-step records of the training loop; the per-GPU load bars show the last step.
    """
    if not steps:
        raise ValueError("steps: expected at least one training step to report, got none")
    summary = summarize(steps)
    last = steps[-1]
    plot_loss(steps, out / "loss.png")
    plot_straggler(steps, out / "straggler.png", summary, meta["config"]["policy"])
    plot_loads(last, meta["config"]["gpus_per_node"], out / "loads.png")
    late = []
    if timeline is not None and hasattr(timeline, "late"):   # (a Timeline: its spans, and its late ones apart)
        timeline, late = timeline.spans(), timeline.late()
    if timeline:
        from feplb.timeline import plot, to_chrome_trace

        plot(timeline, out / "timeline.png", title=f"MoE layer 0, last forward of step {last['step']} (rank 0)")
        to_chrome_trace([timeline], out / "timeline.json")
    doc = {"meta": meta, "summary": summary, "load_bars_step": last["step"], "steps": steps}
    _write_text(out / "report.json", json.dumps(doc, indent=1))
    md = _md(meta, summary, last["step"])
    if timeline:
        md += "\n".join(["", "## One MoE layer forward, step by step", "", "![timeline](timeline.png)", "",
                          _timeline_text(timeline, late), ""])
    _write_text(out / "report.md", md)
    return summary
