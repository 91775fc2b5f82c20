"""feplb.titan_ep under torchtitan's own ``Trainer``: its ``train()`` loop, data loader and tokenizer, AdamW with its
warm-up schedule, gradient clipping over the expert-parallel mesh, the Qwen3-MoE load-balancing bias update, metrics
and distributed checkpoints. The ``qwen3_moe_debug`` training config (64 experts, top-8; 1 of its 8 layers and the
experts' hidden size 192 of 768, for the test's time and memory; FSDP 4 x EP 4 as 2 nodes x 2, selective activation
checkpointing), FEPLB (``feplb-split@ema``) and its checkpoints' balancing histories turned on by
``--override.imports`` in its parsed form; three steps against the same trainer without the overrides, then from
the step-2 checkpoints: torchtitan without FEPLB resumed from FEPLB's, FEPLB resumed from its own (bit for bit its
uninterrupted step 3), and FEPLB resumed from torchtitan's (no histories: a warning, then afresh).

The test's own inputs: a word-level tokenizer written with ``tokenizers`` and a small text set (60 of its 1,000
words, drawn uniformly), in torchtitan's formats (``tokenizer.json`` and ``tokenizer_config.json``; json lines with
a ``text`` field for its ``c4_test`` loader).

CPU stand-ins, besides test_titan_ep.py's (device type, uneven all-to-all): flex attention (no CPU backward in
torch) is torchtitan's own SDPA backend in both runs (causal, without flex's document masks, which are not built),
FSDP reduces with SUM then scales (``set_force_sum_reduction_for_comms``), as gloo has no PREMUL_SUM, torchtitan's
device module is ``torch.cpu`` (with device index 0), its device-memory monitor reports zeros, and
``torch.distributed.set_timeout``, which torchtitan 0.3.0's trainer calls after its first step and torch 2.13 does
not have (on any device), sets the group's timeout through c10d. DTensor's random initialisation on a CPU mesh gives
every shard the same numbers, so the parameters are drawn again (see ``_reinit``). Nothing of feplb is patched."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan.trainer")
pytest.importorskip("tokenizers")

import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

from feplb.replicas import state_digest  # noqa: E402
from feplb.testing import load_module, run_dist  # noqa: E402

# test_titan_ep.py's CPU stand-ins, row count and relative error (loaded by path, as the ranks load this file)
_ep = load_module(Path(__file__).with_name("test_titan_ep.py"))

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORLD, LAYERS, SEQ, STEPS, SAVED, EXPERT_HIDDEN = 4, 1, 64, 3, 2, 192
SETTINGS = '{"policy": "feplb-split@ema", "gpus_per_node": 2, "min_chunk": 1, "min_straggler_rows": 0, ' \
           '"plan_wait_ms": 60000}'
WORDS, USED = 1000, 60   # the tokenizer's words; the texts use the first USED of them


def _assets(root: Path) -> None:
    """A word-level tokenizer and a text set in torchtitan's formats."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(WORDS)]
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (root / "tokenizer").mkdir()
    tok.save(str(root / "tokenizer" / "tokenizer.json"))
    (root / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": True}))
    g = torch.Generator().manual_seed(0)
    (root / "data").mkdir()
    with open(root / "data" / "train.jsonl", "w") as f:
        for _ in range(64):
            ids = torch.randint(0, USED, (200,), generator=g)
            f.write(json.dumps({"text": " ".join(words[i] for i in ids)}) + "\n")


def _cpu_trainer() -> None:
    """torchtitan's trainer on the CPU (see the module docstring)."""
    import torch.distributed as dist
    import torchtitan.components.metrics as tm
    import torchtitan.trainer  # noqa: F401  (imports the modules patched below)
    from torch.distributed import distributed_c10d

    _ep._cpu_torchtitan()
    cpu = types.SimpleNamespace(**{k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("__")})
    cpu.current_device = lambda: 0
    for name, mod in list(sys.modules.items()):
        if name.startswith("torchtitan") and mod is not None:
            if getattr(mod, "device_module", None) is torch.cuda:
                mod.device_module = cpu
            if getattr(mod, "device_type", None) == "cuda":
                mod.device_type = "cpu"

    class _Memory:
        device_name, device_capacity_gib = "cpu", 0.0

        def get_peak_stats(self):
            return tm.DeviceMemStats(0, 0, 0, 0, 0, 0)

        def reset_peak_stats(self):
            pass

    tm.build_device_memory_monitor = _Memory
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: distributed_c10d._set_pg_timeout(timeout, group)


# run -> (FEPLB on, the run whose step-2 checkpoint it resumes from, or None)
RUNS = {"ours": (True, None), "titan": (False, None), "resumed": (False, "ours"), "afresh": (True, "titan"),
        "again": (True, "ours")}


def _config(root: Path, run: str, feplb: bool):
    from torchtitan.config.override import OverrideConfig, parse_cli_imports
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    config = qwen3_moe_debug()
    config.hf_assets_path = str(root / "tokenizer")
    config.dataloader.dataset_path = str(root / "data")
    config.dump_folder = str(root / run)
    config.parallelism.expert_parallel_degree = WORLD
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.seq_len, config.training.local_batch_size, config.training.steps = SEQ, 1, STEPS
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True   # torchtitan refuses them with its all-to-all dispatcher too
    config.checkpoint.enable, config.checkpoint.interval = True, SAVED
    config.checkpoint.load_step = SAVED if RUNS[run][1] else -1
    config.model_spec.model.layers = config.model_spec.model.layers[:LAYERS]
    for layer in config.model_spec.model.layers:   # (the test's memory: full copies of every run are compared)
        layer.moe.routed_experts.inner_experts.hidden_dim = EXPERT_HIDDEN
        layer.attention.inner_attention = ScaledDotProductAttention.Config()   # (flex attention: no CPU backward)
    if feplb:   # as `--override.imports 'feplb.titan_ep.feplb_experts={...}' feplb.titan_ep.feplb_checkpoint` gives it
        config.override = OverrideConfig(imports=parse_cli_imports([f"feplb.titan_ep.feplb_experts={SETTINGS}",
                                                                    "feplb.titan_ep.feplb_checkpoint"]))
    parallelize = config.model_spec.parallelize_fn

    def cpu_parallelize(model, **kwargs):
        from torch.distributed.fsdp import FSDPModule

        model = parallelize(model, **kwargs)
        for mod in model.modules():
            if isinstance(mod, FSDPModule):
                mod.set_force_sum_reduction_for_comms(True)
        return model

    config.model_spec.parallelize_fn = cpu_parallelize
    return config


def _reinit(model) -> None:
    """DTensor's random initialisation on a CPU mesh draws the same numbers for every shard (every rank's experts
    and router rows alike, so every rank gets the same load): each parameter drawn again as one full tensor from
    one seed, at its initial scale, and sharded as it was."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            full = _whole(p)
            std = float(full.float().std())
            if std == 0.0 or full.numel() < 2:
                continue
            new = (torch.randn(full.shape, generator=g) * std + float(full.float().mean())).to(p.dtype)
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(new, p.device_mesh, p.placements).to_local())
            else:
                p.copy_(new)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` in full (a DTensor gathered from its shards: collective)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _adam_state(trainer, model) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's optimizer state (AdamW's moments and step), as full tensors."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: _whole(v) for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
            for opt in trainer.optimizers for group in opt.param_groups for p in group["params"]}


def _lr_state(trainer) -> tuple:
    """The LR schedulers' state (what torchtitan checkpoints of them) and every parameter group's learning rate."""
    return trainer.lr_schedulers.state_dict(), [g["lr"] for opt in trainer.optimizers for g in opt.param_groups]


def _full(model) -> dict[str, torch.Tensor]:
    return {n: _whole(p) for n, p in model.named_parameters()} | \
        {n: _whole(b) for n, b in model.named_buffers() if n.endswith("expert_bias_E")}


def _job(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist
    from torchtitan.trainer import Trainer

    root = Path(root)
    _cpu_trainer()
    os.environ["LOCAL_RANK"] = str(rank)
    out, warned = {}, {}
    for run, (feplb, source) in RUNS.items():
        if source is not None:   # resumed from another run's step-2 checkpoint
            if rank == 0:
                shutil.copytree(root / source / "checkpoint" / f"step-{SAVED}",
                                root / run / "checkpoint" / f"step-{SAVED}")
            dist.barrier()
        trainer = Trainer(_config(root, run, feplb))
        (model,) = trainer.model_parts
        _reinit(model)
        inners = [layer.moe.routed_experts.inner_experts for layer in model.layers.values()]
        res = {"classes": sorted({type(m).__name__ for m in inners}), "losses": {}, "norms": {}, "moved": {},
               "labels": {}, "start": _full(model) if source is None else {}}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if source is not None:
                if run == "afresh":   # layers made before the load: their fresh histories' digests
                    res["fresh"] = [state_digest(m.make_engine().state) for m in inners]
                if run == "again":    # no layer yet: the load makes them
                    res["made_before"] = [m.engine is not None for m in inners]
                trainer.checkpointer.load(step=SAVED)
                res["loaded"], res["loaded_adam"] = _full(model), _adam_state(trainer, model)
                res["loaded_lr"] = _lr_state(trainer)
                res["loaded_histories"] = [state_digest(m.engine.state) if m.engine is not None else None
                                           for m in inners] if feplb else []
        log, fwd_bwd, opt_step = trainer.metrics_processor.log, trainer.forward_backward_step, trainer.optimizers.step

        def forward_backward(*, labels, _res=res, _trainer=trainer, _f=fwd_bwd, **kwargs):
            _res["labels"][_trainer.step] = labels.clone()
            return _f(labels=labels, **kwargs)

        def step(*args, _res=res, _trainer=trainer, _model=model, _step=opt_step, **kwargs):
            if _trainer.step == 1:   # the first step's gradients (clipped), before AdamW takes them
                _res["grads"] = {n: _whole(p.grad) for n, p in _model.named_parameters() if p.grad is not None}
            return _step(*args, **kwargs)

        def record(step, loss, max_loss, grad_norm, *args, _res=res, _log=log, _model=model, _trainer=trainer,
                   _inners=inners,
                   _feplb=feplb, **kwargs):
            _res["losses"][step], _res["norms"][step] = float(loss), float(grad_norm)
            _res["moved"][step] = [_ep._moved(m) for m in _inners] if _feplb else []
            if step == SAVED:
                _res["saved"], _res["saved_adam"] = _full(_model), _adam_state(_trainer, _model)
                _res["saved_lr"] = _lr_state(_trainer)
                _res["saved_histories"] = [state_digest(m.engine.state) for m in _inners] if _feplb else []
            return _log(step, loss, max_loss, grad_norm, *args, **kwargs)

        trainer.metrics_processor.log, trainer.forward_backward_step = record, forward_backward
        trainer.optimizers.step = step
        with warnings.catch_warnings(record=True) as also:
            warnings.simplefilter("always")
            trainer.train()
        warned[run] = [str(w.message) for w in [*caught, *also] if "feplb" in str(w.message)]
        res["final"] = _full(model)
        res["saved_steps"] = sorted(p.name for p in (root / run / "checkpoint").iterdir())
        trainer.close()
        for m in inners:
            if hasattr(m, "close"):
                m.close()
        del trainer, model, inners
        out[run] = res
        if run == "titan":   # compared here, on each rank, to keep few of the full tensors alive at once
            out["titan_losses"] = res["losses"]
            out["vs_titan"] = _vs_titan(out["ours"], out.pop("titan"))
        if run == "resumed":
            out["vs_resumed"] = _vs_resumed(out["ours"], out.pop("resumed"))
        if run == "afresh":
            out["vs_afresh"] = {"losses": (out.pop("afresh")["losses"], out.pop("titan_losses")),
                                "moved": res["moved"], "histories": (res["fresh"], res["loaded_histories"])}
        if run == "again":   # (the fresh histories: the afresh run's, of the same settings, before its load)
            out["vs_again"] = _vs_again(out["ours"], out.pop("again"), out["vs_afresh"]["histories"][0])
    out["warned"] = warned
    return {k: v for k, v in out.items() if k.startswith("vs_") or k == "warned"}


def _vs_titan(ours: dict, titan: dict) -> dict:
    """FEPLB's run against torchtitan's, in numbers (and frees what only this comparison needed)."""
    bias = [n for n in titan["final"] if n.endswith("expert_bias_E")]
    out = {"classes": (ours["classes"], titan["classes"]), "losses": (ours["losses"], titan["losses"]),
           "norms": (ours["norms"], titan["norms"]), "moved": ours["moved"], "bias": bias,
           "same_start": sorted(ours["start"]) == sorted(titan["start"])
           and all(torch.equal(ours["start"][n], w) for n, w in titan["start"].items()),
           "same_labels": sorted(ours["labels"]) == sorted(titan["labels"])
           and all(torch.equal(ours["labels"][k], w) for k, w in titan["labels"].items()),
           "grad_names": (sorted(ours["grads"]), sorted(titan["grads"])),
           "grad_err": {n: _ep._rel(ours["grads"][n], w) for n, w in titan["grads"].items()},
           "off": _off(ours["final"], titan["final"], titan["start"]), "params": len(titan["final"]),
           "bias_moved": all(not torch.equal(titan["final"][n], titan["start"][n]) for n in bias)}
    for k in ("start", "grads"):
        ours.pop(k)
    return out


def _vs_resumed(ours: dict, resumed: dict) -> dict:
    """torchtitan resumed from FEPLB's step-2 checkpoint against FEPLB's own step 3, in numbers."""
    adam_same = sorted(resumed["loaded_adam"]) == sorted(ours["saved_adam"]) and all(
        sorted(resumed["loaded_adam"][n]) == sorted(st) and all(torch.equal(resumed["loaded_adam"][n][k], v)
                                                                for k, v in st.items())
        for n, st in ours["saved_adam"].items())
    return {"saved_steps": ours["saved_steps"], "losses": (resumed["losses"], ours["losses"]),
            "loaded_same": sorted(resumed["loaded"]) == sorted(ours["saved"])
            and all(torch.equal(resumed["loaded"][n], w) for n, w in ours["saved"].items()),
            "adam_same": adam_same, "adam_entries": len(ours["saved_adam"]),
            "lr": (resumed["loaded_lr"], ours["saved_lr"]),
            "same_labels": torch.equal(resumed["labels"][STEPS], ours["labels"][STEPS]),
            "off": _off(resumed["final"], ours["final"], ours["saved"])}


def _vs_again(ours: dict, again: dict, fresh: list) -> dict:
    """FEPLB resumed from its own step-2 checkpoint against its uninterrupted step 3, in numbers."""
    return {"histories": (fresh, again["loaded_histories"], ours["saved_histories"]),
            "made_before": again["made_before"],
            "loaded_same": all(torch.equal(again["loaded"][n], w) for n, w in ours["saved"].items()),
            "losses": (again["losses"], ours["losses"]), "moved": (again["moved"], ours["moved"]),
            "final_same": sorted(again["final"]) == sorted(ours["final"])
            and all(torch.equal(again["final"][n], w) for n, w in ours["final"].items())}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("titan-trainer")
    _assets(root)
    return run_dist(_job, WORLD, str(root), timeout_s=900, collective_timeout_s=300)


def _off(got: dict, want: dict, start: dict) -> dict[str, float]:
    """Each tensor's distance from ``want``, relative to ``want``'s update from ``start`` (2-norms). AdamW moves
    every element by about its learning rate whatever the gradient's size, so an element whose gradient is near
    zero may move either way in two runs that round differently: the norms, not the largest element, compare."""
    out = {}
    for n, w in want.items():
        update = float((w - start[n]).float().norm())
        if update:
            out[n] = float((got[n] - w).float().norm()) / update
    return out


def test_torchtitans_trainer_runs_feplb_as_its_own_experts(trained):
    for r, res in enumerate(trained):
        c = res["vs_titan"]
        assert c["classes"] == (["FEPLBGroupedExperts"], ["GroupedExperts"]), r
        (ours, titan), (ours_norms, titan_norms) = c["losses"], c["norms"]
        assert sorted(ours) == sorted(titan) == list(range(1, STEPS + 1)), r
        assert all(m > 0 for step in c["moved"].values() for m in step), f"rank {r}: rows moved {c['moved']}"
        assert c["same_start"] and c["same_labels"], r   # the same seed and parameters; the same data
        # the first step's gradients, each tensor within 2e-2 of its largest element
        names, titan_names = c["grad_names"]
        assert names == titan_names and any("inner_experts" in n for n in names), r
        for n, err in c["grad_err"].items():
            assert err <= 2e-2, f"rank {r}: step 1's gradient of {n} off torchtitan's by {err:.2e} (relative)"
        # bf16 experts on both sides, through attention, the loss, clipping and AdamW: the same losses and norms
        for step, want in titan.items():
            assert abs(ours[step] - want) <= 5e-4 * abs(want), (r, step, ours[step], want)
            norm = titan_norms[step]
            assert abs(ours_norms[step] - norm) <= 5e-3 * norm, (r, step, ours_norms[step], norm)
        # trained alike: each parameter within 15% of torchtitan's own update; the load-balancing bias, which moves
        # by a fixed step per expert toward the mean count, within 25% (one expert's count on the other side of
        # the mean moves it by two steps)
        off, bias = c["off"], c["bias"]
        assert bias and set(bias) <= set(off) and len(off) == c["params"] and c["bias_moved"], (r, sorted(off))
        for n, err in off.items():
            bound = 0.25 if n in bias else 0.15
            assert err <= bound, f"rank {r}: {n} off torchtitan's after {STEPS} steps by {err:.2e} of its update"


def test_a_feplb_checkpoint_is_torchtitans(trained):
    for r, res in enumerate(trained):
        c = res["vs_resumed"]
        assert c["saved_steps"] == [f"step-{SAVED}", f"step-{STEPS}"], (r, c["saved_steps"])
        # FEPLB's step-2 state loaded by torchtitan's own experts: the parameters, the optimizer's state, and the
        # data loader's (the same batch next)
        assert c["loaded_same"] and c["adam_same"] and c["adam_entries"] > 0 and c["same_labels"], (r, c)
        # and the LR schedule's: its step count, and the learning rate each parameter group had then
        (loaded_sched, loaded_lrs), (saved_sched, saved_lrs) = c["lr"]
        assert loaded_sched == saved_sched == {"last_epoch": SAVED} and loaded_lrs == saved_lrs, (r, c["lr"])
        assert saved_lrs and all(lr > 0 for lr in saved_lrs), (r, saved_lrs)
        resumed, ours = c["losses"]
        assert sorted(resumed) == list(range(SAVED + 1, STEPS + 1)), (r, resumed)
        for step, loss in resumed.items():   # the same data and optimizer state carry on
            assert abs(loss - ours[step]) <= 5e-4 * abs(ours[step]), (r, step, loss, ours[step])
        # one step from the same state: each parameter within 2% of FEPLB's update
        for n, err in c["off"].items():
            assert err <= 0.02, f"rank {r}: {n} off FEPLB's after the resumed step by {err:.2e} of its update"


def test_a_resumed_run_carries_on_with_the_balancing_histories(trained):
    for r, res in enumerate(trained):
        c = res["vs_again"]
        fresh, loaded, saved = c["histories"]
        # no layer before the load; the load makes them and gives them the histories FEPLB's step 2 saved (not the
        # fresh ones a layer starts with)
        assert c["made_before"] == [False], (r, c["made_before"])
        assert loaded == saved and all(f != s for f, s in zip(fresh, saved, strict=True)), (r, c["histories"])
        assert c["loaded_same"], r
        # so the resumed step 3 is FEPLB's own, bit for bit: the same rows moved, loss and parameters
        (again, ours), (moved_again, moved_ours) = c["losses"], c["moved"]
        assert sorted(again) == [STEPS] and again[STEPS] == ours[STEPS], (r, again, ours)
        assert moved_again[STEPS] == moved_ours[STEPS] and all(m > 0 for m in moved_again[STEPS]), (r, c["moved"])
        assert c["final_same"], r
        assert res["warned"]["again"] == [], (r, res["warned"]["again"])


def test_a_checkpoint_without_histories_starts_them_afresh(trained):
    for r, res in enumerate(trained):
        # torchtitan's own step-2 checkpoint (no histories): FEPLB loads it, warns, and trains on from it
        c = res["vs_afresh"]
        assert any("holds no FEPLB balancing histories" in w for w in res["warned"]["afresh"]), res["warned"]
        fresh, loaded = c["histories"]
        assert loaded == fresh, (r, c["histories"])   # (the layers made before the load keep their fresh histories)
        (afresh, titan) = c["losses"]
        assert sorted(afresh) == [STEPS], (r, afresh)
        assert abs(afresh[STEPS] - titan[STEPS]) <= 5e-4 * abs(titan[STEPS]), (r, afresh, titan)
        assert all(m > 0 for m in c["moved"][STEPS]), (r, c["moved"])
        # and FEPLB's runs from scratch warn of nothing
        assert res["warned"]["ours"] == [], (r, res["warned"]["ours"])
