"""GPU paths of the runtime (NCCL transport, CUDA copy paths on a copy stream, NVSHMEM transport): balancing on
equals balancing off on real GPUs. Skipped without CUDA GPUs (and without nvshmem4py for NVSHMEM).

With one GPU, several processes share it: NCCL refuses that ("Duplicate GPU"), so a gloo group carries the small
host collectives, NVSHMEM (2 PEs on one GPU, UID bootstrap) carries phase 1, and the copy path is CUDA IPC or
NVSHMEM. That proves correctness only: processes sharing one GPU time-slice it."""

from __future__ import annotations

import time

import pytest
import torch
import torch.utils.checkpoint

from feplb.testing import dense_moe_reference, error_bound, load_global_weights, max_abs_error, run_dist
from feplb.transport import nvshmem_unavailable

pytestmark = pytest.mark.dist   # and each GPU test is marked gpu (one test here runs the strided worker on the CPU)

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_2 = pytest.mark.skipif(NGPU < 2, reason="needs at least 2 CUDA GPUs (one rank per GPU)")
# First forwards compile and autotune different shapes on different ranks: give collectives room.
COLLECTIVE_S = 120.0
NVSHMEM_SKIP_PREFIX = "NVSHMEM unavailable"


# feplb's modules are imported above, so a broken import of ours fails instead of skipping
NVSHMEM_REASON = f"{NVSHMEM_SKIP_PREFIX}: {why}" if (why := nvshmem_unavailable()) else None
HAVE_NVSHMEM = NVSHMEM_REASON is None
needs_nvshmem = pytest.mark.skipif(not HAVE_NVSHMEM, reason=f"{NVSHMEM_REASON} (pip install 'feplb[nvshmem]')")


TOL = 1e-5   # max |error| <= TOL * max |reference| (or twice fp32's own error), as tests/runtime/test_layer.py


def _compare(runs: dict[str, dict[str, torch.Tensor]], ref: dict[str, tuple[torch.Tensor, float]] | None = None
             ) -> dict:
    """Balancing on (feplb-split) against off (none), and each against an fp64 reference where one is given.

    An element-wise rtol/atol is the wrong test here: a weight gradient whose rows are summed on two GPUs rounds
    differently in fp32, and an element near zero of a gradient whose largest element is in the thousands then
    misses any element-wise bound (on the CPU too). So each tensor passes when its largest error is within TOL of
    its largest element, or within twice the error torch's own fp32 makes on the same math (``ref``'s floor).

    A "feplb-split+checkpoint" run (the layer under activation checkpointing, its recompute replaying the plan) and a
    "feplb-split+recopy" run (``recopy_weights``: the helpers receive the weights again in the backward) must equal
    "feplb-split" within the same bound ("checkpoint_on", "recopy_on").

    Returns {"ok": bool, "<tensor>": {"on_off": rel, "none_ref": rel, "split_ref": rel, "scale": max |ref|}}, the
    errors relative to the scale, so a failing GPU run says which tensor is off, and by how much.
    """
    report, ok = {}, True
    for name, off in runs["none"].items():
        on = runs["feplb-split"][name]
        want, floor = ref[name] if ref is not None else (off.double(), 0.0)
        scale, bound = error_bound(want, floor, TOL)
        errs = {"on_off": max_abs_error(on, off)}
        if "feplb-split+checkpoint" in runs:
            # the recompute replays the plan: the run without checkpointing (bit for bit on the CPU, where
            # tests/runtime/test_checkpoint.py asserts it; within the bound where a GPU library may sum otherwise)
            errs["checkpoint_on"] = max_abs_error(runs["feplb-split+checkpoint"][name], on)
        if "feplb-split+recopy" in runs:
            errs["recopy_on"] = max_abs_error(runs["feplb-split+recopy"][name], on)
        if ref is not None:
            errs |= {"none_ref": max_abs_error(off, want), "split_ref": max_abs_error(on, want)}
        ok &= all(e <= bound for e in errs.values())
        report[name] = {k: float(f"{e / max(scale, 1e-12):.3g}") for k, e in errs.items()} | {
            "scale": float(f"{scale:.4g}"), "bound": float(f"{bound / max(scale, 1e-12):.3g}")}
    return {"ok": ok} | report


def _dense_reference(rank: int, world: int, router, w1, w2, xs: list, top_k: int) -> dict:
    """fp64 dense MoE on every rank's tokens with the test's loss (sum of squares of all outputs): this rank's
    output and its gradients (tokens, router), and this rank's shard of the expert gradients. Each value comes
    with the max error torch's fp32 makes on the same math (the floor of the tolerance)."""
    per_dtype = {}
    for dtype in (torch.float64, torch.float32):
        w1_, w2_ = (w.to(dtype, copy=True).requires_grad_(True) for w in (w1, w2))
        routers = [router.to(dtype, copy=True).requires_grad_(True) for _ in xs]
        xs_ = [x.to(dtype, copy=True).requires_grad_(True) for x in xs]
        outs = [dense_moe_reference(x, r, w1_, w2_, top_k) for x, r in zip(xs_, routers, strict=True)]
        sum(o.square().sum() for o in outs).backward()
        L = w1.shape[0] // world
        per_dtype[dtype] = {"out": outs[rank].detach(), "dx": xs_[rank].grad,
                            "dw1": w1_.grad[rank * L:(rank + 1) * L], "dw2": w2_.grad[rank * L:(rank + 1) * L],
                            "drouter": routers[rank].grad}
    return {k: (v, max_abs_error(per_dtype[torch.float32][k], v)) for k, v in per_dtype[torch.float64].items()}


def _gpu_worker(rank, world, transport, one_gpu=False, copy_path="auto", device="cuda"):
    from feplb import FEPLBConfig, MoELayer

    if one_gpu:
        torch.cuda.set_device(0)
    E, H, F, K = 4 * world, 256, 128, 2
    gen = torch.Generator().manual_seed(1)
    w1 = torch.randn(E, H, 2 * F, generator=gen) / 16
    w2 = torch.randn(E, F, H, generator=gen) / 12
    router = torch.randn(E, H, generator=gen) / 16
    router[:, 0] = 0
    router[0, 0] = 3.0                       # tokens with a large first feature pick expert 0 (rank 0's)
    xs = [torch.randn(512, H, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    for x in xs:
        x[:, 0] = x[:, 0].abs() + 1
    runs, layers = {}, []
    for run in ("none", "feplb-split", "feplb-split+checkpoint", "feplb-split+recopy"):
        policy = run.split("+")[0]
        torch.manual_seed(0)
        layer = MoELayer(FEPLBConfig(hidden=H, ffn=F, num_experts=E, top_k=K, gpus_per_node=world,
                                     dyn=2, policy=policy, transport=transport, plan_wait_ms=10_000.0,
                                     min_straggler_rows=0, min_chunk=8,
                                     weights="per-microbatch", device=device, copy_path=copy_path,
                                     recopy_weights=run.endswith("+recopy")))
        load_global_weights(layer, router, w1, w2)
        x = xs[rank].to(device, copy=True).requires_grad_(True)
        if run.endswith("+checkpoint"):
            # non-reentrant activation checkpointing: the backward recomputes the layer, replaying its plan
            y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        else:
            y = layer(x)
        y.square().sum().backward()
        runs[run] = {"out": y.detach().cpu(), "dx": x.grad.cpu(), "dw1": layer.w1.grad.cpu(),
                     "dw2": layer.w2.grad.cpu(), "drouter": layer.router.weight.grad.cpu()}
        moved = layer.last_stats.rows_moved
        if run.endswith("+recopy"):
            recopied = layer.last_stats.weight_copies   # copies this rank's node made, each received again
        layers.append(layer)
    # Free NVSHMEM buffers and IPC engines, newest first: the first layer initialised NVSHMEM and finalises it, and
    # NVSHMEM is not re-initialised after a finalize, so no layer is closed while another still uses it.
    for layer in reversed(layers):
        layer.close()
    return _compare(runs, _dense_reference(rank, world, router, w1, w2, xs, K)) | {"moved": moved,
                                                                                  "recopied": recopied}


@pytest.mark.gpu
@needs_2
def test_layer_nccl_balanced_equals_plain_ep():
    world = min(NGPU, 4)
    for res in run_dist(_gpu_worker, world, "torch", backend="nccl", timeout_s=300,
                        collective_timeout_s=COLLECTIVE_S):
        assert res["ok"] and res["moved"] > 0, res


@pytest.mark.gpu
@needs_nvshmem
@needs_2  # evaluated first (closest): on one GPU this test skips for its GPU count, not for nvshmem4py
def test_layer_nvshmem_balanced_equals_plain_ep():
    world = min(NGPU, 4)
    for res in run_dist(_gpu_worker, world, "nvshmem", backend="nccl", timeout_s=300,
                        collective_timeout_s=COLLECTIVE_S):
        assert res["ok"] and res["moved"] > 0, res


needs_1 = pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_1
@needs_nvshmem
def test_layer_two_processes_one_gpu():
    """NVSHMEM phase 1 and the CUDA IPC copy path with two processes on one GPU. ("auto" would pick IPC too: with
    processes sharing a GPU NVSHMEM runs limited; the NVSHMEM copy path is covered by the >= 2 GPU tests above,
    where "auto" picks it.)"""
    for res in run_dist(_gpu_worker, 2, "nvshmem", True, "ipc", backend="gloo", timeout_s=110,
                        collective_timeout_s=COLLECTIVE_S):
        assert res["ok"] and res["moved"] > 0, res


@pytest.mark.gpu
@needs_1
def test_layer_two_processes_one_gpu_without_nvshmem():
    """device='cuda' over a gloo group, the torch transport (phase 1 staged through host memory) and the CUDA IPC
    copy path: the layer's GPU path on a single GPU, balancing on == off.

    Also, in the same two processes, transposed (transformers-layout) expert weights copied per micro-batch
    (``_strided_worker``)."""
    # 115 s: inside gpu_check.sh's 125 s runtime step, so a stall fails here, by name
    results = run_dist(_one_gpu_worker, 2, backend="gloo", timeout_s=115, collective_timeout_s=COLLECTIVE_S)
    for res, strided in results:
        assert res["ok"] and res["moved"] > 0, res
        assert strided["ok"] and strided["offload"]["ok"], strided
    assert sum(s["moved"] for _, s in results) > 0 and sum(s["copies"] for _, s in results) > 0, results


def _one_gpu_worker(rank, world):
    return _gpu_worker(rank, world, "torch", True, "ipc"), _strided_worker(rank, world, "torch", "cuda", "ipc")


def _strided_worker(rank, world, transport, device, copy_path):
    """Expert weights stored transposed, as transformers stores them (``feplb.hf.FEPLBExperts`` computes with
    strided views), copied to helpers every micro-batch: the copy thread must flatten them on a stream ordered
    after the sends' ready event, before the copy path reads them. Balancing on == off, outputs and gradients
    (of the tokens, both expert parameters and the routing weights)."""
    from feplb import FEPLBConfig
    from feplb.hf import FEPLBExperts

    if device == "cuda":
        torch.cuda.set_device(0)
    E, H, F, K = 4 * world, 256, 128, 2
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(E, 2 * F, H, generator=gen) / 16).requires_grad_(True)
    down = (torch.randn(E, H, F, generator=gen) / 12).requires_grad_(True)
    x = torch.randn(512, H, generator=torch.Generator().manual_seed(rank))
    hot = torch.rand(512, generator=torch.Generator().manual_seed(100 + rank)) < 0.7
    scores = torch.rand(512, E, generator=torch.Generator().manual_seed(200 + rank))
    scores[hot, 0] = 2.0                                   # most tokens pick expert 0 (rank 0's): a straggler
    top_w, top_i = scores.softmax(-1).topk(K, dim=-1)
    runs, layers = {}, []
    for policy in ("none", "feplb-split"):
        cfg = FEPLBConfig(hidden=H, ffn=F, num_experts=E, top_k=K, gpus_per_node=world, dyn=2, policy=policy,
                          transport=transport, plan_wait_ms=10_000.0, min_straggler_rows=0, min_chunk=8,
                          weights="per-microbatch", device=device, copy_path=copy_path, router="external")
        layer = FEPLBExperts(cfg, None, gate_up, down, name="experts")
        assert not layer.expert_weights()[0].is_contiguous()
        if device == "cuda":
            # A long static GEMM (a 20 ms spin on the compute stream before it): copies ordered only after the
            # ready event, not after the flattening of the strided weights, would read them before they exist.
            static = layer._static_gemm

            def slow_static(*args, _static=static):
                torch.cuda._sleep(40_000_000)
                return _static(*args)

            layer._static_gemm = slow_static
        xs = x.to(device, copy=True).requires_grad_(True)
        tw = top_w.to(device, copy=True).requires_grad_(True)
        y = layer(xs, top_i.to(device), tw)
        y.square().sum().backward()
        runs[policy] = {"out": y.detach().cpu(), "dx": xs.grad.cpu(), "dgates": tw.grad.cpu(),
                        "dgate_up": layer.gate_up_proj.grad.cpu(), "ddown": layer.down_proj.grad.cpu()}
        moved, copies = layer.last_stats.rows_moved, layer.last_stats.weight_copies
        layers.append(layer)
    offload = _offload_check(layers[-1], {"gate_up_proj": gate_up, "down_proj": down}, rank, device)
    for layer in reversed(layers):
        layer.close()
    return _compare(runs) | {"moved": moved, "copies": copies, "offload": offload}


def _offload_check(layer, want: dict[str, torch.Tensor], rank: int, device: str) -> dict:
    """``full_state_dict(cpu_offload=True)`` gathers each expert parameter through the device and keeps it in CPU
    memory: rank 0 gets the model's whole tensors on the CPU, bit for bit, and the device holds nothing of them
    once it returns (without offloading, every whole tensor stays there); at its peak, about one parameter's. A
    weight tied under two names (one Linear reachable twice) is one CPU tensor under both."""
    from feplb.dropin import full_state_dict

    model = torch.nn.Module()
    model.experts = layer
    model.tied = model.again = torch.nn.Linear(4, 4, device=device)
    want = {f"experts.{k}": v.detach() for k, v in want.items()} | {
        f"{name}.{k}": v.detach().cpu() for name in ("tied", "again") for k, v in model.tied.state_dict().items()}
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    full = full_state_dict(model, cpu_offload=True)
    out = {"ok": True}
    if rank == 0:
        out["ok"] = sorted(full) == sorted(want) and all(
            full[k].device.type == "cpu" and torch.equal(full[k], want[k]) for k in want) and \
            full["tied.weight"].data_ptr() == full["again.weight"].data_ptr()
    else:
        out["ok"] = full == {}
    if device == "cuda":
        torch.cuda.synchronize()
        # gloo's worker thread drops its reference to a collective's tensors just after the caller's wait returns
        deadline = time.monotonic() + 2.0
        while torch.cuda.memory_allocated() > before and time.monotonic() < deadline:
            time.sleep(0.01)
        largest = max(w.numel() * w.element_size() for w in want.values())
        out |= {"held": torch.cuda.memory_allocated() - before, "peak": torch.cuda.max_memory_allocated() - before,
                "largest": largest}
        # a parameter's whole tensor, and the contiguous copy of this rank's strided shard beside it
        out["ok"] = out["ok"] and out["held"] == 0 and out["peak"] <= 2 * largest
    return out


def _sync_worker(rank, world, transport, one_gpu):
    """Forward and backward of a balancing layer under torch.cuda.set_sync_debug_mode("error") after the counts
    step (the all-gathered counts are the one host sync a forward makes). Returns the error text, or None."""
    from feplb import FEPLBConfig, MoELayer

    if one_gpu:
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    layer = MoELayer(FEPLBConfig(hidden=256, ffn=128, num_experts=4 * world, top_k=2, gpus_per_node=world, dyn=2,
                                 policy="feplb-split", transport=transport, plan_wait_ms=10_000.0,
                                 min_straggler_rows=0, min_chunk=8, device="cuda", dtype=torch.bfloat16,
                                 copy_path="auto"))
    with torch.no_grad():
        layer.router.weight[:, 0] = 0
        layer.router.weight[0, 0] = 3.0
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, generator=None)
    x[:, 0] = x[:, 0].abs() + 1
    x.requires_grad_(True)
    for _ in range(2):                      # compile and autotune the kernels first
        layer(x).float().square().sum().backward()
    count = layer._count

    def counted(*args, **kwargs):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return count(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    layer._count = counted
    err = None
    try:
        torch.cuda.set_sync_debug_mode("error")
        y = layer(x)
        y.float().square().sum().backward()
        torch.cuda.set_sync_debug_mode(0)
        moved = layer.last_stats.rows_moved
    except RuntimeError as exc:
        torch.cuda.set_sync_debug_mode(0)
        err, moved = str(exc).splitlines()[0], 0
    layer.close()
    return {"err": err, "moved": moved}


@pytest.mark.gpu
@needs_1
@needs_nvshmem  # the torch transport over gloo stages phase 1 through host memory, a sync by design
def test_no_host_sync_after_counts_one_gpu():
    results = run_dist(_sync_worker, 2, "nvshmem", True, backend="gloo", timeout_s=90,
                       collective_timeout_s=COLLECTIVE_S)
    for res in results:
        assert res["err"] is None, res["err"]
    assert sum(r["moved"] for r in results) > 0


@pytest.mark.gpu
@needs_2
def test_no_host_sync_after_counts_nccl():
    results = run_dist(_sync_worker, min(NGPU, 4), "torch", False, backend="nccl", timeout_s=300,
                       collective_timeout_s=COLLECTIVE_S)
    for res in results:
        assert res["err"] is None, res["err"]


def test_strided_worker_on_cpu():
    """The strided-weights worker above on CPU tensors (gloo ranks, shared-memory copy path): the GPU test's own
    logic is checked where no GPU is, so a GPU run is not spent on a broken test."""
    results = run_dist(_strided_worker, 2, "torch", "cpu", "auto", backend="gloo", timeout_s=120,
                       collective_timeout_s=30.0)
    for res in results:
        assert res["ok"] and res["offload"]["ok"], res
    assert sum(r["moved"] for r in results) > 0 and sum(r["copies"] for r in results) > 0, results


def test_gpu_worker_on_cpu():
    """The layer worker of the GPU tests on CPU tensors (gloo ranks, torch transport, shared-memory copy path):
    balancing on equals off, and both equal the fp64 dense reference, by the GPU tests' own criterion."""
    results = run_dist(_gpu_worker, 2, "torch", False, "auto", "cpu", backend="gloo", timeout_s=120,
                       collective_timeout_s=30.0)
    for res in results:
        assert res["ok"], res
        assert "recopy_on" in res["dx"], res
    assert results[0]["moved"] > 0 and results[0]["recopied"] > 0, results


def test_compare_names_the_tensor_off():
    """_compare passes fp32 rounding of reordered sums (which an element-wise rtol/atol fails) and fails an error
    of 1e-3 of a tensor's scale, naming that tensor."""
    gen = torch.Generator().manual_seed(7)
    off = {"out": torch.randn(64, 32, generator=gen), "dw1": torch.randn(4, 32, 64, generator=gen) * 1000}
    off["dw1"][0, 0, 0] = 1e-3                       # an element near zero of a large gradient
    rounded = {k: v.clone() for k, v in off.items()}
    rounded["dw1"][0, 0, 0] += 2e-4                  # ~1e-7 of the scale: fp32 rounding of a reordered sum
    assert not torch.allclose(rounded["dw1"], off["dw1"], rtol=1e-4, atol=1e-5)
    rep = _compare({"none": off, "feplb-split": rounded})
    assert rep["ok"], rep
    wrong = {k: v.clone() for k, v in off.items()}
    wrong["dw1"][1, 2, 3] += 1e-3 * off["dw1"].abs().max()
    rep = _compare({"none": off, "feplb-split": wrong})
    assert not rep["ok"] and rep["dw1"]["on_off"] > rep["dw1"]["bound"] and rep["out"]["on_off"] == 0, rep
    ref = {k: (v.double(), 0.0) for k, v in off.items()}
    rep = _compare({"none": wrong, "feplb-split": wrong}, ref)
    assert not rep["ok"] and rep["dw1"]["none_ref"] > rep["dw1"]["bound"] and rep["dw1"]["on_off"] == 0, rep
