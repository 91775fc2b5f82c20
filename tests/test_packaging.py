"""Packaging: the ``nvshmem`` extra installs an nvshmem4py built for torch's CUDA line, and the nvshmem4py calls
the code makes exist, with those arguments, in the version the extra pins.

Two committed fixtures hold what a GPU-less machine cannot read from an installed package:

* ``data/torch_pypi_requires.json``: the requirements of torch's PyPI wheel (the one the README installs), read
  with ``pip install --dry-run --no-deps --report`` from PyPI. It gives the CUDA line when the installed torch is
  a CPU build.
* ``data/nvshmem4py_api.json``: the public API of the pinned nvshmem4py (names, enum members, parameter names),
  derived by :func:`derive_nvshmem4py_api` from the published wheel's source (its Python modules and Cython
  ``.pyx`` bindings). Re-derive it with ``FEPLB_NVSHMEM4PY_SRC=<unpacked wheel> pytest tests/test_packaging.py``.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).with_name("data")
TORCH_PYPI = DATA / "torch_pypi_requires.json"
NVSHMEM_API = DATA / "nvshmem4py_api.json"
# Every source file of the project that imports nvshmem4py or gets its modules from feplb.transport.
NVSHMEM_CALLERS = sorted(path for room in ("feplb", "kernels", "sched", "examples")
                         for path in (ROOT / room).rglob("*.py")
                         if re.search(r"import nvshmem|from nvshmem |nvshmem_modules\(", path.read_text()))
# How the code names nvshmem4py's two modules (see feplb.transport.nvshmem_modules).
NVSHMEM_ALIASES = {"core": "core", "nv": "core", "self._nv": "core", "nvshmem.core": "core",
                   "bindings": "bindings", "bind": "bindings", "self._bind": "bindings", "nvshmem.bindings": "bindings"}


# ---------------------------------------------------------------------------------------------------- CUDA lines

def cuda_major_of(requirements: list[str]) -> int | None:
    """The CUDA major version a list of requirement strings pins (nvidia-*-cuNN, cuda-toolkit / cuda-bindings /
    cuda-python versions, nvshmem4py-cuNN), or None when none names CUDA. Extras-only requirements are ignored.

    Raises ValueError when they name two different lines.
    """
    majors = set()
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and "extra" in str(req.marker):
            continue
        name = req.name.lower().replace("_", "-")
        suffix = re.search(r"-cu(\d+)$", name)
        if suffix:
            majors.add(int(suffix.group(1)))
        elif name in ("cuda-toolkit", "cuda-bindings", "cuda-python"):
            lower = [Version(s.version).major for s in req.specifier if s.operator in ("==", ">=", "~=", "===")]
            majors.update(lower)
    if len(majors) > 1:
        raise ValueError(f"requirements name several CUDA lines {sorted(majors)}: {requirements}")
    return majors.pop() if majors else None


def test_cuda_major_of_reads_each_way_of_naming_a_line():
    assert cuda_major_of(['nvidia-cublas-cu12==12.8.4.1; platform_system == "Linux"', "filelock"]) == 12
    assert cuda_major_of(['cuda-toolkit[cublas,cudart]==13.0.3; platform_system == "Linux"']) == 13
    assert cuda_major_of(["cuda-bindings<14,>=13.0.3"]) == 13
    assert cuda_major_of(["nvshmem4py-cu12>=0.1"]) == 12
    assert cuda_major_of(["nvshmem4py_cu13>=0.4,<0.5"]) == 13
    assert cuda_major_of(["filelock", 'nvidia-nccl-cu12; extra == "cuda"']) is None
    with pytest.raises(ValueError, match=r"several CUDA lines \[12, 13\]"):
        cuda_major_of(["nvidia-cublas-cu12", "cuda-bindings>=13"])


def torch_cuda_line() -> tuple[int | None, str]:
    """(CUDA major, where it was read) of the installed torch, or (None, why) for a CPU build."""
    import torch

    if torch.version.cuda:
        return int(torch.version.cuda.split(".")[0]), f"torch.version.cuda = {torch.version.cuda}"
    reqs = importlib.metadata.requires("torch") or []
    major = cuda_major_of(reqs)
    if major is not None:
        return major, "the installed torch's requirements"
    return None, f"the installed torch {torch.__version__} is a CPU build"


def readme_torch_pin() -> str:
    """The torch pin of the README's two commands (its first code block; later blocks may name other stacks)."""
    first_block = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    pins = set(re.findall(r"torch==([0-9][0-9.]*[0-9])", first_block))
    assert len(pins) == 1, f"expected one torch==X pin in README.md's two commands, got {sorted(pins)}"
    return pins.pop()


def extra_requirements(extra: str) -> list[str]:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["optional-dependencies"][extra]


def test_torch_fixture_is_the_readme_pin():
    recorded = json.loads(TORCH_PYPI.read_text())
    assert recorded["version"] == readme_torch_pin(), (
        f"{TORCH_PYPI.name} records torch {recorded['version']} but README.md installs torch=={readme_torch_pin()}: "
        "re-record it (pip install --dry-run --no-deps --report)")


def test_nvshmem_extra_matches_torch_cuda_line():
    import torch

    line, source = torch_cuda_line()
    if line is None:
        recorded = json.loads(TORCH_PYPI.read_text())
        base = torch.__version__.split("+")[0]
        if base != recorded["version"]:
            pytest.skip(f"{source}, and {TORCH_PYPI.name} records torch {recorded['version']}, not {base}")
        line = cuda_major_of(recorded["requires_dist"])
        source = f"{source}; torch {base}'s PyPI wheel requires CUDA {line} ({TORCH_PYPI.name})"
    extra = extra_requirements("nvshmem")
    assert line is not None, source
    assert cuda_major_of(extra) == line, f"the nvshmem extra {extra} is not for CUDA {line} ({source})"


def test_nvshmem_extra_pins_the_api_version():
    (text,) = extra_requirements("nvshmem")
    req = Requirement(text)
    api = json.loads(NVSHMEM_API.read_text())
    assert req.name.lower().replace("_", "-") == api["package"]
    # The version the API fixture was read from is allowed; 0.1.1 (pip's silent fallback, without init_status)
    # and a next minor with unknown API are not.
    assert api["version"] in req.specifier, (text, api["version"])
    for other in ("0.1.1", "0.3.0", "0.5.0", "1.0.0"):
        assert other not in req.specifier, (text, other)


# ---------------------------------------------------------------------------------------------------- nvshmem4py API

def nvshmem_uses(source: str, filename: str = "<source>") -> list[dict]:
    """Every attribute chain of the code on nvshmem4py's modules: {"name": "core.init", "where": "file:line",
    "args": positional count or None when not called, "kwargs": keyword names}."""
    tree = ast.parse(source, filename)
    calls = {id(node.func): node for node in ast.walk(tree) if isinstance(node, ast.Call)}
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    uses = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        dotted = ast.unparse(node)
        for alias, module in NVSHMEM_ALIASES.items():
            if dotted.startswith(alias + "."):
                call = calls.get(id(node))
                uses.append({"name": module + dotted[len(alias):], "where": f"{Path(filename).name}:{node.lineno}",
                             "args": None if call is None else len(call.args),
                             "kwargs": [] if call is None else [k.arg for k in call.keywords]})
                break
    return uses


def missing_from(api: dict, uses: list[dict]) -> list[str]:
    """The uses the API does not have: unknown names, too many positional arguments, unknown keywords."""
    problems = []
    for use in uses:
        if use["name"] not in api:
            problems.append(f"{use['where']}: {use['name']} does not exist")
            continue
        params = api[use["name"]]
        if use["args"] is None:
            continue
        if params is None:
            problems.append(f"{use['where']}: {use['name']} is not a function")
            continue
        if use["args"] > len(params):
            problems.append(f"{use['where']}: {use['name']} takes {len(params)} arguments {params}, "
                            f"called with {use['args']}")
        problems += [f"{use['where']}: {use['name']} has no parameter {k!r} {params}"
                     for k in use["kwargs"] if k not in params]
    return problems


def _code_uses() -> list[dict]:
    return [u for path in NVSHMEM_CALLERS for u in nvshmem_uses(path.read_text(), str(path))]


def test_nvshmem_is_imported_only_under_known_names():
    """The use check above finds calls through the names in NVSHMEM_ALIASES: an import binding nvshmem4py under
    another name would hide its calls from it."""
    bound = {}
    for path in NVSHMEM_CALLERS:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                bound.update({(a.asname or a.name.split(".")[0]): f"{path.name}:{node.lineno}" for a in node.names
                              if a.name.split(".")[0] == "nvshmem"})
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "nvshmem":
                bound.update({(a.asname or a.name): f"{path.name}:{node.lineno}" for a in node.names})
    assert bound, "no nvshmem import found: the use check would check nothing"
    unknown = {name: where for name, where in bound.items() if name != "nvshmem" and name not in NVSHMEM_ALIASES}
    assert not unknown, f"nvshmem4py bound under names the API check does not follow: {unknown}"


def test_code_calls_only_the_pinned_nvshmem4py_api():
    api = json.loads(NVSHMEM_API.read_text())["api"]
    uses = _code_uses()
    names = {u["name"] for u in uses}
    # The extraction must see the calls the transports are built on, or this test would pass on nothing.
    assert {"core.init", "core.init_status", "core.InitStatus.STATUS_LIMITED_MPG", "core.interop.torch.tensor",
            "core.free_tensor", "bindings.putmem_signal_on_stream", "bindings.signal_wait_until_on_stream",
            "bindings.barrier_all_on_stream"} <= names, sorted(names)
    assert missing_from(api, uses) == []


def test_api_check_flags_what_the_pinned_version_lacks():
    api = json.loads(NVSHMEM_API.read_text())["api"]
    code = ("def f(self, nv, bind):\n"
            "    nv.init_statuss()\n"
            "    self._nv.init(device=1, uid=2, bootstrap='uid')\n"
            "    bind.putmem_on_stream(1, 2, 3, 4, 5, 6)\n"
            "    int(nv.ComparisonType.CMP_GEQ)\n"
            "    nv.InitStatus()\n")
    problems = missing_from(api, nvshmem_uses(code))
    assert len(problems) == 5, problems
    assert any("core.init_statuss does not exist" in p for p in problems)
    assert any("no parameter 'bootstrap'" in p for p in problems)
    assert any("putmem_on_stream takes 5 arguments" in p for p in problems)
    assert any("CMP_GEQ does not exist" in p for p in problems)
    assert any("InitStatus is not a function" in p for p in problems)
    # The API the README's old extra fell back to (nvshmem4py-cu12 0.1.1) had no init_status.
    del api["core.init_status"]
    assert any("core.init_status does not exist" in p for p in missing_from(api, _code_uses()))


@pytest.mark.skipif(importlib.util.find_spec("nvshmem") is None, reason="nvshmem4py is not installed")
def test_installed_nvshmem4py_has_what_the_code_calls():
    import inspect

    try:
        import nvshmem.bindings as bindings
        import nvshmem.core as core
    except (ImportError, OSError) as err:  # e.g. no CUDA driver on this machine
        pytest.skip(f"nvshmem4py does not import here: {err}")
    modules = {"core": core, "bindings": bindings}
    for use in _code_uses():
        head, *rest = use["name"].split(".")
        obj = modules[head]
        for part in rest:
            assert hasattr(obj, part), f"{use['where']}: {use['name']} is missing from nvshmem4py " \
                                       f"{importlib.metadata.version(json.loads(NVSHMEM_API.read_text())['package'])}"
            obj = getattr(obj, part)
        if use["args"] is not None and not inspect.isclass(obj):
            try:
                inspect.signature(obj).bind_partial(*range(use["args"]), **dict.fromkeys(use["kwargs"]))
            except ValueError:
                continue  # a compiled function without a signature: the fixture test covers it
            except TypeError as err:
                pytest.fail(f"{use['where']}: {use['name']}: {err}")


# ---------------------------------------------------------------------------------------------------- the fixture

def _all_of(path: Path) -> list[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def _defs_of(path: Path) -> dict[str, list[str]]:
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            a = node.args
            out[node.name] = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return out


def derive_nvshmem4py_api(root: Path) -> dict[str, list[str] | None]:
    """Dotted name under ``nvshmem`` -> parameter names (functions) or None (modules, enums, members), from an
    unpacked nvshmem4py wheel at ``root`` (the folder holding ``nvshmem/``): the ``__all__`` of every module
    ``nvshmem.core`` star-imports, their ``def`` signatures, the enum classes and ``cpdef`` functions of the
    Cython bindings (``bindings/nvshmem.pyx``), and ``core``'s enum aliases of them."""
    pkg = root / "nvshmem"
    api: dict[str, list[str] | None] = {"core": None, "bindings": None, "core.interop": None}
    pyx = (pkg / "bindings" / "nvshmem.pyx").read_text()
    for m in re.finditer(r"^cpdef\s+[\w\s]*?\b(\w+)\(([^)]*)\)", pyx, re.M):
        params = [p.split("=")[0].split()[-1].lstrip("*") for p in m.group(2).split(",") if p.strip()]
        api[f"bindings.{m.group(1)}"] = params
    enums = {}
    for m in re.finditer(r"^class (\w+)\(_IntEnum\):\n((?:    .*\n|\s*\n)+)", pyx, re.M):
        enums[m.group(1)] = re.findall(r"^    (\w+) = ", m.group(2), re.M)
        api[f"bindings.{m.group(1)}"] = None
        api.update({f"bindings.{m.group(1)}.{member}": None for member in enums[m.group(1)]})
    core_dir = pkg / "core"
    star = re.findall(r"^from \.([\w.]+) import \*", (core_dir / "__init__.py").read_text(), re.M)
    for module in star:
        path = core_dir / (module.replace(".", "/") + ".py")
        defs = _defs_of(path)
        source = path.read_text()
        prefixes = ["core"] + ([f"core.{module}"] if module.startswith("interop.") else [])
        for name in _all_of(path):
            alias = re.search(rf"^{name} = bindings\.(\w+)\s*$", source, re.M)
            for prefix in prefixes:
                api[f"{prefix}.{name}"] = defs.get(name)
                if alias and alias.group(1) in enums:
                    api.update({f"{prefix}.{name}.{member}": None for member in enums[alias.group(1)]})
        if module.startswith("interop."):
            api[f"core.{module}"] = None
    return dict(sorted(api.items()))


@pytest.mark.skipif(not os.environ.get("FEPLB_NVSHMEM4PY_SRC"), reason="set FEPLB_NVSHMEM4PY_SRC to an unpacked "
                    "nvshmem4py wheel to re-derive the API fixture")
def test_api_fixture_is_derived_from_the_wheel():
    derived = derive_nvshmem4py_api(Path(os.environ["FEPLB_NVSHMEM4PY_SRC"]))
    recorded = json.loads(NVSHMEM_API.read_text())
    if os.environ.get("FEPLB_WRITE_FIXTURE") == "1":
        NVSHMEM_API.write_text(dump_fixture({**recorded, "api": derived}))
    assert recorded["api"] == derived


def dump_fixture(doc: dict) -> str:
    """JSON with one API entry per line (reviewable diffs)."""
    head = {k: v for k, v in doc.items() if k != "api"}
    lines = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in doc["api"].items())
    return json.dumps(head, indent=1)[:-2] + ',\n "api": {\n' + lines + "\n }\n}\n"
