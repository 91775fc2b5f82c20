"""feplb.hf.Trainer: transformers' own Trainer (DDP over 4 gloo ranks as 2 nodes x 2) trains a tiny Qwen3-MoE as it
trains the unmodified model: the same logged losses and gradient norms, the same parameters after every step
(gradient accumulation over two micro-batches, clipping active), with rows moving (feplb-split) and with per-step
expert replicas (feplb-split@ema). Its checkpoints hold the whole model (plain transformers loads it) and every
rank's optimizer state: resuming from the middle of a run ends where the uninterrupted run ends, and the optimizer
state loads at another number of ranks. Setups it cannot run exactly are refused at construction."""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", minversion="5")
pytest.importorskip("accelerate")

from feplb.testing import load_module, run_dist  # noqa: E402

pytestmark = pytest.mark.dist

W, G = 4, 2
STEPS = 4
TOL = 1e-5


def _models():
    return load_module(Path(__file__).with_name("models.py"))


def _dataset(n: int = 64, seq: int = 8) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, _models().VOCAB, (n, seq), generator=g)
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


def _env(rank: int, world: int) -> None:
    """What accelerate reads to see the process group run_dist made."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")


def _args(out: str, optim: str, **kw):
    import transformers as tf

    base = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
                learning_rate=0.05, max_grad_norm=0.5, optim=optim, use_cpu=True, ddp_backend="gloo", report_to=[],
                logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0,
                lr_scheduler_type="linear")
    if optim == "sgd":
        base["optim_args"] = "momentum=0.9"
    base.update(kw)
    return tf.TrainingArguments(**base)


class _Snapshots:
    """A TrainerCallback keeping the whole parameters after every step (gathered: collective on every rank)."""

    def __init__(self, full):
        self.full, self.steps = full, []

    def __getattr__(self, name):           # every other TrainerCallback event: nothing
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_step_end(self, args, state, control, model=None, **kw):
        self.steps.append({k: v.detach().clone() for k, v in self.full(model).items()})


def _train(rank, world, mode, out, optim, resume=None, save_steps=None):
    _env(rank, world)
    import feplb.hf

    model = _models().make_model("qwen3_moe")
    if mode == "plain":
        import transformers as tf

        cls, full = tf.Trainer, (lambda m: m.state_dict())
    else:
        policy, _, layout = mode.partition("/")
        groups = {}
        if layout == "ep2xdp2":   # EP groups {0, 1} and {2, 3}; ranks 0 and 2 (1 and 3) hold the same experts
            import torch.distributed as dist

            eps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            groups = dict(group=eps[rank // 2])
        feplb.hf.apply(model, policy=policy, gpus_per_node=G, min_straggler_rows=0, plan_wait_ms=60_000, **groups)
        cls, full = feplb.hf.Trainer, (lambda m: feplb.hf.full_state_dict(m, rank0_only=False))
        if groups:
            cls = functools.partial(cls, data_parallel_group=dps[rank % 2])
    kw = {} if save_steps is None else dict(save_strategy="steps", save_steps=save_steps)
    snaps = _Snapshots(full)
    trainer = cls(model=model, args=_args(out, optim, **kw), train_dataset=_dataset(), callbacks=[snaps])
    trainer.train(resume_from_checkpoint=resume)
    logs = [(h["loss"], float(h["grad_norm"])) for h in trainer.state.log_history if "loss" in h]
    return {"logs": logs, "steps": snaps.steps, "flos": trainer.state.total_flos,
            "policy": None if mode == "plain" else feplb.hf.policy_state_dict(model)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / (scale or 1.0)


def _same_training(got: dict, want: dict, tol: float = TOL) -> None:
    assert len(got["steps"]) == len(want["steps"]) > 0
    for (loss, norm), (loss0, norm0) in zip(got["logs"], want["logs"], strict=True):
        assert abs(loss - loss0) <= tol * abs(loss0) and abs(norm - norm0) <= tol * norm0, (got["logs"], want["logs"])
    for step, (sd, ref) in enumerate(zip(got["steps"], want["steps"], strict=True)):
        assert sd.keys() == ref.keys()
        worst = max(ref, key=lambda k: _rel(sd[k], ref[k]))
        assert _rel(sd[worst], ref[worst]) <= tol, (step, worst, _rel(sd[worst], ref[worst]))


@pytest.fixture(scope="module")
def plain():
    with tempfile.TemporaryDirectory() as d:
        runs = run_dist(_train, W, "plain", d, "sgd", timeout_s=300)
    for r in runs[1:]:   # DDP keeps the unmodified model equal on every rank
        assert all(torch.equal(a[k], b[k]) for a, b in zip(r["steps"], runs[0]["steps"], strict=True) for k in a)
    # clipping acts in every step (the norm is above max_grad_norm), so a norm counted wrong changes the step
    assert all(norm > 0.5 for _, norm in runs[0]["logs"]), runs[0]["logs"]
    return runs[0]


@pytest.mark.parametrize("policy", ["feplb-split", "feplb-split@ema", "feplb-split/ep2xdp2"])
def test_trains_as_the_unmodified_model(plain, policy):
    """On 4 ranks: EP over all 4, or EP 2 x data-parallel 2 (feplb-split/ep2xdp2: the Trainer given the
    data-parallel group), against the unmodified model under DDP over the 4."""
    with tempfile.TemporaryDirectory() as d:
        runs = run_dist(_train, W, policy, d, "sgd", timeout_s=300)
    for r in runs:
        _same_training(r, plain)
        # transformers' FLOP estimate counts the unmodified model's parameters, every expert included
        assert r["flos"] == pytest.approx(plain["flos"], rel=1e-9) and plain["flos"] > 0, (r["flos"], plain["flos"])


def _subclasses(rank, world, out):
    """Trainer subclasses as TRL's are made: one hashing model.state_dict() with .numpy() in its construction (DPO's
    cache name of reference log-probs), one holding a reference model whose parameters a callback mixes into the
    model's one by one (sync_ref_model), one wrapping the model in DDP in its construction and one stepping in a loop
    of its own (TRL's PPOTrainer does both)."""
    _env(rank, world)
    import dataclasses

    import transformers as tf

    import feplb.hf
    from feplb.testing import error_of

    class Hashing(tf.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.digest = sum(float(t.cpu().numpy().sum()) for t in self.model.state_dict().values())

    class WithRef(tf.Trainer):
        def __init__(self, model, ref_model, *args, **kwargs):
            super().__init__(model, *args, **kwargs)
            self.ref_model = ref_model

    @dataclasses.dataclass
    class RefArgs(tf.TrainingArguments):
        sync_ref_model: bool = False

    class Wrapping(tf.Trainer):   # as TRL's PPOTrainer: the model in a module of its own, prepared (DDP) at once
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.model = torch.nn.parallel.DistributedDataParallel(torch.nn.ModuleDict({"policy": self.model}))

    class OwnLoop(tf.Trainer):    # a loop of its own, not through training_step (PPOTrainer's train())
        def train(self, *args, **kwargs):
            self.create_optimizer()
            batch = {k: torch.stack([d[k] for d in _dataset()[:2]]) for k in ("input_ids", "labels")}
            self.model(**batch).loss.backward()
            self.optimizer.step()

    class FHashing(feplb.hf.TrainerMixin, Hashing):
        pass

    class FWrapping(feplb.hf.TrainerMixin, Wrapping):
        pass

    class FOwnLoop(feplb.hf.TrainerMixin, OwnLoop):
        pass

    class FWithRef(feplb.hf.TrainerMixin, WithRef):
        pass

    model = _models().make_model("qwen3_moe")
    twin = _models().make_model("qwen3_moe")
    feplb.hf.apply(model, policy="feplb-split", gpus_per_node=G)
    feplb.hf.apply(twin, policy="feplb-split", gpus_per_node=G)
    plain_ref = _models().make_model("qwen3_moe")
    hashing = FHashing(model=model, args=_args(out, "sgd"), train_dataset=_dataset())
    # the model's state dict is sharded again after the construction
    after = type(next(t for k, t in model.state_dict().items() if k.endswith("gate_up_proj"))).__name__

    def with_ref(ref, sync):
        return error_of(lambda: FWithRef(model, ref, args=RefArgs(**{**_args(out, "sgd").to_dict(), "output_dir": out,
                                                                     "sync_ref_model": sync}),
                                         train_dataset=_dataset()))

    wrapped = _models().make_model("qwen3_moe")
    feplb.hf.apply(wrapped, policy="feplb-split", gpus_per_node=G)
    own = _models().make_model("qwen3_moe")
    feplb.hf.apply(own, policy="feplb-split", gpus_per_node=G)
    return {"digest": hashing.digest, "after": after, "sync_plain": with_ref(plain_ref, True),
            "sync_applied": with_ref(twin, True), "nosync_plain": with_ref(plain_ref, False),
            "wrapping": error_of(lambda: FWrapping(model=wrapped, args=_args(out, "sgd"), train_dataset=_dataset())),
            "own_loop": error_of(lambda: FOwnLoop(model=own, args=_args(out, "sgd"), train_dataset=_dataset()).train())}


def test_trl_like_subclasses():
    with tempfile.TemporaryDirectory() as d:
        runs = run_dist(_subclasses, 2, d, timeout_s=200)
    for r in runs:
        # the state dict hashed in the construction is the same on every rank (each expert parameter every rank's
        # digest of its shard): what TRL's DPO names its cache of reference log-probs by, which every rank looks up
        assert r["digest"] != 0 and r["digest"] == runs[0]["digest"] and r["after"] == "DTensor", r
        assert r["sync_plain"] is not None and r["sync_plain"].startswith("ValueError") and \
            "sync_ref_model mixes the model's parameters" in r["sync_plain"], r["sync_plain"]
        assert r["sync_plain"] == runs[0]["sync_plain"]
        assert r["sync_applied"] is None and r["nosync_plain"] is None, r
        # a trainer wrapping the model in DDP in its construction (TRL's PPOTrainer), or stepping in a loop of its
        # own: refused on every rank, at the construction and at the step
        assert r["wrapping"] is not None and r["wrapping"].startswith("ValueError") and \
            "wrapped a module holding FEPLB experts in DistributedDataParallel" in r["wrapping"], r["wrapping"]
        assert r["own_loop"] is not None and "average_expert_grads" in r["own_loop"], r["own_loop"]


def _evaluated_first(rank, world, out):
    """evaluate() before the first train(): accelerate prepared the model for evaluation only, so train() would run
    without DDP (the ranks' replicated parameters parting): refused on every rank, naming the way out, which then
    trains with the ranks' replicated parameters equal; torch_compile (DDP inside the compiled module) trains."""
    _env(rank, world)
    import torch.distributed as dist

    import feplb.hf
    from feplb.testing import error_of

    def trainer(**kw):
        model = _models().make_model("qwen3_moe")
        feplb.hf.apply(model, policy="feplb-split", gpus_per_node=G)
        return feplb.hf.Trainer(model=model, args=_args(out, "sgd", per_device_eval_batch_size=2, **kw),
                                train_dataset=_dataset(), eval_dataset=_dataset(7))

    first = trainer()
    loss = first.evaluate()["eval_loss"]
    refused = error_of(first.train)
    # accelerate compiles the model after wrapping it in DDP (an OptimizedModule over DDP): not refused
    compiled = error_of(trainer(torch_compile=True, torch_compile_backend="eager", max_steps=1).train)
    inside = trainer(eval_on_start=True)
    inside.train()
    evals = [h["eval_loss"] for h in inside.state.log_history if "eval_loss" in h]
    replicated = torch.cat([p.detach().flatten() for n, p in inside.model.named_parameters() if "experts" not in n])
    everyone = [torch.empty_like(replicated) for _ in range(world)]
    dist.all_gather(everyone, replicated)
    return {"loss": loss, "refused": refused, "compiled": compiled, "evals": evals,
            "equal": all(torch.equal(t, everyone[0]) for t in everyone)}


def test_evaluate_before_train_is_refused_on_every_rank():
    with tempfile.TemporaryDirectory() as d:
        runs = run_dist(_evaluated_first, 2, d, timeout_s=200)
    for r in runs:
        assert r["loss"] == runs[0]["loss"] and r["refused"] is not None, r
        assert r["refused"].startswith("RuntimeError") and "outside DistributedDataParallel" in r["refused"] and \
            "eval_on_start=True" in r["refused"], r["refused"]
        assert r["evals"] == [runs[0]["loss"]] and r["equal"] and r["compiled"] is None, r


def _experts_alone(rank, world, out):
    """Only the experts trainable (ESFT's expert-only fine-tuning): accelerate's DDP, which the expert shards stay
    out of, would have no parameter to train and raise in train() with torch's message; refused at construction on
    every rank, naming the way out; with the router trainable too it trains."""
    _env(rank, world)
    import feplb.hf
    from feplb.testing import error_of

    def trainer(router: bool):
        model = _models().make_model("qwen3_moe")
        feplb.hf.apply(model, policy="feplb-split", gpus_per_node=G)
        for name, p in model.named_parameters():
            p.requires_grad_(".experts." in name or (router and name.endswith("mlp.gate.weight")))
        return feplb.hf.Trainer(model=model, args=_args(out, "sgd", max_steps=1), train_dataset=_dataset())

    alone = error_of(lambda: trainer(router=False))
    with_router = error_of(lambda: trainer(router=True).train())
    return {"alone": alone, "with_router": with_router}


def test_experts_alone_trainable_is_refused_at_construction():
    with tempfile.TemporaryDirectory() as d:
        runs = run_dist(_experts_alone, 2, d, timeout_s=200)
    for r in runs:
        assert r["alone"] is not None and r["alone"].startswith("ValueError: feplb.hf.Trainer: only the experts "
                                                                "train") and "your own loop" in r["alone"], r
        assert r["with_router"] is None, r


def test_the_mixin_after_a_trainer_class_is_refused_at_class_creation():
    """After transformers.Trainer among the bases, the mixin's per-step calls are shadowed (each rank would clip its
    own experts): refused when the class is made; first among the bases, or over a Trainer subclass, it is taken."""
    import transformers as tf

    import feplb.hf

    class Mine(tf.Trainer):
        pass

    for bases in ((tf.Trainer, feplb.hf.TrainerMixin), (Mine, feplb.hf.TrainerMixin)):
        with pytest.raises(TypeError, match="put feplb.hf.TrainerMixin first among the bases"):
            type("Late", bases, {})
    assert type("Early", (feplb.hf.TrainerMixin, Mine), {}).__mro__[1] is feplb.hf.TrainerMixin
    assert issubclass(feplb.hf.Trainer, tf.Trainer)


def test_ref_model_problem():
    from feplb.hf_trainer import ref_model_problem

    def net(*shapes):
        m = torch.nn.Module()
        for i, shape in enumerate(shapes):
            m.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(shape)))
        return m

    assert ref_model_problem(net((4, 3), (2, 5)), None) is None
    assert ref_model_problem(net((4, 3), (2, 5)), net((4, 3), (2, 5))) is None
    for ref in (net((4, 3), (1, 5)), net((4, 3)), net((4, 3), (2, 5), (1,))):
        why = ref_model_problem(net((4, 3), (2, 5)), ref) or ""
        assert "sync_ref_model" in why and "pass it as ref_model" in why, ref
        # a trainer loading its reference model itself (GRPO, RLOO) is not told to pass one
        why = ref_model_problem(net((4, 3), (2, 5)), ref, takes_ref_model=False) or ""
        assert "set sync_ref_model=False" in why and "pass it as ref_model" not in why, why


def test_which_trainers_take_a_ref_model():
    """The sync_ref_model refusal's advice follows the Trainer class under the mixin: TRL's DPOTrainer takes a
    ref_model, GRPO's and RLOO's load theirs from the model's path."""
    trl = pytest.importorskip("trl")
    import feplb.hf
    from feplb.hf_trainer import _takes_ref_model

    def mixed(base):
        return type("X", (feplb.hf.TrainerMixin, base), {})

    assert _takes_ref_model(mixed(trl.DPOTrainer))
    assert not _takes_ref_model(mixed(trl.GRPOTrainer))
    assert not _takes_ref_model(mixed(trl.RLOOTrainer))
    assert not _takes_ref_model(feplb.hf.Trainer)


def _checkpointed(rank, world, out):
    """4 steps saving at steps 2 and 4 (AdamW: its state matters), the optimizer's whole state at each save
    gathered by a callback; then a fresh model resumed from step 2's checkpoint."""
    _env(rank, world)
    import transformers as tf
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    import feplb.hf

    first = _train(rank, world, "feplb-split", out, "adamw_torch", save_steps=2)
    resumed = _train(rank, world, "feplb-split", out + "_resumed", "adamw_torch",
                     resume=os.path.join(out, "checkpoint-2"), save_steps=2)
    # @ema: the dynamic sets and the copies held for each step follow the layers' histories, which the checkpoint
    # keeps; resumed from a copy of the checkpoint without them (an older checkpoint's), the histories start afresh
    import shutil

    import torch.distributed as dist

    ema = _train(rank, world, "feplb-split@ema", out + "_ema", "adamw_torch", save_steps=2)
    ckpt, bare = os.path.join(out + "_ema", "checkpoint-2"), out + "_ema_bare"
    if rank == 0:
        shutil.copytree(ckpt, bare)
        os.remove(os.path.join(bare, "policy_feplb.pt"))
    dist.barrier()
    ema_resumed = _train(rank, world, "feplb-split@ema", out + "_ema_resumed", "adamw_torch", resume=ckpt,
                         save_steps=2)
    ema_bare = _train(rank, world, "feplb-split@ema", out + "_ema_bare_resumed", "adamw_torch", resume=bare,
                      save_steps=2)
    # EP 2 x DP 2: each EP group trains on its own data, and resumes its own histories
    epdp_first = _train(rank, world, "feplb-split@ema/ep2xdp2", out + "_epdp", "adamw_torch", save_steps=2)
    epdp_resumed = _train(rank, world, "feplb-split@ema/ep2xdp2", out + "_epdp_resumed", "adamw_torch",
                          resume=os.path.join(out + "_epdp", "checkpoint-2"), save_steps=2)
    # the final model as plain transformers loads it from the last checkpoint
    loaded = tf.Qwen3MoeForCausalLM.from_pretrained(os.path.join(out, "checkpoint-4")).state_dict()
    files = sorted(os.listdir(os.path.join(out, "checkpoint-2")))
    modes = [os.stat(os.path.join(out, "checkpoint-2", f)).st_mode & 0o777 for f in ("policy_feplb.pt",
                                                                                   "trainer_state.json")]
    # the optimizer state saved at step 2, gathered whole, for the load at another number of ranks
    model = _models().make_model("qwen3_moe")
    feplb.hf.apply(model, policy="feplb-split", gpus_per_node=G)
    trainer = feplb.hf.Trainer(model=model, args=_args(out + "_x", "adamw_torch"), train_dataset=_dataset())
    trainer.create_optimizer_and_scheduler(num_training_steps=STEPS)
    trainer._load_optimizer_and_scheduler(os.path.join(out, "checkpoint-2"))
    whole = get_optimizer_state_dict(model, trainer.optimizer, options=StateDictOptions(full_state_dict=True))
    # EP 2 x DP 2 with ranks 2 and 3 passing their EP group as the data-parallel group (the right size, the wrong
    # ranks): refused on every rank, naming them; the right groups are taken
    import torch.distributed as dist

    from feplb.testing import error_of

    ep = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    model = _models().make_model("qwen3_moe")
    feplb.hf.apply(model, group=ep, policy="feplb-split", gpus_per_node=2)
    epdp = [error_of(lambda g=g: feplb.hf.Trainer(model=model, args=_args(out + "_z", "sgd"), train_dataset=_dataset(),
                                                  data_parallel_group=g))
            # (a list of ranks on rank 0 alone: dist.new_group's argument, not a group; it failed there alone)
            for g in (ep if rank >= 2 else dp, dp, [0, 2] if rank == 0 else dp)]
    return {"first": first, "resumed": resumed, "loaded": loaded, "files": files, "modes": modes, "epdp": epdp,
            "opt_state": whole["state"], "lr": trainer.lr_scheduler.get_last_lr(), "ema": ema,
            "ema_resumed": ema_resumed, "ema_bare": ema_bare, "epdp_first": epdp_first, "epdp_resumed": epdp_resumed}


def _load_elsewhere(rank, world, out):
    _env(rank, world)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    import feplb.hf

    model = _models().make_model("qwen3_moe")
    unsharded = model.model.layers[1].mlp.experts.gate_up_proj.detach().clone()
    feplb.hf.apply(model, policy="feplb-split", gpus_per_node=1)
    # DDP around the applied model (apply left the shards out of it) keeps each rank's own experts
    torch.nn.parallel.DistributedDataParallel(model)
    kept = torch.equal(model.model.layers[1].mlp.experts.gate_up_proj, unsharded.chunk(world)[rank])
    trainer = feplb.hf.Trainer(model=model, args=_args(out + "_y", "adamw_torch"), train_dataset=_dataset())
    trainer.create_optimizer_and_scheduler(num_training_steps=STEPS)
    trainer._load_optimizer_and_scheduler(os.path.join(out, "checkpoint-2"))
    whole = get_optimizer_state_dict(model, trainer.optimizer, options=StateDictOptions(full_state_dict=True))
    # an optimizer whose update reads a whole tensor's statistics: refused when the Trainer makes it
    from feplb.testing import error_of

    ada = feplb.hf.Trainer(model=model, args=_args(out + "_a", "adafactor"), train_dataset=_dataset())
    # FSDP through accelerate, asked for in the arguments (on the CPU accelerate would drop it and run on)
    fsdp = error_of(lambda: feplb.hf.Trainer(model=model, args=_args(out + "_f", "sgd", fsdp="full_shard"),
                                             train_dataset=_dataset()))
    # a checkpoint on a disk of each node's own: rank 1 does not see DCP's metadata; every rank raises (the load is
    # collective: the ranks that see it waited in it)
    import unittest.mock

    real = os.path.isfile
    unseen = (lambda p: False if p.endswith(".metadata") else real(p)) if rank == 1 else real
    with unittest.mock.patch("feplb.hf_trainer.os.path.isfile", unseen):
        node_local = error_of(lambda: trainer._load_model_shards(os.path.join(out, "checkpoint-2")))
    # the balancing histories unreadable on rank 1 alone: every rank raises, naming it (none waits in a collective)
    real_load = torch.load

    def unreadable(path, *a, **kw):
        if rank == 1 and str(path).endswith("policy_feplb.pt"):
            raise OSError("stale file handle")
        return real_load(path, *a, **kw)

    with unittest.mock.patch("feplb.hf_trainer.torch.load", unreadable):
        policy_unread = error_of(lambda: trainer._load_model_shards(os.path.join(out, "checkpoint-2")))
    # read at 2 ranks, the 4-rank histories are for another EP layout: the layers start afresh, with a warning
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer._load_model_shards(os.path.join(out, "checkpoint-2"))
    afresh = [str(w.message) for w in caught if "start theirs afresh" in str(w.message)]
    return {"opt_state": whole["state"], "lr": trainer.lr_scheduler.get_last_lr(), "kept": kept,
            "adafactor": error_of(ada.create_optimizer), "fsdp": fsdp, "node_local": node_local,
            "policy_unread": policy_unread, "afresh": afresh}


def _same_policy(a, b) -> bool:
    """Whether two policy_state_dict results are equal, entry by entry (layer names -> lists of entries)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_policy(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_policy(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_checkpoints_resume_and_load_elsewhere():
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "run")
        runs = run_dist(_checkpointed, W, out, timeout_s=400)
        elsewhere = run_dist(_load_elsewhere, 2, out, timeout_s=200)
    r0 = runs[0]
    for r in runs:
        # resumed at step 2: steps 3 and 4 end where the uninterrupted run's do (RNG, data order, weights and the
        # optimizer's state restored)
        assert len(r["resumed"]["steps"]) == 2
        for sd, ref in zip(r["resumed"]["steps"], r["first"]["steps"][2:], strict=True):
            worst = max(ref, key=lambda k: _rel(sd[k], ref[k]))
            assert _rel(sd[worst], ref[worst]) <= 1e-6, (worst, _rel(sd[worst], ref[worst]))
        # the checkpoint's model is the whole trained model, in the unmodified model's names and shapes
        final = r["first"]["steps"][-1]
        assert r["loaded"].keys() == final.keys()
        assert all(torch.equal(r["loaded"][k], final[k]) for k in final)
        assert r["opt_state"].keys() == r0["opt_state"].keys()
    # DCP's folder for the optimizer, no rank-0-only optimizer.pt of transformers' own; the balancing histories
    assert "optimizer_feplb" in r0["files"] and "optimizer.pt" not in r0["files"], r0["files"]
    assert "policy_feplb.pt" in r0["files"], r0["files"]
    assert r0["modes"][0] == r0["modes"][1], [oct(m) for m in r0["modes"]]   # (as the checkpoint's other files)
    for rank, r in enumerate(runs):
        # @ema resumed with the histories: steps 3 and 4 bit for bit the uninterrupted run's, histories equal
        assert len(r["ema_resumed"]["steps"]) == 2
        # (the resumed Trainer's log history starts with the checkpoint's)
        assert r["ema_resumed"]["logs"] == r["ema"]["logs"], (rank, r["ema_resumed"]["logs"], r["ema"]["logs"])
        for sd, ref in zip(r["ema_resumed"]["steps"], r["ema"]["steps"][2:], strict=True):
            assert all(torch.equal(sd[k], ref[k]) for k in ref), (rank, [k for k in ref if not torch.equal(sd[k],
                                                                                                      ref[k])])
        assert _same_policy(r["ema_resumed"]["policy"], r["ema"]["policy"]), rank
        assert all(len(hs) == 1 and hs[0]["ep_ranks"] == [0, 1, 2, 3] and int(hs[0]["step"]) > 0
                   for hs in r["ema"]["policy"].values()), r["ema"]["policy"]
        # without them the layers started afresh: another history at the end (fewer micro-batches seen)
        assert not _same_policy(r["ema_bare"]["policy"], r["ema"]["policy"]), rank
        # EP x DP: both groups' histories saved, each restored to its own group
        assert [h["ep_ranks"] for h in r["epdp_first"]["policy"]["model.layers.0.mlp.experts"]] == [[0, 1], [2, 3]]
        assert not _same_policy(*r["epdp_first"]["policy"]["model.layers.0.mlp.experts"]), "the groups' histories"
        assert _same_policy(r["epdp_resumed"]["policy"], r["epdp_first"]["policy"]), rank
        for sd, ref in zip(r["epdp_resumed"]["steps"], r["epdp_first"]["steps"][2:], strict=True):
            assert all(torch.equal(sd[k], ref[k]) for k in ref), rank
    # the optimizer state: every expert's moments there, and equal at 2 ranks to what 4 ranks load
    expert_keys = [k for k in r0["opt_state"] if k.endswith(("gate_up_proj", "down_proj"))]
    assert expert_keys and all(r0["opt_state"][k]["exp_avg"].shape[0] == 8 for k in expert_keys)
    assert all(r0["opt_state"][k]["exp_avg"].abs().amax(dim=(1, 2)).gt(0).all() for k in expert_keys)
    for rank, r in enumerate(runs):
        wrong, right, listed = r["epdp"]
        assert listed == "ValueError: feplb.hf.Trainer: data_parallel_group must be a torch.distributed.ProcessGroup " \
            "(dist.new_group(ranks)), got list (on rank(s) [0])", (rank, listed)
        assert wrong is not None and wrong.startswith("ValueError") and "data_parallel_group must hold" in wrong, \
            (rank, wrong)
        assert wrong == runs[0]["epdp"][0], "the same refusal on every rank"
        assert right is None, right
    for r in elsewhere:
        assert r["kept"]
        assert r["node_local"] is not None and "lacks DCP's .metadata on global rank(s) [1]" in r["node_local"], \
            r["node_local"]
        assert r["policy_unread"] is not None and "could not be read on global rank(s) [1] (OSError: stale file" \
            in r["policy_unread"], r["policy_unread"]
        assert len(r["afresh"]) == 1 and "model.layers.0.mlp.experts" in r["afresh"][0], r["afresh"]
        assert r["adafactor"] is not None and "Adafactor: its update clipping takes the RMS of the whole tensor" in \
            r["adafactor"], r["adafactor"]
        assert r["fsdp"] is not None and "FSDP through accelerate would shard the expert shards again" in r["fsdp"], \
            r["fsdp"]
        assert r["lr"] == r0["lr"]
        for k, st in r0["opt_state"].items():
            for name, t in st.items():
                assert torch.equal(r["opt_state"][k][name], t), (k, name)


def test_refuses_what_it_cannot_run_exactly(tmp_path):
    import feplb.hf
    from feplb.hf_trainer import trainer_problem

    with pytest.raises(ValueError, match=r"feplb.hf.Trainer: the model holds no FEPLB experts module; call "
                                         r"feplb.hf.apply\(model\)"):
        feplb.hf.Trainer(model=_models().make_model("qwen3_moe"), args=_args(str(tmp_path), "sgd", ddp_backend=None),
                         train_dataset=_dataset())

    ok = dict(has_experts=True, distributed_type="MULTI_CPU", deepspeed=False, fsdp=False, n_gpu=1, tp_size=1,
              xla=False, sagemaker_mp=False)
    assert trainer_problem(**ok) is None
    assert trainer_problem(**{**ok, "distributed_type": "MULTI_GPU"}) is None
    from feplb.hf_trainer import _groups_problem, optimizer_problem

    # EP x DP group layouts, as every rank's (per layer: EP group's ranks, index there; data-parallel group's ranks)
    def infos(eps, dps):
        return [(((ep, ep.index(r)),) * 2, dp) for r in range(4)
                for ep in [next(e for e in eps if r in e)] for dp in [None if dps is None else dps[r]]]

    contiguous, strided = [(0, 1), (2, 3)], [(0, 2), (1, 3)]
    assert _groups_problem(infos(contiguous, {0: (0, 2), 2: (0, 2), 1: (1, 3), 3: (1, 3)})) is None
    assert _groups_problem(infos(strided, {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)})) is None
    assert _groups_problem(infos([(0, 1, 2, 3)], None)) is None
    for eps, dps in [(contiguous, None),                                            # EP smaller than the world
                     (contiguous, {0: (0, 3), 3: (0, 3), 1: (1, 2), 2: (1, 2)}),   # other experts' ranks
                     (contiguous, {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}),   # the EP groups themselves
                     (contiguous, {0: (0, 2), 2: (1, 2), 1: (1, 3), 3: (1, 3)}),   # named differently by 0 and 2
                     (contiguous, {0: (0, 2, 1, 3), 1: (0, 2, 1, 3), 2: (0, 2, 1, 3), 3: (0, 2, 1, 3)})]:  # too big
        assert _groups_problem(infos(eps, dps)) is not None, (eps, dps)

    params = [torch.nn.Parameter(torch.ones(2, 3))]
    assert optimizer_problem(torch.optim.AdamW(params)) is None and optimizer_problem(torch.optim.SGD(params)) is None
    assert "whole tensor" in optimizer_problem(torch.optim.Adafactor(params))
    for change, words in [({"has_experts": False}, "feplb.hf.apply"), ({"deepspeed": True}, "DeepSpeed"),
                          ({"fsdp": True}, "FSDP"), ({"n_gpu": 2}, "DataParallel"), ({"tp_size": 2}, "tensor"),
                          ({"xla": True}, "TPU"), ({"distributed_type": "MEGATRON_LM"}, "MEGATRON_LM"),
                          ({"missing": ("_clip_grad_norm",)}, "has no _clip_grad_norm"),
                          ({"full_eval": "fp16_full_eval"}, "fp16_full_eval=True makes the Trainer cast")]:
        why = trainer_problem(**{**ok, **change})
        assert why is not None and words in why, (change, why)


class _ScheduleFreeLike(torch.optim.SGD):
    """schedule-free's interface, which the Trainer calls: eval() moves every parameter in place to its evaluation
    point (here half the weights), train() back."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.training = True

    @torch.no_grad()
    def eval(self):
        if self.training:
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["train_point"] = p.detach().clone()
                    p.mul_(0.5)
            self.training = False

    @torch.no_grad()
    def train(self):
        if not self.training:
            for group in self.param_groups:
                for p in group["params"]:
                    p.copy_(self.state[p].pop("train_point"))
            self.training = True


def _mode_switch(rank, world, out):
    """An optimizer with eval() / train() (schedule-free's) under per-step expert copies (feplb-split@ema),
    evaluating after every step, against transformers' Trainer on the unmodified model; bf16_full_eval (the Trainer
    casts the model for evaluate() outside train()) refused at construction, unless the model is bf16 already."""
    _env(rank, world)
    import transformers as tf

    import feplb.hf
    from feplb.testing import error_of

    res = {}
    for mode in ("plain", "feplb-split@ema"):
        model = _models().make_model("qwen3_moe")
        cls = tf.Trainer
        if mode != "plain":
            feplb.hf.apply(model, policy=mode, gpus_per_node=world, min_straggler_rows=0, plan_wait_ms=60_000)
            cls = feplb.hf.Trainer
        opt = _ScheduleFreeLike(model.parameters(), lr=0.05)
        trainer = cls(model=model, args=_args(out + mode, "sgd", max_steps=3, eval_strategy="steps", eval_steps=1,
                                              per_device_eval_batch_size=2),
                      train_dataset=_dataset(), eval_dataset=_dataset(7), optimizers=(opt, None))
        res[mode] = {"error": error_of(trainer.train)}
        res[mode]["evals"] = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
        res[mode]["params"] = {k: v.detach().clone() for k, v in (
            model.state_dict() if mode == "plain" else feplb.hf.full_state_dict(model, rank0_only=False)).items()}
    for dtype in (torch.float32, torch.bfloat16):
        model = _models().make_model("qwen3_moe").to(dtype)
        feplb.hf.apply(model, policy="feplb-split", gpus_per_node=world)
        res["full_eval", dtype] = error_of(lambda m=model: feplb.hf.Trainer(
            model=m, args=_args(out + "_fe", "sgd", bf16_full_eval=True), train_dataset=_dataset()))
    return res


def test_optimizer_mode_switches_refresh_copies_and_full_eval_casts_are_refused():
    """schedule-free's eval() / train(), which the Trainer calls, write the expert parameters in place: the per-step
    copies are made again after such a switch (before, the first evaluation was refused on every rank, asking for a
    refresh_replicas() a Trainer's user cannot place); the evaluations and the parameters then equal the unmodified
    model's. bf16_full_eval, whose cast of the model the layers refuse at the forward after training, is refused when
    the Trainer is made, on every rank."""
    with tempfile.TemporaryDirectory() as d:
        runs = run_dist(_mode_switch, 2, d, timeout_s=240, collective_timeout_s=60)
    for rank, r in enumerate(runs):
        got, want = r["feplb-split@ema"], r["plain"]
        assert got["error"] is None and want["error"] is None, (rank, got["error"], want["error"])
        assert len(got["evals"]) == len(want["evals"]) == 3
        assert all(abs(a - b) <= TOL * abs(b) for a, b in zip(got["evals"], want["evals"], strict=True)), \
            (got["evals"], want["evals"])
        assert got["params"].keys() == want["params"].keys()
        assert max(_rel(got["params"][k], want["params"][k]) for k in want["params"]) <= TOL, rank
        refused = r["full_eval", torch.float32]
        assert refused is not None and refused.startswith("ValueError") and "bf16_full_eval=True" in refused and \
            "Cast the model before feplb.hf.apply" in refused, refused
        assert refused == runs[0]["full_eval", torch.float32]
        assert r["full_eval", torch.bfloat16] is None, r["full_eval", torch.bfloat16]
