"""The suite's ``@pytest.mark.requires_jax("0.7.2")`` (tests/conftest.py): a test that needs a
newer jax than the installed one is skipped, naming the version it needs and the one installed;
a malformed version is a usage error naming the test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import conftest
import pytest
from conftest import REPO, TESTS, requires_jax_reason

ITEM: Any = SimpleNamespace(nodeid="tests/test_x.py::test_y")


@pytest.mark.parametrize(
    ("installed", "needed", "skips"),
    [
        ("0.6.2", "0.7.2", True),
        ("0.6.2", "0.6.2", False),
        ("0.6.2", "0.6", False),
        ("0.9.2", "0.10", True),
        ("0.10.2", "0.9.1", False),  # numbers, not text: 10 > 9
        ("0.10.2.dev20261101", "0.10.2", False),
    ],
)
def test_a_test_is_skipped_below_the_version_it_needs(
    monkeypatch: pytest.MonkeyPatch, installed: str, needed: str, skips: bool
) -> None:
    monkeypatch.setattr(conftest, "JAX_VERSION", installed)
    reason = requires_jax_reason(ITEM, needed)
    if skips:
        assert reason == (
            f"needs jax>={needed} (installed: jax {installed}): pip install 'jax>={needed}'"
        )
    else:
        assert reason is None


@pytest.mark.parametrize("needed", ["0.7.x", "v0.7.2", "", 0.7, ("0", "7")])
def test_a_malformed_version_is_a_usage_error_naming_the_test(needed: object) -> None:
    with pytest.raises(pytest.UsageError) as info:
        requires_jax_reason(ITEM, needed)
    assert str(info.value) == (
        'tests/test_x.py::test_y: @pytest.mark.requires_jax: expected a version like "0.7.2", '
        f"found {needed!r}"
    )


CONFTEST = f"""
import importlib.util
import sys

spec = importlib.util.spec_from_file_location("suite_conftest", {str(TESTS / "conftest.py")!r})
suite = importlib.util.module_from_spec(spec)
sys.modules["suite_conftest"] = suite
spec.loader.exec_module(suite)
suite.JAX_VERSION = "0.6.2"
pytest_configure = suite.pytest_configure
pytest_collection_modifyitems = suite.pytest_collection_modifyitems
"""

TESTS_FILE = """
import pytest


@pytest.mark.requires_jax("0.7.2")
def test_newer():
    raise AssertionError("ran on a jax older than it needs")


@pytest.mark.requires_jax("0.6.2")
def test_same():
    pass
"""


def test_the_mark_skips_in_a_pytest_run_naming_the_version(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_marked.py").write_text(TESTS_FILE)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-rs", "-q"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 1 skipped" in done.stdout
    assert (
        "test_marked.py:5: needs jax>=0.7.2 (installed: jax 0.6.2): pip install 'jax>=0.7.2'"
        in done.stdout
    )
