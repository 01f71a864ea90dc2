"""XLA's effort levels (compile.optimization_level, compile.memory_fitting_level) as a sweep
axis: checked before JAX, keyed, and reaching XLA as plain JAX passes them, on a v5e:2x2
topology compiled here."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import jaxaot
import pytest
from conftest import cli_env, read_manifest, run_cli
from effort_programs import layers
from jaxaot.errors import ConfigError
from jaxaot.schema import validate
from jaxaot.stages.compile_options import EFFORT_VALUES, options_of
from jaxaot.util.canonical import canonical_hlo

ARGS = "program.args=[f32[512,512],f32[512,512]]"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["compile.optimization_level=O4"], r"^compile.optimization_level: expected one of O0, O1"),
        (["compile.memory_fitting_level=fast"], r"^compile.memory_fitting_level: .* 'fast'"),
        (["compile.optimization_level=19"], r"^compile.optimization_level: .* found '19'"),
        (
            ["+compile.compiler_options.optimization_level=7"],
            r"^compile.compiler_options.optimization_level: expected one of XLA's effort levels "
            r"\(O0=9, O1=19, O2=29, O3=39\), found 7",
        ),
        (
            [
                "+compile.compiler_options.memory_fitting_level=19",
                "compile.memory_fitting_level=O1",
            ],
            r"^compile.compiler_options.memory_fitting_level=19 and "
            r"compile.memory_fitting_level=O1 both set",
        ),
    ],
)
def test_bad_effort_levels_are_one_line_config_errors(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        validate(jaxaot.compose(["program=mlp", *overrides]))


def test_levels_are_xlas_numbers_in_the_compile_options() -> None:
    cfg = validate(
        jaxaot.compose(
            ["program=mlp", "compile.optimization_level=O1", "compile.memory_fitting_level=O3"]
        )
    )
    assert options_of(cfg.compile) == {"optimization_level": 19, "memory_fitting_level": 39}
    # XLA's own numbers, as JAX's EffortLevel has them
    from jax._src.config import EffortLevel

    assert {e.name: e.value for e in EffortLevel if e.name != "UNKNOWN"} == EFFORT_VALUES


def _plain(level: str | None, via_config: bool = False) -> Any:
    """``layers`` compiled by plain JAX for one v5e:2x2 device at ``level``."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding
    from jaxaot.targets.tpu import quiet_libtpu

    with quiet_libtpu():
        topo = topologies.get_topology_desc(
            platform="tpu", topology_name="v5e:2x2", chip_config_name="default"
        )
    one = SingleDeviceSharding(topo.devices[0])
    x = jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=one)
    lowered = jax.jit(layers).lower(x, x)
    if via_config:  # JAX's own config value, the other way JAX takes the level
        prior = jax.config.jax_optimization_level
        jax.config.update("jax_optimization_level", level)
        try:
            return lowered.compile()
        finally:
            jax.config.update("jax_optimization_level", prior)
    return lowered.compile(
        compiler_options={"optimization_level": EFFORT_VALUES[level]} if level else None
    )


def _ops(hlo: str) -> list[tuple[str, str]]:
    """The optimized module's instructions as (shape with layout, opcode), sorted: what XLA
    made of the program, without the names and attributes that follow how it was lowered
    (jaxaot's argument names and shardings, plain JAX's)."""
    return sorted(re.findall(r"^\s*(?:ROOT )?%\S+ = (\S+) ([\w-]+)\(", hlo, re.M))


@pytest.mark.extra("tpu")
def test_an_effort_sweep_on_a_topology(tmp_path: Path) -> None:
    """compile.optimization_level=O0,O1,O2,O3 with the basic sweeper: a row per level with its
    compile time and verdict, four compile keys, and each level's executable plain JAX's at
    that level (its optimized HLO and memory analysis)."""
    from jaxaot.stages.executable import memory_of

    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            "program.target=tests.effort_programs:layers",
            ARGS,
            "compile.topology=v5e:2x2",
            "compile.optimization_level=O0,O1,O2,O3",
            "compile.memory_fitting_level=O2",
            "hydra.callbacks.sweep.plots=false",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=tmp_path,
        env=cli_env(JAXAOT_STORE_DIR=str(tmp_path / "store")),
    )
    assert "sweep: 4 jobs, 4 ok, 0 failed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(sweep_dir / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["compile.optimization_level"] for r in rows] == ["O0", "O1", "O2", "O3"]
    assert {r["compile.memory_fitting_level"] for r in rows} == {"O2"}  # set: a column
    keys, hlos = set(), set()
    plains: dict[str, Any] = {}  # plain JAX's executable at each level
    for row in rows:
        level = row["compile.optimization_level"]
        manifest = read_manifest(sweep_dir / row["dir"])
        stage = manifest["stages"]["compile"]
        assert stage["status"] == "ran" and float(row["compile.seconds"]) == stage["seconds"] > 0
        assert row["compile.fits"] == "True" and stage["metrics"]["fits"] is True
        keys.add(stage["key"])
        hlo = (sweep_dir / row["dir"] / "compile" / "optimized.hlo.txt").read_text()
        memory = json.loads(
            (sweep_dir / row["dir"] / "compile" / "memory_analysis.json").read_text()
        )
        plain = plains[level] = _plain(level)
        assert _ops(hlo) == _ops(plain.as_text()), level
        assert memory == memory_of(plain), level
        assert int(row["compile.hbm_bytes_needed"]) == stage["metrics"]["hbm_bytes_needed"]
        hlos.add(tuple(_ops(hlo)))
    assert len(keys) == 4
    assert len(hlos) > 1  # the levels make XLA compile differently: each one reached it
    md = (sweep_dir / "sweep.md").read_text()
    head = next(ln for ln in md.splitlines() if ln.startswith("| job |"))
    assert "| mem. fit level |" in head and "| fits |" in head and "| compile |" in head
    # JAX's own config value compiles the same executable as the compile option
    via_config, option = _plain("O1", via_config=True), plains["O1"]
    assert canonical_hlo(via_config.as_text()) == canonical_hlo(option.as_text())
    assert memory_of(via_config) == memory_of(option)
