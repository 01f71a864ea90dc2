"""What a compile records about its executable, against plain JAX in the same test:
shardings.json's rows are ``Compiled.in_avals`` (unused inputs included), whether the
executable kept each input, and ``input_formats``/``output_formats`` (layout, sharding,
memory kind), on one device and on a mesh; a store hit serves the same file. And the compile
key: a CPU executable is keyed by the devices it runs on, not by how many the host has."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aot_records_programs as progs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.layout import Format
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxaot.config.tree_paths import input_path
from jaxaot.stages.execute import load_outputs
from jaxaot.stages.inputs import spec_inputs

T = "program.target=aot_records_programs"
ONCE = ("execute.warmup=0", "execute.repeats=1")


@pytest.fixture(autouse=True)
def _programs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def _rows(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "compile" / "shardings.json").read_text())


def _sds(x: Any) -> Any:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _expected_inputs(compiled: Any) -> list[dict[str, Any]]:
    """The rows plain JAX's executable implies: its in_avals and input_formats, per flat input."""
    avals = jax.tree_util.tree_flatten_with_path(compiled.in_avals)[0]
    fmts = jax.tree.leaves(compiled.input_formats, is_leaf=lambda x: isinstance(x, Format))
    out = []
    for (path, aval), f in zip(avals, fmts, strict=True):
        sh = f.sharding
        out.append(
            {
                "path": input_path(path),
                "aval": str(aval),
                "shape": list(aval.shape),
                "kept": sh is not None,
                "layout": list(f.layout.major_to_minor) if f.layout is not None else None,
                "sharding": None if sh is None else str(getattr(sh, "spec", sh)),
                "shard_shape": None if sh is None else list(sh.shard_shape(aval.shape)),
                "memory_kind": None if sh is None else sh.memory_kind,
            }
        )
    return out


def _said(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = ("path", "aval", "shape", "kept", "sharding", "shard_shape", "memory_kind")
    return [
        {k: r[k] for k in keys} | {"layout": r["layout"] and r["layout"]["major_to_minor"]}
        for r in rows
    ]


def _outputs_said(rows: list[dict[str, Any]]) -> list[Any]:
    return [(r["shape"], r["layout"]["major_to_minor"], r["memory_kind"]) for r in rows]


def _outputs_expected(compiled: Any) -> list[Any]:
    infos = jax.tree.leaves(compiled.out_info)
    fmts = jax.tree.leaves(compiled.output_formats, is_leaf=lambda x: isinstance(x, Format))
    return [
        (list(i.shape), list(f.layout.major_to_minor), f.sharding.memory_kind)
        for i, f in zip(infos, fmts, strict=True)
    ]


@pytest.mark.parametrize("keep_unused", [False, True])
def test_one_device_rows_are_plain_jaxs_in_avals_kept_and_formats(
    compose_run: Any, keep_unused: bool
) -> None:
    # JAX: Compiled.in_avals keeps the unused y; input_formats gives it Format(None, None)
    # unless keep_unused=True, which keeps it in the executable.
    over = [f"{T}:dead", "program.args=[f32[4], f32[3], f32[4]]", *ONCE]
    result = compose_run(*over, f"lower.keep_unused={str(keep_unused).lower()}")
    args = spec_inputs(result["stage_out"].bound, 0)[0]
    plain = jax.jit(progs.dead, keep_unused=keep_unused).lower(*map(_sds, args)).compile()
    rows = _rows(result.run_dir)
    assert _said(rows["inputs"]) == _expected_inputs(plain)
    assert [r["kept"] for r in rows["inputs"]] == [True, keep_unused, True]
    assert _outputs_said(rows["outputs"]) == _outputs_expected(plain)
    assert result["compile"].compiled.input_formats == plain.input_formats
    want = np.asarray(plain(*[a for a in args]))
    got = load_outputs(result.run_dir / "execute")[""]
    assert got.dtype == want.dtype and np.array_equal(got, want)
    # A store hit serves the same record.
    hit = compose_run(*over, f"lower.keep_unused={str(keep_unused).lower()}")
    assert hit.manifest["stages"]["compile"]["status"] == "cached"
    assert _rows(hit.run_dir) == rows


def test_a_sub_byte_layout_is_recorded_with_every_field_of_jaxs_layout(compose_run: Any) -> None:
    # JAX: an int4 array's compiled Layout says its element size, 4 bits
    # (Layout(major_to_minor=(0,), tiling=(), sub_byte_element_size_in_bits=4) on cpu).
    result = compose_run("program.target=jax.numpy:negative", "program.args=[i4[8]]", *ONCE)
    args = spec_inputs(result["stage_out"].bound, 0)[0]
    plain = jax.jit(jnp.negative).lower(*map(_sds, args)).compile()
    formats = [
        *jax.tree.leaves(plain.input_formats, is_leaf=lambda x: isinstance(x, Format)),
        *jax.tree.leaves(plain.output_formats, is_leaf=lambda x: isinstance(x, Format)),
    ]
    want = [
        {
            "major_to_minor": list(f.layout.major_to_minor),
            "tiling": [list(t) for t in f.layout.tiling],
            "sub_byte_element_size_in_bits": f.layout.sub_byte_element_size_in_bits,
        }
        for f in formats
    ]
    assert [w["sub_byte_element_size_in_bits"] for w in want] == [4, 4]
    rows = _rows(result.run_dir)
    assert [r["layout"] for r in rows["inputs"] + rows["outputs"]] == want
    got = load_outputs(result.run_dir / "execute")[""]
    expected = np.asarray(plain(*args))
    assert got.dtype == expected.dtype and np.array_equal(got, expected)


def test_a_dict_leaf_and_a_keyword_argument_by_path(compose_run: Any) -> None:
    # JAX flattens (args, kwargs): params' unused 'b' has an aval and no format; the keyword
    # argument 'scale' comes after the positional ones.
    result = compose_run(
        f"{T}:dead_tree",
        "program.args=[{w: f32[3], b: f32[2]}, f32[3]]",
        "+program.kwargs.scale=f32[]",
        *ONCE,
    )
    (params, x), kwargs = spec_inputs(result["stage_out"].bound, 0)
    plain = (
        jax.jit(progs.dead_tree)
        .lower(jax.tree.map(_sds, params), _sds(x), scale=_sds(kwargs["scale"]))
        .compile()
    )
    rows = _rows(result.run_dir)["inputs"]
    assert _said(rows) == _expected_inputs(plain)
    assert [(r["path"], r["kept"]) for r in rows] == [
        ("args[0]['b']", False),
        ("args[0]['w']", True),
        ("args[1]", True),
        ("kwargs['scale']", True),
    ]


def test_mesh_rows_are_plain_jaxs_on_the_same_mesh(compose_run: Any) -> None:
    result = compose_run(
        f"{T}:dead",
        "program.args=[f32[8], f32[4], f32[8]]",
        "mesh.shape=[2]",
        "mesh.axes=[data]",
        "lower.in_shardings=[[data], [data], null]",
        *ONCE,
    )
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((2,), ("data",), axis_types=auto, devices=jax.devices("cpu")[:2])
    rows_sh = NamedSharding(mesh, P("data"))  # [data]; null is replicated: P()
    args = spec_inputs(result["stage_out"].bound, 0)[0]
    plain = (
        jax.jit(progs.dead, in_shardings=(rows_sh, rows_sh, NamedSharding(mesh, P())))
        .lower(*map(_sds, args))
        .compile()
    )
    record = _rows(result.run_dir)
    assert _said(record["inputs"]) == _expected_inputs(plain)
    assert [r["shard_shape"] for r in record["inputs"]] == [[4], None, [8]]
    assert _outputs_said(record["outputs"]) == _outputs_expected(plain)
    # the dropped input is in neither count of the summary
    metrics = result.manifest["stages"]["compile"]["metrics"]
    assert (metrics["sharded_inputs"], metrics["inputs"]) == (1, 2)


def test_keyed_backend_keys_the_devices_the_executable_runs_on(compose_run: Any) -> None:
    from jaxaot.stages.compile import keyed_backend

    lowered = compose_run(
        f"{T}:dead",
        "program.args=[f32[8], f32[4], f32[8]]",
        "mesh.shape=[2]",
        "mesh.axes=[data]",
        "compile.num_devices=2",  # the host's CPU backend has them, whatever ran here before
        "stop_after=lower",
    )["lower"]
    cfg = jaxaot_cfg(
        ["program.args=[f32[8], f32[4], f32[8]]", "mesh.shape=[2]", "mesh.axes=[data]"]
    )
    host = {"platform": "cpu", "device_count": 8, "topology": None}
    assert keyed_backend(cfg.compile, lowered, host) == {
        "platform": "cpu",
        "topology": None,
        "device_ids": [0, 1],
    }
    tpu = {"platform": "tpu", "device_count": 8, "topology": []}
    assert keyed_backend(cfg.compile, lowered, tpu) == tpu  # kept where it is not proven


def jaxaot_cfg(overrides: list[str]) -> Any:
    import jaxaot

    return jaxaot.validate(jaxaot.compose([f"{T}:dead", *overrides]))


def test_the_hosts_device_count_is_not_in_the_key(tmp_path: Path) -> None:
    """A one-device program compiled with 8 host devices (XLA_FLAGS) hits the entry compiled
    with 1: the same optimized HLO and outputs bit for bit. (JAX's own persistent cache misses
    here, jax 0.10.2: its key hashes the CPU client's whole topology, 1 device or 8.)"""
    from conftest import REPO, cli_env, run_cli

    store = tmp_path / "store"
    over = [f"{T}:dead", "program.args=[f32[4], f32[3], f32[4]]", *ONCE]
    path = f"{REPO / 'tests'}"
    runs = []
    for i, flags in enumerate([None, "--xla_force_host_platform_device_count=8"]):
        env = cli_env(JAXAOT_STORE_DIR=str(store))
        env.pop("XLA_FLAGS", None)  # no flags: the host's one CPU device (a run the server takes)
        if flags is not None:
            env["XLA_FLAGS"] = flags
        env["PYTHONPATH"] = f"{path}:{env['PYTHONPATH']}"
        rd = tmp_path / f"run{i}"
        proc = run_cli([*over, f"hydra.run.dir={rd}"], cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        runs.append(rd)
    manifests = [json.loads((rd / "manifest.json").read_text()) for rd in runs]
    assert [m["backend"]["device_count"] for m in manifests] == [1, 8]
    assert [m["stages"]["compile"]["status"] for m in manifests] == ["ran", "cached"]
    first, second = (load_outputs(rd / "execute")[""] for rd in runs)
    assert first.dtype == second.dtype and np.array_equal(first, second)
    hlo = [(rd / "compile" / "optimized.hlo.txt").read_text() for rd in runs]
    assert hlo[0] == hlo[1]


def test_a_mesh_program_hits_across_host_device_counts(compose_run: Any) -> None:
    # mesh.shape=[2] runs on devices 0 and 1 whether the host has 2 (the mesh's own count) or 8
    over = [
        f"{T}:dead",
        "program.args=[f32[8], f32[4], f32[8]]",
        "mesh.shape=[2]",
        "mesh.axes=[data]",
        "lower.in_shardings=[[data], [data], null]",
        *ONCE,
    ]
    first = compose_run(*over)
    second = compose_run(*over, "compile.num_devices=8")
    assert [r.manifest["backend"]["device_count"] for r in (first, second)] == [2, 8]
    assert second.manifest["stages"]["compile"]["status"] == "cached"
    a, b = (load_outputs(r.run_dir / "execute")[""] for r in (first, second))
    assert np.array_equal(a, b)
    # a mesh of 4 runs on other devices: another key
    third = compose_run(*over[:2], "mesh.shape=[4]", *over[3:], "compile.num_devices=8")
    assert third.manifest["stages"]["compile"]["status"] == "ran"
