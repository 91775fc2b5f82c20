"""feplb.titan_ep in a whole torchtitan model, built the way torchtitan's trainer builds it: the ``qwen3_moe_debug``
training config (Qwen3-MoE debug model: 64 experts, top-8, its selective activation checkpointing), expert
parallelism 4 (2 nodes x 2) with FSDP over the dense parameters, FEPLB turned on by ``--override.imports`` as the
trainer parses and applies it, then ``update_from_config``, the overrides, a build on the meta device, torchtitan's
``parallelize_qwen3``, ``to_empty`` and ``init_weights``. One forward and backward of a language-model loss, against
the same model without the override: the same loss and every gradient at bfloat16's precision, rows moved.

CPU stand-ins, as in test_titan_ep.py, plus: flex attention (no CPU backward in torch) is replaced in both models by
causal SDPA, and FSDP reduces with SUM then scales (``set_force_sum_reduction_for_comms``), as gloo has no
PREMUL_SUM. The model keeps 1 of its 8 layers (the test's time) and the ``partial_dtensor`` SPMD backend (FSDP under
``spmd_types`` needs torchtitan's trainer set-up). Nothing of feplb is patched."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan.models.qwen3")

from pathlib import Path  # noqa: E402

from feplb.testing import load_module, run_dist  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORLD, LAYERS, SEQ = 4, 1, 64
SETTINGS = '{"policy": "feplb-split", "gpus_per_node": 2, "min_chunk": 1, "min_straggler_rows": 0, ' \
           '"plan_wait_ms": 60000}'


class _CausalSDPA(torch.nn.Module):
    """Flex attention's CPU stand-in: causal scaled-dot-product attention on [B, L, N, H]."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
            enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def _model(feplb: bool):
    """The trainer's model-building steps (torchtitan/trainer.py), with the CPU stand-ins."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config.override import OverrideConfig, apply_overrides, parse_cli_imports
    from torchtitan.distributed import utils as tdu
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    config = qwen3_moe_debug()
    config.parallelism.expert_parallel_degree = WORLD
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.seq_len, config.training.local_batch_size = SEQ, 1
    config.training.mixed_precision_param = "float32"
    model_config = config.model_spec.model
    model_config.layers = model_config.layers[:LAYERS]
    model_config.update_from_config(config=config)
    if feplb:   # as `--override.imports 'feplb.titan_ep.feplb_experts={...}'` gives it
        config.override = OverrideConfig(imports=parse_cli_imports([f"feplb.titan_ep.feplb_experts={SETTINGS}"]))
    replaced = apply_overrides(config.override, config) if config.override.imports else []
    with torch.device("meta"):
        model = model_config.build()
    tdu.set_spmd_backend(config.parallelism.spmd_backend)
    dims = ParallelDims.from_config(config.parallelism, WORLD)
    dims.build_mesh()
    model = config.model_spec.parallelize_fn(
        model, parallel_dims=dims, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=config.activation_checkpoint, dump_folder="")
    for layer in model.layers.values():
        layer.attention.inner_attention = _CausalSDPA()
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            mod.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        for layer in model.layers.values():   # a load-balancing bias toward the first experts: skewed routing
            bias = layer.moe.expert_bias_E
            bias = bias.to_local() if hasattr(bias, "to_local") else bias
            bias.copy_(torch.linspace(0.02, 0.0, bias.numel()))
    model.train()
    return model, replaced


def _job(rank: int, world: int) -> dict:
    from torch.distributed.tensor import DTensor

    ep = load_module(Path(__file__).with_name("test_titan_ep.py"))   # its CPU stand-ins and row count
    _cpu_torchtitan, _moved = ep._cpu_torchtitan, ep._moved
    _cpu_torchtitan()
    tokens = torch.randint(0, 2048, (1, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    out = {}
    for name in ("titan", "ours"):
        model, replaced = _model(name == "ours")
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                 for n, p in model.named_parameters() if p.grad is not None}
        inners = [layer.moe.routed_experts.inner_experts for layer in model.layers.values()]
        out[name] = {"loss": float(loss.detach()), "grads": grads, "replaced": len(replaced),
                     "classes": sorted({type(m).__name__ for m in inners}),
                     "moved": [_moved(m) for m in inners] if name == "ours" else []}
        for m in inners:
            if hasattr(m, "close"):
                m.close()
    return out


@pytest.fixture(scope="module")
def trained():
    return run_dist(_job, WORLD, timeout_s=600, collective_timeout_s=300)


def test_a_torchtitan_model_built_as_its_trainer_builds_it(trained):
    for r, res in enumerate(trained):
        ours, titan = res["ours"], res["titan"]
        assert ours["replaced"] == LAYERS and titan["replaced"] == 0, r
        assert ours["classes"] == ["FEPLBGroupedExperts"] and titan["classes"] == ["GroupedExperts"], r
        assert all(m > 0 for m in ours["moved"]), f"rank {r}: rows moved per layer {ours['moved']}"
        # bf16 experts on both sides, through attention and the loss: the same loss at bf16's precision
        assert abs(ours["loss"] - titan["loss"]) <= 1e-3 * abs(titan["loss"]), (r, ours["loss"], titan["loss"])
        assert sorted(ours["grads"]) == sorted(titan["grads"]), r
        assert any("inner_experts" in n for n in ours["grads"]), r
        for n, want in titan["grads"].items():
            got, scale = ours["grads"][n], want.abs().max()
            err = float((got - want).abs().max() / scale) if scale else float(got.abs().max())
            assert err <= 2e-2, f"rank {r}: gradient of {n} off torchtitan's by {err:.2e} (relative)"
