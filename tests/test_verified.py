"""jaxaot.util.verified: the one reader of store entries, checkpoints and snapshots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jaxaot.util.verified import (
    FileRecord,
    Refused,
    VerifiedFiles,
    parse_versioned_json,
    record_of,
)


def _files(tmp_path: Path, **contents: bytes) -> dict[str, FileRecord]:
    for name, data in contents.items():
        (tmp_path / name).write_bytes(data)
    return {name: record_of(data) for name, data in contents.items()}


def test_read_returns_the_recorded_bytes_and_refuses_others(tmp_path: Path) -> None:
    files = VerifiedFiles(tmp_path, _files(tmp_path, a=b"alpha", b=b"beta"), label="entry x")
    assert files.read("a") == b"alpha" and files.size_bytes == 9
    (tmp_path / "b").write_bytes(b"BETA")  # same size, other bytes
    with pytest.raises(Refused, match=r"'b' at .*: expected 4 bytes sha256 .*, found 4 bytes"):
        files.read("b")
    (tmp_path / "a").unlink()
    with pytest.raises(Refused, match=r"'a' at .*No such file"):
        files.read("a")
    with pytest.raises(KeyError, match=r"entry x has no file 'c'"):
        files.read("c")


def test_an_untrusted_entry_is_refused_at_every_read_of_a_guarded_file(tmp_path: Path) -> None:
    """The trust check runs before the first guarded read, and until it passes it runs again at
    every read: a refused file is never handed out by a second read."""
    asked: list[str] = []

    def trust() -> None:
        asked.append("asked")
        raise Refused("writable by others")

    records = _files(tmp_path, pickled=b"PICKLE", text=b"plain")
    files = VerifiedFiles(tmp_path, records, label="ck", trust=trust, guarded={"pickled"})
    assert files.read("text") == b"plain" and asked == []  # not guarded: no check
    for _ in range(2):
        with pytest.raises(Refused, match="writable by others"):
            files.read("pickled")
    assert asked == ["asked", "asked"]


def test_a_trusted_entry_is_checked_once(tmp_path: Path) -> None:
    asked: list[str] = []
    records = _files(tmp_path, pickled=b"PICKLE")
    files = VerifiedFiles(tmp_path, records, label="ck", trust=lambda: asked.append("ok"))
    assert files.read("pickled") == b"PICKLE" and files.read("pickled") == b"PICKLE"
    assert asked == ["ok"]


def test_versioned_json_refuses_another_version_naming_both() -> None:
    raw = json.dumps({"format_version": 2, "x": 1}).encode()
    with pytest.raises(Refused, match=r"entry format version 2, this jaxaot reads version 1"):
        parse_versioned_json(raw, 1, name="entry.json", kind="entry")
    assert parse_versioned_json(raw, 2, name="entry.json", kind="entry")["x"] == 1
    with pytest.raises(Refused):
        parse_versioned_json(b"[1, 2]", 1, name="entry.json", kind="entry")
