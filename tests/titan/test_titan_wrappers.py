"""``feplb.titan.apply`` and the wrappers torchtitan's parallelize functions put around a model, on 4 gloo ranks as
2 nodes x 2: DDP around the applied MoE leaves the expert shards alone by itself (``apply`` puts them on DDP's ignore
list, as ``feplb.hf.apply`` does; DDP would otherwise broadcast rank 0's experts to every rank), and FSDP2's
``fully_shard`` over the shards (``ignored_params`` forgotten, which would gather other ranks' experts into each
rank's tensor) is refused on every rank at the first forward; with the experts left out it computes what the
unmodified MoE computes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from feplb.testing import error_of, load_module, run_dist

pytest.importorskip("torchtitan.models.common.moe")

pytestmark = pytest.mark.dist

TT = load_module(Path(__file__).with_name("test_titan.py"))


def _wrapped(rank: int, world: int, wrapper: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import feplb.titan as ft

    moe = TT.make_moe("qwen3")
    ref = copy.deepcopy(moe)
    ref.routed_experts.inner_experts.float()      # (the reference routes its experts in fp32, as FEPLB here)
    ft.apply(moe, policy="feplb-split", gpus_per_node=2, dtype=torch.float32, **TT.OPTS)
    if wrapper == "ddp":
        model = DistributedDataParallel(moe)
    else:
        ignored = set(ft.expert_parameters(moe)) if wrapper == "fsdp_ignored" else set()
        fully_shard(moe, mesh=init_device_mesh("cpu", (world,)), ignored_params=ignored)
        model = moe
    x, _, _ = TT._inputs(rank)
    got = []
    out = {"error": error_of(lambda: got.append(model(x))), "rel": None}
    if got:
        out["rel"] = TT._rel(got[0].detach(), ref(x).detach())
    return out


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp_ignored", "fsdp_forgotten"])
def test_wrappers_around_an_applied_moe(wrapper):
    runs = run_dist(_wrapped, 4, wrapper, timeout_s=300, collective_timeout_s=90)
    for rank, r in enumerate(runs):
        if wrapper == "fsdp_forgotten":
            assert r["error"] is not None and r["error"].startswith("RuntimeError") and \
                "no longer the tensors it holds its experts in" in r["error"] and "ignored_params" in r["error"], \
                (rank, r)
        else:   # bf16 tolerance: torchtitan's reference computes its router in its own precision
            assert r["error"] is None and r["rel"] is not None and r["rel"] < 0.05, (rank, r)
