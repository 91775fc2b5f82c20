"""FEPLBConfig validation and the layer's single-process guards (no process group needed)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from feplb import FEPLBConfig, LayerStats, MoELayer
from feplb.transport import NVSHMEM_HINT

BASE = dict(hidden=16, ffn=32, num_experts=8, top_k=2)


@pytest.mark.parametrize(("field", "value", "exc", "needle"), [
    ("hidden", 0, ValueError, "hidden"),
    ("ffn", -3, ValueError, "ffn"),
    ("num_experts", 2.5, TypeError, "num_experts"),
    ("top_k", 9, ValueError, "top_k"),
    ("router", "relu", ValueError, "router"),
    ("transport", "mpi", ValueError, "transport"),
    ("weights", "never", ValueError, "weights"),
    ("on_overflow", "drop", ValueError, "on_overflow"),
    ("dtype", torch.int32, TypeError, "dtype"),
    ("plan_wait_ms", float("nan"), ValueError, "plan_wait_ms"),
    ("dyn", -1, ValueError, "dyn"),
    ("policy", "bogus", ValueError, "bogus"),
    ("policy", "feplb+bogus", ValueError, "+bogus"),
    ("recv_capacity", -1, ValueError, "recv_capacity"),
    ("device", "gpu", ValueError, "device"),
    ("copy_path", "dma", ValueError, "copy_path"),
    ("cost", 3.0, TypeError, "cost"),
    ("min_chunk", 0, ValueError, "min_chunk"),
    ("min_straggler_rows", -1, ValueError, "min_straggler_rows"),
    ("timeline", "yes", TypeError, "timeline"),
    ("swiglu_limit", 0.0, ValueError, "swiglu_limit"),
    ("swiglu_limit", float("inf"), ValueError, "swiglu_limit"),
    ("swiglu_limit", True, TypeError, "swiglu_limit"),
    ("swiglu_limit", "7", TypeError, "swiglu_limit"),
    ("dyn", 2.0, TypeError, r"dyn must be an int >= 0, got 2.0 \(float\)"),
    ("hidden", True, TypeError, "hidden must be an int"),
    ("num_experts", "8", TypeError, "num_experts must be an int"),
    ("plan_wait_ms", "5", TypeError, "plan_wait_ms"),
    ("activation", "relu", ValueError, "activation must be one of"),
    ("activation", None, ValueError, "activation"),
    ("swiglu_alpha", float("nan"), ValueError, "swiglu_alpha must be a finite number"),
    ("swiglu_alpha", "1.7", TypeError, "swiglu_alpha"),
    ("gate_on_input", 1, TypeError, "gate_on_input"),
    ("gated", 0, TypeError, "gated must be a bool"),
    ("glu_interleaved", "yes", TypeError, "glu_interleaved must be a bool"),
    ("expert_bias", None, TypeError, "expert_bias must be a bool"),
    ("router_bias", "no", TypeError, "router_bias must be a bool"),   # truthy: it made the bias buffer
    ("router_bias", 1, TypeError, "router_bias must be a bool"),
    # refused by the planner only at the forward, where every micro-batch then computed at home with a warning
    ("tau", -0.5, ValueError, "tau must be a finite number >= 0"),
    ("tau", float("nan"), ValueError, "tau must be a finite number >= 0"),
    ("tau", float("inf"), ValueError, "tau must be a finite number >= 0"),
    ("tau", "0.01", TypeError, "tau must be a finite number >= 0"),
    ("tau", True, TypeError, "tau must be a finite number >= 0"),
    ("activation", "relu2", ValueError,
     r"one of \('silu', 'gelu_tanh', 'gelu', 'swiglu_oai', 'silu_softcap', 'silu_postclamp'\) \(gated experts\)"),
    ("activation", "silu_postclamp", ValueError, "silu_postclamp clamps after the activation and needs a limit"),
    ("activation", "silu_softcap", ValueError, r"silu_softcap expects \(c_gate, c_up\)"),   # no softcaps given
    ("glu_softcap", (4.0, 25.0), ValueError, "only .*silu_softcap.* take softcaps"),   # softcaps with plain SwiGLU
], ids=lambda v: str(v))
def test_config_rejects_bad_values(field, value, exc, needle):
    with pytest.raises(exc, match=needle.replace("+", r"\+")):
        FEPLBConfig(**{**BASE, field: value})


def test_config_takes_the_tau_the_planner_takes():
    import numpy as np

    assert FEPLBConfig(**BASE, tau=np.float32(0.05)).tau == np.float32(0.05)
    assert FEPLBConfig(**BASE, tau=0).tau == 0


_INT_FIELDS = {"hidden": 64, "ffn": 48, "num_experts": 8, "top_k": 3, "gpus_per_node": 2, "refresh_every": 5,
               "dyn": 0, "min_straggler_rows": 7, "min_chunk": 4, "recv_capacity": 0}
_NUMBER_FIELDS = {"plan_wait_ms": 2.5, "tau": 0.125, "swiglu_alpha": 1.5, "swiglu_limit": 7.25}


def _same_config(a: FEPLBConfig, b: FEPLBConfig) -> None:
    """Equal, and equal in every way a config is compared or written: its hash, repr, and the repr of its fields
    that every rank's layer checks for agreement (MoELayer compares it over the EP group)."""
    assert a == b and hash(a) == hash(b) and repr(a) == repr(b)
    assert repr(dataclasses.asdict(a)) == repr(dataclasses.asdict(b))


@pytest.mark.parametrize("np_type", ["int64", "int32", "uint16"])
def test_config_takes_numpy_integers_as_ints(np_type):
    """Sizes computed with numpy (np.int64 from an array's sum, say) are ints, stored as Python's: a config from
    them equals one from Python's ints, so ranks that built theirs either way agree."""
    import numpy as np

    rng = np.random.default_rng()
    for name, value in _INT_FIELDS.items():
        value = value + int(rng.integers(0, 3)) * (name not in ("top_k", "num_experts", "gpus_per_node"))
        got = FEPLBConfig(**{**BASE, name: getattr(np, np_type)(value)})
        assert type(getattr(got, name)) is int and getattr(got, name) == value, name
        _same_config(got, FEPLBConfig(**{**BASE, name: value}))
    low = {"dyn": 0, "min_straggler_rows": 0, "recv_capacity": 0}
    for name in _INT_FIELDS:   # the bound and its message as for a Python int
        lo = low.get(name, 1)
        if np_type == "uint16" and lo == 0:
            continue
        msg = rf"FEPLBConfig.{name} must be an int >= {lo}, got {re.escape(repr(getattr(np, np_type)(lo - 1)))}"
        with pytest.raises(ValueError, match=msg):
            FEPLBConfig(**{**BASE, name: getattr(np, np_type)(lo - 1)})


@pytest.mark.parametrize("name", list(_INT_FIELDS))
def test_config_refuses_numpy_bools_and_whole_floats_as_ints(name):
    import numpy as np

    for bad in (np.bool_(True), np.float64(4.0), np.float32(4.0)):
        msg = rf"FEPLBConfig.{name} must be an int >= \d, got .*\({type(bad).__name__}\)"
        with pytest.raises(TypeError, match=msg):
            FEPLBConfig(**{**BASE, name: bad})


@pytest.mark.parametrize("np_type", ["float64", "float32", "float16", "int64"])
def test_config_takes_numpy_numbers_as_numbers(np_type):
    """plan_wait_ms, tau, swiglu_alpha and swiglu_limit take numpy's real scalars, stored as Python's float (int
    for a numpy integer): np.float64, a float subclass, too, whose repr is not a float's."""
    import numpy as np

    rng = np.random.default_rng()
    for name, value in _NUMBER_FIELDS.items():
        value = value + int(rng.integers(0, 4))   # exact in float16 as in the others
        if np_type == "int64":
            value = int(value)
        got = FEPLBConfig(**{**BASE, name: getattr(np, np_type)(value)})
        assert type(getattr(got, name)) is type(value) and getattr(got, name) == value, name
        _same_config(got, FEPLBConfig(**{**BASE, name: value}))
    assert FEPLBConfig(**BASE, swiglu_alpha=np.float32(1.5)).glu[2] == 1.5
    for name, bad in (("plan_wait_ms", -1.0), ("tau", float("nan")), ("swiglu_alpha", float("inf")),
                      ("swiglu_limit", 0.0)):
        if np_type == "int64" and name in ("tau", "swiglu_alpha"):
            continue
        with pytest.raises(ValueError, match=f"FEPLBConfig.{name} must be"):
            FEPLBConfig(**{**BASE, name: getattr(np, np_type)(bad)})
    for name in _NUMBER_FIELDS:
        with pytest.raises(TypeError, match=f"FEPLBConfig.{name} must be"):
            FEPLBConfig(**{**BASE, name: np.bool_(True)})


def test_config_lazy_replicas():
    """replicas='lazy' holds what a plan copied: an @ema set of the in-node planners, with per-step weights."""
    for policy in ("feplb@ema", "feplb-split@ema", "lp@ema", "feplb-split+place@ema"):
        assert FEPLBConfig(**BASE, policy=policy, replicas="lazy").replicas == "lazy"
    assert FEPLBConfig(**BASE).replicas == "eager"
    with pytest.raises(ValueError, match="replicas must be 'eager' or 'lazy', got 'sometimes'"):
        FEPLBConfig(**BASE, policy="feplb@ema", replicas="sometimes")
    for policy in ("feplb", "feplb-split@current", "eplb", "fastermoe", "none"):
        with pytest.raises(ValueError, match=f"not to policy '{policy}'"):
            FEPLBConfig(**BASE, policy=policy, replicas="lazy")
    with pytest.raises(ValueError, match="replicas='lazy' needs weights='per-step'"):
        FEPLBConfig(**BASE, policy="feplb@ema", replicas="lazy", weights="per-microbatch")


def test_config_reduce_in_fp32():
    """reduce_in_fp32 (the per-step copies' gradients sent as fp32 sums, or rounded to the weights' dtype) is a bool,
    and False applies to per-step weights only, which hold copies over a step."""
    assert FEPLBConfig(**BASE).reduce_in_fp32 is True
    assert FEPLBConfig(**BASE, reduce_in_fp32=False).reduce_in_fp32 is False
    with pytest.raises(TypeError, match="reduce_in_fp32 must be a bool, got 0"):
        FEPLBConfig(**BASE, reduce_in_fp32=0)
    with pytest.raises(ValueError, match="reduce_in_fp32=False needs weights='per-step'"):
        FEPLBConfig(**BASE, reduce_in_fp32=False, weights="per-microbatch")
    assert FEPLBConfig(**BASE, weights="per-microbatch").reduce_in_fp32   # the default applies to any weights


def test_config_non_gated_experts():
    cfg = FEPLBConfig(**BASE, gated=False, activation="relu2")
    assert cfg.glu == (None, "relu2", 1.702, False, False, None)
    with pytest.raises(ValueError, match=r"one of \('silu', 'gelu_tanh', 'gelu', 'relu2'\) \(non-gated experts\)"):
        FEPLBConfig(**BASE, gated=False, activation="swiglu_oai")
    for bad in ({"swiglu_limit": 1.0}, {"glu_interleaved": True}):
        with pytest.raises(ValueError, match="apply to gated experts only"):
            FEPLBConfig(**BASE, gated=False, **bad)
    with pytest.raises(ValueError, match="glu_softcap applies to gated experts only"):
        FEPLBConfig(**BASE, gated=False, activation="silu", glu_softcap=(4.0, 25.0))


def test_config_masked_routes_need_an_external_router():
    assert FEPLBConfig(**BASE, router="external", masked_routes=True).masked_routes
    with pytest.raises(ValueError, match="masked_routes needs router='external'"):
        FEPLBConfig(**BASE, masked_routes=True)
    with pytest.raises(TypeError, match="masked_routes must be a bool"):
        FEPLBConfig(**BASE, router="external", masked_routes=1)


def test_config_softcapped_swiglu():
    cfg = FEPLBConfig(**BASE, activation="silu_softcap", glu_softcap=[4, 25.0])
    assert cfg.glu == (None, "silu_softcap", 1.702, False, True, (4.0, 25.0))
    for bad in ((4.0,), (4.0, 0.0), (4.0, float("inf")), (True, 2.0), "4,25"):
        with pytest.raises(ValueError, match="two finite numbers > 0"):
            FEPLBConfig(**BASE, activation="silu_softcap", glu_softcap=bad)
    with pytest.raises(ValueError, match="takes softcaps, not a clamp"):
        FEPLBConfig(**BASE, activation="silu_softcap", glu_softcap=(4.0, 25.0), swiglu_limit=7.0)


def test_config_postclamped_swiglu():
    cfg = FEPLBConfig(**BASE, activation="silu_postclamp", swiglu_limit=7)
    assert cfg.glu == (7, "silu_postclamp", 1.702, False, True, None)
    with pytest.raises(ValueError, match="silu_postclamp clamps after the activation and needs a limit"):
        FEPLBConfig(**BASE, activation="silu_postclamp")
    with pytest.raises(ValueError, match="only .*silu_softcap.* take softcaps"):
        FEPLBConfig(**BASE, activation="silu_postclamp", swiglu_limit=7.0, glu_softcap=(4.0, 25.0))


def test_config_defaults_and_external_router():
    cfg = FEPLBConfig(**BASE)
    assert cfg.plan_wait_ms is None and cfg.min_straggler_rows is None and cfg.timeline is False
    assert FEPLBConfig(**BASE, router="external").router == "external"
    with pytest.raises(ValueError, match="router_bias needs the layer's own router"):
        FEPLBConfig(**BASE, router="external", router_bias=True)


def test_config_is_frozen_and_kw_only():
    cfg = FEPLBConfig(**BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden = 3
    with pytest.raises(TypeError):
        FEPLBConfig(16, 32, 8, 2)
    assert {f.name for f in dataclasses.fields(LayerStats)} >= {
        "token_straggler_before", "token_straggler_after", "rows_moved", "copy_bytes", "plan_us", "fell_back",
        "loads_before_W", "loads_after_W"}


def test_layer_needs_a_process_group():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        MoELayer(FEPLBConfig(**BASE))
    with pytest.raises(TypeError, match="FEPLBConfig"):
        MoELayer({"hidden": 16})


def test_nvshmem_hint_names_the_extra():
    assert "pip install 'feplb[nvshmem]'" in NVSHMEM_HINT
