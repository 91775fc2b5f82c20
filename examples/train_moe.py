"""Train a small decoder-only MoE transformer under expert parallelism, with FEPLB balancing its MoE layers.

CPU demo (4 gloo processes modelled as 2 nodes of 2 GPUs; a few minutes on a laptop)::

    torchrun --standalone --nproc-per-node 4 examples/train_moe.py --gpus-per-node 2 --out runs/demo

GPUs (one node of 8)::

    torchrun --nproc-per-node 8 examples/train_moe.py --device cuda --transport nvshmem --out runs/gpu

Every rank reads its own slice of the text (data parallel over the expert-parallel group). Attention, embedding,
norm and router weights are replicated: their gradients are averaged over the world by one explicit all-reduce per
step. Expert weights are sharded (each rank owns ``E / W`` experts) and are never all-reduced: the all-to-all
backward already brings every rank's gradient to the expert's owner. The script writes ``report.json``, plots and
``report.md`` to ``--out`` and a per-rank checkpoint that ``--resume`` continues from, step for step.

Shape legend: B sequences per rank, S sequence length, T = B*S tokens per rank, D hidden, V vocabulary (256 byte
values), L MoE layers, W ranks (modelled GPUs).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import hashlib
import json
import math
import os
import random
import shutil
import signal
import socket
import sys
import sysconfig
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

EXAMPLES_DIR = Path(__file__).resolve().parent

VOCAB = 256
CKPT_DIR = "checkpoint"
CKPT_POINTER = "latest.json"
STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class UsageError(ValueError):
    """Bad input the user can fix: printed as one message, then the script exits with status 2."""


# ----------------------------------------------------------------------------------------------------------------
# Command line and configuration


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that decides the training trajectory; its hash guards ``--resume``.

    ``steps``, ``out``, logging and checkpoint cadence and the transport are left out on purpose: they change how
    long or where the run goes, never what a given step computes.
    """

    layers: int
    hidden: int
    heads: int
    ffn: int
    experts: int
    top_k: int
    router: str
    bias_rate: float
    router_lr_scale: float
    dyn: int
    policy: str
    gpus_per_node: int
    world_size: int
    batch: int
    seq_len: int
    lr: float
    warmup: int
    weight_decay: float
    clip: float
    seed: int
    device: str
    text: str
    text_bytes: int
    corpus_sha256: str

    def __post_init__(self) -> None:
        positive = ("layers", "hidden", "heads", "ffn", "experts", "top_k", "gpus_per_node", "world_size", "batch",
                    "seq_len", "text_bytes")
        for name in positive:
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise UsageError(f"--hidden {self.hidden} is not divisible by --heads {self.heads}")
        if self.top_k > self.experts:
            raise UsageError(f"--top-k {self.top_k} exceeds --experts {self.experts}")
        if self.world_size % self.gpus_per_node:
            raise UsageError(
                f"--gpus-per-node {self.gpus_per_node} does not divide the world size {self.world_size} "
                f"(torchrun --nproc-per-node x nodes); nodes must be whole")
        if self.experts % self.world_size:
            raise UsageError(
                f"--experts {self.experts} is not divisible by the world size {self.world_size}: every rank must own "
                f"the same number of experts (choose --experts as a multiple of {self.world_size})")
        if not 0 <= self.dyn <= self.experts // self.world_size:
            raise UsageError(
                f"--dyn {self.dyn}: expected 0..{self.experts // self.world_size} (the experts each rank owns, "
                f"--experts {self.experts} / world size {self.world_size})")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UsageError(f"--lr: expected a positive finite number, got {self.lr}")
        if not (self.router_lr_scale >= 0 and math.isfinite(self.router_lr_scale)):
            raise UsageError(f"--router-lr-scale: expected a finite number >= 0, got {self.router_lr_scale}")
        if not (self.bias_rate >= 0 and math.isfinite(self.bias_rate)):
            raise UsageError(f"--bias-rate: expected a finite number >= 0, got {self.bias_rate}")
        if self.warmup < 0:
            raise UsageError(f"--warmup: expected an integer >= 0, got {self.warmup}")
        if not -(2**63) <= self.seed < 2**63:
            raise UsageError(f"--seed: expected an integer in [-2**63, 2**63), got {self.seed}")
        # (NaN passed a '< 0' test: --clip nan turned clipping off, --weight-decay nan failed at step 2 asking to
        # lower --lr)
        for name in ("weight_decay", "clip"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise UsageError(f"--{name.replace('_', '-')}: expected a finite number >= 0, got "
                                 f"{getattr(self, name)}")

    def digest(self) -> str:
        """Hash of the fields that decide the trajectory (the text's description is left out: its bytes' hash is
        in, so a corpus at another path on another machine still resumes)."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k != "text"}
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where the help text already explains a computed one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class RankZeroParser(argparse.ArgumentParser):
    """argparse that reports a bad option on rank 0 alone: under torchrun every rank parses the same command line
    and fails alike, before any process group exists; each would otherwise print its own usage and error."""

    def error(self, message: str):
        if os.environ.get("RANK", "0") == "0":
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = RankZeroParser(
        description="Train a small MoE transformer with FEPLB load balancing (run under torchrun).",
        formatter_class=_HelpFormatter)
    run = p.add_argument_group("run")
    run.add_argument("--steps", type=int, default=120, help="total optimizer steps (a resumed run continues to this)")
    run.add_argument("--out", type=Path, default=Path("runs/demo"), help="directory for the report and checkpoint")
    run.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    run.add_argument("--overwrite", action="store_true",
                     help="start afresh even if --out holds a run: its checkpoint and report are removed first")
    run.add_argument("--log-every", type=int, default=10, help="steps between log lines")
    run.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints (and one at the end)")
    run.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                     help="cpu: one gloo process per modelled GPU; cuda: one GPU per rank, NCCL")
    run.add_argument("--transport", choices=("torch", "nvshmem"), default="torch",
                     help="how MoE rows travel between ranks (nvshmem needs CUDA and nvshmem4py)")
    run.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    bal = p.add_argument_group("balancing")
    bal.add_argument("--policy", default="feplb-split",
                     help="balancing policy of every MoE layer (feplb.sched.POLICIES): 'feplb-split' moves dynamic "
                          "experts and splits the hottest ones' rows inside a node, 'feplb' is the paper's "
                          "whole-expert greedy, 'none' is plain expert parallelism")
    bal.add_argument("--gpus-per-node", type=int, default=None,
                     help="ranks per (modelled) node; balancing moves work only inside a node "
                          "(default: torchrun's --nproc-per-node)")
    bal.add_argument("--plan-wait-ms", type=float, default=None,
                     help="how long a layer waits for its plan after the static experts' GEMM before it computes "
                          "at home instead (default: the layer's: 0 on CUDA, where the plan overlaps the GEMM; on "
                          "the CPU it waits for the plan)")
    bal.add_argument("--dyn", type=int, default=None,
                     help="dynamic experts per rank, which may run on another rank of the node "
                          "(default: min(4, experts per rank))")
    model = p.add_argument_group("model")
    model.add_argument("--layers", type=int, default=4, help="transformer layers, each with a MoE MLP")
    model.add_argument("--hidden", type=int, default=128, help="model width")
    model.add_argument("--heads", type=int, default=4, help="attention heads")
    model.add_argument("--ffn", type=int, default=128, help="hidden size of each expert's SwiGLU")
    model.add_argument("--experts", type=int, default=16, help="experts per MoE layer (a multiple of the world size)")
    model.add_argument("--top-k", type=int, default=2, help="experts per token")
    model.add_argument("--router", choices=("softmax", "sigmoid"), default="sigmoid",
                       help="gate weights: softmax probabilities, or sigmoids normalised over the top-k")
    model.add_argument("--bias-rate", type=float, default=0.01,
                       help="step of the auxiliary-loss-free expert bias per optimizer step (0 = no bias)")
    model.add_argument("--router-lr-scale", type=float, default=0.1,
                       help="router learning rate relative to --lr; a fast router in a tiny model sends every "
                            "token to one expert within a few steps")
    data = p.add_argument_group("data and optimizer")
    data.add_argument("--text", type=Path, default=None,
                      help="a text file or a directory of them (default: this Python's standard-library source)")
    data.add_argument("--text-bytes", type=int, default=4 << 20, help="bytes of text to read, split over the ranks")
    data.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    data.add_argument("--seq-len", type=int, default=128)
    data.add_argument("--lr", type=float, default=3e-3)
    data.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warm-up, then constant")
    data.add_argument("--weight-decay", type=float, default=0.01)
    data.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0 = off)")
    return p


# ----------------------------------------------------------------------------------------------------------------
# Distributed helpers


def init_distributed(device: str) -> tuple[int, int, int]:
    """Join the torchrun group (or form a group of one when started as a plain script); returns rank, world, local."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: this torch build or machine has no CUDA device")
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), local_rank


def agree(error: str | None) -> str | None:
    """Share each rank's error (or None) so that all ranks stop together instead of hanging in a collective."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(rank, err) for rank, err in enumerate(errors) if err is not None]
    if not failed:
        return None
    rank, err = failed[0]
    # The rank is worth naming only when the ranks disagree (a file one rank cannot read, say).
    return err if len(failed) == len(errors) and len({e for _, e in failed}) == 1 else f"(rank {rank}) {err}"


def forward_or_lower_lr(model, step: int, *args, **kwargs):
    """``model(*args, **kwargs)``; where the MoE layers refuse non-finite router logits (on every rank together:
    weights grown too large by a finite loss's step), the UsageError that says what to do."""
    from feplb import NonFiniteRoutingError

    try:
        return model(*args, **kwargs)
    except NonFiniteRoutingError as exc:
        raise UsageError(f"the router logits became inf or NaN at step {step} (weights grown too large); lower "
                         "--lr") from exc


def collective_check(fn, *args, **kwargs):
    """Run ``fn`` on every rank; if it raises UsageError on any rank, raise UsageError on all of them."""
    result, error = None, None
    try:
        result = fn(*args, **kwargs)
    except UsageError as exc:
        error = str(exc)
    err = agree(error)
    if err is not None:
        raise UsageError(err)
    return result


# ----------------------------------------------------------------------------------------------------------------
# Data: bytes of real text, one contiguous slice per rank, B parallel streams per slice


def _read_up_to(f, n: int) -> bytes:
    """Up to ``n`` bytes of ``f``, read in 16 MiB pieces: ``f.read(n)`` reserves all n bytes first, so a huge
    --text-bytes failed with a MemoryError however small the files."""
    parts, left = [], n
    while left > 0:
        part = f.read(min(left, 1 << 24))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def check_options(args: argparse.Namespace, positive: tuple[str, ...]) -> None:
    """The Hugging Face examples' numeric options, alike on every rank before any collective: ``positive`` integers
    >= 1 (a 0 was a ZeroDivisionError on one rank, its peers waiting), ``--lr`` positive and ``--clip`` >= 0, both
    finite (--clip -1 trained without clipping, --lr 0 without learning, NaN went through)."""
    for name in positive:
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise UsageError(f"--lr: expected a positive finite number, got {args.lr}")
    if not (args.clip >= 0 and math.isfinite(args.clip)):
        raise UsageError(f"--clip: expected a finite number >= 0 (0: no clipping), got {args.clip}")


def read_corpus(text: Path | None, budget: int) -> tuple[bytes, str]:
    """Read up to ``budget`` bytes of text, in a deterministic order; returns the bytes and a description."""
    if text is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        label = f"Python {sys.version.split()[0]} standard-library source ({root})"
        suffixes = (".py",)
    else:
        root, label, suffixes = text, str(text), None
        if not root.exists():
            raise UsageError(f"--text {text}: no such file or directory")
    chunks, total = [], 0
    try:
        if root.is_file():
            with open(root, "rb") as f:
                chunks.append(_read_up_to(f, budget))
            total = len(chunks[0])
        else:
            for dirpath, dirnames, filenames in os.walk(root):
                # Sorting in place fixes the walk order, so every machine with the same files reads the same bytes.
                dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_SKIP_DIRS and not d.startswith("."))
                for name in sorted(filenames):
                    if name.startswith(".") or (suffixes and not name.endswith(suffixes)):
                        continue
                    path = Path(dirpath) / name
                    if not path.is_file():
                        continue
                    with open(path, "rb") as f:
                        data = _read_up_to(f, budget - total)
                    chunks.append(data)
                    total += len(data)
                    if total >= budget:
                        break
                if total >= budget:
                    break
    except OSError as exc:
        raise UsageError(f"--text {root}: cannot read the text ({type(exc).__name__}: {exc})") from exc
    corpus = b"".join(chunks)
    if not corpus:
        raise UsageError(f"--text {root}: found no text to train on")
    return corpus, label


class ByteStreams:
    """Rank ``rank``'s slice of the corpus as B contiguous streams; step ``i`` reads window ``i`` of every stream.

    The data position is just the step index, so a checkpoint's step restores it exactly.
    """

    def __init__(self, corpus: bytes, *, rank: int, world: int, batch: int, seq_len: int, device: torch.device):
        need = world * batch * (seq_len + 2)
        if len(corpus) < need:
            raise UsageError(
                f"--text: {len(corpus)} bytes of text, but {world} ranks x --batch {batch} x (--seq-len {seq_len} + 2)"
                f" needs at least {need}; give more text (--text, --text-bytes) or lower --batch / --seq-len")
        per_rank = len(corpus) // world
        mine = np.frombuffer(corpus, dtype=np.uint8)[rank * per_rank:(rank + 1) * per_rank]
        self.stream_len = per_rank // batch
        self.streams_BL = torch.from_numpy(mine[:batch * self.stream_len].astype(np.int64)).view(batch, -1)
        self.seq_len, self.device = seq_len, device

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets of step ``step``: two int64 tensors [B, S]."""
        span = self.stream_len - self.seq_len - 1
        start = (step * self.seq_len) % span
        window_BS1 = self.streams_BL[:, start:start + self.seq_len + 1]
        return window_BS1[:, :-1].to(self.device), window_BS1[:, 1:].to(self.device)


# ----------------------------------------------------------------------------------------------------------------
# Model


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a FEPLB MoE layer in place of the MLP."""

    def __init__(self, cfg: TrainConfig, moe_config, group) -> None:
        super().__init__()
        import feplb

        self.heads = cfg.heads
        self.norm1 = nn.RMSNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.norm2 = nn.RMSNorm(cfg.hidden)
        self.moe = feplb.MoELayer(moe_config, group)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q, k, v = self.qkv(self.norm1(x_BSD)).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        attn_BSD = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, D)
        x_BSD = x_BSD + self.proj(attn_BSD)
        return x_BSD + self.moe(self.norm2(x_BSD))


class MoETransformer(nn.Module):
    """Byte-level decoder-only transformer; ``forward`` maps int64 ids [B, S] to logits [B, S, V]."""

    def __init__(self, cfg: TrainConfig, moe_config, group) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, cfg.hidden)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.hidden))
        self.blocks = nn.ModuleList(Block(cfg, moe_config, group) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)
        for blk in self.blocks:
            nn.init.normal_(blk.qkv.weight, std=0.02)
            # Residual outputs start small (GPT-2's scaling), which keeps early steps stable without tuning.
            nn.init.normal_(blk.proj.weight, std=0.02 / math.sqrt(2 * cfg.layers))

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        x_BSD = self.embed(ids_BS) + self.pos[: ids_BS.shape[1]]
        for blk in self.blocks:
            x_BSD = blk(x_BSD)
        return self.norm(x_BSD) @ self.embed.weight.T  # tied input/output embedding

    def moe_layers(self) -> list:
        return [blk.moe for blk in self.blocks]


def split_parameters(model: MoETransformer) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(replicated, expert-sharded) parameters. Expert weights are each MoE layer's w1 and w2."""
    expert_ids = {id(p) for moe in model.moe_layers() for p in (moe.w1, moe.w2)}
    replicated = [p for p in model.parameters() if id(p) not in expert_ids]
    experts = [p for p in model.parameters() if id(p) in expert_ids]
    return replicated, experts


def init_expert_weights(model: MoETransformer, cfg: TrainConfig, rank: int) -> None:
    """Give every global expert its own initial weights, drawn from (seed, layer, global expert id).

    Without this, ranks seeded alike would start their local shards from identical draws, so expert e on rank 0
    and expert e on rank 1 would begin as twins; and the start would depend on the world size.
    """
    e_local = cfg.experts // cfg.world_size
    with torch.no_grad():
        for layer, moe in enumerate(model.moe_layers()):
            for j in range(e_local):
                # (folded into the seeds torch takes: a --seed of 2e7 or more made the product overflow them)
                g = torch.Generator().manual_seed(
                    ((cfg.seed * 1_000_003 + layer) * 1_000_003 + rank * e_local + j) % 2**63)
                for w in (moe.w1, moe.w2):
                    fan_in = w.shape[1]
                    draw = torch.randn(w.shape[1:], generator=g) / math.sqrt(fan_in)
                    w[j].copy_(draw.to(w.dtype))


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints: per rank, written atomically, committed by a pointer file once every rank has written


def _new_file_mode() -> int:
    """The mode open() gives a new file under this process's umask (mkstemp's files are 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _new_file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_torch_save(obj, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.chmod(tmp, _new_file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def rng_state(device: str) -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict, device: str) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if device == "cuda":
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(out: Path, *, step: int, cfg: TrainConfig, model, optimizer, history: dict | None,
                    rank: int, local_rank: int) -> None:
    """Every rank writes its shard into checkpoint/step_N/; once every rank has, latest.json is switched to step_N.

    A crash at any point leaves latest.json naming the previous complete checkpoint; a rank that cannot write its
    file raises UsageError on every rank.
    """
    step_dir = out / CKPT_DIR / f"step_{step:07d}"
    state = {"step": step, "data_position": step, "config_hash": cfg.digest(), "config": dataclasses.asdict(cfg),
             "rank": rank, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "rng": rng_state(cfg.device), "history": history,
             # The layers' planning history (EMA of loads, frozen dynamic sets) lives outside their state_dict.
             "policy_states": [moe.state for moe in model.moe_layers()]}
    # a rank that cannot write its file (disk full, say) stops every rank together, the pointer left on the last
    # complete checkpoint, instead of leaving the others in the barrier until the process group's timeout
    error = None
    try:
        step_dir.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(state, step_dir / f"rank{rank}.pt")
    except Exception as exc:  # noqa: BLE001 - agreed below (a full disk makes torch.save raise a RuntimeError)
        error = f"cannot write the checkpoint of step {step} ({type(exc).__name__}: {exc})"
    err = agree(error)
    if err is not None:
        raise UsageError(f"{err}; the last complete checkpoint stays in {out / CKPT_DIR}")
    if local_rank == 0:  # one writer per node, so a node-local --out works too
        pointer = {"step": step, "dir": step_dir.name, "config_hash": cfg.digest(), "config": dataclasses.asdict(cfg)}
        atomic_write_bytes(out / CKPT_DIR / CKPT_POINTER, json.dumps(pointer, indent=1).encode())
        for old in (out / CKPT_DIR).glob("step_*"):
            if old.name != step_dir.name:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def read_pointer(out: Path, option: str = "--resume") -> dict | None:
    """The checkpoint pointer in ``out`` (None without one); one that cannot be read, or is not one this script
    writes, is a usage error naming ``option``, the argument that led here."""
    return read_pointer_file(out / CKPT_DIR / CKPT_POINTER, option)


def read_pointer_file(path: Path, option: str) -> dict | None:
    """A checkpoint pointer file (an object naming its ``step`` and the ``dir`` holding it; this script's, and
    hf_moe.py's), or None where there is none; unreadable, or of another form, a usage error naming ``option``."""
    if not path.exists():
        return None
    try:
        pointer = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{option}: cannot read {path} ({type(exc).__name__}: {exc})") from exc
    if not isinstance(pointer, dict) or not isinstance(pointer.get("dir"), str) or \
            type(pointer.get("step")) is not int:
        raise UsageError(f"{option}: {path} is not a checkpoint pointer this script wrote (expected an object with "
                         "'step' and 'dir')")
    return pointer


def config_mismatch(saved: dict, cfg: TrainConfig) -> str:
    now = dataclasses.asdict(cfg)
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {now[k]!r}" for k in now if k != "text" and saved.get(k) != now[k]]
    return "; ".join(diffs) or "every field matches but the hash does not: written by another version of this script"


def load_checkpoint(out: Path, cfg: TrainConfig, rank: int) -> dict:
    pointer = read_pointer(out)
    if pointer is None:
        raise UsageError(f"--resume: {out} holds no checkpoint ({out / CKPT_DIR / CKPT_POINTER} is missing)")
    if pointer.get("config_hash") != cfg.digest():
        raise UsageError(f"--resume: the checkpoint in {out} was written by a different configuration "
                         f"({config_mismatch(pointer.get('config', {}), cfg)})")
    path = out / CKPT_DIR / pointer["dir"] / f"rank{rank}.pt"
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError) as exc:
        raise UsageError(f"--resume: cannot load {path} ({type(exc).__name__}: {exc})") from exc
    if state.get("config_hash") != cfg.digest() or state.get("step") != pointer["step"] or state.get("rank") != rank:
        raise UsageError(f"--resume: {path} does not belong to this checkpoint (step, rank or configuration differ)")
    return state


# ----------------------------------------------------------------------------------------------------------------
# Training


def check_out_dir(out: Path, resume: bool, overwrite: bool = False) -> None:
    """Check that ``out`` can be written and holds no run unless resuming or overwriting, without creating it or
    changing what it holds (a run refused later, for its configuration say, leaves no empty folder behind and the
    previous run intact: ``make_out_dir`` creates it, ``clear_previous_run`` removes an overwritten run once every
    check has passed)."""
    if resume and overwrite:
        raise UsageError("--resume and --overwrite exclude each other: continue the run in --out, or replace it")
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"--out {out}: cannot write there ({existing} is not a directory)")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".write-test-"):
            pass
    except OSError as exc:
        # (the error without the test file's random name: every rank then says the same, and it is said once)
        why = exc.strerror or type(exc).__name__
        raise UsageError(f"--out {out}: cannot write there ({type(exc).__name__}: {why} in {existing})") from exc
    if overwrite:
        return
    pointer = read_pointer(out, "--out") if not resume else None
    if pointer is not None:
        raise UsageError(f"--out {out} already holds a run (checkpoint at step {pointer.get('step')}); "
                         f"pass --resume to continue it, --overwrite to replace it, or choose another --out")


def clear_previous_run(out: Path) -> None:
    """--overwrite: remove the previous run's checkpoint and report files from ``out`` (one rank; the caller then
    barriers). Called once every check has passed, so that a refused run leaves the previous one intact."""
    if out.is_dir():
        # the run's own checkpoint files only (step_N/ folders and the pointer): anything else there stays
        ckpt = out / CKPT_DIR
        for old in ckpt.glob("step_*"):
            shutil.rmtree(old, ignore_errors=True)
        (ckpt / CKPT_POINTER).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            ckpt.rmdir()     # (only when nothing else is left in it)
        try:
            for name in _report_module().FILES:
                (out / name).unlink(missing_ok=True)
        except OSError as exc:
            raise UsageError(f"--overwrite: cannot remove the previous run's files in {out} ({exc})") from exc


def make_out_dir(out: Path, creator: bool) -> list[Path]:
    """Create ``out`` (on ``creator``, one rank per node; the caller then barriers). Returns the folders this call
    created, outermost first, so that a run which fails before writing anything can remove them again."""
    if not creator:
        return []
    missing, p = [], out
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot create it ({type(exc).__name__}: {exc})") from exc
    return missing[::-1]


def remove_if_empty(created: list[Path]) -> None:
    """Remove the folders ``make_out_dir`` created, innermost first, as long as they are empty."""
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            return


class ExpertBias:
    """Auxiliary-loss-free balancing on the slow timescale (as in DeepSeek-V3), one selection bias per expert.

    After every step each layer's bias moves by ``rate`` towards under-used experts (sign of mean load minus the
    expert's load, over all ranks' tokens). It keeps experts alive without an auxiliary loss; the per-micro-batch
    imbalance that remains is what FEPLB balances. The bias only selects experts, it never enters the gate weights.
    """

    def __init__(self, moes: list, rate: float) -> None:
        self.moes, self.rate = moes, rate

    @torch.no_grad()
    def update(self) -> None:
        if self.rate <= 0:
            return
        # the layer's last forward already all-gathered every rank's per-expert counts
        for moe in self.moes:
            counts_E = torch.tensor(moe.last_stats.tokens_per_expert, dtype=torch.float64)
            step_E = torch.sign(counts_E.mean() - counts_E).to(moe.router_bias.dtype)
            moe.router_bias.add_(self.rate * step_E)


def rank_stats(moes: list) -> list:
    """This rank's report of each layer's last forward (``LayerStats``, without the [W, E] counts and dynamic
    sets, which every step would all-gather): exact for the GPUs it planned, its own node's with several nodes
    (``LayerStats.planned_ranks``), so each node speaks for itself."""
    return [dataclasses.replace(moe.last_stats, counts_WE=[], dynamic_WD=[]) for moe in moes]


def layer_stats(views: list[list]) -> dict:
    """This step's balancing statistics from every rank's ``rank_stats`` (``feplb.join_stats`` per layer): per-layer
    lists and means over layers."""
    from feplb import join_stats

    joined = [join_stats([view[layer] for view in views]) for layer in range(len(views[0]))]
    before = [j["token_straggler_before"] for j in joined]
    after = [j["token_straggler_after"] for j in joined]
    moved_L = [j["rows_moved"] for j in joined]
    return {
        "token_straggler_before": sum(before) / len(before),
        "token_straggler_after": sum(after) / len(after),
        "rows_moved": sum(moved_L),
        "layer_rows_moved": moved_L,
        "fell_back": sum(j["fell_back"] for j in joined),
        "layer_straggler_before": before,
        "layer_straggler_after": after,
        "loads_before_LW": [[int(v) for v in views[0][layer].loads_before_W] for layer in range(len(joined))],
        "loads_after_LW": [[int(v) for v in j["loads_after_W"]] for j in joined],
    }


def make_optimizer(model: MoETransformer, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; matrices decay, vectors and the position table do not; routers learn at ``router_lr_scale`` x lr."""
    routers = {id(moe.router.weight) for moe in model.moe_layers()}
    groups: dict[str, list[nn.Parameter]] = {"decay": [], "no_decay": [], "router": []}
    for p in model.parameters():
        if id(p) in routers:
            groups["router"].append(p)
        elif p.dim() >= 2 and p is not model.pos:
            groups["decay"].append(p)
        else:
            groups["no_decay"].append(p)
    return torch.optim.AdamW([
        {"params": groups["decay"], "weight_decay": cfg.weight_decay, "lr_scale": 1.0},
        {"params": groups["no_decay"], "weight_decay": 0.0, "lr_scale": 1.0},
        {"params": groups["router"], "weight_decay": 0.0, "lr_scale": cfg.router_lr_scale},
    ], lr=cfg.lr, betas=(0.9, 0.95))


def reduce_gradients(replicated: list[nn.Parameter], experts: list[nn.Parameter], loss: torch.Tensor,
                     world: int, clip: float) -> tuple[float, float]:
    """Average replicated gradients over the world and scale expert gradients to the same (global-mean) loss.

    One all-reduce carries the replicated gradients, the loss and the expert shards' squared gradient norm, so the
    clip coefficient is computed from the true global norm on every rank. Returns (global mean loss, grad norm).
    """
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in replicated]
    expert_sq = sum((p.grad.double().square().sum() for p in experts if p.grad is not None),
                    torch.zeros((), dtype=torch.float64, device=loss.device))
    flat = torch.cat([g.reshape(-1).double() for g in grads]
                     + [loss.detach().double().reshape(1), expert_sq.reshape(1)])
    dist.all_reduce(flat)
    # Each rank's loss is a mean over its own tokens, so the global loss is the mean over ranks: replicated
    # gradients are divided by W, and so are expert gradients, which the all-to-all backward summed over ranks.
    offset = 0
    for p, g in zip(replicated, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(g).to(g.dtype) / world
        offset += n
    mean_loss = float(flat[offset]) / world
    for p in experts:
        if p.grad is not None:
            p.grad.div_(world)
    rep_sq = sum(float(p.grad.double().square().sum()) for p in replicated)
    norm = math.sqrt(rep_sq + float(flat[offset + 1]) / world**2)
    if clip > 0 and norm > clip:
        scale = clip / (norm + 1e-6)
        for p in replicated + experts:
            if p.grad is not None:
                p.grad.mul_(scale)
    return mean_loss, norm


def make_config(args, world: int, corpus_sha: str, text_label: str) -> TrainConfig:
    dyn = args.dyn if args.dyn is not None else min(4, args.experts // world)
    gpn = args.gpus_per_node if args.gpus_per_node is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return TrainConfig(
        layers=args.layers, hidden=args.hidden, heads=args.heads, ffn=args.ffn, experts=args.experts,
        top_k=args.top_k, router=args.router, bias_rate=args.bias_rate,
        router_lr_scale=args.router_lr_scale, dyn=dyn, policy=args.policy,
        gpus_per_node=gpn, world_size=world, batch=args.batch,
        seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay, clip=args.clip,
        seed=args.seed, device=args.device, text=text_label, text_bytes=args.text_bytes, corpus_sha256=corpus_sha)


def params_per_rank(cfg: TrainConfig) -> int:
    """Parameters each rank holds: the replicated ones (embedding, positions, attention, norms, routers) and its
    E / W experts' w1 [D, 2F] and w2 [F, D] in every layer."""
    D, local_experts = cfg.hidden, cfg.experts // cfg.world_size
    per_layer = 2 * D + 4 * D * D + cfg.experts * D + local_experts * 3 * D * cfg.ffn   # norms, qkv, proj, router
    return VOCAB * D + cfg.seq_len * D + D + cfg.layers * per_layer   # embedding, positions, final norm


def activation_bytes_per_rank(cfg: TrainConfig) -> int:
    """A lower bound of the bytes one training forward keeps for its backward on each rank: every block's input
    [B, S, D] and the logits [B, S, V], in fp32 (attention, the experts' rows and the rest come on top)."""
    return 4 * cfg.batch * cfg.seq_len * (cfg.layers * cfg.hidden + VOCAB)


def memory_for_ranks(device: str, local_rank: int) -> tuple[int, str]:
    """(bytes, description) of the memory each rank of this machine can have at most: a GPU's, or the machine's
    physical memory shared by its ranks (torchrun's LOCAL_WORLD_SIZE)."""
    if device == "cuda":
        total = torch.cuda.get_device_properties(local_rank).total_memory
        return total, f"{total / 2**30:.1f} GiB of GPU {local_rank}"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return total // ranks, (f"{total / ranks / 2**30:.1f} GiB per rank ({total / 2**30:.1f} GiB of memory on this "
                            f"machine, {ranks} rank{'s' if ranks > 1 else ''} on it)")


def check_memory(cfg: TrainConfig, local_rank: int) -> None:
    """Refuse a run whose fp32 parameters, gradients and AdamW's two states, with the activations a forward keeps
    at the least (lower bounds of what training holds), exceed the memory a rank can have: a slip such as
    ``--hidden 6400000`` or ``--batch 1000000`` would otherwise be found by an allocation failing (or the machine's
    OOM killer) only while the model is built or in the first step."""
    n = params_per_rank(cfg)
    need = 16 * n   # 4 bytes each for the parameter, its gradient, and AdamW's exp_avg and exp_avg_sq
    limit, where = memory_for_ranks(cfg.device, local_rank)
    if need > limit:
        raise UsageError(
            f"--hidden {cfg.hidden} and --ffn {cfg.ffn} (--layers {cfg.layers}, --experts {cfg.experts}) make "
            f"{n:.3g} parameters per rank, which need at least {need / 2**30:.1f} GiB (fp32, with their gradients "
            f"and AdamW's two states), more than the limit of {where}; lower --hidden or --ffn")
    act = activation_bytes_per_rank(cfg)
    if need + act > limit:
        raise UsageError(
            f"--batch {cfg.batch} x --seq-len {cfg.seq_len} tokens per rank keep at least {act / 2**30:.1f} GiB of "
            f"activations for the backward (each of the {cfg.layers} layers' input of --hidden {cfg.hidden} and the "
            f"logits, fp32), which with the model's {need / 2**30:.1f} GiB is more than the limit of {where}; lower "
            "--batch or --seq-len")


def make_moe_config(cfg: TrainConfig, transport: str, plan_wait_ms: float | None,
                    min_straggler_rows: int | None = None):
    import feplb

    try:
        return feplb.FEPLBConfig(hidden=cfg.hidden, ffn=cfg.ffn, num_experts=cfg.experts, top_k=cfg.top_k,
                                 router=cfg.router, router_bias=cfg.bias_rate > 0, gpus_per_node=cfg.gpus_per_node,
                                 dyn=cfg.dyn, policy=cfg.policy, transport=transport,
                                 plan_wait_ms=plan_wait_ms, min_straggler_rows=min_straggler_rows, timeline=True)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"MoE layer configuration rejected: {exc}") from exc


def train(args: argparse.Namespace, created: list[Path] | None = None) -> Path:
    """The training run. ``created`` receives the folders this run created for ``--out``."""
    if args.steps < 1:
        raise UsageError(f"--steps: expected a positive integer, got {args.steps}")
    if args.log_every < 1 or args.ckpt_every < 1:
        raise UsageError("--log-every and --ckpt-every: expected positive integers")
    if args.text_bytes < 1:
        raise UsageError(f"--text-bytes: expected a positive integer, got {args.text_bytes}")
    if args.transport == "nvshmem" and args.device != "cuda":
        raise UsageError("--transport nvshmem needs --device cuda (NVSHMEM moves rows between GPUs)")
    rank, world, local_rank = init_distributed(args.device)
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    out: Path = args.out

    collective_check(check_out_dir, out, args.resume, args.overwrite)
    corpus, text_label = collective_check(read_corpus, args.text, args.text_bytes)
    corpus_sha = hashlib.sha256(corpus).hexdigest()
    if len(set(gather(corpus_sha))) != 1:  # the same answer on every rank, so all of them stop here together
        raise UsageError("--text: the ranks read different text; every rank must see the same corpus")
    cfg = collective_check(make_config, args, world, corpus_sha, text_label)
    collective_check(check_memory, cfg, local_rank)   # before any weight is allocated
    moe_config = collective_check(make_moe_config, cfg, args.transport, args.plan_wait_ms)
    data = collective_check(ByteStreams, corpus, rank=rank, world=world, batch=cfg.batch, seq_len=cfg.seq_len,
                            device=device)
    del corpus

    torch.manual_seed(cfg.seed)
    model = MoETransformer(cfg, moe_config, None).to(device)
    init_expert_weights(model, cfg, rank)
    for moe in model.moe_layers():
        moe.refresh_replicas()
    replicated, experts = split_parameters(model)
    with torch.no_grad():  # same seed gives the same replicas; the broadcast makes it a guarantee
        for p in replicated:
            dist.broadcast(p, src=0)
    moes = model.moe_layers()
    expert_bias = ExpertBias(moes, cfg.bias_rate)
    optimizer = make_optimizer(model, cfg)

    start_step, history = 0, {"steps": []}
    if args.resume:
        state = collective_check(load_checkpoint, out, cfg, rank)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"], cfg.device)
        for moe, policy_state in zip(moes, state["policy_states"], strict=True):
            moe.state = policy_state
        start_step = state["step"]
        history = state["history"] if rank == 0 else history
        if start_step >= args.steps:   # every rank read the same checkpoint: all refuse together
            raise UsageError(f"--resume: the run in --out {out} is already at step {start_step}; pass --steps "
                             f"above {start_step} to continue it (got --steps {args.steps})")
        for moe in moes:
            moe.refresh_replicas()
    # Every check has passed: only now is an overwritten run removed, and does --out come into being.
    if args.overwrite:
        collective_check(lambda: clear_previous_run(out) if rank == 0 else None)
        dist.barrier()  # the removal is complete before any rank writes
    new_dirs = collective_check(make_out_dir, out, creator=local_rank == 0)
    if created is not None:
        created.extend(new_dirs)
    dist.barrier()

    meta = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "world_size": world,
            "config": dataclasses.asdict(cfg), "config_hash": cfg.digest(), "steps_planned": args.steps,
            "transport": args.transport, "plan_wait_ms": moe_config.plan_wait_ms, "torch": torch.__version__,
            "platform": platform_line(device)}
    tokens_per_step = world * cfg.batch * cfg.seq_len
    if rank == 0:
        nodes = world // cfg.gpus_per_node
        modelled = " (modelled: CPU processes)" if device.type == "cpu" else ""

        def n(count: int, what: str) -> str:
            return f"{count} {what}" + ("" if count == 1 else "s")

        print(f"feplb demo: {n(world, 'rank')} = {n(nodes, 'node')} x {n(cfg.gpus_per_node, 'GPU')}{modelled}, "
              f"{n(cfg.layers, 'MoE layer')} x {cfg.experts} experts (top-{cfg.top_k}, {cfg.dyn} dynamic per GPU), "
              f"policy {cfg.policy!r}, {tokens_per_step} tokens/step, text: {text_label} "
              f"({cfg.text_bytes} bytes budget)", flush=True)
        if start_step:
            print(f"resuming from step {start_step} in {out}", flush=True)

    bar = make_bar(rank, start_step, args.steps)
    t_run = time.perf_counter()
    for step in range(start_step, args.steps):
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * group["lr_scale"] * (min(1.0, (step + 1) / cfg.warmup) if cfg.warmup else 1.0)
        ids_BS, targets_BS = data.batch(step)
        logits_BSV = forward_or_lower_lr(model, step + 1, ids_BS)
        loss = F.cross_entropy(logits_BSV.reshape(-1, VOCAB), targets_BS.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for moe in moes:
            moe.reduce_replica_grads()
        mean_loss, grad_norm = reduce_gradients(replicated, experts, loss, world, cfg.clip)
        if not math.isfinite(mean_loss):  # the all-reduced value, so every rank stops at the same step
            raise UsageError(f"the loss became {mean_loss} at step {step + 1}; lower --lr")
        optimizer.step()
        expert_bias.update()
        for moe in moes:
            moe.refresh_replicas()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        rec = {"step": step + 1, "loss": mean_loss, "grad_norm": grad_norm, "wall_s": dt,
               "tokens_per_s": tokens_per_step / dt,
               **layer_stats(gather(rank_stats(moes)))}
        if rank == 0:
            history["steps"].append(rec)
            bar.update(1)
            bar.set_postfix(loss=f"{mean_loss:.3f}", straggler=f"{rec['token_straggler_before']:.0f}->"
                                                               f"{rec['token_straggler_after']:.0f}")
            if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
                bar.write(log_line(rec))
        if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps:
            save_checkpoint(out, step=step + 1, cfg=cfg, model=model, optimizer=optimizer,
                            history=history if rank == 0 else None, rank=rank, local_rank=local_rank)
    bar.close()
    run_s = time.perf_counter() - t_run

    if rank == 0:
        meta["run_wall_s"] = run_s
        meta["resumed_from"] = start_step
        last = moes[0].last_timeline
        write_report(out, meta, history["steps"], timeline=last)
    dist.barrier()
    for moe in moes:
        moe.close()
    return out / "report.md"


def _report_module():
    """The sibling module report.py, imported on demand so that ranks which write no report never load matplotlib."""
    if str(EXAMPLES_DIR) not in sys.path:
        sys.path.insert(0, str(EXAMPLES_DIR))
    import report

    return report


def write_report(out: Path, meta: dict, steps: list[dict], timeline=None) -> None:
    """Rank 0 only."""
    _report_module().write_report(out, meta, steps, timeline)


def gather(obj) -> list:
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return objs


def platform_line(device: torch.device) -> str:
    if device.type == "cuda":
        return f"CUDA: {torch.cuda.get_device_name(device)}"
    return f"CPU: {os.cpu_count()} cores visible, {torch.get_num_threads()} torch thread(s) per rank"


def make_bar(rank: int, start: int, total: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, disable=rank != 0, unit="step", dynamic_ncols=True, file=sys.stderr,
                mininterval=1.0)


def log_line(rec: dict) -> str:
    per_layer = " ".join(f"{b:.0f}->{a:.0f}" for b, a in zip(rec["layer_straggler_before"],
                                                          rec["layer_straggler_after"], strict=True))
    return (f"step {rec['step']:5d}  loss {rec['loss']:.4f}  {rec['tokens_per_s']:8.0f} tok/s  "
            f"straggler/layer [{per_layer}] tokens  rows moved {rec['rows_moved']}")


def run_example(script: str, device: str, fn: Callable[[], object]) -> int:
    """The transformers examples' main: join the group, run ``fn``, and stop every rank cleanly (:func:`stop`;
    never returns): after ``fn`` with status 0, on a usage error (raised on every rank together: one message, status
    2) or on Ctrl-C (one line per rank, status 130)."""
    try:
        init_distributed(device)
        fn()
    except UsageError as exc:
        stop(2, f"{script}: error: {exc}", True, [])
    except KeyboardInterrupt:
        stop(130, f"{script}: rank {dist.get_rank()}: interrupted", False, [])
    # done: the same clean stop (the Trainer and accelerate keep the model to the interpreter's exit, whose
    # teardown can abort a process whose communication threads still hold tensors)
    stop(0, "", True, [])
    return 0


def stop(code: int, message: str, agreed: bool, created: list[Path]) -> None:
    """Leave after an error or after the run, with the process group shut down
    cleanly on every rank; never returns.

    ``agreed``: every rank stops here on the same error (a UsageError is always raised on all of them together), so
    they wait for each other before closing their connections: a rank still inside its last collective must not see
    a peer vanish. torchrun stops the remaining workers (SIGTERM) as soon as one exits with an error; a rank still
    shutting down then exits with the same status instead of dying mid-teardown. The layers are collected while
    the group still exists, and the process leaves without the interpreter's teardown, where communication threads
    still holding tensors abort the process ("terminate called without an active exception").
    """
    signal.signal(signal.SIGTERM, lambda *_: os._exit(code))
    initialized = dist.is_initialized()
    rank = dist.get_rank() if initialized else int(os.environ.get("RANK", "0"))
    if message and (rank == 0 or not agreed):
        print(message, file=sys.stderr, flush=True)
    gc.collect()
    if initialized:
        with contextlib.suppress(Exception):
            if agreed and dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=60), wait_all_ranks=True)
    remove_if_empty(created)
    if initialized:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    created: list[Path] = []
    try:
        report = train(args, created)
    except UsageError as exc:
        code, message, agreed = 2, f"train_moe.py: error: {exc}", True
    except KeyboardInterrupt:   # Ctrl-C reaches every rank: one line each, no traceback; the newest checkpoint stays
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        code, message, agreed = 130, f"train_moe.py: rank {rank}: interrupted", False
    except Exception:  # a fault or a bug, possibly on this rank alone: the traceback says where
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        code, message, agreed = 1, f"train_moe.py: rank {rank} failed:\n{traceback.format_exc()}", False
    else:
        if dist.get_rank() == 0:
            print(f"\nreport: {report}  (plots and report.json next to it)", flush=True)
        # (after a run that succeeded too: the interpreter's teardown aborted one rank of a finished run once, in CI,
        # "terminate called without an active exception", and torchrun reported the run failed)
        stop(0, "", True, created)
        return 0
    # The exception and the frames it held (the model, its layers) are gone by here; stop() collects them.
    stop(code, message, agreed, created)
    return code


if __name__ == "__main__":
    sys.exit(main())
