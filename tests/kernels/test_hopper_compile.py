"""Every Triton kernel compiles for an H100/H200 (sm_90) on a machine without a GPU, and the grouped GEMMs get
Hopper's warpgroup MMA and pipelined async copies (what their tile configs were chosen for)."""

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
    assert {"grouped_mm forward", "grouped_mm dX", "grouped_mm dW", "routing scatter", "permute", "unpermute",
            "unpermute backward", "swiglu", "swiglu backward"} <= names
    for row in rows:
        if row["kernel"].startswith("grouped_mm"):
            assert row["wgmma"] and row["async_copies"] > 0, row
            assert row["shared_bytes"] <= 227 * 1024, row  # an H100/H200 block's shared-memory limit
