"""Test-wide setup, for tests/ and bench/ alike.

Without a GPU, Triton kernels run under the interpreter; the switch must be set before any kernel module is
imported, which is why it lives here and not in a fixture; so does a speed-up of the interpreter (it patches the
language once per launch). Under pytest-xdist, tests marked ``timing`` run alone (``feplb.pytest_plugin``).
"""

import os

import torch

pytest_plugins = ("feplb.pytest_plugin",)


def _interpreter_patches_the_language_once_per_launch() -> None:
    """Triton's interpreter patches ``triton.language`` for a kernel's launch (``GridExecutor.__call__``: every
    builtin found by ``inspect.getmembers`` over the language's modules, restored when the launch ends), and again at
    every call of a ``@triton.jit`` helper inside it (``InterpretedFunction.__call__``: ``tl.sum``, ``tl.cdiv``, the
    kernels' own helpers), once per program of the grid. Those calls find nothing left to patch: the launch patched
    the modules the kernels' helpers see, and a helper's patch of any other module (``triton.language.core``, which
    ``tl.sum``'s module sees) is never restored. Here a helper's call inside a launch skips the patching when
    every language module it sees is patched already, and patches as before otherwise. The kernels compute the same;
    the interpreted kernel tests take about a sixth less time. Applied only where Triton's interpreter has the
    functions this wraps (3.9)."""
    import functools
    import inspect
    import threading

    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return

    if not all(hasattr(ti, name) for name in ("_patch_lang", "GridExecutor", "_LangPatchScope")):
        return
    original, launch = ti._patch_lang, ti.GridExecutor.__call__
    launched: list[frozenset] = []   # the language modules each running launch patched (their scopes not restored)
    kept: set[int] = set()           # modules a helper's call patched outside every launch's: patched for good
    launching = threading.local()    # .now: this thread's launch is about to patch

    @functools.cache
    def langs_of(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    @functools.wraps(original)
    def patch_lang(fn):
        langs = langs_of(fn)
        if not getattr(launching, "now", False):   # a helper's call
            patched = frozenset().union(*launched)
            if launched and langs <= patched | kept:
                return ti._LangPatchScope()
            kept.update(langs - patched)
            return original(fn)
        launching.now = False
        scope = original(fn)
        launched.append(langs)
        restore = scope.restore

        def restore_and_forget() -> None:
            launched.remove(langs)
            restore()

        scope.restore = restore_and_forget
        return scope

    def launch_once(self, *args, **kwargs):
        launching.now = True
        try:
            return launch(self, *args, **kwargs)
        finally:
            launching.now = False

    ti._patch_lang, ti.GridExecutor.__call__ = patch_lang, launch_once


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_patches_the_language_once_per_launch()
