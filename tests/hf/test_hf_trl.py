"""TRL's own trainers with FEPLB (``class SFT(feplb.hf.TrainerMixin, trl.SFTTrainer)``, and alike for DPO and GRPO)
on 4 gloo ranks as 2 nodes x 2, against the same TRL trainer on the unmodified model under DDP: a tiny Mixtral (rows
moving, ``feplb-split``) trained three steps of two accumulated micro-batches with clipping active, from a word-level
tokenizer and datasets made here (nothing downloaded). The logged losses and gradient norms and the whole
parameters after every step agree within 1e-5, relative to each tensor's largest element (in fp32: TRL's own
default is bf16 autocast; with TRL's default gradient checkpointing, whose recomputes replay the layers' forwards):

* SFT on prompt / completion pairs (the completion-only loss);
* DPO with a reference model copied before ``apply`` and given to both alike, its log-probabilities precomputed
  (TRL names that cache by a hash of ``model.state_dict()``, read with ``.numpy()`` while the trainer is built);
* GRPO with a reward function: every rank samples its own completions (``generate`` with FEPLB's layers kept in
  step while the ranks' sequences end apart), so the reward, the advantages and the loss follow the samples, which
  the two runs draw alike from logits equal up to rounding."""

from __future__ import annotations

import copy
import functools
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", minversion="5")
pytest.importorskip("trl")

from feplb.testing import load_module, run_dist  # noqa: E402

pytestmark = pytest.mark.dist

W, G = 4, 2
STEPS = 3
KINDS = ("sft", "dpo", "grpo")
PAD, EOS, BOS, UNK = 60, 61, 62, 63


def _trainer_tests():
    return load_module(Path(__file__).with_name("test_hf_trainer.py"))


def _tokenizer():
    """A word-level tokenizer over the tiny models' vocabulary: ``w0`` ... ``w59`` and four special tokens."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(PAD)}
    vocab.update({"[PAD]": PAD, "[EOS]": EOS, "[BOS]": BOS, "[UNK]": UNK})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]",
                                      bos_token="[BOS]", unk_token="[UNK]")


def _dataset(kind: str, n: int = 64):
    import datasets

    g = torch.Generator().manual_seed(11)

    def words(k: int, lead: str = "") -> list[str]:   # (a completion follows its prompt after a space)
        return [lead + " ".join(f"w{int(v)}" for v in torch.randint(0, PAD, (k,), generator=g)) for _ in range(n)]

    if kind == "sft":
        cols = {"prompt": words(4), "completion": words(4, " ")}
    elif kind == "dpo":
        cols = {"prompt": words(4), "chosen": words(3, " "), "rejected": words(3, " ")}
    else:
        cols = {"prompt": words(4)}
    return datasets.Dataset.from_dict(cols)


def _reward(completions, **kwargs) -> list[float]:
    """GRPO's reward: how many words of the upper half of the vocabulary a completion holds."""
    return [float(sum(int(w[1:]) >= PAD // 2 for w in c.split() if w[1:].isdigit())) for c in completions]


def _train(rank: int, world: int, kind: str, mode: str, out: str) -> dict:
    helpers = _trainer_tests()
    helpers._env(rank, world)
    import trl

    import feplb.hf

    model = helpers._models().make_model("mixtral", pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
    ref = copy.deepcopy(model) if kind == "dpo" else None   # (copied before apply, applied to alike below)
    base = {"sft": trl.SFTTrainer, "dpo": trl.DPOTrainer, "grpo": trl.GRPOTrainer}[kind]
    if mode == "plain":
        cls, full = base, (lambda m: m.state_dict())
    else:
        for m in (model, ref):
            if m is not None:
                feplb.hf.apply(m, policy=mode, gpus_per_node=G, min_straggler_rows=0, plan_wait_ms=60_000)
        cls = type(f"FEPLB{base.__name__}", (feplb.hf.TrainerMixin, base), {})
        full = functools.partial(feplb.hf.full_state_dict, rank0_only=False)
    common = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
                  learning_rate=0.05, max_grad_norm=0.5, optim="sgd", optim_args="momentum=0.9", use_cpu=True,
                  ddp_backend="gloo", report_to=[], logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True,
                  dataloader_num_workers=0, bf16=False)   # (TRL's default is bf16 autocast; gradient
    # checkpointing stays on, as TRL turns it on by default: the layers' recompute replays their forwards)
    kw = {}
    if kind == "sft":
        args = trl.SFTConfig(max_length=16, **common)
    elif kind == "dpo":
        args = trl.DPOConfig(max_length=16, precompute_ref_log_probs=True, **common)
        kw["ref_model"] = ref
    else:
        args = trl.GRPOConfig(max_completion_length=4, num_generations=2, **common)
        kw["reward_funcs"] = _reward
    snaps = helpers._Snapshots(full)
    trainer = cls(model=model, args=args, train_dataset=_dataset(kind), processing_class=_tokenizer(),
                  callbacks=[snaps], **kw)
    trainer.train()
    logs = [(h["loss"], float(h["grad_norm"])) for h in trainer.state.log_history if "loss" in h]
    return {"logs": logs, "steps": snaps.steps,
            "moved": [] if mode == "plain" else [lay.last_stats.rows_moved
                                                  for lay in feplb.hf.experts_modules(model)]}


def _both(rank: int, world: int, kind: str, out: str) -> dict:
    """The unmodified model's run, then FEPLB's, in one process (one start of the ranks for the two)."""
    return {mode: _train(rank, world, kind, mode, f"{out}/{mode}") for mode in ("plain", "feplb-split")}


@pytest.mark.parametrize("kind", KINDS)
def test_trl_trainers_train_as_on_the_unmodified_model(kind):
    with tempfile.TemporaryDirectory() as d:
        runs = run_dist(_both, W, kind, d, timeout_s=400)
    plain = runs[0]["plain"]
    for r in runs[1:]:   # DDP keeps the unmodified model equal on every rank
        assert all(torch.equal(a[k], b[k]) for a, b in zip(r["plain"]["steps"], plain["steps"], strict=True)
                   for k in a)
    assert len(plain["logs"]) == STEPS and all(norm > 0 for _, norm in plain["logs"][1:]), plain["logs"]
    for r in runs:
        _trainer_tests()._same_training(r["feplb-split"], plain)
    moved = [m for r in runs for m in r["feplb-split"]["moved"]]
    assert any(m > 0 for m in moved), moved   # balancing moved rows
