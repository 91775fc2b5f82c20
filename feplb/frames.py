"""The callers' frames: what called the function running now (a checkpoint's recompute, an optimizer's DCP state
initialisation, a GradScaler's step, torch.distributed.checkpoint asking for a state dict), where torch keeps no
record of it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType

__all__ = ["caller_frame"]


def caller_frame(match: Callable[[FrameType], bool], depth: int, skip: int = 0) -> FrameType | None:
    """The first frame ``match`` accepts among ``depth`` frames, from the caller of this function's caller upwards
    (``skip`` more frames skipped first), or None."""
    frame = sys._getframe(2 + skip)
    for _ in range(depth):
        if frame is None:
            return None
        if match(frame):
            return frame
        frame = frame.f_back
    return None
