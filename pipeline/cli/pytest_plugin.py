"""pytest plugin (entry point ``pytest11: jaxaot``): the ``jaxaot_snapshot`` fixture.

Installing jaxaot makes it available in every test suite of that environment::

    def test_mlp_lowering(jaxaot_snapshot):
        jaxaot_snapshot("golden/mlp", ["program=mlp"])

A relative golden folder is taken from the test file's directory. The pipeline runs in the
test's process (``stop_after=compile`` unless the overrides say otherwise) and a difference
fails the test with the summary and the bounded diff. ``pytest --jaxaot-update`` rewrites the
golden snapshots that differ instead. Loading the plugin does not import JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--jaxaot-update",
        action="store_true",
        default=False,
        help="jaxaot: rewrite golden snapshots that differ (snapshot.update=true)",
    )


@pytest.fixture
def jaxaot_snapshot(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., Any]:
    """``jaxaot_snapshot(golden_dir, overrides)`` -> the RunResult; AssertionError on a diff."""
    from jaxaot.api import verify_snapshot
    from jaxaot.snapshots.snapshot import INDEX_NAME

    update = bool(request.config.getoption("--jaxaot-update"))
    calls = [0]

    def check(golden_dir: str | Path, overrides: Sequence[str] = ()) -> Any:
        golden = Path(golden_dir)
        if not golden.is_absolute():
            golden = Path(request.path).parent / golden
        calls[0] += 1
        run_dir = tmp_path / f"jaxaot-run{calls[0]}"
        if not update and not (golden / INDEX_NAME).is_file():
            # A first run: one line that says what to do, not a traceback through the pipeline.
            pytest.fail(
                f"no golden yet: run `pytest --jaxaot-update` to write {golden}", pytrace=False
            )
        return verify_snapshot(golden, overrides, update=update, run_dir=run_dir)

    return check


__all__ = ["jaxaot_snapshot", "pytest_addoption"]
