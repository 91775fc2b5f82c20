"""Paths to routing traces for the simulator tests."""

import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def flame_path() -> Path:
    return DATA / "flame_moe_290m_prefill.npz"


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """The full routing traces (FEPLB_TRACES, or ../shared/routing_traces next to the repository)."""
    root = Path(os.environ.get("FEPLB_TRACES", Path(__file__).resolve().parents[3] / "shared" / "routing_traces"))
    if not (root / "esft_deepseek_v2_lite").is_dir():
        pytest.skip(f"routing traces not found at {root} (set FEPLB_TRACES)")
    return root
