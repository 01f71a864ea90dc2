"""The suite's skips for missing extras (tests/conftest.py): decided from the exception a test
raised, or its ``@pytest.mark.extra``, never from what it printed or logged.

One pytest process over a scratch test file, with the suite's hooks and a made-up extra
``fake`` whose module is not installed, and ``present`` whose module is.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import REPO, TESTS, find_missing_extras, missing_extra_of

FAKE_MODULE = "jaxaot_tests_no_such_extra_module"

CONFTEST = f"""
import importlib.util
import sys

spec = importlib.util.spec_from_file_location("suite_conftest", {str(TESTS / "conftest.py")!r})
suite = importlib.util.module_from_spec(spec)
sys.modules["suite_conftest"] = suite
spec.loader.exec_module(suite)
extras = {{"fake": ({FAKE_MODULE!r},), "present": ("json",)}}
suite.EXTRAS.update(extras)
suite.MISSING_EXTRAS.update(suite.find_missing_extras(extras))
pytest_configure = suite.pytest_configure
pytest_collection_modifyitems = suite.pytest_collection_modifyitems
pytest_runtest_makereport = suite.pytest_runtest_makereport
pytest_pycollect_makemodule = suite.pytest_pycollect_makemodule
"""

TESTS_FILE = f"""
import logging
import sys

import pytest
from jaxaot.errors import BackendError, MissingDependencyError


def test_unrelated_failure_that_mentions_a_missing_module():
    print("No module named {FAKE_MODULE!r}; pip install 'jaxaot[fake]'")
    logging.getLogger("x").warning("No module named {FAKE_MODULE!r}")
    assert 1 + 1 == 3


def test_imports_the_missing_module():
    import {FAKE_MODULE}


def test_imports_inside_the_missing_module():
    import {FAKE_MODULE}.sub


def test_jaxaot_says_the_extra_is_missing():
    raise MissingDependencyError("this needs it: pip install 'jaxaot[fake]'")


def test_a_backend_error_says_the_extra_is_missing():
    raise BackendError("compiling for this needs it; install it with pip install 'jaxaot[fake]'")


def test_a_backend_error_for_something_else():
    raise BackendError("this machine has 1 device, the mesh needs 8")


@pytest.fixture
def needs_fake():
    import {FAKE_MODULE}


def test_setup_imports_the_missing_module(needs_fake):
    pass


@pytest.mark.extra("fake")
def test_marked():
    assert False


@pytest.mark.extra("present")
def test_marked_present():
    pass


def test_hides_an_installed_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "json", None)
    import json
"""

EXPECTED = {
    "test_unrelated_failure_that_mentions_a_missing_module": "failure",
    "test_imports_the_missing_module": "skipped",
    "test_imports_inside_the_missing_module": "skipped",
    "test_jaxaot_says_the_extra_is_missing": "skipped",
    "test_a_backend_error_says_the_extra_is_missing": "skipped",
    "test_a_backend_error_for_something_else": "failure",
    "test_setup_imports_the_missing_module": "skipped",
    "test_marked": "skipped",
    "test_marked_present": "passed",
    "test_hides_an_installed_module": "failure",
    "test_module_needs_fake": "skipped",
    "test_module_is_broken": "error",
}


def test_missing_extras_skip_from_the_exception_or_the_mark_only(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_cases.py").write_text(TESTS_FILE)
    (tmp_path / "test_module_needs_fake.py").write_text(
        f"import {FAKE_MODULE}\n\ndef test_never():\n    pass\n"
    )
    (tmp_path / "test_module_is_broken.py").write_text(
        "import jaxaot_tests_other_missing_module\n\ndef test_never():\n    pass\n"
    )
    report = tmp_path / "report.xml"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "TMPDIR": str(tmp_path),  # the suite conftest's session cache folder lands here
    }
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs"),
            *(f"--junitxml={report}", "--continue-on-collection-errors"),
            *("--rootdir", str(tmp_path), str(tmp_path)),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    found: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for case in ET.parse(report).iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "skipped", "error")), "passed")
        name = case.get("name") or ""
        if not name:  # a module that did not import: its classname names it
            name = (case.get("classname") or "").rpartition(".")[2]
        found[name] = outcome
        skip = case.find("skipped")  # a collection skip keeps its reason in the text
        reasons[name] = "" if skip is None else f"{skip.get('message')} {skip.text}"
    assert found == EXPECTED, done.stdout[-3000:]
    for name, outcome in EXPECTED.items():
        if outcome == "skipped":
            assert (
                f"needs the [fake] extra ({FAKE_MODULE} not installed): pip install -e '.[fake]'"
                in reasons[name]
            ), (name, reasons[name])


def test_an_extra_is_missing_only_where_its_modules_are_not_on_the_path() -> None:
    assert find_missing_extras({"a": ("json", FAKE_MODULE, "json.no_such_module")}) == {
        "a": (FAKE_MODULE, "json.no_such_module")
    }
    assert find_missing_extras({"a": (f"{FAKE_MODULE}.sub",)}) == {"a": (f"{FAKE_MODULE}.sub",)}


@pytest.mark.parametrize(
    "exc",
    [
        AssertionError(f"No module named {FAKE_MODULE!r}"),
        RuntimeError("pip install 'jaxaot[sweep]'"),
        ModuleNotFoundError("No module named 'json.nothing'", name="json.nothing"),
    ],
    ids=["assertion", "other-error", "no-extra-module"],
)
def test_other_exceptions_name_no_extra(exc: BaseException) -> None:
    assert missing_extra_of(exc) is None
