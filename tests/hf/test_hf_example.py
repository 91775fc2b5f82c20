"""Smoke test of examples/hf_moe.py: a few steps on 4 gloo ranks as 2 nodes x 2; balancing moves rows and lowers
the straggler, the report is written, and the saved checkpoint loads into plain transformers with the full expert
shapes; its torch.distributed.checkpoint resumes on 2 ranks with the same weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", minversion="5")

from feplb.testing import run_dist  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_moe.py"


def _run_example(rank: int, world: int, argv: list[str]) -> dict:
    spec = importlib.util.spec_from_file_location("_feplb_hf_moe_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.train(mod.build_parser().parse_args(argv))


def test_example_trains_balances_reports_and_saves(tmp_path, capfd):
    out, ckpt, dcp_dir, again = tmp_path / "run", tmp_path / "ckpt", tmp_path / "dcp", tmp_path / "again"
    argv = ["--steps", "3", "--hidden", "32", "--batch", "2", "--seq-len", "32", "--text-bytes", "40000",
            "--gpus-per-node", "2", "--log-every", "1", "--plan-wait-ms", "60000", "--out", str(out),
            "--save", str(ckpt), "--clip", "0.5", "--checkpoint", str(dcp_dir)]
    ranks = run_dist(_run_example, 4, argv, timeout_s=240, collective_timeout_s=120)
    steps = ranks[0]["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)
    assert sum(s["rows_moved"] for s in steps) > 0, "balancing should move rows here"
    for s in steps:
        assert s["token_straggler_after"] <= s["token_straggler_before"], s
        assert [sum(w) for w in s["loads_after_LW"]] == [sum(w) for w in s["loads_before_LW"]], "rows lost"
    assert ranks[0]["summary"]["reduction"] > 0
    assert all(r["summary"] is None for r in ranks[1:])
    assert sorted(p.name for p in out.iterdir()) == sorted(["report.json", "loss.png", "straggler.png", "loads.png",
                                                            "report.md"])
    printed = capfd.readouterr().out
    assert "token straggler, plain EP -> feplb-split:" in printed and "straggler/layer [" in printed, printed

    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert [n for n, _ in model.named_modules() if n.endswith("mlp.experts")] == ranks[0]["names"]
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8

    # the checkpoint is a step folder and the pointer naming it (written after every rank's shards)
    first = sorted(p.name for p in dcp_dir.iterdir())
    assert len(first) == 2 and first[0] == "latest.json" and first[1].startswith("step_0000003-"), first

    # --resume on 2 ranks (EP 2) from the 4 ranks' torch.distributed.checkpoint, nothing left to train: the full
    # weights it gathers are the saving run's, bit for bit; its own checkpoint into the same folder is a new step
    # folder, the pointer moved to it and the old one gone (a save failing part way leaves the old one in charge)
    resume = ["--steps", "3", "--hidden", "32", "--gpus-per-node", "2", "--text-bytes", "40000",
              "--resume", str(dcp_dir), "--save", str(again), "--checkpoint", str(dcp_dir)]
    resumed = run_dist(_run_example, 2, resume, timeout_s=240, collective_timeout_s=120)
    assert resumed[0]["steps"] == [] and resumed[0]["summary"] is None
    assert "resumed at step 3 from" in capfd.readouterr().out
    reloaded = AutoModelForCausalLM.from_pretrained(again)
    want, got = model.state_dict(), reloaded.state_dict()
    assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)
    second = sorted(p.name for p in dcp_dir.iterdir())
    assert len(second) == 2 and second[0] == "latest.json" and second[1].startswith("step_0000003-") and \
        second[1] != first[1], (first, second)
    # a checkpoint of another model: one usage line on every rank, before any training
    other = ["--steps", "4", "--hidden", "16", "--gpus-per-node", "2", "--text-bytes", "40000",
             "--resume", str(dcp_dir)]
    with pytest.raises(Exception, match="another model \\(--hidden: checkpoint 32, now 16\\)"):
        run_dist(_run_example, 2, other, timeout_s=240, collective_timeout_s=120)
    # a pointer naming a folder that is gone (deleted, or the pointer copied alone): one usage line on every rank
    # (torch.distributed.checkpoint's CheckpointException is no Exception: it escaped as a long traceback)
    import json

    pointer = json.loads((dcp_dir / "latest.json").read_text())
    (dcp_dir / "latest.json").write_text(json.dumps({**pointer, "dir": "step_0000003-gone"}))
    with pytest.raises(Exception, match="UsageError: --resume: cannot load the checkpoint in .*step_0000003-gone "
                                        "\\(CheckpointException"):
        run_dist(_run_example, 2, resume[:-2], timeout_s=240, collective_timeout_s=120)


def test_example_with_gradient_checkpointing_has_the_same_losses():
    """--gradient-checkpointing recomputes every decoder layer (the FEPLB layers replay their plans): the same losses
    and balancing, step by step, as the run without it."""
    argv = ["--steps", "3", "--hidden", "32", "--batch", "2", "--seq-len", "32", "--text-bytes", "40000",
            "--gpus-per-node", "2", "--log-every", "1", "--plan-wait-ms", "60000"]
    plain = run_dist(_run_example, 4, argv, timeout_s=240, collective_timeout_s=120)[0]["steps"]
    ckpt = run_dist(_run_example, 4, [*argv, "--gradient-checkpointing"], timeout_s=240,
                    collective_timeout_s=120)[0]["steps"]
    assert [s["loss"] for s in ckpt] == [s["loss"] for s in plain]
    assert [s["rows_moved"] for s in ckpt] == [s["rows_moved"] for s in plain] and sum(s["rows_moved"] for s in plain)


def _refused(rank: int, world: int, argv: list[str]) -> str | None:
    spec = importlib.util.spec_from_file_location("_feplb_hf_moe_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        mod.train(mod.build_parser().parse_args(argv))
    except mod._demo().UsageError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("extra, words", [
    (["--policy", "bogus"], "unknown base policy 'bogus'"),
    (["--steps", "0"], "--steps: expected an integer >= 1, got 0"),
    (["--out", "FILE"], "cannot write there"),
    (["--save", "FILE"], "--save"),
    (["--lr", "1e9", "--steps", "6"], "lower --lr"),
], ids=["policy", "steps", "out", "save", "lr"])
def test_example_refuses_with_one_error_on_every_rank(tmp_path, extra, words):
    """What the example cannot run stops every rank with the same usage error (main prints it once), before any
    training where it can be known before: no traceback per rank, no rank left waiting."""
    afile = tmp_path / "afile"
    afile.write_text("")
    argv = ["--hidden", "32", "--batch", "2", "--seq-len", "32", "--text-bytes", "40000", "--gpus-per-node", "2",
            "--plan-wait-ms", "60000", *[str(afile) if a == "FILE" else a for a in extra]]
    errors = run_dist(_refused, 2, argv, timeout_s=180, collective_timeout_s=60)
    assert all(e is not None and words in e for e in errors), errors
    assert afile.read_text() == ""


def _refused_each(rank: int, world: int, argvs: list[list[str]]) -> list[str | None]:
    return [_refused(rank, world, argv) for argv in argvs]


def test_example_refuses_bad_numbers_before_any_work():
    """Options a run cannot use are refused by name on every rank before any collective: a 0 was a ZeroDivisionError
    on one rank (--log-every: after the first step, its peers waiting on it), NaN went through."""
    base = ["--hidden", "32", "--batch", "2", "--seq-len", "32", "--text-bytes", "40000", "--gpus-per-node", "2"]
    cases = [(["--log-every", "0"], "--log-every: expected an integer >= 1, got 0"),
             (["--batch", "0"], "--batch: expected an integer >= 1, got 0"),
             (["--seq-len", "-1"], "--seq-len: expected an integer >= 1, got -1"),
             (["--text-bytes", "0"], "--text-bytes: expected an integer >= 1, got 0"),
             (["--layers", "0"], "--layers: expected an integer >= 1, got 0"),
             (["--lr", "nan"], "--lr: expected a positive finite number, got nan"),
             (["--clip", "nan"], "--clip: expected a finite number >= 0 (0: no clipping), got nan"),
             (["--clip", "-1"], "--clip: expected a finite number >= 0 (0: no clipping), got -1.0"),
             (["--gpus-per-node", "0"], "--gpus-per-node: expected an integer >= 1, got 0"),    # (was the default)
             (["--seed", str(2**64)], "--seed: expected an integer in [-2**63, 2**64)")]
    got = run_dist(_refused_each, 2, [base + extra for extra, _ in cases], timeout_s=180, collective_timeout_s=60)
    for errors in got:
        for (extra, words), err in zip(cases, errors, strict=True):
            assert err is not None and words in err, (extra, err)


TRAINER_EXAMPLE = EXAMPLE.with_name("hf_trainer.py")


def _trainer_refused_each(rank: int, world: int, argvs: list[list[str]]) -> list[str | None]:
    spec = importlib.util.spec_from_file_location("_feplb_hf_trainer_example", TRAINER_EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    errors = []
    for argv in argvs:
        try:
            mod.run(mod.build_parser().parse_args(argv))
            errors.append(None)
        except mod._sibling("train_moe").UsageError as exc:
            errors.append(str(exc))
    return errors


def test_trainer_example_refuses_bad_options_before_any_work(tmp_path):
    """As hf_moe.py: one usage error on every rank, naming the option (--clip -1 trained unclipped, --lr 0 without
    learning, --text-bytes 10 failed in torch.frombuffer, --policy bogus was a traceback per rank)."""
    base = ["--out", str(tmp_path / "out"), "--hidden", "32", "--batch", "2", "--seq-len", "32", "--gpus-per-node",
            "2", "--text-bytes", "40000"]
    cases = [(["--clip", "-1"], "--clip: expected a finite number >= 0 (0: no clipping), got -1.0"),
             (["--lr", "0"], "--lr: expected a positive finite number, got 0.0"),
             (["--lr", "nan"], "--lr: expected a positive finite number, got nan"),
             (["--layers", "0"], "--layers: expected an integer >= 1, got 0"),
             (["--text-bytes", "10"], "--text-bytes 10: too few sequences of 32 bytes for 2 ranks of 2 and a "
                                      "held-out batch"),
             (["--policy", "bogus"], "unknown base policy 'bogus'"),
             (["--gpus-per-node", "0"], "--gpus-per-node: expected an integer >= 1, got 0"),
             (["--seed", "-1"], "--seed: expected an integer in [0, 2**32) (transformers' set_seed (numpy's) takes "
                                "no other), got -1")]
    got = run_dist(_trainer_refused_each, 2, [base + extra for extra, _ in cases], timeout_s=240,
                   collective_timeout_s=60)
    for errors in got:
        for (extra, words), err in zip(cases, errors, strict=True):
            assert err is not None and words in err, (extra, err)
    assert not (tmp_path / "out").exists()


def _torchrun(nproc: int, *args: str, timeout: int = 300):
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(TRAINER_EXAMPLE), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_trainer_example_trains_checkpoints_resumes_and_saves(tmp_path):
    """examples/hf_trainer.py as a user runs it (torchrun, 2 gloo ranks): feplb.hf.Trainer checkpoints, the final
    model's held-out loss under plain transformers equals the FEPLB model's, --resume continues from the newest
    checkpoint, and a --resume without one stops every rank with one line."""
    import json
    import re

    out = tmp_path / "run"
    small = ["--gpus-per-node", "2", "--hidden", "32", "--batch", "2", "--seq-len", "32", "--text-bytes", "40000",
             "--save-steps", "2", "--log-every", "1", "--out", str(out)]

    def losses(proc):
        assert proc.returncode == 0, proc.stderr[-4000:]
        found = re.findall(r"held-out loss: FEPLB model ([0-9.]+), plain transformers from \S+ ([0-9.]+)", proc.stdout)
        assert len(found) == 1, proc.stdout[-4000:]
        ours, plain = map(float, found[0])
        assert abs(ours - plain) <= 1e-5 * abs(plain), (ours, plain)
        return proc

    losses(_torchrun(2, *small, "--max-steps", "4"))
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4", "final"]
    assert {"model_feplb", "optimizer_feplb", "model.safetensors"} <= {p.name for p in (out / "checkpoint-4").iterdir()}
    resumed = losses(_torchrun(2, *small, "--max-steps", "6", "--resume"))
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6, state
    # steps 5 and 6 trained (and logged, every step here), not all six again
    assert resumed.stdout.count("'loss':") == 2, resumed.stdout[-3000:]

    for args, message in [((*small[:-1], str(tmp_path / "none"), "--resume"), "--resume: no checkpoint-N folder in"),
                          ((*small, "--max-steps", "2"), "holds checkpoints of an earlier run (checkpoint-6)")]:
        proc = _torchrun(2, *args, timeout=120)
        assert proc.returncode != 0
        assert proc.stderr.count("hf_trainer.py: error: ") == 1 and message in proc.stderr, proc.stderr[-3000:]
        assert "exitcode  : 2" in proc.stderr and "SIGTERM" not in proc.stderr.split("Failures:")[-1], \
            proc.stderr[-3000:]
        assert f'File "{TRAINER_EXAMPLE}"' not in proc.stderr, proc.stderr[-3000:]
