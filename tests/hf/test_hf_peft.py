"""PEFT's LoRA on a model ``feplb.hf.apply`` made expert-parallel (2 gloo ranks as one node of 2, tiny Qwen3-MoE,
rows moving): LoRA on the attention, made before or after ``apply``, gives the logits and every LoRA gradient of
the unmodified model with the same LoRA on the same input, and a step of the LoRA weights stays equal to its; LoRA on
the expert weights (``target_parameters``) is refused on every rank, at ``apply`` when PEFT came first, at the
forward when it came after (its parametrization would add a delta for every expert to this rank's shards)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", minversion="5")
pytest.importorskip("peft")

from feplb.testing import error_of, load_module, run_dist  # noqa: E402

pytestmark = pytest.mark.dist

TOL = 1e-5   # relative to each tensor's largest element, as tests/hf/test_hf.py


def _models():
    return load_module(Path(__file__).with_name("models.py"))


def _lora(kind: str):
    from peft import LoraConfig

    if kind == "attention":
        return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return LoraConfig(r=4, lora_alpha=8, target_modules=[], init_lora_weights=False,
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / (float(b.abs().max()) or 1.0)


def _peft(rank: int, world: int) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    from peft import get_peft_model

    import feplb.hf as fh

    M = _models()
    ids = M.tokens(rank, batch=4, seq=16)
    kw = dict(policy="feplb-split", gpus_per_node=world, min_straggler_rows=0, plan_wait_ms=60_000)

    def step(model) -> tuple[torch.Tensor, dict, dict]:
        """Logits, the LoRA gradients, and the LoRA weights after one SGD step."""
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
        grads = {n: p.grad.detach().clone() for n, p in lora.items()}
        with torch.no_grad():
            for p in lora.values():
                p.sub_(0.5 * p.grad)
        return out.logits.detach(), grads, {n: p.detach().clone() for n, p in lora.items()}

    ref = get_peft_model(M.make_model("qwen3_moe"), _lora("attention"))
    init = {k: v.detach().clone() for k, v in ref.state_dict().items() if "lora_" in k}
    want = step(ref)
    res: dict = {}
    for order in ("apply first", "peft first"):
        base = M.make_model("qwen3_moe")
        if order == "apply first":
            fh.apply(base, **kw)
            model = get_peft_model(base, _lora("attention"))
        else:
            model = get_peft_model(base, _lora("attention"))
            res[order, "applied"] = fh.apply(model, **kw)
        model.load_state_dict(init, strict=False)
        got = step(model)
        moved = sum(m.last_stats.rows_moved for m in fh.experts_modules(model))
        res[order] = {"logits": _rel(got[0], want[0]), "moved": moved, "names": sorted(got[1]) == sorted(want[1]),
                      "grads": max(_rel(got[1][n], want[1][n]) for n in want[1]),
                      "stepped": max(_rel(got[2][n], want[2][n]) for n in want[2])}
    # LoRA on the expert weights
    wrapped = get_peft_model(M.make_model("qwen3_moe"), _lora("experts"))
    res["experts, peft first"] = error_of(lambda: fh.apply(wrapped, **kw))
    applied = M.make_model("qwen3_moe")
    fh.apply(applied, **kw)
    lora_after = get_peft_model(applied, _lora("experts"))
    res["experts, apply first"] = error_of(lambda: lora_after(input_ids=ids))
    return res


@pytest.mark.slow
def test_lora_on_attention_is_exact_and_on_the_experts_refused():
    runs = run_dist(_peft, 2, timeout_s=240, collective_timeout_s=60)
    for rank, r in enumerate(runs):
        assert r["peft first", "applied"] == ["base_model.model.model.layers.0.mlp.experts",
                                              "base_model.model.model.layers.1.mlp.experts"], r
        for order in ("apply first", "peft first"):
            got = r[order]
            assert got["names"] and got["logits"] <= TOL and got["grads"] <= TOL and got["stepped"] <= TOL, \
                (rank, order, got)
        refused = r["experts, peft first"]
        assert refused is not None and refused.startswith("ValueError") and "peft.tuners.lora" in refused and \
            "LoRA on the expert weights" in refused and "nothing was replaced" in refused, (rank, refused)
        refused = r["experts, apply first"]
        assert refused is not None and refused.startswith("RuntimeError") and \
            "its expert parameters are parametrized" in refused, (rank, refused)
    assert sum(r["peft first"]["moved"] + r["apply first"]["moved"] for r in runs) > 0, runs


def _trainer(rank: int, world: int, out: str) -> dict:
    """transformers' Trainer on the unmodified model with LoRA on the attention, and feplb.hf.Trainer on the applied
    one (the experts frozen by PEFT, so holding no gradient): two steps of two micro-batches, clipping, a checkpoint."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    import transformers as tf
    from peft import get_peft_model

    import feplb.hf as fh

    M = _models()
    g = torch.Generator().manual_seed(5)
    data = [{"input_ids": r, "labels": r.clone()} for r in torch.randint(0, M.VOCAB, (16, 8), generator=g)]
    res = {}
    for mode in ("plain", "feplb"):
        base = M.make_model("qwen3_moe")
        if mode == "feplb":
            fh.apply(base, policy="feplb-split", gpus_per_node=world, min_straggler_rows=0, plan_wait_ms=60_000)
        model = get_peft_model(base, _lora("attention"))
        args = tf.TrainingArguments(output_dir=os.path.join(out, mode), per_device_train_batch_size=2,
                                    gradient_accumulation_steps=2, max_steps=2, learning_rate=0.5, max_grad_norm=0.1,
                                    optim="sgd", use_cpu=True, ddp_backend="gloo", report_to=[], logging_steps=1,
                                    save_strategy="steps", save_steps=2, seed=0, disable_tqdm=True)
        cls = tf.Trainer if mode == "plain" else fh.Trainer
        trainer = cls(model=model, args=args, train_dataset=data)
        res[mode] = {"error": error_of(trainer.train)}
        res[mode]["lora"] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        res[mode]["logs"] = [(h["loss"], float(h["grad_norm"])) for h in trainer.state.log_history if "loss" in h]
    return res


@pytest.mark.slow
def test_lora_on_attention_trains_with_the_trainer(tmp_path):
    """feplb.hf.Trainer with LoRA on the attention (frozen experts): it trained as transformers' Trainer trains the
    unmodified model with the same LoRA (its optimizer's attachment registered a hook on each expert parameter, which
    torch refuses on one that requires no gradient: every rank raised in create_optimizer)."""
    runs = run_dist(_trainer, 2, str(tmp_path), timeout_s=240, collective_timeout_s=60)
    for rank, r in enumerate(runs):
        assert r["plain"]["error"] is None and r["feplb"]["error"] is None, (rank, r["plain"]["error"],
                                                                            r["feplb"]["error"])
        got, want = r["feplb"], r["plain"]
        assert got["lora"].keys() == want["lora"].keys() and want["lora"]
        assert max(_rel(got["lora"][n], want["lora"][n]) for n in want["lora"]) <= TOL, rank
        assert len(got["logs"]) == len(want["logs"]) == 2
        for (loss, norm), (loss0, norm0) in zip(got["logs"], want["logs"], strict=True):
            assert abs(loss - loss0) <= TOL * loss0 and abs(norm - norm0) <= TOL * norm0 and norm0 > 0.1, r["feplb"]
