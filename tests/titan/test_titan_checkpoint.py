"""The pieces of ``feplb.titan_ep``'s checkpoint support around the load: the override that turns it on, the check
of a checkpoint for the histories (agreed over 2 gloo ranks where they read otherwise), and the refusal of a
malformed entry. The whole path (torchtitan's trainer saving, loading and resuming bit for bit) is in
test_titan_trainer.py."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

pytest.importorskip("torchtitan.components.checkpointer.dcp")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torchtitan.components.checkpointer.base import BaseCheckpointManager  # noqa: E402
from torchtitan.components.checkpointer.dcp import CheckpointManager  # noqa: E402

from feplb import titan_ep  # noqa: E402


def test_the_override_keeps_every_setting_and_builds_feplbs_manager():
    cfg = CheckpointManager.Config(enable=True, interval=7, folder="ckpt", keep_latest_k=3, async_mode="async",
                                   exclude_from_loading=["dataloader"])
    got = titan_ep.feplb_checkpoint(cfg)
    assert type(got) is titan_ep.FEPLBCheckpointManager.Config
    assert got._owner is titan_ep.FEPLBCheckpointManager
    for f in dataclasses.fields(cfg):
        assert getattr(got, f.name) == getattr(cfg, f.name), f.name


class _OtherManager(BaseCheckpointManager):   # (another checkpointer, as torchtitan's torch_checkpointing one)
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        pass


def test_the_override_refuses_another_checkpoint_manager():
    with pytest.raises(ValueError, match="_OtherManager"):
        titan_ep.feplb_checkpoint(_OtherManager.Config())
    ours = titan_ep.FEPLBCheckpointManager.Config(interval=5)
    assert titan_ep.feplb_checkpoint(ours) is ours


def test_a_checkpoint_is_read_for_the_histories(tmp_path):
    blob = io.BytesIO()
    torch.save({"layers.0.moe": [None]}, blob)
    with_histories, without = tmp_path / "with", tmp_path / "without"
    dcp.save({"w": torch.randn(3), titan_ep.POLICY_STATES: {"histories": blob.getvalue()}},
             checkpoint_id=str(with_histories), no_dist=True)
    dcp.save({"w": torch.randn(3), "feplb_policy_other": torch.zeros(1)}, checkpoint_id=str(without), no_dist=True)
    assert titan_ep._saved_with(str(with_histories), titan_ep.POLICY_STATES)
    assert not titan_ep._saved_with(str(without), titan_ep.POLICY_STATES)
    # a remote URI goes through fsspec, as dcp.load reads it (fsspec's local filesystem here)
    pytest.importorskip("fsspec")
    assert titan_ep._saved_with(f"file://{with_histories}", titan_ep.POLICY_STATES)
    assert not titan_ep._saved_with(f"file://{without}", titan_ep.POLICY_STATES)


def _checkpoints(root) -> tuple[str, str]:
    """Two DCP checkpoints under ``root``, with the histories' entry and without."""
    blob = io.BytesIO()
    torch.save({"layers.0.moe": [None]}, blob)
    with_histories, without = root / "with", root / "without"
    dcp.save({"w": torch.randn(3), titan_ep.POLICY_STATES: {"histories": blob.getvalue()}},
             checkpoint_id=str(with_histories), no_dist=True)
    dcp.save({"w": torch.randn(3)}, checkpoint_id=str(without), no_dist=True)
    return str(with_histories), str(without)


def test_the_histories_are_looked_for_before_the_load(tmp_path):
    with_histories, without = _checkpoints(tmp_path)
    assert titan_ep._histories_saved(with_histories) and not titan_ep._histories_saved(without)
    with pytest.raises(RuntimeError, match=r"reading the metadata of the checkpoint .* failed on rank\(s\) \[0\]"):
        titan_ep._histories_saved(str(tmp_path / "nowhere"))


def _ranks_look(rank: int, world: int, paths: list[str]) -> str | None:
    from feplb.testing import error_of

    return error_of(lambda: titan_ep._histories_saved(paths[rank]))


@pytest.mark.dist
def test_ranks_that_read_otherwise_raise_together(tmp_path):
    """A read that fails on one rank, or ranks that find different checkpoints, raise on every rank (2 gloo ranks),
    instead of leaving the others in the load's first collective."""
    from feplb.testing import run_dist

    with_histories, without = _checkpoints(tmp_path)
    for paths, want in (([with_histories, str(tmp_path / "nowhere")], "failed on rank(s) [1]"),
                        ([without, with_histories], "holds the balancing histories on rank(s) [1] and not on")):
        got = run_dist(_ranks_look, 2, paths, timeout_s=120, collective_timeout_s=30)
        assert all(g is not None and g.startswith("RuntimeError") and want in g for g in got), got


@pytest.mark.parametrize("bad", [{"histories": 3}, {"other": b""}, [b""]])
def test_a_malformed_entry_is_refused_naming_it(bad):
    states = titan_ep.PolicyStates(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"PolicyStates.load_state_dict: expected"):
        states.load_state_dict(bad)
