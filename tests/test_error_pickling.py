"""jaxaot's errors survive pickling with their message and attributes: a probe's task in a
process of its own raises them back to the fit search (jaxaot.sweeps.probe_process)."""

from __future__ import annotations

import pickle

from jaxaot.errors import DoesNotFit, SnapshotMismatch, StageError
from jaxaot.sweeps.probe_process import _portable


def test_does_not_fit_round_trips() -> None:
    fit = {"fits": False, "hbm_bytes_needed": 17 << 30, "hbm_bytes_available": 16911433728}
    exc = DoesNotFit("v5e:2x2: needs 17 GiB of 15.75 GiB per device", fit, {"fits": False})
    exc.breakdown = {"peak_bytes": 17 << 30, "top": [{"bytes": 1 << 30}]}
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is DoesNotFit
    assert str(back) == str(exc) and back.args == exc.args
    assert (back.fit, back.metrics, back.breakdown) == (exc.fit, exc.metrics, exc.breakdown)
    assert _portable(exc) is exc  # not turned into a RuntimeError

    bare = pickle.loads(pickle.dumps(DoesNotFit("no", {"fits": False})))
    assert (bare.metrics, bare.breakdown) == ({}, None)


def test_stage_error_round_trips() -> None:
    exc = StageError("compile", "XLA refused the module")
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is StageError
    assert str(back) == "stage 'compile' failed: XLA refused the module" == str(exc)
    assert (back.stage, back.reason) == ("compile", "XLA refused the module")
    assert _portable(exc) is exc


def test_snapshot_mismatch_round_trips() -> None:
    exc = SnapshotMismatch("lower differs", diff="-a\n+b", diff_path="/tmp/d.diff")
    back = pickle.loads(pickle.dumps(exc))
    assert (str(back), back.diff, back.diff_path) == ("lower differs", "-a\n+b", "/tmp/d.diff")
