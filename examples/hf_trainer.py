"""Train a small transformers MoE model with transformers' own ``Trainer``, made expert-parallel and balanced by
FEPLB (``feplb.hf.apply``, then ``feplb.hf.Trainer`` in place of ``transformers.Trainer``).

CPU (4 gloo processes modelled as 2 nodes of 2 GPUs; about a minute)::

    torchrun --standalone --nproc-per-node 4 examples/hf_trainer.py --gpus-per-node 2 --out runs/hf_trainer

GPUs (one node; NCCL)::

    torchrun --nproc-per-node 8 examples/hf_trainer.py --device cuda --out runs/hf_trainer_gpu

The model is ``hf_moe.py``'s (``--arch``: a scaled-down Qwen3-MoE, Mixtral or DeepSeek-V3, random init, nothing
downloaded), trained on the bytes the demo reads (this Python's standard-library source), which the Trainer shards
over the ranks as in any DDP run. The Trainer checkpoints every ``--save-steps`` into ``--out/checkpoint-N``: the
whole model, which ``from_pretrained`` of the original class loads without feplb, and each rank's expert shards and
optimizer state, which ``--resume`` continues from (on any number of ranks). At the end the model is saved to
``--out/final`` and rank 0 loads it with plain transformers: its loss on a held-out batch is printed beside the
FEPLB model's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

EXAMPLES_DIR = Path(__file__).resolve().parent


def _sibling(name: str):
    if str(EXAMPLES_DIR) not in sys.path:
        sys.path.insert(0, str(EXAMPLES_DIR))
    return __import__(name)


def build_parser() -> argparse.ArgumentParser:
    arch = sorted(_sibling("hf_moe").ARCHS)
    p = _sibling("train_moe").RankZeroParser(
        description="Train a small transformers MoE model with feplb.hf.Trainer (run under torchrun).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--arch", choices=arch, default="qwen3_moe", help="architecture (scaled down)")
    p.add_argument("--out", type=Path, required=True, help="the Trainer's output_dir: checkpoints, final model")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--save-steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0, help="max_grad_norm (0 = no clipping)")
    p.add_argument("--policy", default="feplb-split", help="FEPLB policy ('none' = plain expert parallelism)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: torchrun's --nproc-per-node")
    p.add_argument("--text-bytes", type=int, default=1 << 20, help="bytes of standard-library source to read")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5, help="logging_steps")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    return p


def sequences(corpus: bytes, seq_len: int) -> list[dict[str, torch.Tensor]]:
    """The corpus cut into sequences of byte ids (labels = inputs: the model shifts them)."""
    n = len(corpus) // seq_len
    ids = torch.frombuffer(bytearray(corpus[:n * seq_len]), dtype=torch.uint8).long().view(n, seq_len)
    return [{"input_ids": row, "labels": row} for row in ids]


def checkpoint_mismatch(folder: Path, config) -> str | None:
    """How the model saved in a Trainer checkpoint differs from ``config`` (its architecture and sizes, read from the
    checkpoint's config.json), or None: such a checkpoint cannot load, and the Trainer says so in a long traceback."""
    import json

    try:
        saved = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None   # (no readable config: the Trainer's own load decides)
    if not isinstance(saved, dict):
        return None
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {getattr(config, k, None)!r}" for k in keys
             if saved.get(k) != getattr(config, k, None)]
    return "; ".join(diffs) or None


def run(args: argparse.Namespace) -> dict:
    """Apply, train, save and reload (every rank; collective). Returns the final losses."""
    demo, hf_moe = _sibling("train_moe"), _sibling("hf_moe")
    hf_moe._needs_transformers(demo, "hf_trainer.py", ("transformers", "accelerate"))
    import transformers

    import feplb.hf

    world = dist.get_world_size()
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise demo.UsageError(f"--gpus-per-node: expected an integer >= 1, got {args.gpus_per_node}")
    if not 0 <= args.seed < 2**32:
        raise demo.UsageError("--seed: expected an integer in [0, 2**32) (transformers' set_seed (numpy's) takes no "
                              f"other), got {args.seed}")
    G = args.gpus_per_node if args.gpus_per_node is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % G:
        raise demo.UsageError(f"--gpus-per-node {G} does not divide the world size {world}")
    demo.check_options(args, ("max_steps", "save_steps", "batch", "accumulation", "seq_len", "log_every", "hidden",
                              "layers", "text_bytes"))
    demo.check_out_dir(args.out, resume=False, overwrite=True)   # (writable; its checkpoints are checked below)
    last = transformers.trainer_utils.get_last_checkpoint(str(args.out)) if args.out.is_dir() else None
    if args.resume and last is None:
        raise demo.UsageError(f"--resume: no checkpoint-N folder in {args.out}")
    if not args.resume and last is not None:
        raise demo.UsageError(f"--out {args.out} holds checkpoints of an earlier run ({Path(last).name}); pass "
                              "--resume to continue it, or another --out")
    corpus, _ = demo.read_corpus(None, args.text_bytes)
    # (checked before cutting: a text shorter than one sequence failed in torch.frombuffer)
    if len(corpus) // args.seq_len < (world + 1) * args.batch:
        raise demo.UsageError(f"--text-bytes {args.text_bytes}: too few sequences of {args.seq_len} bytes for "
                              f"{world} ranks of {args.batch} and a held-out batch")
    data = sequences(corpus, args.seq_len)
    held_out, data = data[-args.batch:], data[:-args.batch]

    model = hf_moe.build_model(args.arch, args.hidden, args.layers, args.seed)
    if args.resume:
        why = checkpoint_mismatch(Path(last), model.config)
        if why is not None:
            raise demo.UsageError(f"--resume: {Path(last).name} in {args.out} is of another model ({why})")
    if args.device == "cuda":
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
    try:   # (what apply refuses, it refuses on every rank together: one usage error, not a traceback per rank)
        feplb.hf.apply(model, policy=args.policy, gpus_per_node=G,
                       plan_wait_ms=0.0 if args.device == "cuda" else 200.0)
    except ValueError as exc:
        raise demo.UsageError(str(exc)) from exc
    targs = transformers.TrainingArguments(
        output_dir=str(args.out), max_steps=args.max_steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation, learning_rate=args.lr, max_grad_norm=args.clip,
        lr_scheduler_type="cosine", warmup_steps=min(5, args.max_steps // 4), logging_steps=args.log_every,
        save_strategy="steps", save_steps=args.save_steps, seed=args.seed, report_to=[], dataloader_num_workers=0,
        # every parameter takes part in every step: no search for unused ones (and no warning about it)
        ddp_find_unused_parameters=False,
        use_cpu=args.device == "cpu", ddp_backend="gloo" if args.device == "cpu" else "nccl")
    trainer = feplb.hf.Trainer(model=model, args=targs, train_dataset=data)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    final = args.out / "final"
    trainer.save_model(str(final))   # every rank: the experts are gathered

    # the FEPLB model's loss on the held-out batch (its forward is collective), and plain transformers' from the
    # saved files
    batch = torch.stack([s["input_ids"] for s in held_out]).to(next(model.parameters()).device)
    model.eval()
    with torch.no_grad():
        ours = float(model(input_ids=batch, labels=batch).loss)
    plain = None
    if dist.get_rank() == 0:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(final).to(batch.device).eval()
        with torch.no_grad():
            plain = float(loaded(input_ids=batch, labels=batch).loss)
        print(f"\nheld-out loss: FEPLB model {ours:.6f}, plain transformers from {final} {plain:.6f}", flush=True)
    dist.barrier()
    # the layers' threads and copy paths, released before the process group goes (the Trainer and accelerate keep
    # the model alive to the interpreter's exit, where threads still running abort the process)
    for moe in feplb.hf.experts_modules(model):
        moe.close()
    return {"step": trainer.state.global_step, "loss": ours, "plain_loss": plain}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return _sibling("train_moe").run_example("hf_trainer.py", args.device, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
