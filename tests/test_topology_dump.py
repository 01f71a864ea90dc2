"""compile.dump=true with compile.topology: XLA's dump of a deviceless TPU compile in the run's
compile/xla_dump/, as for this host's backend; memory_breakdown.json read from that dump (the
same as from the temporary dump every topology compile makes); a store hit compiles again only
for the dump; a program XLA refuses keeps its dump and its breakdown."""

from __future__ import annotations

import json
from pathlib import Path

import jaxaot
import pytest
from conftest import run_numbered
from jaxaot.errors import DoesNotFit
from jaxaot.stages import memory_breakdown as mb
from jaxaot.targets.tpu import GENERATIONS

pytestmark = pytest.mark.slow

TOPOLOGY = ("program=mlp", "compile.topology=v5e:2x2")


def _run(tmp_path: Path, name: str, *overrides: str) -> jaxaot.RunResult:
    return jaxaot.run(jaxaot.compose([*TOPOLOGY, *overrides]), run_dir=tmp_path / name)


def _breakdown(run_dir: Path) -> dict:
    return json.loads((run_dir / "compile" / mb.ARTIFACT).read_text())


def test_a_topology_compile_dumps_into_the_run(tmp_path: Path) -> None:
    plain = _run(tmp_path, "plain")
    dumped = _run(tmp_path, "dumped", "compile.dump=true", "store.enabled=false")
    stage = dumped.manifest["stages"]["compile"]
    assert stage["status"] == "ran"
    folder = tmp_path / "dumped" / "compile" / "xla_dump"
    on_disk = {p.name: p.stat().st_size for p in folder.iterdir()}
    assert stage["xla_dump"]["files"] == on_disk
    names = " ".join(on_disk)
    assert "after_optimizations.txt" in names and "buffer-assignment" in names
    after = next(p for p in folder.iterdir() if p.name.endswith("after_optimizations.txt"))
    optimized = (folder.parent / "optimized.hlo.txt").read_text()
    assert after.read_text().split("\n", 1)[0] == optimized.split("\n", 1)[0]  # HloModule line
    # the breakdown from the run's dump is the one from the temporary dump
    assert _breakdown(dumped.run_dir) == _breakdown(plain.run_dir)
    assert _breakdown(plain.run_dir)["source"] == "xla_dump"
    assert stage["metrics"]["fits"] is True

    # dump_keep drops the buffer assignment after the breakdown read it
    kept = _run(tmp_path, "kept", "compile.dump=true", "compile.dump_keep=[hlo]")
    stage = kept.manifest["stages"]["compile"]
    assert stage["status"] == "cached"  # the dump options are not in the key
    assert "compiled again only for XLA's dump" in stage["xla_dump"]["note"]
    files = stage["xla_dump"]["files"]
    assert files and not any("buffer-assignment" in n for n in files)
    assert any(n.endswith("after_optimizations.txt") for n in files)
    assert _breakdown(kept.run_dir) == _breakdown(plain.run_dir)  # the stored one


def test_a_refused_program_keeps_its_dump(tmp_path: Path) -> None:
    limit = GENERATIONS["v5e"].hbm_usable_bytes
    with pytest.raises(DoesNotFit):
        jaxaot.run(
            jaxaot.compose(
                [
                    "program.target=tests.test_topology:head",
                    f"program.args=[bf16[{limit // 2}]]",
                    "compile.topology=v5e:2x2",
                    "compile.dump=true",
                    "compile.dump_keep=[hlo]",
                ]
            ),
            run_dir=tmp_path / "r",
        )
    folder = tmp_path / "r" / "compile" / "xla_dump"
    names = [p.name for p in folder.iterdir()]
    assert any(n.endswith("after_optimizations.txt") for n in names)
    assert not any("buffer-assignment" in n for n in names)  # dump_keep=[hlo]
    found = _breakdown(tmp_path / "r")
    assert found["source"] == "xla_dump" and found["top"][0]["shape"] == f"bf16[{limit // 2}]"


def test_an_executable_compiled_with_a_dump_is_never_stored(tmp_path: Path) -> None:
    """compile.dump's options ride in the serialized executable: a dumping run stores nothing,
    so a later plain run compiles and stores its own, and a hit serves that one."""
    dumped = run_numbered(tmp_path, "program=mlp", "compile.topology=v5e:2x2", "compile.dump=true")
    assert any("executable not stored" in w for w in dumped.manifest["warnings"])
    plain = run_numbered(tmp_path, "program=mlp", "compile.topology=v5e:2x2")
    assert plain.manifest["stages"]["compile"]["status"] == "ran"
    hit = run_numbered(tmp_path, "program=mlp", "compile.topology=v5e:2x2")
    assert hit.manifest["stages"]["compile"]["status"] == "cached"
    exe = [(r.run_dir / "compile" / "executable.bin").read_bytes() for r in (dumped, plain, hit)]
    assert exe[1] == exe[2] and exe[0] != exe[1]
    where = str(dumped.run_dir / "compile" / "xla_dump").encode()
    assert where in exe[0] and where not in exe[1]  # the dumping run's folder is not stored
