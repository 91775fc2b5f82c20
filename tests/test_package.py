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


def test_kernels_dir_as_top_level_module_registers_nothing():
    # From the checkout's root (on sys.path as '' under ``python -c`` or ``python -m``), ``import kernels`` finds this
    # repository's kernels/ directory; transformers does exactly that when it probes for the Hugging Face ``kernels``
    # package. It must define nothing, or feplb.kernels would register the operators' namespace a second time.
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", "import kernels, feplb.kernels; "
                           "assert kernels.__file__.startswith(%r), kernels.__file__; "
                           "assert kernels.__all__ == [] and not hasattr(kernels, 'permute'); "
                           "import torch; torch.ops.feplb.permute; print('ok')" % str(root)],
                          capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-1500:]


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
