"""examples/train_moe.py: the demo trains, balances, reports and resumes; bad input stops it with a clear message.

The end-to-end tests launch the script as a user would (torchrun, 4 gloo ranks modelled as 2 nodes x 2 GPUs) with a
small model; the others load its functions in-process. Shape legend: B sequences, S sequence length, W ranks.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_moe.py"
REPORT_FILES = ("report.json", "report.md", "loss.png", "straggler.png", "loads.png")
# A model small enough that a 4-rank run is mostly start-up time on two cores, big enough to learn bytes.
SMALL = ["--layers", "2", "--hidden", "64", "--heads", "2", "--ffn", "64", "--experts", "8", "--batch", "4",
         "--seq-len", "64", "--text-bytes", "262144", "--warmup", "5", "--log-every", "5"]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is being built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train_moe():
    return _load("train_moe")


@pytest.fixture(scope="module")
def report():
    return _load("report")


def _env(**extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    env.pop("RANK", None)
    return env


def _torchrun(nproc: int, *args: str, timeout: int = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env or _env(), capture_output=True, text=True, timeout=timeout)


def _rank_exit_codes(proc: subprocess.CompletedProcess) -> list[int]:
    """Every failed rank's exit status from torchrun's failure summary (negative: killed by that signal)."""
    return sorted(int(c) for c in re.findall(r"^\s+exitcode\s+:\s+(-?\d+)", proc.stderr, flags=re.M))


def _plain(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """One process, no torchrun: the script forms a group of one."""
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> None:
    tail = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, f"exit {proc.returncode}\n{tail}"


def _steps(out: Path) -> list[dict]:
    return json.loads((out / "report.json").read_text())["steps"]


# ----------------------------------------------------------------------------------------------------------------
# End to end


@pytest.mark.dist
@pytest.mark.slow
def test_demo_trains_balances_reports_and_resumes(tmp_path):
    out = tmp_path / "run"
    steps = 30
    proc = _torchrun(4, "--gpus-per-node", "2", "--out", str(out), "--steps", str(steps), *SMALL, "--ckpt-every", "7")
    _ok(proc)
    assert f"report: {out / 'report.md'}" in proc.stdout

    for name in REPORT_FILES:
        assert (out / name).stat().st_size > 0, name
    for png in ("loss.png", "straggler.png", "loads.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    hidden = [p for p in out.rglob("*") if p.name.startswith(".")]
    assert not hidden, f"temporary files left behind (also inside the checkpoint's step folders): {hidden}"
    assert (out / "checkpoint" / f"step_{steps:07d}").is_dir(), "the temp-file check must see the step folders"
    doc = json.loads((out / "report.json").read_text())
    steps_ = doc["steps"]
    assert [s["step"] for s in steps_] == list(range(1, steps + 1))
    md = (out / "report.md").read_text()
    assert all(f"({name})" in md for name in ("loss.png", "straggler.png", "loads.png"))

    losses = [s["loss"] for s in steps_]
    assert all(math.isfinite(v) for v in losses)
    assert abs(losses[0] - math.log(256)) < 0.3, "an untrained byte model starts near ln 256"
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, losses

    rows_per_layer = 4 * 4 * 64 * 2  # W ranks x B x S x top-k
    for s in steps_:
        assert s["wall_s"] > 0
        assert s["rows_moved"] == sum(s["layer_rows_moved"]) and len(s["layer_rows_moved"]) == 2
        for moved, before_W, after_W in zip(s["layer_rows_moved"], s["loads_before_LW"], s["loads_after_LW"],
                                            strict=True):
            # Every row a GPU's load lost was moved (moves may also go both ways inside a node, so more may move).
            lost = sum(max(0, b - a) for b, a in zip(before_W, after_W, strict=True))
            assert lost <= moved <= rows_per_layer, (s["step"], moved, lost)
            if before_W != after_W:
                assert moved > 0, s["step"]
        for before_W, after_W in zip(s["loads_before_LW"], s["loads_after_LW"], strict=True):
            assert len(before_W) == len(after_W) == 4
            assert sum(before_W) == sum(after_W) == rows_per_layer, "every row is computed exactly once"
            # Balancing moves rows only inside a node (ranks 0-1, 2-3): each node's total is unchanged.
            assert before_W[0] + before_W[1] == after_W[0] + after_W[1]
        recomputed = np.mean([max(w) - np.mean(w) for w in s["loads_before_LW"]])
        assert s["token_straggler_before"] == pytest.approx(recomputed)
        assert s["token_straggler_after"] <= s["token_straggler_before"] + 1e-9, "balancing made a step worse"
    before = np.mean([s["token_straggler_before"] for s in steps_])
    after = np.mean([s["token_straggler_after"] for s in steps_])
    assert after < 0.8 * before, (before, after)
    assert sum(s["rows_moved"] > 0 for s in steps_) >= steps // 2, "skewed routing with balancing on moves rows"
    assert doc["summary"]["reduction"] == pytest.approx(1 - after / before)

    # A checkpoint from a different configuration is refused, and the run's files stay as they were.
    pointer = (out / "checkpoint" / "latest.json").read_bytes()
    report_json = (out / "report.json").read_bytes()
    proc = _plain("--out", str(out), *SMALL, "--hidden", "32", "--resume", "--steps", str(steps + 5))
    assert proc.returncode == 2, proc.stderr
    assert "different configuration" in proc.stderr and "hidden: checkpoint 64, now 32" in proc.stderr, proc.stderr
    assert (out / "checkpoint" / "latest.json").read_bytes() == pointer
    assert (out / "report.json").read_bytes() == report_json
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == ["latest.json", f"step_{steps:07d}"]
    # So is a resume of a run already at --steps, and an --overwrite whose options are refused leaves the previous
    # run (checkpoint, report, timeline) as it was
    proc = _torchrun(4, "--gpus-per-node", "2", "--out", str(out), "--steps", str(steps), "--resume", *SMALL)
    assert proc.returncode != 0 and f"already at step {steps}; pass --steps above {steps}" in proc.stderr, proc.stderr
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert out / "timeline.png" in files and out / "report.md" in files
    proc = _plain("--out", str(out), *SMALL, "--overwrite", "--dyn", "99")
    assert proc.returncode == 2 and "--dyn 99" in proc.stderr, proc.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files

    # Interrupted at step n and resumed to 2n: the same trajectory, step for step, as the run above.
    n, part = 8, tmp_path / "part"
    _ok(_torchrun(4, "--gpus-per-node", "2", "--out", str(part), "--steps", str(n), *SMALL))
    proc = _torchrun(4, "--gpus-per-node", "2", "--out", str(part), "--steps", str(2 * n), "--resume", *SMALL)
    _ok(proc)
    assert f"resuming from step {n}" in proc.stdout
    resumed = _steps(part)
    assert [s["step"] for s in resumed] == list(range(1, 2 * n + 1))
    assert any(s["rows_moved"] for s in resumed[n:]), "the continuation should exercise balancing"
    for key in ("loss", "grad_norm", "loads_before_LW", "loads_after_LW", "rows_moved"):
        assert [s[key] for s in resumed] == [s[key] for s in steps_[:2 * n]], key


@pytest.mark.dist
@pytest.mark.slow
def test_world_size_the_config_does_not_divide_fails_on_every_rank(tmp_path):
    out = tmp_path / "run"
    proc = _torchrun(2, "--gpus-per-node", "2", "--out", str(out), "--steps", "2", *SMALL, "--experts", "3",
                     timeout=120)
    assert proc.returncode != 0
    assert "--experts 3 is not divisible by the world size 2" in proc.stderr, proc.stderr
    assert _rank_exit_codes(proc) == [2, 2], proc.stderr
    assert not out.exists(), "a refused configuration leaves no empty --out behind"


# Makes rank 1 slow to shut down, as a loaded machine does: torchrun then stops it (SIGTERM) once rank 0 has exited.
SLOW_SHUTDOWN = """
import os
if os.environ.get("RANK") == "1":
    import time
    import torch.distributed as dist
    _destroy = dist.destroy_process_group
    def _slow_destroy(*args, **kwargs):
        time.sleep(5)
        return _destroy(*args, **kwargs)
    dist.destroy_process_group = _slow_destroy
"""


@pytest.mark.dist
@pytest.mark.slow
def test_an_error_after_the_group_started_stops_every_rank_cleanly(train_moe, tmp_path):
    """A --resume refused after the model (and its layers' threads and copy path) exists: every rank exits with
    status 2 and the message is printed once, also when a rank is slow to shut down; never a rank killed by a
    signal or aborted ("terminate called without an active exception")."""
    out = tmp_path / "run"
    (out / "checkpoint").mkdir(parents=True)
    other = train_moe.TrainConfig(**{**_BASE, "hidden": 48})
    (out / "checkpoint" / "latest.json").write_text(json.dumps(
        {"step": 3, "dir": "step_0000003", "config_hash": other.digest(), "config": dataclasses.asdict(other)}))
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_SHUTDOWN)
    tiny = ["--layers", "1", "--hidden", "16", "--heads", "2", "--ffn", "16", "--experts", "4", "--batch", "2",
            "--seq-len", "16", "--text-bytes", "4096"]
    for env in (_env(PYTHONPATH=str(hook)), _env()):
        proc = _torchrun(2, "--gpus-per-node", "2", "--out", str(out), "--steps", "5", "--resume", *tiny,
                         timeout=120, env=env)
        assert proc.stderr.count("train_moe.py: error: --resume: the checkpoint in") == 1, proc.stderr
        assert "different configuration (" in proc.stderr, proc.stderr
        assert "hidden: checkpoint 48, now 16" in proc.stderr, proc.stderr
        assert _rank_exit_codes(proc) == [2, 2], proc.stderr
        assert "terminate called" not in proc.stderr and "Signal" not in proc.stderr, proc.stderr
    assert sorted(p.name for p in out.rglob("*")) == ["checkpoint", "latest.json"], "nothing else written"


@pytest.mark.slow
def test_missing_text_exits_with_a_message(tmp_path):
    proc = _plain("--out", str(tmp_path / "a"), "--text", str(tmp_path / "missing.txt"), *SMALL, "--steps", "2")
    assert proc.returncode == 2, proc.stderr
    assert f"train_moe.py: error: --text {tmp_path / 'missing.txt'}: no such file or directory" in proc.stderr
    assert not (tmp_path / "a").exists(), "a refused run leaves no empty --out behind"


@pytest.mark.slow
@pytest.mark.parametrize("option, value", [("--hidden", "64000000000"), ("--ffn", "1000000000000")])
def test_a_model_too_large_for_the_memory_is_refused_before_it_is_built(option, value, tmp_path):
    """A slip in --hidden or --ffn is refused with the memory it needs and the limit (exit 2, one line, no --out
    left behind), not found by an allocation failing (or the OOM killer) while the model is built."""
    out = tmp_path / "run"
    proc = _plain("--out", str(out), *SMALL, option, value, "--steps", "2")
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("train_moe.py: error: --hidden ") and len(err.splitlines()) == 1, err
    assert f"{option} {value}" in err and "GiB (fp32, with their gradients" in err, err
    assert re.search(r"more than the limit of [\d.]+ GiB per rank \([\d.]+ GiB of memory on this machine, 1 rank on "
                     r"it\); lower --hidden or --ffn", err), err
    assert "Traceback" not in proc.stderr and not out.exists()


# ----------------------------------------------------------------------------------------------------------------
# Pieces, in-process


def test_corpus_is_deterministic_and_respects_the_budget(train_moe):
    a, label = train_moe.read_corpus(None, 50_000)
    b, _ = train_moe.read_corpus(None, 50_000)
    assert a == b and len(a) == 50_000 and "standard-library" in label
    assert a.startswith(train_moe.read_corpus(None, 1_000)[0])


def test_corpus_from_a_directory_reads_sorted_files(train_moe, tmp_path):
    (tmp_path / "b.txt").write_bytes(b"BBBB")
    (tmp_path / "a.txt").write_bytes(b"AA")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_bytes(b"CCC")
    data, _ = train_moe.read_corpus(tmp_path, 1 << 20)
    assert data == b"AABBBBCCC"
    assert train_moe.read_corpus(tmp_path, 4)[0] == b"AABB"


def test_byte_streams_give_each_rank_its_own_next_byte_pairs(train_moe):
    rng = np.random.default_rng(0)
    corpus = rng.integers(0, 256, size=40_000, dtype=np.uint8).tobytes()
    world, B, S = 4, 3, 16
    seen = []
    for rank in range(world):
        data = train_moe.ByteStreams(corpus, rank=rank, world=world, batch=B, seq_len=S, device=torch.device("cpu"))
        x_BS, y_BS = data.batch(7)
        again_BS, _ = data.batch(7)
        assert x_BS.shape == y_BS.shape == (B, S) and x_BS.dtype == torch.int64
        assert torch.equal(x_BS, again_BS)
        per_rank = len(corpus) // world
        for row_S, target_S in zip(x_BS, y_BS, strict=True):
            text = bytes(row_S.tolist())
            pos = corpus.find(text, rank * per_rank)
            assert rank * per_rank <= pos < (rank + 1) * per_rank, "a rank read outside its slice"
            assert bytes(target_S.tolist()) == corpus[pos + 1:pos + 1 + S]
        seen.append(x_BS)
    assert all(not torch.equal(seen[0], other) for other in seen[1:])


_BASE = dict(layers=2, hidden=32, heads=4, ffn=32, experts=16, top_k=2, router="sigmoid", bias_rate=1e-3,
             router_lr_scale=0.1, dyn=2, policy="feplb", gpus_per_node=2, world_size=4, batch=2, seq_len=8, lr=1e-3,
             warmup=0, weight_decay=0.0, clip=1.0, seed=0, device="cpu", text="t", text_bytes=100, corpus_sha256="x")


@pytest.mark.parametrize(("change", "message"), [
    ({"world_size": 4, "experts": 6}, "--experts 6 is not divisible by the world size 4"),
    ({"world_size": 6, "gpus_per_node": 4, "experts": 12}, "--gpus-per-node 4 does not divide the world size 6"),
    ({"dyn": 9}, "--dyn 9: expected 0..4"),
    ({"hidden": 30}, "--hidden 30 is not divisible by --heads 4"),
    ({"top_k": 17}, "--top-k 17 exceeds --experts 16"),
    ({"lr": float("nan")}, "--lr"),
    ({"weight_decay": float("nan")}, "--weight-decay: expected a finite number >= 0, got nan"),
    ({"clip": float("nan")}, "--clip: expected a finite number >= 0, got nan"),
    ({"clip": float("inf")}, "--clip: expected a finite number >= 0, got inf"),
    ({"warmup": -1}, "--warmup: expected an integer >= 0, got -1"),
    ({"seed": 2**63}, "--seed: expected an integer in"),
], ids=["experts-vs-world", "node-vs-world", "dyn-too-large", "heads", "top-k", "lr-nan", "weight-decay-nan",
        "clip-nan", "clip-inf", "warmup", "seed"])
def test_config_rejects_what_it_cannot_run(train_moe, change, message):
    base = _BASE
    train_moe.TrainConfig(**base)
    moved = train_moe.TrainConfig(**{**base, "text": "the same bytes at another path"})
    assert moved.digest() == train_moe.TrainConfig(**base).digest()
    with pytest.raises(train_moe.UsageError, match=message.replace("(", r"\(").replace(".", r"\.")):
        train_moe.TrainConfig(**{**base, **change})
    assert train_moe.TrainConfig(**base).digest() != train_moe.TrainConfig(**{**base, "seed": 1}).digest()


def test_expert_weights_are_drawn_from_any_seed(train_moe):
    """Every seed the config takes draws the experts' weights (a --seed of 2e7 or more overflowed torch's seed in the
    per-expert product); a small one draws what it always drew."""
    import types

    for seed in (-(2**63), -1, 0, 5, 10**12, 2**63 - 1):
        cfg = train_moe.TrainConfig(**{**_BASE, "seed": seed})
        e = cfg.experts // cfg.world_size
        moe = types.SimpleNamespace(w1=torch.zeros(e, 4, 6), w2=torch.zeros(e, 3, 4))
        train_moe.init_expert_weights(types.SimpleNamespace(moe_layers=lambda m=moe: [m]), cfg, 1)
        assert all(bool(w[j].abs().sum() > 0) for w in (moe.w1, moe.w2) for j in range(e)), seed
        if seed == 5:
            g = torch.Generator().manual_seed((5 * 1_000_003 + 0) * 1_000_003 + 1 * e + 2)
            assert torch.equal(moe.w1[2], torch.randn(4, 6, generator=g) / 2.0)


def _built_model_sizes(rank: int, world: int, change: dict) -> tuple[int, int, int]:
    """(parameters this rank's model holds, bytes of its parameters, gradients and AdamW states after one step,
    bytes of the distinct storages the forward saved for the backward)."""
    train_moe = _load("train_moe")
    cfg = train_moe.TrainConfig(**{**_BASE, "world_size": world, **change})
    torch.manual_seed(cfg.seed)
    model = train_moe.MoETransformer(cfg, train_moe.make_moe_config(cfg, "torch", None), None)
    optimizer = train_moe.make_optimizer(model, cfg)
    ids_BS = torch.randint(0, train_moe.VOCAB, (cfg.batch, cfg.seq_len))
    saved: dict[tuple, int] = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            s = t.untyped_storage()
            saved[(s.data_ptr(), s.nbytes())] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids_BS).square().mean()
    loss.backward()
    optimizer.step()
    held = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    held += [t for st in optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
    for moe in model.moe_layers():
        moe.close()
    return (sum(p.numel() for p in model.parameters()), sum(t.numel() * t.element_size() for t in held),
            sum(saved.values()))


@pytest.mark.dist
def test_the_memory_check_counts_what_a_rank_holds(train_moe):
    """The check's parameter count is the built model's on each rank, and its bytes (a lower bound of training's)
    what parameters, gradients and AdamW's states hold after a step; its activation bytes are at most what a
    forward saves for the backward; it refuses only above the limit, naming --batch when activations pass it."""
    from feplb.testing import run_dist

    rng = np.random.default_rng()
    change = {"hidden": 4 * int(rng.integers(4, 12)), "ffn": int(rng.integers(8, 40)),
              "layers": int(rng.integers(1, 3)), "seq_len": int(rng.integers(4, 12)), "batch": int(rng.integers(1, 4))}
    world = 2
    cfg = train_moe.TrainConfig(**{**_BASE, "world_size": world, **change})
    got = run_dist(_built_model_sizes, world, change)
    n = train_moe.params_per_rank(cfg)
    assert [g[0] for g in got] == [n] * world, (got, n)
    assert [g[1] for g in got] == [16 * n] * world, (got, n)
    act = train_moe.activation_bytes_per_rank(cfg)
    assert all(g[2] >= act for g in got), (got, act)
    limit, _ = train_moe.memory_for_ranks("cpu", 0)
    assert limit > 16 * n
    train_moe.check_memory(cfg, 0)
    big = dataclasses.replace(cfg, ffn=limit // (cfg.layers * cfg.experts // world * 3 * cfg.hidden * 16) + 1)
    with pytest.raises(train_moe.UsageError, match=rf"--ffn {big.ffn} .* more than the limit of"):
        train_moe.check_memory(big, 0)
    tokens = (limit - 16 * n) // (4 * (cfg.layers * cfg.hidden + train_moe.VOCAB)) + 1
    fits = dataclasses.replace(cfg, batch=(tokens - 1) // cfg.seq_len)
    train_moe.check_memory(fits, 0)
    many = dataclasses.replace(cfg, batch=-(-tokens // cfg.seq_len))
    with pytest.raises(train_moe.UsageError, match=rf"--batch {many.batch} x --seq-len {cfg.seq_len} tokens per "
                                                   r"rank .* more than the limit of .*; lower --batch or --seq-len"):
        train_moe.check_memory(many, 0)


@pytest.mark.parametrize("script", ["train_moe", "hf_moe", "hf_trainer"])
def test_a_bad_option_is_reported_by_rank_zero_alone(script, monkeypatch, capsys):
    """Under torchrun every rank parses the same command line and fails alike, before any process group exists:
    rank 0 prints the usage and the one error line, the other ranks nothing; all exit with status 2."""
    if script != "train_moe":
        pytest.importorskip("transformers")
    parser = _load(script).build_parser()
    for rank, lines in (("0", 1), ("3", 0)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as stop:
            parser.parse_args(["--out", "x", "--no-such-option"])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert err.count(": error: ") == lines, (rank, err)
        assert err.count("usage: ") == lines, (rank, err)
    monkeypatch.delenv("RANK")   # plain python, no torchrun: the one process reports it
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", "x", "--no-such-option"])
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def _fake_steps(rng: np.random.Generator, n: int, layers: int = 2, world: int = 4) -> list[dict]:
    steps = []
    for i in range(n):
        before = rng.integers(0, 100, size=(layers, world)).tolist()
        after = [sorted(w) for w in before]  # a stand-in plan: same rows, any placement
        sb = [max(w) - sum(w) / world for w in before]
        sa = [max(w) - sum(w) / world for w in after]
        steps.append({"step": i + 1, "loss": 5.0 - 0.1 * i, "grad_norm": 1.0, "wall_s": 0.5, "tokens_per_s": 100.0,
                      "token_straggler_before": float(np.mean(sb)), "token_straggler_after": float(np.mean(sa)) / 2,
                      "rows_moved": int(rng.integers(0, 50)), "fell_back": 0, "layer_straggler_before": sb,
                      "layer_straggler_after": [v / 2 for v in sa], "loads_before_LW": before,
                      "loads_after_LW": after})
    return steps


def test_report_writes_every_file_and_its_numbers_match_the_steps(report, tmp_path):
    steps = _fake_steps(np.random.default_rng(1), 30)
    meta = {"command": "train_moe.py", "world_size": 4, "config": {
        "gpus_per_node": 2, "layers": 2, "experts": 8, "top_k": 2, "hidden": 64, "ffn": 64, "dyn": 2,
        "policy": "feplb", "text": "t", "text_bytes": 1, "batch": 1, "seq_len": 1},
        "platform": "CPU: test", "torch": torch.__version__, "transport": "torch", "resumed_from": 0}
    summary = report.write_report(tmp_path, meta, steps)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(REPORT_FILES), "exactly the report, no temp files"
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["steps"] == steps and doc["load_bars_step"] == 30
    before = np.mean([s["token_straggler_before"] for s in steps])
    after = np.mean([s["token_straggler_after"] for s in steps])
    assert summary["reduction"] == pytest.approx(1 - after / before)
    assert summary["loss_first"] == pytest.approx(np.mean([s["loss"] for s in steps[:3]]))
    assert summary["loss_last"] == pytest.approx(np.mean([s["loss"] for s in steps[-3:]]))
    md = (tmp_path / "report.md").read_text()
    assert f"{100 * summary['reduction']:.1f}% lower" in md
    with pytest.raises(ValueError, match="steps"):
        report.write_report(tmp_path / "none", meta, [])


def test_smoothing_is_a_trailing_mean(report):
    values = list(np.random.default_rng(2).normal(size=25))
    got = report.smooth(values, 4)
    want = [np.mean(values[max(0, i - 3):i + 1]) for i in range(25)]
    assert got == pytest.approx(want)


def test_atomic_save_leaves_the_old_file_when_writing_fails(train_moe, tmp_path):
    target = tmp_path / "ckpt.pt"
    train_moe.atomic_torch_save({"step": 1}, target)
    # saved files take the mode open() would give them under the umask, as latest.json does (were 0600)
    old = os.umask(0o027)
    try:
        train_moe.atomic_torch_save({"step": 1}, target)
        train_moe.atomic_write_bytes(tmp_path / "latest.json", b"{}")
    finally:
        os.umask(old)
    assert (target.stat().st_mode & 0o777, (tmp_path / "latest.json").stat().st_mode & 0o777) == (0o640, 0o640)
    (tmp_path / "latest.json").unlink()

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError):
        train_moe.atomic_torch_save({"step": 2, "bad": Unpicklable()}, target)
    assert torch.load(target, weights_only=False) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_out_dir_checks(train_moe, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(train_moe.UsageError, match="--out .*: cannot write there"):
        train_moe.check_out_dir(blocker / "run", resume=False)
    with pytest.raises(train_moe.UsageError, match="--out .*: cannot write there .*is not a directory"):
        train_moe.check_out_dir(blocker / "deeper" / "run", resume=False)
    # a folder that cannot be written: the message names it, and not the write test's random file (each rank's
    # own: the ranks' messages differed, so the error was printed with a rank's prefix)
    ro = tmp_path / "ro"
    ro.mkdir()
    def denied(*args, dir=None, **kwargs):  # noqa: A002 (NamedTemporaryFile's own keyword)
        raise PermissionError(13, "Permission denied", str(Path(dir) / ".write-test-x7q2"))

    with monkeypatch.context() as m:
        m.setattr(train_moe.tempfile, "NamedTemporaryFile", denied)
        with pytest.raises(train_moe.UsageError) as err:
            train_moe.check_out_dir(ro / "run", resume=False)
    assert str(err.value) == f"--out {ro / 'run'}: cannot write there (PermissionError: Permission denied in {ro})"
    ro.rmdir()
    run = tmp_path / "new" / "run"
    train_moe.check_out_dir(run, resume=False)
    assert sorted(tmp_path.iterdir()) == [blocker], "checking creates nothing, and the write test leaves nothing"
    assert train_moe.make_out_dir(run, creator=False) == [] and not run.exists()
    assert train_moe.make_out_dir(run, creator=True) == [tmp_path / "new", run] and run.is_dir()
    train_moe.remove_if_empty([tmp_path / "new", run])
    assert sorted(tmp_path.iterdir()) == [blocker], "the folders a failed run created are gone again"
    train_moe.make_out_dir(run, creator=True)
    (run / "kept.txt").write_text("written by the run")
    train_moe.remove_if_empty([tmp_path / "new", run])
    assert (run / "kept.txt").exists(), "a folder with content stays"
    (run / "kept.txt").unlink()
    (run / "checkpoint").mkdir()
    (run / "checkpoint" / "latest.json").write_text(json.dumps({"step": 7, "dir": "step_0000007"}))
    with pytest.raises(train_moe.UsageError, match="already holds a run \\(checkpoint at step 7\\); pass --resume"):
        train_moe.check_out_dir(run, resume=False)
    train_moe.check_out_dir(run, resume=True)
    with pytest.raises(train_moe.UsageError, match="--resume and --overwrite exclude each other"):
        train_moe.check_out_dir(run, resume=True, overwrite=True)
    (run / "report.md").write_text("old report")
    (run / "notes.txt").write_text("a file of the user's")
    (run / "timeline.png").write_text("old timeline")
    (run / "checkpoint" / "step_0000007").mkdir()
    (run / "checkpoint" / "step_0000007" / "rank0.pt").write_text("old shard")
    train_moe.check_out_dir(run, resume=False, overwrite=True)
    assert (run / "report.md").exists(), "checking removes nothing: a run refused later keeps the previous one"
    train_moe.clear_previous_run(run)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"], "the old run is gone, the user's file stays"
    # a file of the user's in checkpoint/ stays too, with the folder; the run's own files there go
    (run / "checkpoint" / "step_0000003").mkdir(parents=True)
    (run / "checkpoint" / "latest.json").write_text(json.dumps({"step": 3}))
    (run / "checkpoint" / "model_v3.pt").write_text("the user's")
    train_moe.clear_previous_run(run)
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["model_v3.pt"]
    (run / "checkpoint" / "model_v3.pt").unlink()
    (run / "checkpoint").rmdir()
    train_moe.check_out_dir(run, resume=False)


def test_resume_refuses_a_missing_or_foreign_checkpoint(train_moe, tmp_path):
    cfg = train_moe.TrainConfig(**_BASE)
    with pytest.raises(train_moe.UsageError, match="holds no checkpoint"):
        train_moe.load_checkpoint(tmp_path, cfg, rank=0)
    other = train_moe.TrainConfig(**{**_BASE, "experts": 8, "seed": 3})
    (tmp_path / "checkpoint").mkdir()
    pointer = {"step": 5, "dir": "step_0000005", "config_hash": other.digest(), "config": dataclasses.asdict(other)}
    (tmp_path / "checkpoint" / "latest.json").write_text(json.dumps(pointer))
    with pytest.raises(train_moe.UsageError, match="different configuration .*experts: checkpoint 8, now 16.*seed"):
        train_moe.load_checkpoint(tmp_path, cfg, rank=0)
    pointer.update(config_hash=cfg.digest(), config=dataclasses.asdict(cfg))
    (tmp_path / "checkpoint" / "latest.json").write_text(json.dumps(pointer))
    with pytest.raises(train_moe.UsageError, match="cannot load"):
        train_moe.load_checkpoint(tmp_path, cfg, rank=0)


def test_text_too_small_for_the_batch_is_refused(train_moe):
    with pytest.raises(train_moe.UsageError, match="79 bytes of text, .* needs at least 80;"):
        train_moe.ByteStreams(b"x" * 79, rank=0, world=4, batch=2, seq_len=8, device=torch.device("cpu"))


def _one_step(rank: int, world: int, ids_NS: torch.Tensor, targets_NS: torch.Tensor, clip: float) -> dict:
    """One training step of the example's model on ``world`` ranks (rank r takes its share of the N sequences)."""
    tm = _load("train_moe")
    N, S = ids_NS.shape
    cfg = tm.TrainConfig(**{**_BASE, "layers": 2, "hidden": 32, "heads": 2, "ffn": 32, "experts": 4, "dyn": 2,
                            "policy": "feplb-split", "gpus_per_node": world, "world_size": world,
                            "batch": N // world, "seq_len": S, "clip": clip, "bias_rate": 1e-3})
    # planning asked for explicitly: these few rows are below the layer's default worth-it gate
    model = tm.MoETransformer(cfg, tm.make_moe_config(cfg, "torch", 1000.0, min_straggler_rows=0), None)
    tm.init_expert_weights(model, cfg, rank)
    replicated, experts = tm.split_parameters(model)
    expert_ids = {id(p) for p in experts}
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the same replicated weights whatever the world size
        for _, p in model.named_parameters():
            if id(p) not in expert_ids:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
        for moe in model.moe_layers():  # every token picks expert 0 (home: rank 0), so balancing has work to do
            moe.router_bias[0] = 1.0
    for moe in model.moe_layers():
        moe.refresh_replicas()
    B = N // world
    mine = slice(rank * B, (rank + 1) * B)
    logits_BSV = model(ids_NS[mine])
    loss = torch.nn.functional.cross_entropy(logits_BSV.reshape(-1, 256), targets_NS[mine].reshape(-1))
    loss.backward()
    for moe in model.moe_layers():
        moe.reduce_replica_grads()
    mean_loss, norm = tm.reduce_gradients(replicated, experts, loss, world, clip)
    return {"loss": mean_loss, "norm": norm, "rows_moved": sum(moe.last_stats.rows_moved for moe in model.moe_layers()),
            "replicated": {n: p.grad.clone() for n, p in model.named_parameters() if id(p) not in expert_ids},
            "experts": [(moe.w1.grad.clone(), moe.w2.grad.clone()) for moe in model.moe_layers()]}


@pytest.mark.dist
@pytest.mark.slow
def test_expert_parallel_step_equals_one_process_on_all_the_data():
    """The explicit all-reduce and the expert-gradient scaling make W ranks compute the gradient of the global
    mean loss: the same gradients as one process with every expert and every rank's tokens, with balancing moving
    rows between the two ranks meanwhile."""
    from feplb.testing import run_dist

    gen = torch.Generator().manual_seed(0)
    ids_NS = torch.randint(0, 256, (4, 16), generator=gen)
    targets_NS = torch.randint(0, 256, (4, 16), generator=gen)
    (ref,) = run_dist(_one_step, 1, ids_NS, targets_NS, 0.0)
    clip = 1e-3 * ref["norm"]  # far below the norm: clipping must scale by the true global norm
    ranks = run_dist(_one_step, 2, ids_NS, targets_NS, clip)
    scale = clip / (ref["norm"] + 1e-6)
    assert all(r["rows_moved"] > 0 for r in ranks), "balancing should move rows here, or the test shows less"
    for out in ranks:
        assert out["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert out["norm"] == pytest.approx(ref["norm"], rel=1e-5)
        for name, g in ref["replicated"].items():
            torch.testing.assert_close(out["replicated"][name], g * scale, rtol=1e-4, atol=1e-9, msg=name)
    for layer, (g1, g2) in enumerate(ref["experts"]):
        torch.testing.assert_close(torch.cat([r["experts"][layer][0] for r in ranks]), g1 * scale, rtol=1e-4,
                                   atol=1e-9)
        torch.testing.assert_close(torch.cat([r["experts"][layer][1] for r in ranks]), g2 * scale, rtol=1e-4,
                                   atol=1e-9)


def test_step_stats_take_each_node_from_its_own_ranks(train_moe):
    # Layer 0 of a 2 x 2 run, each rank reporting its own node: node 0 balanced (rows 30 of GPU 0 moved to GPU 1);
    # node 1 fell back, and only its ranks know it.
    from feplb import LayerStats

    before = [100, 40, 90, 50]

    def stats(after, planned, moved, fell_back):
        return LayerStats(loads_before_W=before, loads_after_W=after, token_straggler_before=0.0,
                          token_straggler_after=0.0, rows_moved=moved, copy_bytes=0, weight_copies=0, plan_us=0.0,
                          balanced=not fell_back, fell_back=fell_back, planned_ranks=planned)

    node0 = [stats([70, 70, 90, 50], [0, 1], 30, False)]
    node1 = [stats([100, 40, 90, 50], [2, 3], 0, True)]
    views = [node0, node0, node1, node1]
    got = train_moe.layer_stats(views)
    assert got["loads_before_LW"] == [before]
    assert got["loads_after_LW"] == [[70, 70, 90, 50]]
    assert got["rows_moved"] == 30 and got["layer_rows_moved"] == [30] and got["fell_back"] == 1
    assert got["token_straggler_before"] == pytest.approx(100 - 70)
    assert got["token_straggler_after"] == pytest.approx(90 - 70)
    assert got["layer_straggler_after"] == [pytest.approx(20.0)]


def test_a_learning_rate_that_blows_up_the_weights_is_one_line(tmp_path):
    """A finite loss can take a step that makes the next forward's router logits infinite: the MoE layer refuses
    them on every rank, and the script says what to do, in one line, with no folder left behind."""
    out = tmp_path / "lr"
    proc = _plain("--out", str(out), *SMALL, "--lr", "1e9", "--warmup", "0", "--steps", "6")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "lower --lr" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()


@pytest.mark.dist
@pytest.mark.slow
def test_ctrl_c_stops_every_rank_with_one_line(tmp_path):
    """Ctrl-C (SIGINT to the whole foreground process group, torchrun and its workers) while training: each rank
    says it was interrupted in one line, without a traceback, and no rank is aborted."""
    import signal
    import time

    out, log = tmp_path / "run", tmp_path / "log.txt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           "--gpus-per-node", "2", "--out", str(out), "--steps", "100000", *SMALL[:-2], "--log-every", "1"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 180
            while "loss" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            assert proc.poll() is None and "loss" in log.read_text(), log.read_text()
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=90)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert proc.returncode != 0, text
    assert sorted(line for line in text.splitlines() if line.startswith("train_moe.py: rank")) == [
        "train_moe.py: rank 0: interrupted", "train_moe.py: rank 1: interrupted"], text
    # (torchrun itself prints its own traceback of the signal; the workers print none)
    assert "KeyboardInterrupt" not in text and f'File "{SCRIPT}"' not in text, text
    assert "terminate called" not in text, text


def _save_failing_on_rank_1(rank: int, world: int, out: str, how: str = "os") -> str | None:
    """save_checkpoint on 2 gloo ranks whose rank 1 cannot write its file (disk full): what each rank raises.
    how: "os", an OSError; "torch", torch.save's own error on a full device (a RuntimeError of its zip writer)."""
    import errno
    import types

    module = _load("train_moe")
    if rank == 1:
        def full(obj, path):
            if how == "torch":
                torch.save(obj, "/dev/full")   # (ENOSPC on every write)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        module.atomic_torch_save = full

    @dataclasses.dataclass
    class Cfg:
        device: str = "cpu"

        def digest(self) -> str:
            return "cfg"

    model = types.SimpleNamespace(state_dict=lambda: {"w": torch.ones(2)}, moe_layers=lambda: [])
    optimizer = types.SimpleNamespace(state_dict=lambda: {})
    try:
        module.save_checkpoint(Path(out), step=3, cfg=Cfg(), model=model, optimizer=optimizer, history=None,
                               rank=rank, local_rank=rank)
    except module.UsageError as exc:
        return str(exc)
    return None


def test_a_checkpoint_one_rank_cannot_write_stops_every_rank(tmp_path):
    """One rank's failed write (disk full) raises on every rank at once, naming it, instead of leaving the others
    in the barrier until the process group's timeout; the pointer is not switched."""
    from feplb.testing import run_dist

    errors = run_dist(_save_failing_on_rank_1, 2, str(tmp_path), timeout_s=120, collective_timeout_s=20)
    for err in errors:
        assert err is not None and "(rank 1) cannot write the checkpoint of step 3 (OSError" in err and \
            "No space left on device" in err, errors
    assert not (tmp_path / "checkpoint" / "latest.json").exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_checkpoint_torch_save_cannot_write_stops_every_rank(tmp_path):
    """A full disk makes torch.save raise a RuntimeError (its zip writer's), not an OSError: it too stops every
    rank at once, naming the rank."""
    from feplb.testing import run_dist

    errors = run_dist(_save_failing_on_rank_1, 2, str(tmp_path), "torch", timeout_s=120, collective_timeout_s=20)
    for err in errors:
        assert err is not None and "(rank 1) cannot write the checkpoint of step 3 (RuntimeError" in err, errors
    assert not (tmp_path / "checkpoint" / "latest.json").exists()


def test_timeline_text_says_what_its_spans_show(report):
    """report.md's sentence on the timeline reads the order off the spans (it said the static GEMM was shorter than
    the planning beside numbers saying the reverse)."""
    from feplb.timeline import Span

    def spans(plan, gemm, copy=None):
        out = [Span(name="plan", lane="planner", start_us=plan[0], end_us=plan[1]),
               Span(name="static_gemm", lane="compute", start_us=gemm[0], end_us=gemm[1])]
        if copy is not None:
            out.append(Span(name="copy_rows", lane="copy", start_us=copy[0], end_us=copy[1]))
        return out

    first = report._timeline_text(spans((3882, 4013), (4055, 4515)))
    assert "static experts' GEMM took 0.46 ms and planning 0.13 ms; nothing ran beside the static GEMM: planning " \
        "ended before the static GEMM began" in first and "shorter" not in first, first
    assert "the static GEMM ended before planning began" in report._timeline_text(spans((500, 600), (100, 200)))
    both = report._timeline_text(spans((100, 300), (200, 400), copy=(250, 260)))
    assert "plan, copy_rows ran beside the static GEMM." in both, both
    gemm_only = [Span(name="static_gemm", lane="compute", start_us=0, end_us=1)]
    assert "made no plan" in report._timeline_text(gemm_only)
    # a plan the forward stopped waiting for (its span among the late ones): not taken for a plan never made
    late = report._timeline_text(gemm_only, [Span(name="plan", lane="planner", start_us=0, end_us=5)])
    assert "plan was not ready in time" in late and "made no plan" not in late, late
    # FasterMoE's and EPLB's path plans on the main thread before phase 1, with no static GEMM
    direct = report._timeline_text([Span(name="plan", lane="compute", start_us=0, end_us=50),
                                    Span(name="phase1", lane="compute", start_us=50, end_us=90)])
    assert "plans on the main thread before phase 1 (0.05 ms)" in direct and "static experts' GEMM took" not in \
        direct, direct


def test_a_pointer_this_script_did_not_write_is_a_usage_error(train_moe, tmp_path):
    """A checkpoint pointer edited by hand (JSON but not an object, no 'dir'): one usage line naming the argument
    that led to it (--resume, or --out when starting a run there), not an AttributeError or KeyError traceback."""
    ckpt = tmp_path / train_moe.CKPT_DIR
    ckpt.mkdir()
    for text in ("[1, 2]", '{"step": 3}', '{"step": "3", "dir": "step_3"}', "{truncated"):
        (ckpt / train_moe.CKPT_POINTER).write_text(text)
        with pytest.raises(train_moe.UsageError, match=r"^--resume: .*latest\.json"):
            train_moe.read_pointer(tmp_path)
        with pytest.raises(train_moe.UsageError, match=r"^--out: .*latest\.json"):
            train_moe.check_out_dir(tmp_path, resume=False)
    (ckpt / train_moe.CKPT_POINTER).write_text('{"step": 3, "dir": "step_3"}')
    assert train_moe.read_pointer(tmp_path) == {"step": 3, "dir": "step_3"}


def test_report_names_the_moe_layers_among_the_models(report):
    assert report._layers_text({"layers": 2}) == "2 transformer layers whose MLPs are FEPLB MoE layers"
    assert report._layers_text({"layers": 2, "moe_layers": 1}).startswith(
        "2 transformer layers, 1 of them with FEPLB MoE layers as MLPs")


def test_hf_examples_without_transformers_say_what_to_install(train_moe, monkeypatch):
    hf_moe = _load("hf_moe")
    import importlib.util as iu

    real = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    hf_moe._needs_transformers(train_moe, "hf_moe.py")     # (hf_moe.py builds no Trainer: accelerate not needed)
    with pytest.raises(train_moe.UsageError, match=r"hf_trainer.py needs accelerate: pip install -e '\.\[hf\]'"):
        hf_moe._needs_transformers(train_moe, "hf_trainer.py", ("transformers", "accelerate"))


def test_hf_trainer_resume_of_another_model_is_named(tmp_path):
    """hf_trainer.py --resume from a checkpoint of another model: the fields that differ, read from its config.json
    (the Trainer's load raised a traceback of 130 lines)."""
    from types import SimpleNamespace

    trainer = _load("hf_trainer")
    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, '
                                        '"vocab_size": 256}')
    now = SimpleNamespace(model_type="qwen3_moe", hidden_size=32, num_hidden_layers=2, vocab_size=256)
    assert trainer.checkpoint_mismatch(folder, now) == "hidden_size: checkpoint 64, now 32"
    assert trainer.checkpoint_mismatch(folder, SimpleNamespace(**{**vars(now), "hidden_size": 64})) is None
    assert trainer.checkpoint_mismatch(tmp_path, now) is None     # (no config.json: the Trainer's load decides)
