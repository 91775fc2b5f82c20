"""The ``feplb`` command: one entry point whose subcommands register in ``SUBCOMMANDS``.

Each subcommand is a pair (add_arguments(parser), run(args) -> exit code); ``main`` dispatches on the first word.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import shlex
import signal
import sys
import tempfile
import threading
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from feplb.files import write_outputs

SIMULATE_EPILOG = """\
TRACE forms:
  PATH.npz                     per-token trace: topk_ids [T, L, K] (+ optional topk_weights[_e4], seq_offsets),
                               or the FLAME layout prefill_topk_ids [T, L, K]
  PATH.json[:model=M][:domains=D1,D2,..][:variant=topk|top1]
                               OLMoE per-domain expert counts (expert_counts_by_domain.json); rank s draws
                               its rows from domain D[s % len(D)] (multinomial); M in olmoe, olmoe-sft,
                               olmoe-dpo, mistral
  synthetic:zipf|dirichlet[:E=128][:K=8][:L=4][:alpha=1.2][:drift=0.1][:seed=0]
                               seeded synthetic popularity drifting over micro-batches
POLICY forms: BASE[+place][@current|@ema], BASE in none, feplb, feplb-split, fastermoe, eplb, lp;
  +place adds the cross-node placement from routing history, refreshed every --refresh-every micro-batches;
  @ema picks dynamic experts from the history (weights replicated once per refresh) instead of the current
  micro-batch (weights copied with the rows).
"""


# A per-token trace gathers W x S x L x K expert ids per micro-batch (plus int64 bin indices): past this many bytes
# a --tokens-per-rank is refused rather than left to exhaust the machine's memory.
MICROBATCH_BYTES_MAX = 2_000_000_000


class UsageError(ValueError):
    """Bad input the user can fix: printed as one line naming the file or option, exit status 2."""


def _positive(v: str) -> int:
    i = int(v)
    if i < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return i


def _expert_dim(v: str) -> int:
    from feplb.traces import MAX_EXPERT_DIM

    i = _positive(v)
    if i > MAX_EXPERT_DIM:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_EXPERT_DIM} (2**20: no model's hidden or expert "
                                         f"ffn size comes near), got {v}")
    return i


def _non_negative(v: str) -> int:
    i = int(v)
    if i < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return i


def _non_negative_float(v: str) -> float:
    f = float(v)
    if not 0 <= f < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {v}")
    return f


def _fraction(v: str) -> float:
    f = float(v)
    if not 0 <= f < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {v}")
    return f


def _policy_names(v: str) -> tuple[str, ...]:
    """Comma-separated policy names, each stripped; an empty one ("feplb," or "feplb,,lp", a slip that would drop
    a policy from the comparison unsaid) is refused."""
    names = tuple(name.strip() for name in v.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated policy names, none empty, got {v!r}")
    return names


# argparse names a value a type function cannot convert by the function's name ("invalid <name> value: '2.5'")
for _f, _name in ((_positive, "positive integer"), (_expert_dim, "expert size"),
                  (_non_negative, "non-negative integer"),
                  (_non_negative_float, "non-negative number"), (_fraction, "fraction")):
    _f.__name__ = _name


def _add_simulate(p: argparse.ArgumentParser) -> None:
    p.add_argument("traces", nargs="+", metavar="TRACE", help="routing workloads (forms below)")
    p.add_argument("--ep", type=_positive, default=8, help="EP ranks W (default 8)")
    p.add_argument("--gpus-per-node", type=_positive, default=None,
                   help="GPUs per node G, divides W (default: min(8, W))")
    p.add_argument("--tokens-per-rank", type=_positive, default=2048,
                   help="tokens per rank per micro-batch S (default 2048)")
    p.add_argument("--dyn", type=_non_negative, default=4, help="dynamic experts per GPU (default 4)")
    p.add_argument("--policies", type=_policy_names, default="none,feplb,feplb-split,fastermoe,eplb,lp",
                   help="comma-separated policies (default: %(default)s)")
    p.add_argument("--microbatches", type=_positive, default=32, help="measured micro-batches (default 32)")
    p.add_argument("--warmup", type=_non_negative, default=8,
                   help="micro-batches that only feed the histories (default 8)")
    p.add_argument("--seed", type=_non_negative, default=0, help="seed of the micro-batch sampler (default 0)")
    p.add_argument("--refresh-every", type=_positive, default=8,
                   help="micro-batches between history refreshes (@ema set, eplb replicas, +place placement; one "
                        "optimizer step; default 8)")
    p.add_argument("--eplb-slots", type=_non_negative, default=1,
                   help="eplb redundant expert slots per GPU (default 1)")
    p.add_argument("--place-min-gain", type=_fraction, default=None,
                   help="+place keeps plain EP's placement unless the new one lowers the most loaded node (GPU) by "
                        "more than this fraction (default: PolicyState's)")
    p.add_argument("--replicas", choices=("eager", "lazy"), default="eager",
                   help="@ema weights: 'eager' replicates the dynamic set in the node at each refresh (between steps),"
                        " 'lazy' copies a weight on first use in the step and keeps it until the step ends (the"
                        " layer's FEPLBConfig(replicas=...))")
    p.add_argument("--recopy-weights", action="store_true",
                   help="FEPLB's helpers receive the weights a plan copied again in the backward instead of holding "
                        "them from the forward (the layer's FEPLBConfig(recopy_weights=True))")
    p.add_argument("--no-reduce-in-fp32", action="store_true",
                   help="held copies' gradients go to their owners at a step's end rounded to bf16 (half the "
                        "bytes) instead of as fp32 sums (the layer's FEPLBConfig(reduce_in_fp32=False), bf16 weights)")
    p.add_argument("--tau", type=_non_negative_float, default=0.01,
                   help="feplb stops at a node gap <= tau x node mean (default 0.01)")
    p.add_argument("--min-chunk", type=_positive, default=None,
                   help="feplb-split's smallest piece in rows (default: the cost model's knee)")
    p.add_argument("--experts", type=_positive, default=None,
                   help="E for npz traces and synthetic specs (default: an npz trace's max id + 1, a spec's E)")
    p.add_argument("--hidden", type=_expert_dim, default=None,
                   help="expert hidden size for bytes and GEMM times, for every workload (default: the traced "
                        "model's; else the cost table's, 6144)")
    p.add_argument("--ffn", type=_expert_dim, default=None,
                   help="expert ffn size for bytes and GEMM times, for every workload (default: the traced "
                        "model's; else the cost table's, 2048)")
    p.add_argument("--eplb-groups", type=_positive, default=1,
                   help="eplb expert groups (hierarchical placement when the nodes divide them)")
    p.add_argument("--cost-table", default=None, help='measured GEMM table JSON {"rows": [..], "us": [..]}')
    p.add_argument("--plan-us", type=_non_negative_float, default=None,
                   help="planning time (us) the layer time and the overlap condition charge every plan (default: "
                        "its measured CPU time on this machine, which varies with the machine and between runs)")
    p.add_argument("--no-validate", action="store_true", help="skip Plan.validate on every plan")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT.json", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="write a plot (straggler per layer, loads)")


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if b < 1000:
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1000
    return f"{b:.1f} TB"


def format_table(title: str, summary: dict[str, dict[str, float]]) -> str:
    head = (f"{'policy':<22} {'straggler':>10} {'reduction':>9} {'max/mean':>8} {'GEMM ms':>8} {'% ideal':>7} "
            f"{'plan p50':>9} {'plan p99':>9} {'copies/mb':>10} {'hidden':>6} {'layer ms':>8} {'speedup':>7} "
            f"{'train ms':>8} {'speedup':>7} {'worse':>5} {'extra wts':>9}")
    lines = [title, head, "-" * len(head)]
    for name, s in summary.items():
        lines.append(f"{name:<22} {s['token_straggler']:>10.1f} {100 * s['token_straggler_reduction']:>8.1f}% "
                     f"{s['max_over_mean']:>8.3f} {s['gemm_straggler_ms']:>8.3f} {s['pct_of_ideal']:>7.2f} "
                     f"{s['planner_us_p50']:>7.1f}us {s['planner_us_p99']:>7.1f}us "
                     f"{_fmt_bytes(s['ce_bytes_per_microbatch']):>10} {s['pct_hidden']:>5.0f}% "
                     f"{s['layer_ms']:>8.3f} {s['layer_speedup']:>6.2f}x {s['train_ms']:>8.3f} "
                     f"{s['train_speedup']:>6.2f}x {s['worse_than_none']:>5} "
                     f"{s['extra_weight_pct']:>8.1f}%")
    return "\n".join(lines)


def plot_results(results: list, path: str, fmt: str | None = None, titles: Sequence[str] | None = None) -> None:
    """Token straggler per layer by policy (one panel per workload, titled ``titles`` or the workload names) and
    per-GPU loads before/after for the example micro-batch of the first workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(1, n + 1, figsize=(6 * (n + 1), 4.2), squeeze=False)
    titles = list(titles) if titles is not None else [r.workload for r in results]
    # one colour per policy, in both panels (tab20 past ten policies, so that none repeats)
    names = list(results[0].metrics)
    palette = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    color = {p: palette(i) for i, p in enumerate(names)}
    for ax, r, title in zip(axes[0], results, titles, strict=False):
        x = range(len(r.layer_names))
        for policy, m in r.metrics.items():
            ax.plot(x, m["token_straggler"].mean(axis=1), marker=".", label=policy, color=color[policy])
        ax.set_xticks(list(x), r.layer_names, fontsize=7, rotation=90 if len(r.layer_names) > 12 else 0)
        ax.set_xlabel("MoE layer")
        ax.set_ylabel("token straggler (rows, mean over micro-batches)")
        ax.set_title(title, fontsize=9)
        ax.set_yscale("symlog", linthresh=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    ex, ax = results[0].example, axes[0][n]
    policies = [p for p in ex["loads_after"] if p != "none"]
    width = 0.8 / (len(policies) + 1)
    W = len(ex["loads_before"])
    # (white, hatched: no policy's colour, tab's greys included)
    ax.bar([d - 0.4 + width / 2 for d in range(W)], ex["loads_before"], width, label="plain EP (before)",
           color="white", edgecolor="black", hatch="//", linewidth=0.5)
    for i, p in enumerate(policies):
        ax.bar([d - 0.4 + width * (i + 1.5) for d in range(W)], ex["loads_after"][p], width, label=p, color=color[p])
    mean = sum(ex["loads_before"]) / W
    ax.axhline(mean, color="k", lw=0.8, ls="--", label="mean")
    ax.set_xlabel("GPU")
    ax.set_ylabel("rows computed")
    ax.set_title(f"{titles[0]}, layer {ex['layer']}, one micro-batch", fontsize=9)
    ax.legend(fontsize=6, loc="lower left", ncol=2, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format=fmt)
    plt.close(fig)


def check_output(path: str, option: str, inputs: Sequence[tuple[str, str]] = ()) -> Path:
    """Refuse an output path that cannot be written (a directory, a missing or read-only folder), before any work:
    a temporary file is created next to it and removed again. The file written is the one the path names after
    its symbolic links (the links stay links); an existing one must be a regular file (a device, a pipe or a
    socket would be replaced by a file), and none of the command's ``inputs`` ((option, path) pairs: it would be
    overwritten by the results)."""
    given = Path(path)
    out = Path(os.path.realpath(given))
    if out.is_dir():
        raise UsageError(f"{option} {given}: is a directory; expected a file name")
    if out.exists() and not out.is_file():
        raise UsageError(f"{option} {given}: exists and is not a regular file (a device, a pipe or a socket), which "
                         "the results would replace; name a file")
    for what, inp in inputs:
        if out.exists() and Path(inp).exists() and os.path.samefile(out, inp):
            raise UsageError(f"{option} {given}: is the input {what} {inp}, which the results would overwrite")
    parent = out.parent
    if not parent.exists():
        raise UsageError(f"{option} {given}: the folder {parent} does not exist")
    if not parent.is_dir():
        raise UsageError(f"{option} {given}: {parent} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{out.name}.", suffix=".tmp")
    except OSError as err:
        raise UsageError(f"{option} {given}: cannot write in {parent} ({err.strerror or err})") from err
    os.close(fd)
    os.unlink(probe)
    return out


def _plot_format(out: Path) -> str:
    from matplotlib.figure import Figure

    fmt = out.suffix[1:].lower() or "png"
    supported = Figure().canvas.get_supported_filetypes()
    if fmt not in supported:
        raise UsageError(f"--plot {out}: unknown image format {fmt!r}; expected one of {', '.join(sorted(supported))}")
    if fmt == "pgf":
        import shutil

        import matplotlib

        tex = matplotlib.rcParams["pgf.texsystem"]
        if shutil.which(tex) is None:
            raise UsageError(f"--plot {out}: matplotlib writes .pgf with {tex}, which is not installed here")
    return fmt


def check_trace_file(spec: str) -> None:
    """Refuse a trace file that cannot be read, or an ``.npz`` that is no zip archive (empty, truncated, another
    format), with one line naming the file, before numpy or json meets it."""
    if spec.startswith("synthetic:"):
        return
    path = Path(_trace_file(spec))
    if path.suffix not in (".npz", ".json") or not path.exists():
        return  # load_workload names an unknown form or a missing file
    if path.is_dir():
        raise UsageError(f"trace {path}: is a directory; expected a {path.suffix} file")
    try:
        with path.open("rb") as f:
            first = f.read(1)
    except OSError as err:
        raise UsageError(f"trace {path}: cannot read the file ({err.strerror or err})") from err
    if not first:
        raise UsageError(f"trace {path}: the file is empty (0 bytes)")
    if path.suffix == ".npz" and not zipfile.is_zipfile(path):
        raise UsageError(f"trace {path}: not an .npz archive (no zip directory: the file is truncated or of "
                         f"another format)")


def _json(doc) -> str:
    """``doc`` as standard JSON: a float that is not finite (a summary's NaN for "mixed", say) becomes null, which
    every JSON reader takes (Python's default writes a bare NaN, which most refuse)."""
    def clean(v):
        if isinstance(v, float):
            return v if math.isfinite(v) else None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(doc), indent=1, allow_nan=False)


def _cost_table(path: str, kw: dict):
    """--cost-table: the cost model of a ``feplb calibrate`` table, or a UsageError naming the file and what is
    wrong with it."""
    from feplb.sched import CostModel

    try:
        return CostModel.from_json(path, **kw)
    except OSError as err:
        raise UsageError(f"--cost-table {path}: cannot read the file ({err.strerror or err})") from err
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise UsageError(f"--cost-table {path}: not a cost table of `feplb calibrate` "
                         f"({type(err).__name__}: {err})") from err


def _trace_file(spec: str) -> str:
    """The file a trace spec reads (an OLMoE counts spec's options stripped)."""
    head = spec.split(":")[0]
    return head if head.endswith(".json") else spec


def _measured_on(meta: dict) -> tuple[str | None, str]:
    """Where a cost table (its ``meta``) or a bench_kernels run (its ``bench_meta``, for tables of --from-bench
    written before calibrate recorded it) was measured: (device type or None, device name)."""
    bench = meta.get("bench_meta") if isinstance(meta.get("bench_meta"), dict) else {}
    kind = meta.get("device_type")
    if kind is None and "cuda" in bench:
        # a CUDA build's bench records its CUDA version, a CPU build's None; a file without the key: unknown
        kind = "cuda" if bench["cuda"] else "cpu"
    return kind, meta.get("device") or bench.get("device") or ""


def _table_doc(path: str) -> dict:
    """A cost table's document as read, for what the model does not keep: its ``meta`` (where and how it was
    measured, as ``feplb calibrate`` writes it) and which keys it gives; {} if it is no JSON object."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


# the command line's names for what SimConfig and the topology name in their messages
_OPTIONS = {"SimConfig.policies": "--policies", "SimConfig.recopy_weights": "--recopy-weights",
            "SimConfig.place_min_gain": "--place-min-gain", "SimConfig.eplb_groups": "--eplb-groups",
            "PolicyState.eplb_groups": "--eplb-groups", "PolicyState.eplb_slots": "--eplb-slots",
            "SimConfig.min_chunk": "--min-chunk",
            "SimConfig.replicas_mode": "--replicas", "SimConfig.tau": "--tau",
            "num_ranks (W=": "--ep (W=", "gpus_per_node (G=": "--gpus-per-node (G=", "SimConfig.dyn must": "--dyn must",
            "dyn must": "--dyn must",
            "num_experts (E=": "the experts (E="}


# (one pass, longest name first: a replacement is never replaced again, "SimConfig.dyn must" before "dyn must")
_OPTION_NAMES = re.compile("|".join(re.escape(k) for k in sorted(_OPTIONS, key=len, reverse=True)))


def _option_names(msg: str) -> str:
    return _OPTION_NAMES.sub(lambda m: _OPTIONS[m.group(0)], msg)


def _option_notes(args: argparse.Namespace, config, workloads: list) -> list[str]:
    """Options that change nothing here, and traces whose expert count looks wrong."""
    import numpy as np

    from feplb.sched.plan import parse_policy

    notes = []
    for spec in dict.fromkeys(args.traces):
        if args.traces.count(spec) > 1:
            notes.append(f"trace {spec} is given {args.traces.count(spec)} times: 'all workloads' pools it as often")
    if args.replicas == "lazy" and not any(parse_policy(p)[2] == "ema" for p in config.policies):
        notes.append("--replicas lazy changes the @ema policies only, and none is simulated")
    bases = {parse_policy(p)[0] for p in config.policies}
    # options of one policy family given for a run without it (their defaults say nothing)
    for option, given, family in (("--min-chunk", args.min_chunk is not None, {"feplb-split"}),
                                  ("--tau", args.tau != 0.01, {"feplb", "feplb-split"}),
                                  ("--eplb-slots", args.eplb_slots != 1, {"eplb"}),
                                  ("--eplb-groups", args.eplb_groups != 1, {"eplb"}),
                                  ("--recopy-weights", args.recopy_weights, {"feplb", "feplb-split", "lp"})):
        if given and not bases & family:
            notes.append(f"{option} changes the {', '.join(sorted(family))} policies only, and none is simulated")
    for spec, w in zip(args.traces, workloads, strict=True):
        ids = getattr(w, "topk_ids_TLK", None)
        if args.experts is not None and ids is None and not spec.startswith("synthetic:"):
            notes.append(f"trace {spec}: --experts {args.experts} is not used: its counts give E={w.num_experts}")
        elif args.experts is not None and args.experts != w.num_experts and spec.startswith("synthetic:"):
            notes.append(f"trace {spec}: --experts {args.experts} is not used: the spec's E={w.num_experts} is")
        if args.experts is None and ids is not None:
            routed = np.unique(ids).size
            if 2 * routed <= w.num_experts:
                notes.append(f"trace {spec}: E={w.num_experts} (its largest expert id + 1), but it routes to {routed} "
                             "experts only: check the trace, or give --experts")
    return notes


def _load(spec: str, num_experts: int | None):
    from feplb.traces import load_workload

    check_trace_file(spec)
    try:
        return load_workload(spec, num_experts)
    except (zipfile.BadZipFile, zlib.error, EOFError) as err:
        raise UsageError(f"trace {spec}: damaged .npz archive ({type(err).__name__}: {err})") from err
    except OSError as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise UsageError(f"trace {spec}: cannot read the file ({err.strerror or err})") from err
    except (ValueError, TypeError) as err:   # a damaged JSON or .npy member, a malformed array: name the file
        msg = str(err)
        raise UsageError(msg if Path(spec.split(":")[0]).name in msg else f"trace {spec}: {msg}") from err


def bound_experts(workload, spec: str, num_ranks: int) -> None:
    """Refuse an E whose per-micro-batch counts (W x L x E int64, and the policies' per-expert histories) would not
    fit in MICROBATCH_BYTES_MAX: a trace's E is its largest expert id + 1, which one stray id makes enormous."""
    E, L = int(workload.num_experts), int(workload.num_layers)
    need = (num_ranks + 2) * L * E * 8
    if need > MICROBATCH_BYTES_MAX:
        where = "its largest expert id + 1" if hasattr(workload, "topk_ids_TLK") else "the experts"
        raise UsageError(f"trace {spec}: E={E} ({where}) makes a micro-batch's counts W={num_ranks} x L={L} x E "
                         f"about {need / 1e9:.1f} GB; the limit is {MICROBATCH_BYTES_MAX / 1e9:.1f} GB (a stray "
                         "expert id? check the trace, or give --experts)")


def bound_microbatch(workload, num_ranks: int, tokens_per_rank: int) -> None:
    """Refuse a --tokens-per-rank whose per-token micro-batch would not fit in MICROBATCH_BYTES_MAX."""
    ids = getattr(workload, "topk_ids_TLK", None)
    if ids is None:
        return  # multinomial and synthetic workloads draw counts, not tokens: their memory does not grow with S
    _, L, K = ids.shape
    per_token = num_ranks * L * K * (ids.itemsize + 16) + num_ranks * 8
    need = per_token * tokens_per_rank
    if need > MICROBATCH_BYTES_MAX:
        raise UsageError(
            f"--tokens-per-rank {tokens_per_rank}: a micro-batch of {workload.name} gathers W={num_ranks} x "
            f"S={tokens_per_rank} x L={L} x K={K} expert ids, about {need / 1e9:.1f} GB; the limit is "
            f"{MICROBATCH_BYTES_MAX / 1e9:.1f} GB (--tokens-per-rank <= {MICROBATCH_BYTES_MAX // per_token} here)")


def bound_metrics(workload, config) -> None:
    """Refuse a --microbatches whose per-micro-batch metrics (every policy's, per layer, float64) would not fit in
    MICROBATCH_BYTES_MAX."""
    from feplb.simulate import _METRICS

    per_mb = len(config.policies) * len(_METRICS) * int(workload.num_layers) * 8
    need = per_mb * config.microbatches
    if need > MICROBATCH_BYTES_MAX:
        raise UsageError(f"--microbatches {config.microbatches}: the metrics of {workload.name} "
                         f"({len(config.policies)} policies x {len(_METRICS)} x L={workload.num_layers} per "
                         f"micro-batch) take about {need / 1e9:.1f} GB; the limit is "
                         f"{MICROBATCH_BYTES_MAX / 1e9:.1f} GB (--microbatches <= {MICROBATCH_BYTES_MAX // per_mb} "
                         "here)")


def workload_keys(names: Sequence[str], specs: Sequence[str]) -> list[str]:
    """One distinct key per workload: its name, or the trace spec where two workloads share a name (two files of
    one name in different folders), numbered where the specs repeat too."""
    keys = [spec if names.count(name) > 1 else name for name, spec in zip(names, specs, strict=True)]
    seen: dict[str, int] = {}
    out = []
    for key in keys:
        seen[key] = seen.get(key, 0) + 1
        out.append(key if keys.count(key) == 1 else f"{key}#{seen[key]}")
    return out


def _run_simulate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from feplb.sched import CostModel
    from feplb.simulate import SimConfig, simulate, summarize

    # Outputs first: a path that cannot be written must not cost a whole simulation, nor overwrite an input.
    inputs = [("trace", _trace_file(t)) for t in args.traces if not t.startswith("synthetic:")]
    inputs += [("--cost-table", args.cost_table)] if args.cost_table else []
    json_out = check_output(args.json_out, "--json", inputs) if args.json_out else None
    plot_out = check_output(args.plot, "--plot", inputs) if args.plot else None
    if json_out and plot_out and json_out.resolve() == plot_out.resolve():
        raise UsageError(f"--json and --plot name the same file {json_out}")
    plot_fmt = _plot_format(plot_out) if plot_out else None
    gpus = args.gpus_per_node or min(8, args.ep)
    if args.ep % gpus:
        raise UsageError(f"--gpus-per-node {gpus} must divide --ep {args.ep}"
                         + ("" if args.gpus_per_node else " (the default, min(8, --ep); give --gpus-per-node)"))
    policies = args.policies
    # an explicit --hidden / --ffn holds for every workload (SimConfig.hidden / ffn); the other dimension is the
    # traced model's, or the cost table's for workloads of no model
    cost_kw = {k: v for k, v in (("hidden", args.hidden), ("ffn", args.ffn)) if v is not None}
    cost = _cost_table(args.cost_table, cost_kw) if args.cost_table else CostModel(**cost_kw)
    table_doc = _table_doc(args.cost_table) if args.cost_table else None
    table_meta = None if table_doc is None else \
        table_doc["meta"] if isinstance(table_doc.get("meta"), dict) else {}
    if args.no_reduce_in_fp32:
        cost = dataclasses.replace(cost, grad_dtype_bytes=cost.dtype_bytes)
    try:
        config = SimConfig(num_ranks=args.ep, gpus_per_node=gpus, tokens_per_rank=args.tokens_per_rank,
                           dyn=args.dyn, policies=policies, microbatches=args.microbatches, warmup=args.warmup,
                           seed=args.seed, refresh_every=args.refresh_every, eplb_slots=args.eplb_slots,
                           replicas_mode=args.replicas, recopy_weights=args.recopy_weights, tau=args.tau,
                           eplb_groups=args.eplb_groups, plan_us=args.plan_us,
                           **({} if args.place_min_gain is None else {"place_min_gain": args.place_min_gain}),
                           min_chunk=args.min_chunk, validate=not args.no_validate, cost=cost,
                           hidden=args.hidden, ffn=args.ffn)
    except (ValueError, TypeError) as err:
        raise UsageError(_option_names(str(err))) from err
    workloads = [_load(t, args.experts) for t in args.traces]
    for spec, w in zip(args.traces, workloads, strict=True):
        bound_experts(w, spec, config.num_ranks)
        try:
            topo = config.topology(w.num_experts)  # refuse a bad topology, or policy options, before any work
        except ValueError as err:
            hint = "" if args.experts is not None or "num_experts" not in str(err) else \
                " (E is the trace's largest expert id + 1; --experts sets it)" if hasattr(w, "topk_ids_TLK") else \
                " (--experts sets E)"
            raise UsageError(f"trace {spec}: {_option_names(str(err))}{hint}") from err
        for policy in config.policies:
            try:
                config.policy_state(topo, policy)
            except ValueError as err:
                raise UsageError(f"trace {spec}: {_option_names(str(err))}") from err
        bound_microbatch(w, config.num_ranks, config.tokens_per_rank)
        if config.tokens_per_rank * w.top_k > topo.max_count:
            # (a rank's S tokens of top-k may all reach one expert: found only mid-run, in the planner's counts)
            raise UsageError(f"--tokens-per-rank {config.tokens_per_rank}: trace {spec}'s S x K = "
                             f"{config.tokens_per_rank * w.top_k} rows from one rank could reach one expert, past the "
                             f"planner's bound of {topo.max_count} per (source, expert) for W={topo.num_ranks}, "
                             f"E={topo.num_experts}")
        bound_metrics(w, config)
    keys = workload_keys([w.name for w in workloads], args.traces)
    # what the options leave without effect, or a trace that looks wrong: said before the run
    early = _option_notes(args, config, workloads)
    if table_doc is not None:
        missing = [k for k in ("hidden", "ffn") if k not in table_doc]
        if missing:   # (a hand-written table of the --cost-table help's form)
            early.append(f"--cost-table {args.cost_table} gives no {' or '.join(missing)}: its times are taken as "
                         f"measured on an expert of H={cost.table_hidden} F={cost.table_ffn} (the cost model's "
                         "default) and scaled to each workload's expert")
    for note in early:
        print(f"feplb simulate: note: {note}", file=sys.stderr)
    results = []
    total = len(workloads) * (config.warmup + config.microbatches)
    with tqdm(total=total, desc="simulate", unit="mb", disable=args.no_progress, file=sys.stderr) as bar:
        for w in workloads:
            results.append(simulate(w, config, progress=bar))
    planning = "" if config.plan_us is None else f"; layer ms and hidden with {config.plan_us:g} us of planning"
    notes = early + [n for r in results for n in r.notes]
    if table_meta is not None:
        kind, device = _measured_on(table_meta)
        where = f"{kind} {device}".strip() if kind else "no record of where it was measured"
        planning += f"; GEMM times from {args.cost_table} ({where})"
        if kind != "cuda":
            notes.append(f"--cost-table {args.cost_table} was not measured on a GPU ({where}): its times, and every "
                         "time above, are not a GPU's")
    given = " and ".join(f"--{k}" for k in ("hidden", "ffn") if getattr(args, k) is not None)
    for key, r in zip(keys, results, strict=True):
        shape = r.expert_shape
        if shape["model"]:
            model = f"{shape['model']}, {given} from the options" if given else shape["model"]
        else:   # a workload of no model (synthetic): the cost table's shape, but for what the options gave
            model = f"no model: {given} from the options, the rest the cost table's" if given else \
                "no model: the cost table's"
        print(format_table(f"\n{key} (E={r.num_experts}, K={r.top_k}, W={config.num_ranks}, "
                           f"G={config.gpus_per_node}, S={config.tokens_per_rank}, dyn={config.dyn}; expert "
                           f"H={shape['hidden']} F={shape['ffn']} ({model}){planning})", r.summary()))
    for note in dict.fromkeys(notes[len(early):]):
        print(f"feplb simulate: note: {note}", file=sys.stderr)
    summary = summarize(results)
    if len(results) > 1:
        print(format_table("\nall workloads", summary))
    writers: list[tuple[Path, Callable[[str], None]]] = []
    if json_out:
        doc = {"config": {**config.as_dict(), "traces": list(args.traces), "command": "feplb " + shlex.join(args.argv),
                          "cost_table": None if table_meta is None else {"path": args.cost_table, "meta": table_meta}},
               "notes": list(dict.fromkeys(notes)),
               "policies": summary,
               "workloads": {key: {"trace": spec, "expert_shape": r.expert_shape, "policies": r.summary(),
                                   "per_layer_token_straggler": {p: m["token_straggler"].mean(axis=1).tolist()
                                                                 for p, m in r.metrics.items()},
                                   "layers": list(r.layer_names), "example": r.example}
                             for key, spec, r in zip(keys, args.traces, results, strict=True)}}
        writers.append((json_out, lambda tmp: Path(tmp).write_text(_json(doc) + "\n")))
    if plot_out:
        writers.append((plot_out, lambda tmp: plot_results(results, tmp, fmt=plot_fmt, titles=keys)))
    write_outputs(writers)
    return 0


CALIBRATE_EPILOG = """\
Measures one expert's forward (gate/up GEMM, the layer's SwiGLU, down GEMM; --experts experts of R rows each in
one grouped call) at every --rows count on --device, fits the cost table (the closest non-decreasing curve, the
knee where the time leaves the weight-read floor) and writes the JSON that `feplb simulate --cost-table` and
CostModel.from_json read. Or, with --from-bench, takes the GEMM times of a bench/bench_kernels.py results file
(the two GEMMs, without SwiGLU). Copy bandwidths are not measured here (one GPU cannot show a peer copy):
--ce-gbps / --net-gbps write given values, and so do --d2d-gbps / --copy-out-slowdown (a copy inside one GPU,
e.g. bench_kernels.py's device copy, and the GEMM slowdown beside it, bench_overlap.py's sm_copy_slowdown_pct / 100).
"""


def _rows_list(v: str) -> list[int]:
    from feplb.calibrate import check_row_counts

    try:
        rows = check_row_counts(int(r) for r in v.split(",") if r.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated, positive, strictly ascending integers, got "
                                         f"{v!r}") from err
    if len(rows) < 2:
        raise argparse.ArgumentTypeError(f"expected at least 2 row counts, got {v!r}")
    return rows


def _positive_float(v: str) -> float:
    f = float(v)
    if not (f > 0 and f != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {v}")
    return f


def _unit_interval(v: str) -> float:
    f = float(v)
    if not 0 <= f <= 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {v}")
    return f


def _tolerance(v: str) -> float:
    f = float(v)
    if not 0 <= f < 10:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a number in [0, 10), got {v}")
    return f


def _device(v: str) -> str:
    import torch

    try:
        dev = torch.device(v)
    except RuntimeError as err:
        raise argparse.ArgumentTypeError(f"not a device: {v!r} ({str(err).splitlines()[0]})") from err
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {v!r}")
    return v


def _triton_errors() -> tuple[type[BaseException], ...]:
    """Triton's own errors (a kernel out of shared memory, a failed compile), which are no RuntimeError."""
    try:
        from triton.errors import TritonError
    except ImportError:
        return ()
    return (TritonError,)


def _add_calibrate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="cost table JSON to write")
    p.add_argument("--from-bench", default=None, metavar="FILE",
                   help="derive the table from a bench_kernels.py results JSON instead of measuring")
    p.add_argument("--bench-impl", default=None, choices=("torch_grouped_mm", "feplb"),
                   help="with --from-bench: whose times (default torch_grouped_mm)")
    # (measuring options default to None: given with --from-bench, which takes all of it from the file, they are
    # refused instead of ignored; _MEASURE_DEFAULTS fills them in otherwise)
    # (the cost model's own limits on the shape, checked before the sweep rather than after it)
    p.add_argument("--hidden", type=_expert_dim, default=None, help="expert hidden size H (default 6144, GLM-5)")
    p.add_argument("--ffn", type=_expert_dim, default=None, help="expert ffn width F (default 2048, GLM-5)")
    p.add_argument("--experts", type=_positive, default=None, help="experts timed together (default 16)")
    p.add_argument("--rows", type=_rows_list, default=None,
                   help="rows per expert to time, comma-separated ascending (default 32,64,...,4096)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"), help="(default bfloat16)")
    p.add_argument("--device", default=None, type=lambda v: v if v == "auto" else _device(v),
                   help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument("--impl", default=None, choices=("torch", "feplb"),
                   help="torch: torch._grouped_mm (default); feplb: feplb.kernels (Triton on a GPU)")
    p.add_argument("--repeats", type=_positive, default=None, help="timed calls per row count (median taken, "
                   "default 10)")
    p.add_argument("--warmup", type=_positive, default=None,
                   help="untimed calls first, at least 1 (the first call compiles and tunes kernels; default 3)")
    p.add_argument("--floor-tolerance", type=_tolerance, default=0.10,
                   help="times within this fraction of the smallest count's are on the floor (default 0.10)")
    p.add_argument("--ce-gbps", type=_positive_float, default=None, help="copy-engine GB/s inside a node to record")
    p.add_argument("--net-gbps", type=_positive_float, default=None, help="GB/s per GPU between nodes to record")
    p.add_argument("--d2d-gbps", type=_positive_float, default=None,
                   help="GB/s copied by a copy inside one GPU (the copy path's copy-out of its inbox) to record")
    p.add_argument("--copy-out-slowdown", type=_unit_interval, default=None,
                   help="fraction (0-1) by which such a copy slows a GEMM beside it, to record")


_MEASURE_DEFAULTS = {"hidden": 6144, "ffn": 2048, "experts": 16, "rows": [32, 64, 128, 256, 512, 1024, 2048, 4096],
                     "dtype": "bfloat16", "device": "auto", "impl": "torch", "repeats": 10, "warmup": 3}


def _run_calibrate(args: argparse.Namespace) -> int:
    import torch

    from feplb.calibrate import expert_us_from_bench, machine_meta, measure_expert_us, table_document

    given = [f"--{k}" for k in _MEASURE_DEFAULTS if getattr(args, k) is not None]
    if args.from_bench and given:
        raise UsageError(f"{', '.join(given)} with --from-bench: the table's shape, rows and device are the bench "
                         "file's, and nothing is measured; leave them out")
    if not args.from_bench and args.bench_impl is not None:
        raise UsageError("--bench-impl is for --from-bench (whose times a bench file's table takes); to measure "
                         "with feplb's kernels, use --impl feplb")
    for k, v in _MEASURE_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.bench_impl = args.bench_impl or "torch_grouped_mm"
    out = check_output(args.out, "--out", [("--from-bench", args.from_bench)] if args.from_bench else ())
    command = "feplb " + shlex.join(args.argv)
    if args.from_bench:
        path = Path(args.from_bench)
        try:
            doc = json.loads(path.read_text())
        except OSError as err:
            raise UsageError(f"--from-bench {path}: cannot read the file ({err.strerror or err})") from err
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise UsageError(f"--from-bench {path}: not JSON ({err})") from err
        except RecursionError:
            raise UsageError(f"--from-bench {path}: not a bench_kernels results file (its JSON is nested too "
                             "deeply to read)") from None
        try:
            measured, shape = expert_us_from_bench(doc, impl=args.bench_impl)
        except ValueError as err:
            raise UsageError(f"--from-bench {path}: {err}") from err
        hidden, ffn = shape["hidden"], shape["ffn"]
        meta = {"source": f"bench_kernels file {path}", "what": f"{args.bench_impl} forward gate/up + down GEMMs "
                "(no SwiGLU), uniform routing, per expert", "experts": shape["experts"],
                "bench_meta": {k: v for k, v in doc["meta"].items() if k != "shape"}}
        if isinstance(doc["meta"]["shape"].get("dtype"), str):
            meta["dtype"] = doc["meta"]["shape"]["dtype"]
        # where the bench ran, in calibrate's own terms
        kind, device = _measured_on(meta)
        meta.update(device_type=kind, device=device or None)
    else:
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto"
                              else args.device)
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.type == "cuda" and (device.index or 0) >= visible:
            raise UsageError(f"--device {args.device}: no such CUDA device here ({visible} visible)")
        hidden, ffn = args.hidden, args.ffn
        print(f"feplb calibrate: {args.experts} experts of H={hidden} F={ffn} ({args.dtype}, {args.impl}) on "
              f"{device}, rows per expert {args.rows}, {args.repeats} timed calls each", file=sys.stderr)
        try:
            measured = measure_expert_us(args.rows, hidden=hidden, ffn=ffn, experts=args.experts,
                                         dtype=getattr(torch, args.dtype), device=device, impl=args.impl,
                                         repeats=args.repeats, warmup=args.warmup)
        except (RuntimeError, *_triton_errors()) as err:  # e.g. torch._grouped_mm refusing a shape or dtype
            if isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in str(err):   # (the CPU's)
                raise UsageError(f"out of memory on {device} timing {args.experts} experts of H={hidden} F={ffn} at up "
                                 f"to {args.rows[-1]} rows per expert: use fewer --experts or smaller --rows") from err
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            hint = " (--impl feplb runs any shape and dtype)" if args.impl == "torch" else ""
            raise UsageError(f"--impl {args.impl} cannot run H={hidden} F={ffn} in {args.dtype} on {device}: "
                             f"{first}{hint}") from err
        meta = {"source": "measured", "what": f"{'torch._grouped_mm' if args.impl == 'torch' else 'feplb.kernels'} "
                "gate/up GEMM + feplb's SwiGLU + down GEMM, every expert the same rows, median per expert",
                "experts": args.experts, "dtype": args.dtype, "repeats": args.repeats, "warmup": args.warmup,
                **machine_meta(device)}
    meta["command"] = command
    # the element size the times were measured in: the model's weight and row bytes (a float32 table read as bf16
    # halved every copy beside fp32 GEMM times); a bench file that names no dtype ran bench_kernels' bfloat16
    dt = getattr(torch, str(meta.get("dtype", "bfloat16")), None)
    if not isinstance(dt, torch.dtype):
        raise UsageError(f"--from-bench {args.from_bench}: meta.shape.dtype {meta.get('dtype')!r} is no torch dtype")
    try:
        table = table_document(measured, hidden=hidden, ffn=ffn, meta=meta, floor_tolerance=args.floor_tolerance,
                               dtype_bytes=dt.itemsize, ce_gbps=args.ce_gbps, net_gbps=args.net_gbps,
                               d2d_gbps=args.d2d_gbps, copy_out_slowdown=args.copy_out_slowdown)
    except ValueError as err:   # (the times cannot make a table: too few row counts, no floor, a flat end)
        raise UsageError(f"--from-bench {args.from_bench}: {err}" if args.from_bench else
                         f"the times measured cannot make a cost table: {err}") from err
    print(f"{'rows/expert':>11} {'us/expert':>11} {'TFLOP/s':>8}")
    for m in measured:
        # four significant digits: a CPU's or a tiny shape's rate is far below 0.01 TFLOP/s
        print(f"{m['rows']:>11} {m['us']:>11.2f} {m['tflops']:>8.4g}")
    fit = table["meta"]["fit"]
    print(f"knee {fit['knee_rows']} rows (floor {table['us'][0]:.2f} us); table rows {table['rows']}"
          + (f"; {fit['moved_points']} point(s) moved by the non-decreasing fit" if fit["moved_points"] else ""))
    if meta.get("device_type") == "cpu":
        where = f"the bench file's times were measured on a CPU ({meta.get('device')})" if args.from_bench else \
            f"measured on this machine's CPU ({meta.get('device')}, {meta.get('threads')} threads)"
        print(f"{where}: CPU times, no GPU's; the table records it (meta.device_type), and feplb simulate says so "
              "when it uses it")
    write_outputs([(out, lambda tmp: Path(tmp).write_text(_json(table) + "\n"))])
    print(f"wrote {out}")
    return 0


HF_CHECK_EPILOG = """\
Builds a tiny random model (2 layers, 2 attention heads, 8 experts, top-2) of each transformers MoE architecture
from its own config class, runs it unmodified and with feplb.hf.apply on --ranks gloo processes on this CPU
(balancing between --gpus-per-node "GPUs" of a node), and compares logits and every gradient. Outcomes: exact;
refused (what feplb.hf.apply refuses, and why); no experts; not built (the tiny recipe could not build or run the
architecture unmodified); WRONG or error (a defect of feplb.hf: exit status 1).
"""


def _add_hf_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("archs", nargs="*", metavar="ARCH",
                   help="transformers model types (default: every MoE architecture of the installed transformers)")
    p.add_argument("--ranks", type=_positive, default=2, help="gloo processes, one EP rank each (default 2)")
    p.add_argument("--gpus-per-node", type=_positive, default=None,
                   help="EP ranks per modelled node (default: min(2, --ranks))")
    p.add_argument("--policy", default="feplb-split", help="balancing policy (default feplb-split)")
    p.add_argument("--markdown", default=None, metavar="FILE", help="also write the table as Markdown")
    p.add_argument("--json", default=None, metavar="FILE", help="also write every outcome as JSON")
    p.add_argument("--timeout", type=_positive, default=None,
                   help="seconds for the whole run (default 120 + 20 per architecture)")


def _run_hf_check(args: argparse.Namespace) -> int:
    try:
        import transformers
    except ImportError as err:
        raise UsageError("feplb hf-check needs transformers >= 5: pip install 'feplb[hf]'") from err
    import platform
    import time

    import torch

    from feplb import hfcheck
    from feplb.config import FEPLBConfig
    from feplb.testing import DistError, run_dist

    major = transformers.__version__.split(".")[0]
    if not major.isdigit() or int(major) < 5:
        raise UsageError(f"feplb hf-check needs transformers >= 5, found {transformers.__version__}")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    unknown = [a for a in args.archs if a not in CONFIG_MAPPING_NAMES]
    if unknown:
        raise UsageError(f"unknown transformers model type(s) {unknown} (transformers {transformers.__version__}); "
                         f"its MoE architectures: {' '.join(hfcheck.moe_architectures())}")
    experts = hfcheck.TINY["num_experts"]
    if experts % args.ranks:
        raise UsageError(f"--ranks {args.ranks} must divide the tiny models' {experts} experts")
    gpn = args.gpus_per_node or min(2, args.ranks)
    if args.ranks % gpn:
        raise UsageError(f"--gpus-per-node {gpn} must divide --ranks {args.ranks}")
    if args.markdown and args.json and Path(args.markdown).resolve() == Path(args.json).resolve():
        raise UsageError(f"--markdown and --json name the same file {args.markdown}")
    md_out = check_output(args.markdown, "--markdown") if args.markdown else None
    json_out = check_output(args.json, "--json") if args.json else None
    archs = list(dict.fromkeys(args.archs)) or hfcheck.moe_architectures()
    overrides = {"policy": args.policy, "gpus_per_node": gpn}
    try:   # a bad policy fails here, before any process starts
        FEPLBConfig(hidden=8, ffn=8, num_experts=args.ranks, top_k=1, router="external", **overrides)
    except (TypeError, ValueError) as err:
        raise UsageError(f"--policy {args.policy}: {err}") from err
    print(f"feplb hf-check: {len(archs)} architecture(s) of transformers {transformers.__version__} on "
          f"{args.ranks} gloo process(es), {gpn} per node, policy {args.policy}", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        got = run_dist(hfcheck._worker, args.ranks, archs, overrides,
                       timeout_s=args.timeout or 120 + 20 * len(archs), collective_timeout_s=120)
    except DistError as err:   # a rank crashed or the run timed out: nothing was written
        lines = str(err).splitlines()
        raise UsageError(f"the check's processes failed, nothing written: {lines[1] if len(lines) > 1 else err}") \
            from err
    wall = time.perf_counter() - t0
    outcomes = [hfcheck.Outcome(**d) for d in got[0]]
    meta = {"transformers": transformers.__version__, "torch": torch.__version__,
            "python": platform.python_version(), "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores",
            "ranks": args.ranks, "gpus_per_node": gpn, "policy": args.policy, "tolerance": hfcheck.TOL,
            "command": "feplb " + shlex.join(args.argv), "wall_s": round(wall, 1),
            "date": time.strftime("%Y-%m-%d", time.gmtime())}
    print(hfcheck.table(outcomes))
    print(hfcheck.summary(outcomes) + f" ({wall:.0f} s)")
    from feplb.sched.plan import parse_policy

    base, place, _ = parse_policy(args.policy)
    if base == "none" and not place:
        print(f"note: --policy {args.policy} balances nothing: 'exact' checks plain expert parallelism only",
              file=sys.stderr)
    writers = []
    if md_out:
        writers.append((md_out, lambda tmp: Path(tmp).write_text(hfcheck.markdown(outcomes, meta))))
    if json_out:
        doc = {"meta": meta, "outcomes": got[0]}
        writers.append((json_out, lambda tmp: Path(tmp).write_text(_json(doc) + "\n")))
    write_outputs(writers)
    for out, _ in writers:
        print(f"wrote {out}")
    return 1 if any(o.defect for o in outcomes) else 0


SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                             Callable[[argparse.Namespace], int], str]] = {
    "simulate": ("simulate balancing policies on routing traces", _add_simulate, _run_simulate, SIMULATE_EPILOG),
    "calibrate": ("measure the expert GEMM time curve for the simulator's cost model", _add_calibrate,
                  _run_calibrate, CALIBRATE_EPILOG),
    "hf-check": ("check which transformers MoE architectures feplb.hf runs exactly", _add_hf_check, _run_hf_check,
                 HF_CHECK_EPILOG),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="feplb", description="FEPLB: MoE load balancing tools")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_, add, run, epilog) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add(p)
        p.set_defaults(_run=run)
    return parser


class _Terminated(BaseException):
    """SIGTERM (a job scheduler's time limit, ``kill``) raised as an exception, as Ctrl-C raises KeyboardInterrupt:
    the outputs' cleanup runs, so no temporary file is left beside them."""


@contextlib.contextmanager
def _terminate_as_exception() -> Iterator[None]:
    """SIGTERM raises :class:`_Terminated` inside (the main thread only: signal handlers live there); the previous
    handler comes back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum, frame):
        raise _Terminated

    old = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``feplb`` console script."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        with _terminate_as_exception():
            return args._run(args)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"feplb {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # (outputs are written whole or not at all: nothing half-written is left)
        print(f"feplb {args.command}: interrupted; nothing written", file=sys.stderr)
        return 130
    except _Terminated:
        print(f"feplb {args.command}: terminated; nothing written", file=sys.stderr)
        return 128 + signal.SIGTERM
    except BrokenPipeError:     # the reader of the output went away (| head): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
