"""The third-party modules jaxaot's source imports, as a Python file of imports for mypy.

``make venv`` (the test environment) type-checks that file once into ``.venv/mypy-deps-cache``:
mypy's analysis of JAX, Flax, Hydra, MLflow and the rest (about four fifths of a cold
``mypy -p jaxaot``) is then done when they are installed, and ``test_lint_and_types`` starts
from that cache, checking jaxaot's own modules. mypy re-analyses a dependency whose source or
whose options differ from what the cache recorded, so a stale cache costs time, never a result.

``python tests/typing_deps.py`` prints the file; :func:`third_party_imports` reads the imports
from the source with ``ast`` (every ``import a.b`` and ``from a.b import c`` outside the standard
library and jaxaot itself), so the list cannot fall behind the code.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("pipeline", "stages", "jaxaot_examples", "hydra_plugins")
OWN = {"jaxaot", "hydra_plugins"}
CACHE = "mypy-deps-cache"  # the folder under the virtual environment (sys.prefix)
# Beside it, written by ``make venv`` when building it failed: mypy's output, which
# test_types_checked_from_the_dependency_cache_still_find_errors reports as a failure.
FAILED = f"{CACHE}.failed"


def third_party_imports(root: Path = REPO) -> list[str]:
    """Sorted dotted names of the modules the source imports from outside the standard library
    and jaxaot."""
    names: set[str] = set()
    for folder in SOURCES:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.add(node.module)
    top = {name: name.partition(".")[0] for name in names}
    return sorted(
        n
        for n, t in top.items()
        if t not in sys.stdlib_module_names and t not in OWN | {"__future__"}
    )


def source(root: Path = REPO) -> str:
    lines = [f"import {name}" for name in third_party_imports(root)]
    return "# ruff: noqa\n" + "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(source())
