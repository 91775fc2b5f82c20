"""Every Triton kernel compiles for an H100/H200 (sm_90) on a machine without a GPU: the grouped GEMMs for every
dtype they can be launched with, each config the shared-memory prune keeps within one block's shared memory,
with Hopper's warpgroup MMA for 16-bit and TF32 operands, pipelined async copies (classic variants) or TMA loads
(persistent variants, dW's included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from feplb.kernels import HAVE_TRITON

SCRIPT = Path(__file__).with_name("hopper_compile.py")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
def test_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in rows if not r["ok"]]
    assert proc.returncode == 0 and not failed, (failed, proc.stderr[-2000:])
    names = {r["kernel"] for r in rows}
    assert {"grouped_mm forward", "grouped_mm dX", "grouped_mm dW", "grouped_mm persistent forward",
            "grouped_mm persistent dX", "grouped_mm persistent dW", "grouped_mm dW reduce", "routing scatter",
            "permute", "unpermute", "unpermute backward"} <= names
    assert {f"glu{b} {act}{c}" for b in ("", " backward") for act in ("silu", "gelu_tanh", "gelu", "swiglu_oai")
            for c in ("", " clamped")} | {"glu swiglu_oai clamped interleaved",
                                          "glu backward swiglu_oai clamped interleaved"} <= names
    assert {f"mlp_act{b} {act}" for b in ("", " backward") for act in ("relu2", "silu", "gelu_tanh", "gelu")} <= names
    gemms = [r for r in rows if r["kernel"].startswith("grouped_mm") and "reduce" not in r["kernel"]]
    # Every dtype a GEMM can be launched with on a GPU was compiled, with the configs the autotuner keeps.
    assert {(r["kernel"], r["dtype"]) for r in gemms} >= {
        (k, d) for k in ("grouped_mm forward", "grouped_mm dX", "grouped_mm dW")
        for d in ("bf16", "fp32-tf32", "fp32-ieee", "fp64")}
    for row in gemms:
        assert row["shared_bytes"] <= 232_448, row  # an H100/H200 block's shared-memory limit
        # The prune's estimate bounds what the compiler allocates, so a kept config never runs out.
        assert row["shared_bytes"] <= row["shared_estimate"], row
        if row["dtype"] in ("bf16", "fp16", "fp32-tf32"):
            assert row["wgmma"], row
        if "persistent" in row["kernel"]:
            assert row["tma_loads"] > 0, row
        else:
            assert row["async_copies"] > 0, row
    # A persistent dW config that launches several programs per SM must fit them in one SM: registers (allocated
    # per warp in units of 8 per thread, 64K per SM) and shared memory (228 KiB per SM, 1 KiB reserved per block).
    dws = [r for r in gemms if r["kernel"] == "grouped_mm persistent dW"]
    assert {r["config"]["PROGRAMS_PER_SM"] for r in dws} == {1, 2}, dws
    for row in dws:
        n = row["config"]["PROGRAMS_PER_SM"]
        assert row["registers"] is not None, ("ptxas gave no register count", row)
        threads = 32 * row["options"]["num_warps"]
        assert n * -(-row["registers"] // 8) * 8 * threads <= 65_536, row
        assert n * (row["shared_bytes"] + 1024) <= 233_472, row


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
def test_fp32_weight_gradient_has_a_config_without_spills():
    """fp32 with IEEE dots (torch's default: TF32 off) computes dW without tensor cores, and ptxas spills the
    64-row reductions' accumulators to local memory: among the configs the autotuner keeps for it one compiles
    without any spill, so the autotuner can choose it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--all", "--only", "grouped_mm dW fp32-ieee"], env=env,
                          capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(rows) >= 2 and all(r["ok"] for r in rows), (rows, proc.stderr[-2000:])
    assert all(r["spill_bytes"] is not None for r in rows), rows
    assert any(r["spill_bytes"] == 0 for r in rows), [(r["config"], r["spill_bytes"]) for r in rows]
