"""The package layout: three rooms in one namespace, and the room rules of ../shared/design/style.md."""

import subprocess
import sys

import pytest


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_rooms_map_into_feplb_namespace():
    import feplb.kernels
    import feplb.sched

    assert feplb.kernels.__name__ == "feplb.kernels"
    assert feplb.sched.__name__ == "feplb.sched"


def test_stdlib_sched_is_not_shadowed(tmp_path):
    # In a fresh interpreter outside the repository (``python -m pytest`` itself puts the working directory on
    # sys.path, which would say nothing about the installed package): feplb installed, the stdlib's sched found.
    proc = subprocess.run([sys.executable, "-c", "import feplb.sched, sched; print(sched.__file__); "
                           "assert hasattr(sched, 'scheduler'), sched.__file__"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, f"'import sched' found {proc.stdout.strip()}, not the standard library's: " \
                                 f"{proc.stderr[-500:]}"


def test_kernels_dir_as_top_level_module_hands_over_to_the_kernels_package():
    # From the checkout's root (on sys.path as '' under ``python -c`` or ``python -m``), ``import kernels`` finds this
    # repository's kernels/ directory first; transformers imports the Hugging Face ``kernels`` package (it installs
    # it) by that name. The import must give that package where it is installed, and never define this folder's
    # operators a second time (feplb.kernels registers them once).
    import importlib.machinery
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    others = [p for p in sys.path if pathlib.Path(p or ".").resolve() != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", others)
    want = None if spec is None else str(pathlib.Path(spec.origin).resolve())
    code = ("import kernels, feplb.kernels, pathlib\n"
            "got = getattr(kernels, '__file__', None)\n"
            "print(got and str(pathlib.Path(got).resolve()))\n"
            "assert not hasattr(kernels, 'permute') and not hasattr(kernels, 'grouped_mm')\n"
            "import torch; torch.ops.feplb.permute\n")
    if want is not None:   # what transformers reads off it
        code += "import transformers.integrations.hub_kernels\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-1500:]
    got = proc.stdout.strip().splitlines()[0]
    if want is None:
        assert got.startswith(str(root)), got
    else:
        assert got == want, (got, want)


@pytest.mark.parametrize("room", ["feplb.sched"])
def test_sched_imports_without_torch(room):
    # A meta-path blocker makes any import of torch fail: the planning room must not need it.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"import importlib, pkgutil\nm = importlib.import_module({room!r})\n"
        "for info in pkgutil.iter_modules(m.__path__):\n"
        f"    importlib.import_module({room!r} + '.' + info.name)\n"
        "print('ok')\n"
    )
    proc = _run(code)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_non_finite_routing_error_is_a_value_error():
    import feplb

    assert issubclass(feplb.NonFiniteRoutingError, ValueError) and "NonFiniteRoutingError" in feplb.__all__
