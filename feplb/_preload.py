"""The one module run_dist's forkserver preloads (``feplb.testing``): it imports the modules named in the server's
``FEPLB_RUN_DIST_PRELOAD`` (comma-separated) in turn, going past any whose import raises. multiprocessing's server
goes past an ImportError only; anything else would end it, and every later job's ranks with it. A module left out so
is imported by a rank that needs it, which then meets the error itself and reports it as any rank's error.

Last, the server moves every object it holds into the garbage collector's permanent generation (``gc.freeze``, as
Python's ``gc`` documentation advises before forking without exec): a forked rank's collections then never walk the
preloaded modules' objects (half a million with transformers and Megatron-Core), which cost it 0.24 s per full
collection and a copy of every page they lie on, since a collection writes into each object's header."""

from __future__ import annotations

import gc
import os

failed: dict[str, str] = {}   # {module: its error} of those the server could not import

for _name in filter(None, os.environ.get("FEPLB_RUN_DIST_PRELOAD", "").split(",")):
    try:
        __import__(_name)
    except (Exception, SystemExit) as _exc:  # noqa: BLE001 - SystemExit from a module's import too
        failed[_name] = f"{type(_exc).__name__}: {_exc}"

gc.collect()   # what is garbage now is freed, not kept for good
gc.freeze()
