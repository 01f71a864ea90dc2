"""XLA's dumps per run: ``compile.dump=true`` writes this compile's dumps into
``compile/xla_dump/``, never through the process's XLA_FLAGS and never into the compile key."""

from __future__ import annotations

import os
from pathlib import Path

import jaxaot
import numpy as np
import pytest
from jaxaot.errors import ConfigError
from jaxaot.stages.execute import load_outputs


def _run(tmp_path: Path, name: str, *overrides: str) -> jaxaot.RunResult:
    return jaxaot.run(jaxaot.compose(["program=mlp", *overrides]), run_dir=tmp_path / name)


def test_a_dump_is_this_compiles_own_and_listed_in_the_manifest(tmp_path: Path) -> None:
    flags = os.environ.get("XLA_FLAGS")
    dumped = _run(tmp_path, "dump", "compile.dump=true")
    assert os.environ.get("XLA_FLAGS") == flags  # never through the process's flags
    stage = dumped.manifest["stages"]["compile"]
    assert stage["status"] == "ran"
    folder = tmp_path / "dump" / "compile" / "xla_dump"
    on_disk = {p.name: p.stat().st_size for p in folder.iterdir()}
    assert stage["xla_dump"]["files"] == on_disk and stage["xla_dump"]["dir"] == "compile/xla_dump"
    names = " ".join(on_disk)
    # the default kinds: the HLO before/after optimizations, buffer assignment, memory usage
    assert "after_optimizations.txt" in names and "before_optimizations.txt" in names
    assert "buffer-assignment" in names and "memory-usage-report" in names
    assert not any(n.endswith((".ll", ".o", ".html")) for n in on_disk)  # kinds not kept
    after = next(p for p in folder.iterdir() if p.name.endswith("after_optimizations.txt"))
    assert "ENTRY" in after.read_text()
    assert stage["metrics"]["xla_dump_files"] == len(on_disk)
    assert "artifacts" in stage and not any("xla_dump" in a for a in stage["artifacts"])

    # Not in the compile key, yet never stored (the executable records the dump's options): the
    # same program without a dump compiles its own under the same key, the dump wrote nothing to
    # the next compile of the process, and the results are the same.
    assert any("executable not stored" in w for w in dumped.manifest["warnings"])
    plain = _run(tmp_path, "plain")
    assert plain.manifest["stages"]["compile"]["status"] == "ran"
    assert plain.manifest["stages"]["compile"]["key"] == stage["key"]
    assert not (tmp_path / "plain" / "compile" / "xla_dump").exists()
    other = jaxaot.run(
        jaxaot.compose(["program=axpy", "store.enabled=false"]), run_dir=tmp_path / "o"
    )
    assert other.manifest["stages"]["compile"]["status"] == "ran"  # a real compile, after it
    assert {p.name: p.stat().st_size for p in folder.iterdir()} == on_disk
    assert not (tmp_path / "o" / "compile" / "xla_dump").exists()
    a, b = load_outputs(tmp_path / "dump" / "execute"), load_outputs(tmp_path / "plain" / "execute")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_dumping_run_hits_the_store_and_says_it_compiled_again_to_dump(tmp_path: Path) -> None:
    first = _run(tmp_path, "first")
    again = _run(tmp_path, "again", "compile.dump=true", "compile.dump_keep=[passes,html]")
    stage = again.manifest["stages"]["compile"]
    assert (
        stage["status"] == "cached" and stage["key"] == first.manifest["stages"]["compile"]["key"]
    )
    assert "compiled again only for XLA's dump" in stage["xla_dump"]["note"]
    files = stage["xla_dump"]["files"]
    assert any(".after_" in n and "optimizations" not in n for n in files)  # per pass
    assert any(n.endswith(".html") for n in files)
    assert not any("buffer-assignment" in n for n in files)  # not asked for


def test_a_resumed_compile_can_dump_too(tmp_path: Path) -> None:
    src = _run(tmp_path, "src", "stop_after=lower", "store.enabled=false").run_dir
    resumed = _run(
        tmp_path,
        "r",
        f"resume_from={src}",
        "start_at=compile",
        "compile.dump=true",
        "store.enabled=false",
    )
    stage = resumed.manifest["stages"]["compile"]
    assert stage["status"] == "ran" and stage["xla_dump"]["files"]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["compile.dump=true", "compile.dump_keep=[hlo,everything]"],
            r"^compile\.dump_keep: expected some of hlo, passes",
        ),
        (["compile.dump=true", "compile.dump_keep=[]"], r"^compile\.dump_keep: expected some of"),
    ],
)
def test_bad_dump_options_are_one_line_errors(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        jaxaot.validate(jaxaot.compose(["program=mlp", *overrides]))
