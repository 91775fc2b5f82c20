"""Train a small Hugging Face transformers MoE model (a real architecture, built from its config) with FEPLB.

CPU (4 gloo processes modelled as 2 nodes of 2 GPUs; about a minute)::

    torchrun --standalone --nproc-per-node 4 examples/hf_moe.py --gpus-per-node 2 --out runs/hf_moe

GPUs (one node; NCCL)::

    torchrun --nproc-per-node 8 examples/hf_moe.py --device cuda --out runs/hf_moe_gpu

The model (``--arch``: Qwen3-MoE, Mixtral or DeepSeek-V3, scaled down, random init, nothing downloaded) is built
identically on every rank; ``feplb.hf.apply`` then replaces each of its experts modules with a balanced
expert-parallel one holding ``E / W`` experts. The model's routers, attention, norms, embeddings and shared experts
stay replicated: their gradients are averaged over the ranks by one all-reduce per step. Each rank reads its own
slice of the text the demo reads (this Python's standard-library source, as bytes: vocabulary 256). The script
prints the token straggler before/after balancing like ``train_moe.py``, writes the same report (report.md,
plots, report.json) to ``--out`` and, with ``--save``, a transformers checkpoint gathered by
``feplb.hf.full_state_dict`` that ``from_pretrained`` loads without feplb; with ``--checkpoint``, a
``torch.distributed.checkpoint`` of the model and optimizer that ``--resume`` continues from on any number of
ranks (each reads its own experts). ``--gradient-checkpointing`` turns on
transformers' gradient checkpointing of the decoder layers (the losses stay those of a run without it).

Shape legend: B sequences per rank, S sequence length, V = 256 byte values, L MoE layers, W ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

EXAMPLES_DIR = Path(__file__).resolve().parent
VOCAB = 256

# Scaled-down configurations of the real architectures: the fields that make each one what it is (DeepSeek-V3's
# dense first layer, shared expert, grouped sigmoid routing and MLA; Qwen3-MoE's normalised top-k) are kept.
ARCHS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=128, moe_intermediate_size=64, num_experts=8, head_dim=16,
                       norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=64, num_local_experts=8)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=128, moe_intermediate_size=64, n_routed_experts=8, n_shared_experts=1,
                         n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4)),
}


def _demo():
    """The sibling train_moe.py (text reading, byte streams, errors), imported on demand."""
    if str(EXAMPLES_DIR) not in sys.path:
        sys.path.insert(0, str(EXAMPLES_DIR))
    import train_moe

    return train_moe


def build_parser() -> argparse.ArgumentParser:
    p = _demo().RankZeroParser(description="Train a small transformers MoE model with FEPLB (run under torchrun).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--arch", choices=sorted(ARCHS), default="qwen3_moe", help="architecture (scaled down)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=0.0,
                   help="clip the whole model's gradient norm to this with feplb.hf.clip_grad_norm_ (0 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="feplb-split", help="FEPLB policy ('none' = plain expert parallelism)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: torchrun's --nproc-per-node")
    p.add_argument("--dyn", type=int, default=2, help="dynamic experts per rank")
    p.add_argument("--plan-wait-ms", type=float, default=None, help="default: 0 on CUDA, 200 on the CPU")
    p.add_argument("--text-bytes", type=int, default=1 << 20, help="bytes of standard-library source to read")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", type=Path, default=None, help="directory for report.md, plots and report.json")
    p.add_argument("--save", type=Path, default=None, help="write a transformers checkpoint here at the end")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="write a torch.distributed.checkpoint (model, optimizer, step) here at the end")
    p.add_argument("--resume", type=Path, default=None,
                   help="continue from a --checkpoint, written by a run of any number of ranks")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each decoder layer in the backward pass (transformers' gradient checkpointing; "
                        "the FEPLB layers replay their forwards' plans)")
    return p


def build_model(arch: str, hidden: int, layers: int, seed: int):
    """The architecture's model, fp32, random init drawn from ``seed`` (the same on every rank)."""
    import transformers

    config_cls, model_cls, extra = ARCHS[arch]
    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, num_experts_per_tok=2, tie_word_embeddings=True)
    config = getattr(transformers, config_cls)(**{**common, **extra})
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(config).float()


def train(args: argparse.Namespace) -> dict:
    """The training run, on an initialised process group (every rank). Returns rank 0's history and summary."""
    import feplb.hf

    demo = _demo()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise demo.UsageError(f"--gpus-per-node: expected an integer >= 1, got {args.gpus_per_node}")
    if not -(2**63) <= args.seed < 2**64:
        raise demo.UsageError("--seed: expected an integer in [-2**63, 2**64) (torch.manual_seed takes no other), "
                              f"got {args.seed}")
    G = args.gpus_per_node if args.gpus_per_node is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % G:
        raise demo.UsageError(f"--gpus-per-node {G} does not divide the world size {world}")
    _needs_transformers(demo, "hf_moe.py")
    if args.checkpoint is not None and args.checkpoint.exists() and not args.checkpoint.is_dir():
        raise demo.UsageError(f"--checkpoint {args.checkpoint} is a file, not a directory")
    demo.check_options(args, ("steps", "layers", "hidden", "batch", "seq_len", "text_bytes", "log_every"))
    # the report's, --save's and --checkpoint's folders can be written, before any training (checked alike on every
    # rank)
    for option, path in (("--out", args.out), ("--save", args.save), ("--checkpoint", args.checkpoint)):
        if path is not None:
            try:
                demo.check_out_dir(path, resume=False, overwrite=True)
            except demo.UsageError as exc:
                raise demo.UsageError(str(exc).replace("--out", option, 1)) from exc
    corpus, label = demo.read_corpus(None, args.text_bytes)
    data = demo.ByteStreams(corpus, rank=rank, world=world, batch=args.batch, seq_len=args.seq_len, device=device)

    model = build_model(args.arch, args.hidden, args.layers, args.seed).to(device)
    with torch.no_grad():   # the same seed gives the same weights; the broadcast makes it a guarantee
        for p in model.parameters():
            dist.broadcast(p, src=0)
    plan_wait = args.plan_wait_ms if args.plan_wait_ms is not None else (0.0 if device.type == "cuda" else 200.0)
    try:   # (what apply refuses, it refuses on every rank together)
        names = feplb.hf.apply(model, policy=args.policy, gpus_per_node=G, dyn=args.dyn, plan_wait_ms=plan_wait)
    except ValueError as exc:
        raise demo.UsageError(str(exc)) from exc
    model.train()
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    experts = feplb.hf.expert_parameters(model)
    expert_ids = {id(p) for p in experts}
    replicated = [p for p in model.parameters() if id(p) not in expert_ids]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    moes = feplb.hf.experts_modules(model)
    first = moes[0]
    E = first.config.num_experts
    if rank == 0:
        print(f"feplb + transformers: {type(model).__name__} ({args.arch}, {args.layers} layers, hidden "
              f"{args.hidden}), {len(names)} experts modules replaced ({names[0]}, ...): {E} experts, "
              f"top-{first.config.top_k}, {E // world} per rank; {world} ranks = {world // G} node(s) x {G} GPU(s)"
              f"{' (modelled: CPU processes)' if device.type == 'cpu' else ''}, "
              f"policy {args.policy!r}; text: {label}", flush=True)

    start = 0
    if args.resume is not None:
        start = load_checkpoint(args.resume, model, optimizer, _shape(args))
        feplb.hf.refresh_replicas(model)       # the loaded weights -> the resident replicas
        if rank == 0:
            print(f"resumed at step {start} from {args.resume}", flush=True)
    steps = []
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        ids_BS, targets_BS = data.batch(step)
        logits_BSV = demo.forward_or_lower_lr(model, step + 1, input_ids=ids_BS).logits
        loss = F.cross_entropy(logits_BSV.reshape(-1, VOCAB), targets_BS.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        feplb.hf.reduce_replica_grads(model)   # helpers' replica gradients -> the owners' shards
        # Replicated parameters: mean over the ranks (data parallel). Expert shards already hold the sum over the
        # ranks' tokens (the dispatch's backward); dividing by W makes both the gradient of the global mean loss.
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in replicated]
                         + [loss.detach().reshape(1)])
        dist.all_reduce(flat)
        flat /= world
        pos = 0
        for p in replicated:
            p.grad = flat[pos:pos + p.numel()].view_as(p).clone()
            pos += p.numel()
        for p in experts:
            if p.grad is not None:
                p.grad /= world
        mean_loss = float(flat[-1])
        if not math.isfinite(mean_loss):   # (the all-reduced value: every rank stops at the same step)
            raise demo.UsageError(f"the loss became {mean_loss} at step {step + 1}; lower --lr")
        if args.clip > 0:   # the whole model's norm: expert shards counted on their owners, over the group
            feplb.hf.clip_grad_norm_(model, args.clip)
        optimizer.step()
        feplb.hf.refresh_replicas(model)       # the owners' new weights -> the resident replicas
        # each rank speaks for the GPUs it planned (its node's with several nodes); join_stats joins them
        views: list = [None] * world
        dist.all_gather_object(views, demo.rank_stats(moes))
        dt = time.perf_counter() - t0
        rec = {"step": step + 1, "loss": mean_loss, "wall_s": dt, "tokens_per_s": world * ids_BS.numel() / dt,
               **demo.layer_stats(views)}
        steps.append(rec)
        if rank == 0 and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
            print(demo.log_line(rec), flush=True)

    if args.checkpoint is not None:
        save_checkpoint(args.checkpoint, model, optimizer, max(start, args.steps), _shape(args))
        if rank == 0:
            print(f"checkpoint (torch.distributed.checkpoint, any number of ranks): {args.checkpoint}", flush=True)
    if args.save is not None:
        full = feplb.hf.full_state_dict(model, cpu_offload=True)   # collective; the full weights on rank 0's CPU
        if rank == 0:
            model.save_pretrained(args.save, state_dict=full)
            print(f"checkpoint (plain transformers, {len(full)} tensors): {args.save}", flush=True)
    summary = None
    if rank == 0 and not steps:
        print(f"nothing left to train: already at step {start} (--steps {args.steps})", flush=True)
    if rank == 0 and steps:
        report = demo._report_module()
        summary = report.summarize(steps)
        print(f"token straggler, plain EP -> {args.policy}: {summary['token_straggler_before']:.1f} -> "
              f"{summary['token_straggler_after']:.1f} rows ({100 * summary['reduction']:.1f}% lower; max/mean "
              f"{summary['max_over_mean_before']:.3f} -> {summary['max_over_mean_after']:.3f}); loss "
              f"{summary['loss_first']:.3f} -> {summary['loss_last']:.3f}", flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            meta = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "world_size": world,
                    "platform": demo.platform_line(device), "torch": torch.__version__, "transport": "torch",
                    "config": {"gpus_per_node": G, "layers": args.layers, "moe_layers": len(names), "experts": E,
                               "top_k": first.config.top_k, "hidden": args.hidden, "ffn": first.config.ffn,
                               "dyn": min(args.dyn, E // world), "policy": args.policy,
                               "router": f"{type(model).__name__}'s own", "text": label,
                               "text_bytes": args.text_bytes, "batch": args.batch, "seq_len": args.seq_len,
                               "arch": args.arch}}
            report.write_report(args.out, meta, steps)
            print(f"report: {args.out / 'report.md'}", flush=True)
    dist.barrier()
    for moe in moes:   # their threads and copy paths, released before the process group goes
        moe.close()
    return {"steps": steps, "summary": summary, "names": names}


def _needs_transformers(demo, script: str, modules: tuple[str, ...] = ("transformers",)) -> None:
    """One usage line, on every rank, where one of ``modules`` (transformers; accelerate for its Trainer) is
    missing."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise demo.UsageError(f"{script} needs {' and '.join(missing)}: pip install -e '.[hf]'")


def _shape(args: argparse.Namespace) -> dict:
    """What a checkpoint's tensors depend on: a --resume with other values cannot load it."""
    return {"arch": args.arch, "hidden": args.hidden, "layers": args.layers}


def save_checkpoint(path: Path, model, optimizer, step: int, shape: dict) -> None:
    """The model and optimizer through ``torch.distributed.checkpoint`` (collective): each rank writes its expert
    shards and their optimizer state at their global offsets (DTensors, ``feplb.sharded``), the replicated rest once,
    into a new ``step_*`` folder of ``path``; then rank 0 points ``path/latest.json`` (``train_moe.CKPT_POINTER``)
    at it (written atomically) and removes the older ones. A save that fails part way leaves the previous checkpoint
    in charge."""
    import shutil
    import uuid

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    demo = _demo()
    name = [f"step_{step:07d}-{uuid.uuid4().hex[:8]}"]   # (new: never the folder the pointer names)
    dist.broadcast_object_list(name, src=0)
    folder = path / name[0]
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}, checkpoint_id=folder)
    dist.barrier()   # (every rank's shards are written before the pointer moves)
    error = None
    if dist.get_rank() == 0:
        try:
            pointer = {"step": step, "dir": folder.name, "model": shape}
            demo.atomic_write_bytes(path / demo.CKPT_POINTER, json.dumps(pointer, indent=1).encode())
        except OSError as exc:
            error = f"--checkpoint {path}: cannot write {demo.CKPT_POINTER} ({type(exc).__name__}: {exc})"
        else:
            for old in path.glob("step_*"):
                if old.name != folder.name:
                    shutil.rmtree(old, ignore_errors=True)
    error = demo.agree(error)   # (every rank stops together; the previous checkpoint stays in charge)
    if error is not None:
        raise demo.UsageError(error)


def load_checkpoint(path: Path, model, optimizer, shape: dict) -> int:
    """Load a :func:`save_checkpoint` into this run's model and optimizer, whatever its number of ranks (each
    reads its own experts); returns the step it was written at. A checkpoint of another model, or none, stops every
    rank with one usage line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    demo = _demo()
    pointer = demo.read_pointer_file(path / demo.CKPT_POINTER, "--resume")   # (the form train_moe.py writes too)
    if pointer is None:
        raise demo.UsageError(f"--resume: {path} holds no checkpoint of this script (no {demo.CKPT_POINTER})")
    if not isinstance(pointer.get("model"), dict):
        raise demo.UsageError(f"--resume: {path / demo.CKPT_POINTER} is not a pointer this script wrote (no 'model')")
    diffs = "; ".join(f"--{k}: checkpoint {pointer['model'].get(k)!r}, now {v!r}" for k, v in shape.items()
                      if pointer["model"].get(k) != v)
    if diffs:   # (only what this run's tensors depend on: a pointer may record more)
        raise demo.UsageError(f"--resume: the checkpoint in {path} is of another model ({diffs})")
    folder = path / pointer["dir"]
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
    from torch.distributed.checkpoint.api import CheckpointException

    try:   # (torch.distributed.checkpoint raises on every rank together; its CheckpointException is no Exception)
        dcp.load(state, checkpoint_id=folder)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - a checkpoint that does not load is input
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise demo.UsageError(f"--resume: cannot load the checkpoint in {folder} ({type(exc).__name__}: "
                              f"{first[:300]})") from exc
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return _demo().run_example("hf_moe.py", args.device, lambda: train(args))


if __name__ == "__main__":
    sys.exit(main())
