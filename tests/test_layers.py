"""The package's parts import one way only (README, "Layout"): a forbidden import, a circle or
a heavy import in a light entry point fails here, not in review.

Every import counts, including those inside functions: a lazy import still makes a circle. Only
imports under ``if TYPE_CHECKING:`` are left out: they name types for annotations and never run."""

from __future__ import annotations

import ast
import fcntl
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typing_deps
from conftest import REPO

# Import name -> folder (pyproject.toml's package-dir).
ROOTS = {
    "jaxaot.stages": "stages",
    "jaxaot.conf": "conf",
    "jaxaot.examples": "jaxaot_examples",
    "jaxaot": "pipeline",
}

# Each part and the parts it may import. The part of a module is its first package level
# below jaxaot (jaxaot.config.mesh -> config); the root package's modules are their own part.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "version": set(),
    "compat": {"errors"},
    "util": {"errors", "version", "compat"},
    "targets": {"errors", "util", "compat"},
    "config": {"errors", "util", "targets", "rundir", "conf", "compat"},
    "store": {"errors", "util", "compat"},
    "rundir": {"errors", "util"},
    "stages": {"errors", "util", "targets", "config", "models", "rundir", "compat"},
    "models": {"errors", "util", "config"},
    "snapshots": {"errors", "util", "version", "config", "rundir", "stages", "compat"},
    "schema": {"errors", "util", "targets", "config", "rundir", "stages", "conf"},
    "engine": {
        "errors",
        "compat",
        "util",
        "targets",
        "config",
        "rundir",
        "stages",
        "store",
        "snapshots",
        "schema",
        "conf",  # the shipped program options (engine.own_args)
    },
    "sweeps": {"errors", "util", "config", "rundir", "stages", "snapshots", "compat"},
    "api": {"errors", "config", "engine", "conf", "snapshots", "schema", "sweeps"},
    "cli": {
        "errors",
        "compat",
        "util",
        "version",
        "targets",
        "config",
        "rundir",
        "stages",
        "store",
        "snapshots",
        "engine",
        "sweeps",
        "api",
        "conf",
        "schema",
    },
    "__init__": {"errors", "version", "api", "config", "engine", "schema"},
    "__main__": {"cli"},
    "conf": set(),
    "examples": {"examples"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for name, folder in ROOTS.items():
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([name, *parts])] = path
    return found


def _part(module: str) -> str:
    rest = module.split(".")[1:]
    return rest[0] if rest else "__init__"


def _imports(module: str, path: Path, typing_too: bool = False) -> set[str]:
    """The jaxaot modules ``module`` imports; those under ``if TYPE_CHECKING:`` only with
    ``typing_too``."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = set()
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
        for stmt in block.body
        for n in ast.walk(stmt)
        if not typing_too
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base]) if base else ".".join(up)
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m == "jaxaot" or m.startswith("jaxaot.")}


def _edges() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {i for i in _imports(m, p) if i in mods and i != m} for m, p in mods.items()}


def test_every_import_goes_down_the_layers() -> None:
    wrong = []
    for module, deps in sorted(_edges().items()):
        mine = _part(module)
        for dep in sorted(deps):
            theirs = _part(dep)
            if theirs != mine and theirs not in ALLOWED[mine]:
                wrong.append(f"{module} imports {dep} ({mine} -> {theirs})")
    assert not wrong, "\n".join(wrong)


def test_below_the_schema_no_module_names_the_root_config() -> None:
    """A stage gets its own options and the run's facts (jaxaot.stages.contract); a function
    below the schema takes the sections it reads. No module of a part the schema sits above
    imports jaxaot.schema, not even for annotations: what reads the root lives in the schema
    or above it."""
    below = {p for p, allowed in ALLOWED.items() if "schema" not in allowed} - {"schema"}
    naming = {
        m
        for m, path in _modules().items()
        if _part(m) in below and "jaxaot.schema" in _imports(m, path, typing_too=True)
    }
    assert not naming


# Private modules of JAX, jaxlib and Hydra: only jaxaot.compat imports them (its docstring
# says why).
PRIVATE_JAX = ("jax._src", "jaxlib._", "jaxlib.xla_client", "jaxlib.mlir", "jaxlib.xla_extension")
PRIVATE_HYDRA = ("hydra._internal",)


def _is_private(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(
        name.startswith(p) if p.endswith("_") else name == p or name.startswith(p + ".")
        for p in prefixes
    )


def _private_imports(path: Path, prefixes: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, module) for each private module ``path`` imports: import statements (inside
    functions too), and string literals handed to ``importlib.import_module``/``__import__``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and ast.unparse(node.func).endswith(("import_module", "__import__"))
        ):
            names = [str(node.args[0].value)]
        hits = [n for n in names if _is_private(n, prefixes)]
        if hits:
            found.append((node.lineno, hits[0]))
    return sorted(found)


@pytest.mark.parametrize("private", [PRIVATE_JAX, PRIVATE_HYDRA], ids=["jax", "hydra"])
def test_only_the_compat_package_imports_privates(private: tuple[str, ...]) -> None:
    compat = REPO / "pipeline" / "compat"
    plugins = sorted((REPO / "hydra_plugins").rglob("*.py"))
    wrong = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in [*sorted(_modules().values()), *plugins]
        if compat not in path.parents
        for line, name in _private_imports(path, private)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_private_import_rule_sees_each_form(tmp_path: Path) -> None:
    forms = {
        "import jax._src.pjit": "jax._src.pjit",
        "from jax._src import xla_bridge": "jax._src",
        "from jaxlib import _hlo": "jaxlib._hlo",
        "import jaxlib.xla_client as xc": "jaxlib.xla_client",
        "from jaxlib.mlir import ir": "jaxlib.mlir",
        "importlib.import_module('jax._src.checkify')": "jax._src.checkify",
        "__import__('jaxlib._jax')": "jaxlib._jax",
        "from jax import export": None,
        "import jaxlib": None,
        "import jax.extend.mlir": None,
        "from hydra._internal.utils import get_args_parser": "hydra._internal.utils",
        "import hydra.core.utils": None,
    }
    path = tmp_path / "forms.py"
    path.write_text("def f():\n" + "".join(f"    {f}\n" for f in forms))
    found = dict(_private_imports(path, (*PRIVATE_JAX, *PRIVATE_HYDRA)))
    assert [found.get(line) for line in range(2, 2 + len(forms))] == list(forms.values())


def test_no_import_circles_between_modules() -> None:
    edges = _edges()
    for m in edges:  # a package importing its own submodules is not a circle
        edges[m] = {d for d in edges[m] if not d.startswith(m + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                circles.append(" -> ".join([*stack[stack.index(d) :], d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not circles, "\n".join(circles)


def test_no_two_modules_share_a_name() -> None:
    """A name is one concept: two ``parallel.py`` in two folders would mean two different things."""
    leaves: dict[str, list[str]] = {}
    for module, path in _modules().items():
        if path.name not in ("__init__.py", "__main__.py"):
            leaves.setdefault(module.rsplit(".", 1)[-1], []).append(module)
    assert not {k: v for k, v in leaves.items() if len(v) > 1}


@pytest.mark.parametrize(
    ("module", "banned"),
    [
        ("jaxaot.cli.store_cmd", ("jax", "hydra", "omegaconf")),
        ("jaxaot.cli.diff_cmd", ("jax", "hydra", "omegaconf")),
        ("jaxaot.cli.graph_cmd", ("jax", "hydra", "omegaconf")),
        ("jaxaot.cli.report_cmd", ("jax", "hydra")),
        ("jaxaot", ("jax", "hydra", "omegaconf")),
    ],
)
def test_light_entry_points_import_neither_jax_nor_hydra(
    module: str, banned: tuple[str, ...]
) -> None:
    code = (
        f"import sys, {module}; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(banned)!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{module} imports {out.stdout.strip()}"


def _mypy_cache(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """mypy's incremental cache: pytest's cache folder (``.pytest_cache/d/mypy``) where pytest
    keeps one, so a later session rechecks only the modules whose sources (the checkout's or a
    dependency's) changed, and their dependents; ``tmp_path`` under ``-p no:cacheprovider``. A
    new one starts as a copy of the environment's analysis of the dependencies
    (tests/typing_deps.py, made by ``make venv``) where there is one, so that a clean clone
    checks jaxaot's own modules; else its first session checks everything."""
    cache = getattr(request.config, "cache", None)
    return cache.mkdir("mypy") if cache is not None else tmp_path / "mypy-cache"


def _seed(cache: Path) -> None:
    """An empty ``cache`` gets the environment's analysis of the dependencies."""
    seed = Path(sys.prefix) / typing_deps.CACHE
    if seed.is_dir() and not any(cache.glob("*/*")):
        shutil.copytree(seed, cache, dirs_exist_ok=True)


@pytest.mark.requires_jax("0.10.2")  # mypy reads the installed jax's annotations
def test_lint_and_types(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """``make lint``'s checks: ruff's rules and format (no ``# fmt: skip`` needed), and mypy
    over the package as it installs (``jaxaot``, laid out as symlinks like the Makefile does)."""
    bin_dir = Path(sys.executable).parent
    paths = ["pipeline", "stages", "jaxaot_examples", "tests", "bench", "hydra_plugins"]
    for cmd in (
        ["ruff", "check", "-q", "--no-cache", *paths],
        ["ruff", "format", "--check", "-q", "--no-cache", *paths],
    ):
        proc = subprocess.run(
            [str(bin_dir / cmd[0]), *cmd[1:]], cwd=REPO, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    tree = tmp_path / "jaxaot"
    tree.mkdir()
    for item in (REPO / "pipeline").iterdir():
        if item.name != "__pycache__":
            (tree / item.name).symlink_to(item)
    for name, folder in (("stages", "stages"), ("conf", "conf"), ("examples", "jaxaot_examples")):
        (tree / name).symlink_to(REPO / folder)
    cache = _mypy_cache(request, tmp_path)
    # one mypy at a time on a cache (two sessions of one checkout share it)
    with open(cache.parent / "mypy.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _seed(cache)
        proc = subprocess.run(
            [
                str(bin_dir / "mypy"),
                "--config-file",
                str(REPO / "pyproject.toml"),
                "-p",
                "jaxaot",
                "--cache-dir",
                str(cache),
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no issues found" in proc.stdout


@pytest.mark.requires_jax("0.10.2")  # the environment's analysis is of the installed jax
def test_types_checked_from_the_dependency_cache_still_find_errors(tmp_path: Path) -> None:
    """mypy started from a copy of the environment's analysis of the dependencies reads JAX's
    types from it (fresh, not analysed again) and still reports an error that needs them."""
    failed = Path(sys.prefix) / typing_deps.FAILED
    if failed.exists():
        tail = " | ".join(failed.read_text(errors="replace").strip().splitlines()[-3:])
        pytest.fail(
            f"`make venv` could not build mypy's analysis of the dependencies: {tail}; "
            "`make venv` builds it again"
        )
    seed = Path(sys.prefix) / typing_deps.CACHE
    if not seed.is_dir():
        pytest.skip(f"no {seed}: `make venv` builds mypy's analysis of the dependencies")
    cache = tmp_path / "cache"
    shutil.copytree(seed, cache)
    (tmp_path / "planted.py").write_text(
        "import jax.numpy as jnp\n\n\ndef total() -> int:\n    return jnp.ones(3).sum()\n"
    )
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "mypy"),
            "--config-file",
            str(REPO / "pyproject.toml"),
            "--cache-dir",
            str(cache),
            "-v",
            "planted.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert 'planted.py:5: error: Incompatible return value type (got "Array"' in proc.stdout
    assert "Metadata fresh for jax.numpy:" in proc.stderr
    assert "Metadata abandoned for jax" not in proc.stderr


def test_the_dependency_list_is_the_third_party_imports_of_the_source(tmp_path: Path) -> None:
    (tmp_path / "pipeline" / "cli").mkdir(parents=True)
    (tmp_path / "stages").mkdir()
    (tmp_path / "pipeline" / "cli" / "a.py").write_text(
        "import os, jax.numpy\nfrom flax import nnx\nfrom . import b\nimport jaxaot.errors\n"
    )
    (tmp_path / "stages" / "s.py").write_text(
        "from __future__ import annotations\nfrom hydra.core.utils import JobReturn\n"
        "import collections.abc, hydra_plugins.x\n"
    )
    assert typing_deps.third_party_imports(tmp_path) == ["flax", "hydra.core.utils", "jax.numpy"]
    src = typing_deps.source(tmp_path)
    assert src.splitlines()[1:] == ["import flax", "import hydra.core.utils", "import jax.numpy"]
    compile(src, "typing_deps", "exec")
