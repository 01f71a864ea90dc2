"""The fast tier's reading of the source (tests/conftest.py): a test is slow when what it
calls, or a fixture it uses, starts a process or runs a pipeline."""

from __future__ import annotations

from conftest import TESTS, _is_slow_function


def test_a_fixture_imported_from_another_test_module_is_read_too() -> None:
    """``from mlflow_server import mlflow_server``: the fixture starts an MLflow server (a
    process), so a test using it is slow, though its own body calls nothing slow."""
    tracking = TESTS / "test_tracking.py"
    used = frozenset({"mlflow_server", "tmp_path", "monkeypatch"})
    name = "test_a_failure_while_logging_ends_the_run_failed_not_running"
    assert _is_slow_function(tracking, name, None, used)
    assert not _is_slow_function(tracking, name, None, frozenset({"tmp_path", "monkeypatch"}))
    assert not _is_slow_function(tracking, "test_skipped_stages_have_no_figures", None, frozenset())
