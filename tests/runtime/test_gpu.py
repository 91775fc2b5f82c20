"""GPU paths of the runtime (NCCL transport, CUDA copy paths on a copy stream, NVSHMEM transport): balancing on
equals balancing off on real GPUs. Skipped without CUDA GPUs (and without nvshmem4py for NVSHMEM).

With one GPU, several processes share it: NCCL refuses that ("Duplicate GPU"), so a gloo group carries the small
host collectives, NVSHMEM (2 PEs on one GPU, UID bootstrap) carries phase 1, and the copy path is CUDA IPC or
NVSHMEM. That proves correctness only: processes sharing one GPU time-slice it."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from feplb.testing import load_global_weights, run_dist

pytestmark = [pytest.mark.gpu, pytest.mark.dist]

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_2 = pytest.mark.skipif(NGPU < 2, reason="needs at least 2 CUDA GPUs (one rank per GPU)")
HAVE_NVSHMEM = importlib.util.find_spec("nvshmem") is not None


def _gpu_worker(rank, world, transport, one_gpu=False, copy_path="auto"):
    from feplb import FEPLBConfig, MoELayer

    if one_gpu:
        torch.cuda.set_device(0)
    out, grads = {}, {}
    for policy in ("none", "feplb-split"):
        torch.manual_seed(0)
        layer = MoELayer(FEPLBConfig(hidden=256, ffn=128, num_experts=4 * world, top_k=2, gpus_per_node=world,
                                     dyn=2, policy=policy, transport=transport, plan_wait_ms=10_000.0,
                                     min_straggler_rows=0, min_chunk=8,
                                     weights="per-microbatch", device="cuda", copy_path=copy_path))
        gen = torch.Generator().manual_seed(1)
        w1 = torch.randn(4 * world, 256, 256, generator=gen) / 16
        w2 = torch.randn(4 * world, 128, 256, generator=gen) / 12
        router = torch.randn(4 * world, 256, generator=gen) / 16
        router[:, 0] = 0
        router[0, 0] = 3.0
        load_global_weights(layer, router, w1, w2)
        x = torch.randn(512, 256, generator=torch.Generator().manual_seed(rank)).cuda()
        x[:, 0] = x[:, 0].abs() + 1
        x.requires_grad_(True)
        y = layer(x)
        y.square().sum().backward()
        out[policy] = y.detach().cpu()
        grads[policy] = [x.grad.cpu(), layer.w1.grad.cpu(), layer.w2.grad.cpu(), layer.router.weight.grad.cpu()]
        moved = layer.last_stats.rows_moved
    ok = torch.allclose(out["none"], out["feplb-split"], rtol=1e-4, atol=1e-5) and all(
        torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(grads["none"], grads["feplb-split"], strict=True))
    return {"ok": ok, "moved": moved}


@needs_2
def test_layer_nccl_balanced_equals_plain_ep():
    world = min(NGPU, 4)
    for res in run_dist(_gpu_worker, world, "torch", backend="nccl", timeout_s=300):
        assert res["ok"] and res["moved"] > 0, res


@needs_2
@pytest.mark.skipif(not HAVE_NVSHMEM, reason="needs nvshmem4py: pip install 'feplb[nvshmem]'")
def test_layer_nvshmem_balanced_equals_plain_ep():
    world = min(NGPU, 4)
    for res in run_dist(_gpu_worker, world, "nvshmem", backend="nccl", timeout_s=300):
        assert res["ok"] and res["moved"] > 0, res


needs_1 = pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")


@needs_1
@pytest.mark.skipif(not HAVE_NVSHMEM, reason="needs nvshmem4py: pip install 'feplb[nvshmem]'")
@pytest.mark.parametrize("copy_path", ["ipc", "auto"])
def test_layer_two_processes_one_gpu(copy_path):
    for res in run_dist(_gpu_worker, 2, "nvshmem", True, copy_path, backend="gloo", timeout_s=300):
        assert res["ok"] and res["moved"] > 0, res
