"""JAX reads a serialized export for 6 months (jax >= 0.11 refuses older ones): resuming from a
lower checkpoint whose export is near or past that window warns, naming when it was made."""

from __future__ import annotations

import json
import time

import pytest
from jaxaot.compat.jax import EXPORT_WARN_DAYS, EXPORT_WINDOW_DAYS, export_age_note

DAY = 86400.0
NOW = 1_800_000_000.0  # 2027-01-15


@pytest.mark.parametrize(
    ("days", "expected"),
    [
        (0, None),
        (EXPORT_WARN_DAYS - 1, None),
        (EXPORT_WARN_DAYS, "near the end of"),
        (EXPORT_WINDOW_DAYS - 1, "near the end of"),
        (EXPORT_WINDOW_DAYS, "past"),
        (400, "past"),
    ],
)
def test_the_note_by_age(days: int, expected: str | None) -> None:
    note = export_age_note(NOW - days * DAY - 1, "0.10.2", NOW)
    if expected is None:
        assert note is None
        return
    assert note is not None and f"is {expected} JAX's 183-day window" in note
    assert f"with jax 0.10.2, {days} days ago" in note and "start_at=lower" in note
    assert export_age_note(None, "0.10.2", NOW) is None


def test_resuming_an_old_lower_checkpoint_warns(compose_run) -> None:  # type: ignore[no-untyped-def]
    src = compose_run("program=axpy", "stop_after=lower").run_dir
    fresh = compose_run(f"resume_from={src}", "start_at=compile")
    assert not any("jax.export" in w for w in fresh.manifest["warnings"])

    manifest = json.loads((src / "manifest.json").read_text())
    manifest["started"] = time.time() - 190 * DAY
    (src / "manifest.json").write_text(json.dumps(manifest))
    old = compose_run(f"resume_from={src}", "start_at=compile")
    assert old.ok
    [line] = [w for w in old.manifest["warnings"] if "jax.export" in w]
    assert f"resume_from={src}" in line or str(src) in line
    assert "190 days ago) is past JAX's 183-day window" in line
