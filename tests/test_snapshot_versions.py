"""A golden snapshot written under another jax or jaxlib: it verifies where the signature and
the lowering (StableHLO, HLO) are the same, whatever JAX's jaxpr printer and XLA's optimizer
print between releases; a different lowering still fails, naming the versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jaxaot.errors import SnapshotMismatch
from jaxaot.snapshots.snapshot import Snapshot, load_snapshot, write_snapshot

AXPY = ("program=axpy", "program.args=[f32[8],f32[8]]", "stop_after=compile")


def _as_if_from(golden: Path, jax: str, edits: dict[str, str]) -> Path:
    """The golden rewritten as another jax's: its versions.json names ``jax``/jaxlib, and each
    file of ``edits`` gets that text appended."""
    snap = load_snapshot(golden)
    files = dict(snap.files)
    versions = json.loads(files["versions.json"])
    versions.update(jax=jax, jaxlib=jax)
    files["versions.json"] = json.dumps(versions, indent=2, sort_keys=True) + "\n"
    for path, text in edits.items():
        files[path] += text
    out = golden.parent / f"from-{jax}"
    write_snapshot(Snapshot(files=files, program=snap.program), out)
    return out


def test_another_jaxs_golden_verifies_where_the_lowering_is_the_same(
    compose_run, tmp_path: Path
) -> None:
    golden = tmp_path / "golden"
    compose_run(*AXPY, f"snapshot.write={golden}")
    older = _as_if_from(
        golden,
        "0.8.3",
        {
            "stage_out/jaxpr.txt": "  # 0.8.3 prints shape=(8,) sharding=None here\n",
            "compile/optimized.hlo.txt": "// another XLA's fusion\n",
        },
    )
    result = compose_run(*AXPY, f"snapshot.verify={older}")
    record = result.manifest["snapshot"]
    assert record["status"] == "match"
    assert record["across_versions"] == ["stage_out/jaxpr.txt", "compile/optimized.hlo.txt"]
    assert Path(record["diff"]).is_file()


def test_another_jaxs_golden_with_another_lowering_still_fails(compose_run, tmp_path: Path) -> None:
    golden = tmp_path / "golden"
    compose_run(*AXPY, f"snapshot.write={golden}")
    older = _as_if_from(golden, "0.8.3", {"lower/module.stablehlo.mlir": "// another\n"})
    with pytest.raises(SnapshotMismatch, match=r"lower \(StableHLO\) differs.*jax: 0\.8\.3 -> "):
        compose_run(*AXPY, f"snapshot.verify={older}")


def test_the_same_jaxs_golden_fails_on_a_jaxpr_difference_alone(
    compose_run, tmp_path: Path
) -> None:
    golden = tmp_path / "golden"
    compose_run(*AXPY, f"snapshot.write={golden}")
    snap = load_snapshot(golden)
    files = dict(snap.files)
    files["stage_out/jaxpr.txt"] += "  # a change\n"
    same = tmp_path / "same"
    write_snapshot(Snapshot(files=files, program=snap.program), same)
    with pytest.raises(SnapshotMismatch, match=r"stage_out \(jaxpr\) differs"):
        compose_run(*AXPY, f"snapshot.verify={same}")


def test_another_jaxs_golden_with_another_config_fails(compose_run, tmp_path: Path) -> None:
    """A compile option changed since the golden shows in the compile files alone: across jax
    versions too it is a difference, never excused as the optimizer's."""
    golden = tmp_path / "golden"
    compose_run(*AXPY, f"snapshot.write={golden}")
    older = _as_if_from(golden, "0.8.3", {"compile/optimized.hlo.txt": "// another XLA\n"})
    with pytest.raises(SnapshotMismatch, match=r"compile \(optimized HLO\) differs"):
        compose_run(
            *AXPY,
            "compile.compiler_options={xla_cpu_enable_fast_math: true}",
            f"snapshot.verify={older}",
        )


def test_a_golden_that_records_no_jax_is_not_another_jaxs(compose_run, tmp_path: Path) -> None:
    golden = tmp_path / "golden"
    compose_run(*AXPY, f"snapshot.write={golden}")
    snap = load_snapshot(golden)
    files = dict(snap.files)
    versions = json.loads(files["versions.json"])
    del versions["jax"]
    files["versions.json"] = json.dumps(versions, indent=2, sort_keys=True) + "\n"
    files["compile/optimized.hlo.txt"] += "// another XLA\n"
    bare = tmp_path / "bare"
    write_snapshot(Snapshot(files=files, program=snap.program), bare)
    with pytest.raises(SnapshotMismatch, match=r"compile \(optimized HLO\) differs"):
        compose_run(*AXPY, f"snapshot.verify={bare}")
