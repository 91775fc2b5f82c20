"""Output files written whole or not at all: each through a temporary file beside it, renamed into place once every
one is written, so a failure (an exception, Ctrl-C) leaves neither a partial file nor a temporary one; a process
killed outright may leave a hidden temporary file beside it, never a partial file under the name."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["write_json", "write_outputs"]


def write_outputs(writers: list[tuple[Path, Callable[[str], None]]]) -> None:
    """Write every output to a temporary file next to it, then rename them all into place: a failure leaves no
    partial file and no temporary one."""
    tmps: list[tuple[str, Path]] = []
    umask = os.umask(0)
    os.umask(umask)
    try:
        for out, write in writers:
            fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
            os.close(fd)
            tmps.append((tmp, out))
            write(tmp)
            # mkstemp makes 0600: a file replaced keeps its mode, a new one gets what open() would give it
            os.chmod(tmp, out.stat().st_mode & 0o7777 if out.is_file() else 0o666 & ~umask)
        for tmp, out in tmps:
            os.replace(tmp, out)
    finally:
        for tmp, _ in tmps:
            Path(tmp).unlink(missing_ok=True)


def write_json(path: str | os.PathLike, doc, *, indent: int | None = 1, allow_nan: bool = True) -> Path:
    """Write ``doc`` as JSON to ``path`` (its folder made if missing), whole or not at all: a value JSON cannot hold
    (an object; NaN or infinity with ``allow_nan=False``) raises before anything is written. Returns the path."""
    out = Path(path)
    text = json.dumps(doc, indent=indent, allow_nan=allow_nan)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_outputs([(out, lambda tmp: Path(tmp).write_text(text + "\n"))])
    return out
