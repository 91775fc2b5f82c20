"""transformers' ``Trainer`` for a model whose experts :func:`feplb.hf.apply` replaced.

transformers' own ``Trainer`` runs such a model, but not the model's math: it would all-reduce the replicated
parameters' gradients (DDP) and leave the expert shards' summed over the ranks (the dispatch's backward), clip by
this rank's shards' norm (a different factor on every rank, so the replicated parameters drift apart), and save
rank 0's experts alone as the model (``save_pretrained`` refuses the DTensor shards) and rank 0's optimizer state as
everyone's. :class:`TrainerMixin` puts FEPLB's once-per-step calls where ``Trainer`` needs them:

* the model is left out of DDP's parameter broadcast and all-reduce (``feplb.ignore_experts_in_ddp``; ``apply``
  does it too);
* after the last backward of each step, :func:`feplb.hf.average_expert_grads` (replica gradients reduced, expert
  gradients divided by the ranks that summed them) before clipping; ``create_optimizer`` attaches the optimizer
  (:func:`feplb.hf.attach_optimizer`: per-step expert copies refreshed after every step);
* clipping and the logged ``grad_norm`` by :func:`feplb.hf.clip_grad_norm_`: the whole model's norm, every expert
  counted once, equal on every rank;
* ``save_model`` (and every checkpoint) writes the whole model (:func:`feplb.hf.full_state_dict`, gathered on
  every rank into the CPU memory of EP rank 0, one parameter at a time through the device, written by the main
  process), which plain transformers loads; a checkpoint also holds the model's
  shards and the optimizer's state through ``torch.distributed.checkpoint`` (``model_feplb/``,
  ``optimizer_feplb/``: each rank's experts at their global offsets), which ``resume_from_checkpoint`` and
  ``load_best_model_at_end`` read, at this or another number of ranks. (transformers' own resume reads the
  ``save_pretrained`` files with ``load_state_dict``, which skips experts saved in the hub's per-expert layout
  with a warning only.)

``feplb.hf.Trainer`` is ``TrainerMixin`` over ``transformers.Trainer``; put the mixin first over another Trainer
subclass (TRL's, say: docs/hf.md, *TRL*): ``class MyTrainer(feplb.hf.TrainerMixin, SFTTrainer)``. While the Trainer
is built, the given models' state dicts hold plain per-rank shards; ``sync_ref_model`` with a reference model
whose parameters differ in shape from the model's is refused (:func:`ref_model_problem`). Runs with DDP over CPU or GPU
processes, or one process; DeepSpeed, FSDP through accelerate, TPUs, SageMaker model parallelism, transformers'
tensor parallelism and ``torch.nn.DataParallel`` (several GPUs in one process) are refused at construction, and
optimizers whose update reads statistics over a whole tensor (Adafactor, GaLore, ...: :func:`optimizer_problem`)
when the optimizer is made.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from feplb.dropin import (
    _agree,
    attach_optimizer,
    average_expert_grads,
    clip_grad_norm_,
    expert_parameters,
    experts_modules,
    full_state_dict,
    load_policy_state_dict,
    policy_state_dict,
    refresh_replicas,
)
from feplb.layer import ignore_experts_in_ddp
from feplb.sharded import local_state_dicts
from feplb.training import _torch_optimizer

try:
    import transformers
except ImportError as e:   # pragma: no cover - the hf extra installs it
    raise ImportError("feplb.hf.Trainer needs transformers (pip install 'feplb[hf]')") from e

__all__ = ["TrainerMixin", "Trainer", "MODEL_DIR", "OPTIMIZER_DIR", "POLICY_FILE", "ref_model_problem"]

# in a checkpoint, torch.distributed.checkpoint folders: the model's shards as they run, and the optimizer's state
MODEL_DIR = "model_feplb"
OPTIMIZER_DIR = "optimizer_feplb"
# and the layers' balancing histories (feplb.dropin.policy_state_dict), which a resumed run continues
POLICY_FILE = "policy_feplb.pt"


# the Trainer methods FEPLB's calls go into; transformers 5.0's Trainer clipped inside its training loop
_HOOKED = ("_clip_grad_norm", "_get_grad_norm", "training_step", "create_optimizer", "_save_checkpoint",
           "_load_from_checkpoint", "_load_best_model", "_save_optimizer_and_scheduler",
           "_load_optimizer_and_scheduler")


def trainer_problem(*, has_experts: bool, distributed_type: str, deepspeed: bool, fsdp: bool, n_gpu: int,
                    tp_size: int, xla: bool, sagemaker_mp: bool, missing: tuple[str, ...] = (),
                    full_eval: str | None = None) -> str | None:
    """Why ``feplb.hf.Trainer`` cannot run this setup, or None. missing: the methods of :data:`_HOOKED` the
    Trainer class lacks. full_eval: the argument asking the Trainer to cast the model for evaluation
    (``bf16_full_eval``, ``fp16_full_eval``), if one does."""
    if missing:
        return (f"transformers {transformers.__version__}'s Trainer has no {', '.join(missing)}, where FEPLB's "
                "per-step calls go (its training loop would clip this rank's experts only); use transformers >= "
                "5.10 (tested with 5.25)")
    if not has_experts:
        return ("the model holds no FEPLB experts module; call feplb.hf.apply(model) on every rank before making "
                "the Trainer")
    if deepspeed:
        return ("DeepSpeed manages the gradients and the optimizer step, and ZeRO would shard the expert shards "
                "again; run the replicated parameters with DDP (the default without a deepspeed config)")
    if fsdp:
        return ("FSDP through accelerate would shard the expert shards again; with FSDP2, call fully_shard yourself "
                "with ignored_params=set(feplb.hf.expert_parameters(model)) and train with your own loop "
                "(docs/hf.md, Training)")
    if xla or sagemaker_mp:
        return "TPUs and SageMaker model parallelism are not supported"
    if tp_size > 1:
        return f"transformers' tensor parallelism (tp_size {tp_size}) is not supported beside FEPLB's experts"
    if n_gpu > 1:
        return (f"one process drives {n_gpu} GPUs (torch.nn.DataParallel); launch one process per GPU "
                "(torchrun)")
    if full_eval is not None:
        # (transformers casts the model itself in evaluation_loop, outside train(): the layers, built for the
        # model's dtype, refused the cast input at the first forward, on every rank, the model left cast)
        return (f"{full_eval}=True makes the Trainer cast the whole model for evaluate() and predict() outside "
                "train(), after feplb.hf.apply built its experts for the model's dtype; FEPLB's layers compute in "
                "the dtype they were built for, and refuse a model cast after apply. Cast the model before "
                f"feplb.hf.apply instead, or leave {full_eval} off and evaluate under autocast (bf16=True / "
                "fp16=True)")
    if distributed_type not in ("NO", "MULTI_CPU", "MULTI_GPU"):
        return f"accelerate's distributed type {distributed_type} is not supported (expected NO, MULTI_CPU, MULTI_GPU)"
    return None


def _full_eval_cast(args: Any, moes: list) -> str | None:
    """``bf16_full_eval`` or ``fp16_full_eval`` where it is set and would cast expert parameters to another dtype
    (a model cast before ``apply`` to that dtype is left as it is); None otherwise."""
    for name, dtype in (("bf16_full_eval", torch.bfloat16), ("fp16_full_eval", torch.float16)):
        if getattr(args, name, False) and any(p.dtype != dtype for m in moes for p in m.expert_params()):
            return name
    return None


def _wrapped_in_construction(trainer: Any) -> str | None:
    """Why the trainer cannot train exactly where its construction wrapped a module holding FEPLB experts in
    ``DistributedDataParallel`` without ignoring them (TRL's PPOTrainer wraps the policy and the value model in a
    module of its own and prepares it itself): DDP's construction broadcast rank 0's expert shards over every
    rank's own, and such a trainer trains in a loop of its own (not ``Trainer.training_step``); None otherwise.
    The same on every rank."""
    from torch.nn.parallel import DistributedDataParallel

    for name in ("model", "model_wrapped"):
        ddp = getattr(trainer, name, None)
        if not isinstance(ddp, DistributedDataParallel):
            continue
        experts = {id(p) for m in experts_modules(ddp.module) for p in m.expert_params()}
        ignored = set(getattr(ddp, "parameters_to_ignore", ()))
        held = [n for n, p in ddp.module.named_parameters() if id(p) in experts and n not in ignored]
        if held:
            return (f"the trainer's construction wrapped a module holding FEPLB experts in DistributedDataParallel "
                    f"without ignoring them ({held[0]}, ...; {type(trainer).__name__}.{name} is "
                    f"DistributedDataParallel({type(ddp.module).__name__})): its construction broadcast rank 0's "
                    "expert shards over every rank's own. A trainer that wraps the model in a module of its own and "
                    "trains in a loop of its own (TRL's PPOTrainer) is not supported: FEPLB averages the experts' "
                    "gradients in Trainer.training_step")
    return None


def _experts_alone_problem(model: nn.Module) -> str | None:
    """Why the Trainer cannot train ``model`` on several ranks where only FEPLB's expert shards train, or None:
    accelerate wraps the model in DistributedDataParallel, the shards stay out of it (each rank holds other
    experts), and DDP refuses a model with no parameter of its own to train (in train(), with torch's message)."""
    experts = {id(p) for p in expert_parameters(model)}
    if any(p.requires_grad for p in model.parameters() if id(p) not in experts):
        return None
    if not any(p.requires_grad for p in model.parameters() if id(p) in experts):
        return None      # (nothing trains at all: the Trainer's own business)
    return ("only the experts train (every parameter outside them is frozen): accelerate wraps the model in "
            "DistributedDataParallel, which FEPLB's expert shards stay out of, and DDP refuses a model with no "
            "parameter of its own to train. Leave a parameter outside the experts trainable (the router, say), or "
            "train the experts alone with your own loop (feplb.hf.attach_optimizer and average_expert_grads, no "
            "DDP: docs/hf.md)")


class TrainerMixin:
    """FEPLB's per-step calls inside a transformers ``Trainer`` (module docstring). Put it first among the bases.

    data_parallel_group: with several EP groups on different data (EP x DP: the world is larger than the EP group),
        the ranks holding the same experts (``feplb.hf.average_expert_grads``' ``data_parallel_group``); DDP then
        averages the replicated parameters over the whole world. None: the EP group is the whole world.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # after transformers.Trainer among the bases, every method here is shadowed by the Trainer's: the class would
        # train as transformers' own Trainer does (each rank clipping its own experts, the replicated parameters
        # drifting apart), silently
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if transformers.Trainer in mro and mro.index(TrainerMixin) > mro.index(transformers.Trainer):
            raise TypeError(f"{cls.__name__}: put feplb.hf.TrainerMixin first among the bases, before every Trainer "
                            f"class (class {cls.__name__}(feplb.hf.TrainerMixin, ...)): after transformers.Trainer "
                            "its per-step calls are never reached, and the model would train otherwise than the "
                            "unmodified model")

    def __init__(self, *args: Any, data_parallel_group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        # Within the construction, the state dicts of the models given (the model, a reference model) hold, for each
        # expert parameter, every rank's digest of its shard (the same on every rank; collective at the first
        # state_dict(), which the ranks call together): a Trainer subclass may hash them there with tensor methods
        # DTensors lack, and gets one name on every rank (TRL's DPO hashes model.state_dict() with .numpy() to name
        # its cache of reference log-probs, which each rank then looks up).
        given = [m for m in (*args, *kwargs.values()) if isinstance(m, nn.Module)]
        with local_state_dicts([lay for m in given for lay in experts_modules(m)], "digest"):
            super().__init__(*args, **kwargs)
        moes = experts_modules(self.model)
        acc = self.accelerator
        problem = trainer_problem(
            has_experts=bool(moes), distributed_type=str(getattr(acc.distributed_type, "value", acc.distributed_type)),
            # (FSDP asked for counts: accelerate drops it silently on the CPU)
            deepspeed=bool(self.is_deepspeed_enabled), fsdp=bool(self.is_fsdp_enabled) or bool(self.args.fsdp),
            n_gpu=self.args.n_gpu,
            tp_size=self.get_tp_size(), xla=bool(getattr(self, "is_fsdp_xla_enabled", False)) or
            transformers.utils.is_torch_xla_available(), sagemaker_mp=transformers.utils.is_sagemaker_mp_enabled(),
            missing=tuple(m for m in _HOOKED if not hasattr(transformers.Trainer, m)),
            full_eval=_full_eval_cast(self.args, moes))
        if problem is None and getattr(self.args, "sync_ref_model", False):
            problem = ref_model_problem(self.model, getattr(self, "ref_model", None),
                                        takes_ref_model=_takes_ref_model(type(self)))
        if problem is None:
            problem = _wrapped_in_construction(self)
        if problem is None and moes and dist.is_initialized() and dist.get_world_size() > 1:
            problem = _experts_alone_problem(self.model)
        bad_dp = data_parallel_group is not None and not isinstance(data_parallel_group, dist.ProcessGroup)
        if problem is None and bad_dp:   # (read on one rank, it failed there alone, its peers left waiting)
            problem = ("data_parallel_group must be a torch.distributed.ProcessGroup (dist.new_group(ranks)), got "
                       f"{type(data_parallel_group).__name__}")
        if not dist.is_initialized():
            if problem is None and data_parallel_group is not None:
                problem = "data_parallel_group given without torch.distributed initialised"
        else:   # refused on every rank together (a group given wrong on some ranks only, say)
            views = _agree((problem, _group_info(moes, None if bad_dp else data_parallel_group)), None)
            ranks = [r for r, (v, _) in enumerate(views) if v is not None]
            if ranks:
                problem = views[ranks[0]][0] + ("" if len(ranks) == len(views) else f" (on rank(s) {ranks})")
            else:
                problem = _groups_problem([info for _, info in views])
        if problem is not None:
            raise ValueError(f"feplb.hf.Trainer: {problem}")
        ignore_experts_in_ddp(self.model)
        if moes:
            from feplb.hf import saves_full_only

            saves_full_only(self.model)   # (its save_model gathers the experts; a direct save_pretrained is refused)
        if any(m.world_size > 1 for m in moes):
            from feplb.hf import generate_in_step

            generate_in_step(self.model)   # (apply may have been given a part of it)
        self._feplb_dp_group = data_parallel_group
        self._feplb_flos_scale = _flos_scale(self.model, moes)
        self._feplb_full: dict[str, torch.Tensor] | None = None
        self._feplb_checkpointing = False

    # ------------------------------------------------------------------------------------------ the step
    def create_optimizer(self, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(*args, **kwargs)
        problem = optimizer_problem(_torch_optimizer(optimizer))
        if problem is not None:   # every rank runs the same optimizer: refused on every rank
            raise ValueError(f"feplb.hf.Trainer: {problem}")
        # (average_required: a step training_step's averaging did not precede, as in a Trainer subclass whose
        # loop bypasses training_step, is refused on every rank)
        attach_optimizer(self.model, _torch_optimizer(optimizer), getattr(self.accelerator, "scaler", None),
                         average_required=True)
        _refresh_after_mode_switch(_torch_optimizer(optimizer), self.model)
        return optimizer

    def training_step(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        from torch.nn.parallel import DistributedDataParallel

        inner = getattr(model, "_orig_mod", model)   # (torch_compile: accelerate compiles the DDP-wrapped model)
        if dist.is_initialized() and dist.get_world_size() > 1 and not isinstance(inner, DistributedDataParallel):
            # (alike on every rank, so every rank raises) accelerate's prepare_model(evaluation_mode=True), which
            # evaluate() and predict() call before any train(), marks the model prepared, and train()'s prepare()
            # then hands it back without DDP: each rank would step its replicated parameters on its own gradients
            raise RuntimeError(
                f"feplb.hf.Trainer: the model would train outside DistributedDataParallel on {dist.get_world_size()} "
                "ranks, each rank stepping the replicated (non-expert) parameters on its own gradients, so the "
                "ranks' models part (transformers' own Trainer does so silently): evaluate() or predict() before "
                "the first train() made accelerate prepare the model for evaluation only. Evaluate inside train() "
                "instead (TrainingArguments(eval_on_start=True)), or build the model and Trainer again")
        loss = super().training_step(model, inputs, *args, **kwargs)
        if self.accelerator.sync_gradients:   # the step's last backward: DDP has averaged the replicated gradients
            average_expert_grads(self.model, self._feplb_dp_group)
        return loss

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        self.accelerator.unscale_gradients()   # a GradScaler's (fp16); nothing otherwise
        return clip_grad_norm_(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:   # no clipping: the norm alone, as clip_grad_norm_ measures it
            self.accelerator.unscale_gradients()
            grad_norm = clip_grad_norm_(self.model, float("inf"))
        return grad_norm

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """transformers' estimate (6 x tokens x parameters) for the unmodified model: its count of this rank's
        parameters scaled to every expert of each layer (``total_flos`` as the unmodified model's run logs it)."""
        return int(round(super().floating_point_ops(inputs) * self._feplb_flos_scale))

    # ------------------------------------------------------------------------------------------ checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the whole model (every rank's experts gathered: collective, so call it on every rank, not under
        ``if trainer.is_world_process_zero():`` as plain DDP allows, where rank 0 would wait for the others until
        the process group's timeout), as the unmodified model's checkpoint: ``from_pretrained`` of the original class
        loads it. Inside a checkpoint, also the model's shards as they run (``model_feplb/``), which resuming and
        ``load_best_model_at_end`` read."""
        # (on EP rank 0 only: transformers' save_pretrained writes on the job's rank 0 alone, save_on_each_node or not)
        # on the CPU, one parameter gathered on the device at a time: the whole model's experts need not fit there
        self._feplb_full = full_state_dict(self.model, cpu_offload=True)
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            self._feplb_full = None
        if self._feplb_checkpointing:
            import torch.distributed.checkpoint as dcp

            folder = output_dir or self.args.output_dir
            with self._sharded():
                dcp.save(self.model.state_dict(), checkpoint_id=os.path.join(folder, MODEL_DIR))
            histories = policy_state_dict(self.model)   # (collective: every EP group's, the same on every rank)
            if self.args.should_save:
                from pathlib import Path

                from feplb.files import write_outputs

                # never a half-written file under the name: a temporary one of this process's own (with
                # save_on_each_node, one rank per node writes), the umask's mode, then renamed
                write_outputs([(Path(folder) / POLICY_FILE, lambda tmp: torch.save(histories, tmp))])

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        self._feplb_checkpointing = True
        try:
            super()._save_checkpoint(*args, **kwargs)
        finally:
            self._feplb_checkpointing = False

    def _sharded(self):
        """Within: the expert shards (and their optimizer state) as DTensors, DCP's form, whatever the layers'
        state-dict type."""
        return local_state_dicts(experts_modules(self.model), "sharded")

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is None and self._feplb_full is not None:
            state_dict = self._feplb_full
        if state_dict is None:
            raise RuntimeError("feplb.hf.Trainer._save: the expert shards are gathered by save_model(), on every "
                               "rank; call save_model() instead")
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        with self._sharded():
            state = get_optimizer_state_dict(self.model, _torch_optimizer(self.optimizer))
            dcp.save({"optimizer": state}, checkpoint_id=os.path.join(output_dir, OPTIMIZER_DIR))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, transformers.trainer.SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        self._load_model_shards(resume_from_checkpoint)

    def _load_best_model(self) -> None:
        self._load_model_shards(self.state.best_model_checkpoint)

    def _load_model_shards(self, checkpoint: str) -> None:
        """The model's weights from a checkpoint's ``model_feplb/`` (each rank reads its experts, at any EP size).
        transformers' own loading reads the checkpoint's ``save_pretrained`` files with ``load_state_dict``, which
        skips, with a warning only, experts saved in another layout (per-expert matrices, as the hub's)."""
        import torch.distributed.checkpoint as dcp

        folder = os.path.join(checkpoint, MODEL_DIR)
        # (agreed: the load is collective, and a disk of one node's own may lack what another's holds)
        seen = os.path.isfile(os.path.join(folder, ".metadata"))
        missing = [r for r, ok in enumerate(_agree(seen, None)) if not ok]
        if missing and os.path.isdir(folder):
            raise ValueError(f"feplb.hf.Trainer: {folder} lacks DCP's .metadata on global rank(s) {missing}: "
                             "checkpoints written through torch.distributed.checkpoint need one filesystem shared by "
                             "every rank to be resumed from")
        if missing:
            raise ValueError(f"feplb.hf.Trainer: {checkpoint} holds no {MODEL_DIR}/ (the model's shards "
                             "feplb.hf.Trainer writes into each checkpoint); load another checkpoint with "
                             "from_pretrained, then call feplb.hf.apply")
        with self._sharded():
            state = self.model.state_dict()
            dcp.load(state, checkpoint_id=folder)
            self.model.load_state_dict(state)
        # the balancing histories, where the checkpoint holds them (older ones do not), then the refresh
        path = os.path.join(checkpoint, POLICY_FILE)
        seen = os.path.isfile(path)
        views = _agree(seen, None)
        if any(views) and not all(views):
            raise ValueError(f"feplb.hf.Trainer: {path} is missing on global rank(s) "
                             f"{[r for r, ok in enumerate(views) if not ok]}: checkpoints need one filesystem "
                             "shared by every rank to be resumed from")
        if not seen:
            refresh_replicas(self.model)
            return
        saved, why = None, None
        try:
            saved = torch.load(path, weights_only=True)
        except Exception as e:   # noqa: BLE001 - agreed below: every rank raises together
            why = f"{type(e).__name__}: {e}"
        views = _agree(why, None)
        bad = [(r, v) for r, v in enumerate(views) if v is not None]
        if bad:
            raise ValueError(f"feplb.hf.Trainer: {path} could not be read on global rank(s) {[r for r, _ in bad]} "
                             f"({bad[0][1]}); delete it to resume with the balancing histories afresh")
        kept = load_policy_state_dict(self.model, saved, strict=False)
        if kept:
            warnings.warn(f"feplb.hf.Trainer: the balancing histories in {path} are for another setup (EP size, "
                          f"policy, ...) than layer(s) {kept}, which start theirs afresh", RuntimeWarning,
                          stacklevel=2)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        if checkpoint is None:
            return
        folder = os.path.join(checkpoint, OPTIMIZER_DIR)
        names = transformers.trainer
        if not os.path.isdir(folder):
            if os.path.exists(os.path.join(checkpoint, names.OPTIMIZER_NAME)):
                raise ValueError(f"feplb.hf.Trainer: {checkpoint} holds an optimizer state saved by transformers' "
                                 "own Trainer (rank 0's alone, without the other ranks' experts); resume from a "
                                 "checkpoint feplb.hf.Trainer wrote")
            return
        optimizer = _torch_optimizer(self.optimizer)
        with self._sharded():
            state = get_optimizer_state_dict(self.model, optimizer)
            dcp.load({"optimizer": state}, checkpoint_id=folder)
            set_optimizer_state_dict(self.model, optimizer, state)
        scheduler = os.path.join(checkpoint, names.SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


def _refresh_after_mode_switch(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """An optimizer with ``eval()`` and ``train()`` (schedule-free's, which the Trainer calls around evaluation and
    at each training step) moves the parameters in place between its training and evaluation points: the per-step
    copies of the experts (weights='per-step', ``@ema``) would keep the other point's weights (refused at the next
    forward, on every rank, asking for ``refresh_replicas()``, which a Trainer's user cannot place). After a switch
    that wrote the expert parameters, the copies are made again from them: ``refresh_replicas`` (collective; the
    Trainer switches on every rank together, and every rank's optimizer writes its own shards alike)."""
    import weakref

    if optimizer.__dict__.get("_feplb_mode_refresh") or not all(
            callable(getattr(optimizer, name, None)) for name in ("eval", "train")):
        return
    model_ref = weakref.ref(model)

    def refreshing(inner):
        def switch(*args: Any, **kwargs: Any) -> Any:
            m = model_ref()
            experts = [] if m is None else expert_parameters(m)
            before = [p._version for p in experts]
            out = inner(*args, **kwargs)
            if any(p._version != v for p, v in zip(experts, before, strict=True)):
                refresh_replicas(m)
            return out

        switch.__doc__ = getattr(inner, "__doc__", None)
        return switch

    for name in ("eval", "train"):
        setattr(optimizer, name, refreshing(getattr(optimizer, name)))
    optimizer._feplb_mode_refresh = True


def ref_model_problem(model: nn.Module, ref_model: nn.Module | None, *, takes_ref_model: bool = True) -> str | None:
    """Why ``sync_ref_model`` (TRL's ``SyncRefModelCallback``, which mixes the model's parameters into the reference
    model's one by one, in order) cannot run with this reference model, or None: it must hold the same parameters
    in the same shapes, its experts applied alike (a reference model TRL loads from the model's path holds every
    expert, and broadcasting a shard into it, with one expert per rank, would even run). takes_ref_model: the
    trainer takes a ``ref_model`` argument (DPO's does; GRPO's and RLOO's load theirs from the model's path)."""
    if ref_model is None:
        return None
    mine = [tuple(p.shape) for p in model.parameters()]
    theirs = [tuple(p.shape) for p in ref_model.parameters()]
    if mine == theirs:
        return None
    return (f"sync_ref_model mixes the model's parameters into the reference model's one by one, but the two hold "
            f"{len(mine)} and {len(theirs)} parameters, not all of the same shape (the model's experts are this "
            "rank's shards): " + ("make the reference model with copy.deepcopy(model) before feplb.hf.apply, apply "
                                  "to both alike and pass it as ref_model" if takes_ref_model else
                                  "this trainer takes no ref_model and loads its reference model from the model's "
                                  "path, with every expert; set sync_ref_model=False"))


def _takes_ref_model(cls: type) -> bool:
    """Whether the Trainer class under ``TrainerMixin`` in ``cls``'s bases takes a ``ref_model`` argument."""
    import inspect

    init = next((vars(c)["__init__"] for c in cls.__mro__
                 if "__init__" in vars(c) and c is not TrainerMixin and issubclass(c, transformers.Trainer)), None)
    try:
        return init is None or "ref_model" in inspect.signature(init).parameters
    except (TypeError, ValueError):
        return True


def _flos_scale(model: nn.Module, moes: list) -> float:
    """The unmodified model's parameter count (transformers' FLOP estimate counts parameters, embeddings left out)
    over this rank's: each expert shard counts once per rank of its layer's EP group."""
    mine = model.num_parameters(exclude_embeddings=True) if hasattr(model, "num_parameters") else \
        sum(p.numel() for p in model.parameters())
    shards = {id(p): (p, m) for m in moes for p in m.expert_params()}   # (a layer under several names: once)
    extra = sum((m.world_size - 1) * p.numel() for p, m in shards.values())
    return (mine + extra) / mine if mine else 1.0


def _group_info(moes: list, dp_group: dist.ProcessGroup | None) -> tuple:
    """This rank's groups, for :func:`_groups_problem`: per FEPLB layer its EP group's ranks and this rank's index
    there (which experts it holds), and the data-parallel group's ranks (None without one)."""
    layers = tuple((m.control.ranks, m.rank) for m in moes)
    return layers, None if dp_group is None else tuple(dist.get_process_group_ranks(dp_group))


def _groups_problem(infos: list[tuple]) -> str | None:
    """Whether the EP groups and the data-parallel groups (every rank's :func:`_group_info`) tile the world: without
    data-parallel groups, every EP group is the world (DDP averages the replicated parameters over the world, the
    expert gradients over the EP group); with them, each rank's data-parallel group holds, of every EP group, the
    one rank holding the same experts (the same index there), and every rank in it names the same group."""
    world = len(infos)
    if len({len(layers) for layers, _ in infos}) != 1:
        return "the ranks hold different numbers of FEPLB layers"
    for r, (layers, dp) in enumerate(infos):
        for j, (ep, index) in enumerate(layers):
            if dp is None:
                if len(ep) != world:
                    return (f"the FEPLB layers' EP group ({len(ep)} ranks) is smaller than the world ({world}); "
                            "pass data_parallel_group= (the ranks holding the same experts) to the Trainer")
                continue
            peers = [infos[m] for m in dp]
            tiles = (r in dp and all(m_dp == dp for _, m_dp in peers) and len(ep) * len(dp) == world
                     and len({m_layers[j][0] for m_layers, _ in peers}) == len(dp)
                     and all(m_layers[j][1] == index for m_layers, _ in peers))
            if not tiles:
                return (f"data_parallel_group must hold, of every EP group, the rank holding the same experts (the "
                        f"same index in its EP group), and name the same ranks on each of them: rank {r}'s holds "
                        f"ranks {list(dp)}, its EP group is {list(ep)} (index {index}); EP size {len(ep)} x "
                        f"data-parallel size {len(dp)} must be the world size {world}")
    return None


# optimizers whose update reads statistics over more than one element (a whole tensor's RMS, low-rank
# projections, an update fused into the backward): on an expert shard they see this rank's experts only, where the
# unmodified model's mix every expert of the tensor
_RMS, _LOW_RANK, _IN_BACKWARD, _TRUST = ("its update clipping takes the RMS of the whole tensor",
                                         "it projects whole matrices to low rank", "it steps inside the backward",
                                         "its trust ratio takes the norms of the whole tensor")
_NOT_ELEMENTWISE = {"Adafactor": _RMS, "StableAdamW": _RMS, "GaLoreAdamW": _LOW_RANK, "GaLoreAdamW8bit": _LOW_RANK,
                    "GaLoreAdafactor": _LOW_RANK, "APOLLOAdamW": _LOW_RANK, "LayerWiseDummyOptimizer": _IN_BACKWARD,
                    "Lomo": _IN_BACKWARD, "AdaLomo": _IN_BACKWARD,
                    **{name: _TRUST for name in ("LAMB", "LAMB8bit", "LAMB32bit", "LARS", "LARS8bit", "LARS32bit",
                                                 "PytorchLARS", "FusedLAMB", "FusedMixedPrecisionLamb", "Lamb",
                                                 "Lars", "NvLamb")}}


def optimizer_problem(optimizer: torch.optim.Optimizer) -> str | None:
    """Why an optimizer would step the expert shards otherwise than the unmodified model's tensors, or None."""
    why = _NOT_ELEMENTWISE.get(type(optimizer).__name__)
    if why is None:
        return None
    return (f"{type(optimizer).__name__}: {why}, which on an expert shard covers this rank's experts only (the "
            "unmodified model's covers every expert of the tensor); use an element-wise optimizer (AdamW, SGD, "
            "Adagrad, RMSprop, Lion, AdEMAMix, schedule-free ...)")


class Trainer(TrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` for a model :func:`feplb.hf.apply` made expert-parallel (:class:`TrainerMixin`)."""
