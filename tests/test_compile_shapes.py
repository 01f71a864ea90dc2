"""A polymorphic lowering is made concrete by the compile stage, at its own compile.shapes: lower
exports once (its record and exported.bin stay polymorphic), compile records the sizes it
compiled at, and every way compile gets its lowering (computed, a lower checkpoint, its own
checkpoint) compiles or loads the concrete export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jaxaot.errors import ConfigError
from jaxaot.rundir.metrics import CompileMetrics, LowerMetrics

POLY = (
    "program.target=aot_api_programs:rows",
    "program.args=[f32[b,4]]",
    "stage_out.shape_constraints=['b >= 2']",
)


@pytest.fixture(autouse=True)
def _programs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def _symbolic(exported: Any) -> bool:
    return any(not isinstance(d, int) for aval in exported.in_avals for d in aval.shape)


def test_compile_records_the_sizes_it_compiled_a_polymorphic_lowering_at(
    compose_run: Any,
) -> None:
    first = compose_run(*POLY, "+compile.shapes.b=3", "stop_after=compile")
    lower, compile_ = first.manifest["stages"]["lower"], first.manifest["stages"]["compile"]
    assert "shapes" not in lower["metrics"]
    assert compile_["metrics"]["shapes"] == {"b": 3}
    assert CompileMetrics.from_metrics(compile_["metrics"]).shapes == {"b": 3}
    assert not hasattr(LowerMetrics.from_metrics(lower["metrics"]), "shapes")
    assert first.records["lower"].state == "live"
    assert _symbolic(first.records["lower"].exported)
    blob = (first.run_dir / "lower" / "exported.bin").read_bytes()
    assert _symbolic(jax.export.deserialize(bytearray(blob)))
    compiled = first.records["compile"]
    assert compiled.lowered.state == "concrete" and not _symbolic(compiled.lowered.exported)
    assert dict(compiled.shapes) == {"b": 3}

    # From compile's checkpoint: its export made concrete again, the executable loaded.
    run = compose_run(
        *POLY,
        f"resume_from={first.run_dir}",
        "start_at=execute",
        "execute.repeats=1",
    )
    stages = run.manifest["stages"]
    assert [stages[s]["status"] for s in ("lower", "compile", "execute")] == [
        "resumed",
        "resumed",
        "ran",
    ]
    assert stages["compile"]["metrics"]["shapes"] == {"b": 3}
    assert np.shape(run.records["execute"].outputs) == (4,)


def test_a_missing_size_fails_the_compile_stage_after_lower(
    compose_run: Any, tmp_path: Path
) -> None:
    run_dir = tmp_path / "missing"
    with pytest.raises(ConfigError, match=r"^compile\.shapes: the lowering is polymorphic in 'b'"):
        compose_run(*POLY, "stop_after=compile", run_dir=run_dir)
    stages = json.loads((run_dir / "manifest.json").read_text())["stages"]
    assert stages["lower"]["status"] == "ran" and stages["compile"]["status"] == "failed"
    # The lowering it made resumes at compile with the size given.
    again = compose_run(
        *POLY,
        "+compile.shapes.b=2",
        f"resume_from={run_dir}",
        "start_at=compile",
        "stop_after=compile",
    )
    assert again.manifest["stages"]["compile"]["metrics"]["shapes"] == {"b": 2}


def _concrete_bytes(poly: Any, depth: int) -> bytes:
    """``poly`` made concrete at b=3 from a call stack ``depth`` frames deeper."""
    if depth:
        return _concrete_bytes(poly, depth - 1)
    from jaxaot.stages.concrete_export import at_sizes
    from jaxaot.stages.lower import Lowered

    record = Lowered(
        exported=poly,
        lowered=None,
        platforms=("cpu",),
        module_sha256="0" * 64,
        donate_argnums=(),
        meta={},
        state="loaded",
    )
    made = at_sizes(record, {"b": 3}, mesh_context=False)
    assert made.state == "concrete" and made.meta["shapes"] == {"b": 3}
    return bytes(made.exported.serialize())


def test_the_concrete_export_does_not_depend_on_who_made_it() -> None:
    # Its bytes are what the compile key hashes: one export at one size, one key, whatever
    # called jaxaot (the CLI, the Python API, a test).
    import aot_api_programs as progs
    import jax.numpy as jnp

    (b,) = jax.export.symbolic_shape("b")
    poly = jax.export.export(jax.jit(progs.rows))(jax.ShapeDtypeStruct((b, 4), jnp.float32))
    assert _concrete_bytes(poly, 0) == _concrete_bytes(poly, 3)


@pytest.mark.extra("tpu")
def test_a_polymorphic_compile_that_does_not_fit_records_its_sizes(
    compose_run: Any, tmp_path: Path
) -> None:
    """The sizes are in compile's metrics before XLA runs: a does-not-fit row (a fit search
    over compile.shapes) says which sizes did not fit."""
    from jaxaot.errors import DoesNotFit

    run_dir = tmp_path / "big"
    with pytest.raises(DoesNotFit):
        compose_run(
            *POLY,
            "+compile.shapes.b=1073741824",  # 16 GiB of f32[b,4]
            "compile.topology=v5e:2x2",
            run_dir=run_dir,
        )
    compile_ = json.loads((run_dir / "manifest.json").read_text())["stages"]["compile"]
    assert compile_["status"] == "does_not_fit"
    assert compile_["metrics"]["shapes"] == {"b": 1073741824}
