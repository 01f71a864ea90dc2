"""The argument table (stages/arg_table.py): every traced leaf with its size whole and per
device, totals per top-level argument, the summary line; and overrides shortened in sweep
progress lines and reports."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jaxaot
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxaot.stages import arg_table
from jaxaot.sweeps import report
from jaxaot.sweeps.overrides import (
    LAUNCHER_LOGGERS,
    ShortOverrides,
    short_value,
    shorten_launcher_lines,
    split_overrides,
)
from jaxaot.sweeps.progress import progress_line, write_job_record

S = jax.ShapeDtypeStruct
MESH = AbstractMesh((4, 2), ("fsdp", "model"))


class AdamState(NamedTuple):
    mu: dict[str, Any]
    nu: dict[str, Any]


def _params() -> dict[str, Any]:
    return {
        "embed": S((1000, 64), jnp.float32),
        "layers": {"wq": S((64, 32), jnp.bfloat16), "b": S((32,), jnp.float32)},
    }


def _named(*spec: Any) -> NamedSharding:
    return NamedSharding(MESH, P(*spec))


def _arguments() -> list[tuple[str, Any]]:
    params = _params()
    # optax's adam state: a tuple holding a NamedTuple of two param trees, then a count.
    opt_state = (AdamState(mu=params, nu=params), S((), jnp.int32))
    return [("params", params), ("opt_state", opt_state), ("tokens", S((8, 128), jnp.int32))]


SHARDINGS: dict[str, Any] = {
    "params": {
        "embed": _named(None, "fsdp"),
        "layers": {"wq": _named("fsdp", "model"), "b": _named()},
    },
    "opt_state": _named(),  # one sharding for a whole subtree (a pytree prefix)
    "tokens": _named("fsdp"),
}


def _bytes(sds: Any) -> int:
    return math.prod(sds.shape) * np.dtype(sds.dtype).itemsize


def test_every_leaf_of_dicts_tuples_and_namedtuples_with_its_shard() -> None:
    table = arg_table.build(_arguments(), SHARDINGS, mesh={"fsdp": 4, "model": 2})
    rows = {r.path: r for r in table.rows}
    assert list(rows) == [
        "params/embed",
        "params/layers/b",
        "params/layers/wq",
        "opt_state/0/mu/embed",
        "opt_state/0/mu/layers/b",
        "opt_state/0/mu/layers/wq",
        "opt_state/0/nu/embed",
        "opt_state/0/nu/layers/b",
        "opt_state/0/nu/layers/wq",
        "opt_state/1",
        "tokens",
    ]
    assert len(rows) == len(_flat())
    expected = {
        "params/embed": SHARDINGS["params"]["embed"],
        "params/layers/wq": SHARDINGS["params"]["layers"]["wq"],
        "params/layers/b": SHARDINGS["params"]["layers"]["b"],
        "tokens": SHARDINGS["tokens"],
    }
    flat = {r.path: leaf for r, leaf in zip(table.rows, _flat(), strict=True)}
    for path, r in rows.items():
        sds = flat[path]
        sharding = expected.get(path, SHARDINGS["opt_state"])
        assert r.shape == sds.shape and r.bytes == _bytes(sds)
        local = sharding.shard_shape(sds.shape)
        assert r.shard_shape == local
        assert r.bytes_per_device == math.prod(local) * np.dtype(sds.dtype).itemsize
    assert rows["params/layers/wq"].sharding == "P('fsdp', 'model')"
    assert rows["params/layers/wq"].bytes_per_device == 64 * 32 * 2 // 8
    assert rows["params/embed"].shard_shape == (1000, 16)
    assert rows["opt_state/1"].sharding == "replicated"
    assert rows["tokens"].dtype == "i32" and rows["tokens"].shard_shape == (2, 128)


def _flat() -> list[Any]:
    return [leaf for _, tree in _arguments() for leaf in jax.tree.leaves(tree)]


def test_totals_are_the_sums_of_their_leaves() -> None:
    table = arg_table.build(_arguments(), SHARDINGS, mesh={"fsdp": 4, "model": 2})
    for t in table.subtrees:
        members = [r for r in table.rows if r.path.split("/")[0] == t.name]
        assert t.leaves == len(members)
        assert t.bytes == sum(r.bytes for r in members if r.bytes is not None)
        assert t.bytes_per_device == sum(r.bytes_per_device or 0 for r in members)
        assert t.elements == sum(r.elements or 0 for r in members)
    assert [t.name for t in table.subtrees] == ["params", "opt_state", "tokens"]
    assert table.total.bytes == sum(_bytes(s) for s in _flat())
    assert table.total.bytes == sum(t.bytes for t in table.subtrees)
    opt = table.subtrees[1]
    assert [c.name for c in opt.children] == ["opt_state/0", "opt_state/1"]
    assert opt.children[0].bytes == 2 * table.subtrees[0].bytes


def test_the_summary_line() -> None:
    table = arg_table.build(_arguments(), SHARDINGS, mesh={"fsdp": 4, "model": 2})
    # params: 64000 + 2048 + 32 elements, 256000 + 4096 + 128 bytes; per device 64000 + 512 + 128.
    assert table.summary == (
        "params 66.1 K (254.1 KiB), opt_state 508.3 KiB, tokens 4.0 KiB; total 766.4 KiB, "
        "per device 572.4 KiB over fsdp=4 x model=2"
    )
    assert (
        table.total.bytes_per_device == (64000 + 512 + 128) + 2 * (256000 + 4096 + 128) + 4 + 1024
    )


def test_without_a_mesh_a_device_holds_everything() -> None:
    table = arg_table.build(_arguments())
    assert all(r.bytes_per_device == r.bytes and r.sharding is None for r in table.rows)
    assert table.summary == (
        "params 66.1 K (254.1 KiB), opt_state 508.3 KiB, tokens 4.0 KiB; total 766.4 KiB"
    )


def test_a_lone_argument_is_summarised_by_its_parts() -> None:
    state = {"params": _params(), "step": S((), jnp.int32)}
    table = arg_table.build([("state", state)])
    assert table.summary == "state/params 66.1 K (254.1 KiB), state/step 4 B; total 254.1 KiB"


def test_symbolic_dimensions_have_no_size() -> None:
    tokens = S(jax.export.symbolic_shape("b, 128"), jnp.int32)
    table = arg_table.build([("params", _params()), ("tokens", tokens), ("lr", 0.5)])
    rows = {r.path: r for r in table.rows}
    assert rows["tokens"].bytes is None and rows["tokens"].bytes_per_device is None
    assert rows["lr"].dtype == "f32 (weak)" and rows["lr"].bytes == 4
    assert table.total.symbolic == 1
    assert table.summary == (
        "params 66.1 K (254.1 KiB), tokens symbolic, lr 4 B; total 254.1 KiB + symbolic"
    )
    assert json.loads(json.dumps(table.to_json()))["arguments"][3]["shape"] == ["b", 128]
    lines = arg_table.to_text(table).splitlines()
    assert [ln.split()[:5] for ln in lines if ln.startswith("tokens")] == [
        ["tokens", "[b,128]", "i32", "-", "symbolic"]
    ]
    assert lines[-2].startswith("= total")
    assert lines[-2].endswith("254.1 KiB + symbolic  254.1 KiB + symbolic")


def test_the_resolved_input_sharding_wins_over_a_leafs_own() -> None:
    typed = S((8, 128), jnp.float32, sharding=_named("fsdp", "model"))
    resolved = arg_table.build([("x", typed)], {"x": _named()}, mesh={"fsdp": 4, "model": 2})
    assert resolved.rows[0].sharding == "replicated" and resolved.rows[0].shard_shape == (8, 128)
    own = arg_table.build([("x", typed)])  # no mesh: jax.jit takes the leaf's own
    assert own.rows[0].shard_shape == (2, 64) and own.rows[0].bytes_per_device == 2 * 64 * 4


def test_with_a_mesh_but_no_shardings_per_device_is_unknown_not_whole() -> None:
    note = "lower.in_shardings not resolved at stage_out: boom"
    table = arg_table.build(_arguments(), mesh={"fsdp": 4, "model": 2}, shardings_note=note)
    assert all(r.bytes_per_device is None and r.shard_shape is None for r in table.rows)
    assert (
        table.total.bytes_per_device is None
        and table.total.bytes == 3 * (256000 + 4096 + 128) + 4 + 4096
    )
    assert table.summary.endswith(f"total 766.4 KiB, per device not known before lower ({note})")
    assert json.loads(json.dumps(table.to_json()))["total"]["bytes_per_device"] is None
    lines = arg_table.to_text(table).splitlines()
    total = next(ln for ln in lines if ln.startswith("= total"))
    assert total.endswith("766.4 KiB  -") and lines[-2] == f"shardings: {note}"


def test_many_arguments_are_summarised_with_the_rest_counted() -> None:
    args = [(f"a{i}", S((256,), jnp.float32)) for i in range(9)]
    table = arg_table.build(args)
    assert table.summary == (
        "a0 1.0 KiB, a1 1.0 KiB, a2 1.0 KiB, a3 1.0 KiB, a4 1.0 KiB, a5 1.0 KiB, "
        "3 more 3.0 KiB; total 9.0 KiB"
    )


def test_human_numbers() -> None:
    assert [arg_table.human_number(n) for n in (42, 12_000, 350_200_000, 7_504_924_672)] == [
        "42",
        "12.0 K",
        "350.2 M",
        "7.5 B",
    ]


# --- the stage_out artifact, against what the compiled executable takes -------------------------


def test_arguments_json_matches_the_compiled_input_shardings(compose_run: Any) -> None:
    result = compose_run(
        "program=mlp",
        "mesh=data2_model4",
        "lower.in_shardings=[[{w: [null, model]}, {w: [model, null]}, {w: [null, model]}], [data, null]]",
        "stop_after=compile",
    )
    out = result.run_dir / "stage_out"
    doc = json.loads((out / "arguments.json").read_text())
    assert doc["format_version"] == 1 and doc["mesh"] == {"data": 2, "model": 4}
    compiled = result["compile"].compiled
    shardings = jax.tree.leaves(compiled.input_shardings)
    avals = jax.tree.leaves(compiled.args_info)
    assert len(doc["arguments"]) == len(shardings) == len(avals) == 7
    for row, sharding, info in zip(doc["arguments"], shardings, avals, strict=True):
        shape = tuple(info.shape)
        assert row["shape"] == list(shape)
        assert row["shard_shape"] == list(sharding.shard_shape(shape))
        assert row["bytes_per_device"] == math.prod(sharding.shard_shape(shape)) * 4
    rows = {r["path"]: r for r in doc["arguments"]}
    assert rows["params/0/w"]["sharding"] == "P(None, 'model')"
    assert rows["params/0/b"]["sharding"] == "replicated"
    assert rows["x"]["shard_shape"] == [32, 256]
    assert doc["total"]["bytes"] == sum(r["bytes"] for r in doc["arguments"])
    text = (out / "arguments.txt").read_text()
    assert text.splitlines()[-1] == f"summary: {doc['summary']}"
    assert doc["summary"].endswith("over data=2 x model=4")
    assert "stage_out/arguments.json" in result.manifest["stages"]["stage_out"]["artifacts"]


def test_a_resumed_run_keeps_the_table_and_says_it_again(
    compose_run: Any, caplog: pytest.LogCaptureFixture
) -> None:
    config = ("program=mlp", "mesh=data4_model2", "lower.in_shardings=[null, [data, null]]")
    first = compose_run(*config, "stop_after=lower")
    table = (first.run_dir / "stage_out" / "arguments.json").read_bytes()
    caplog.set_level("INFO", logger="jaxaot")
    second = compose_run(*config, f"resume_from={first.run_dir}", "start_at=compile")
    assert second.manifest["stages"]["stage_out"]["status"] == "resumed"
    assert (second.run_dir / "stage_out" / "arguments.json").read_bytes() == table
    summary = json.loads(table)["summary"]
    assert summary.endswith("per device 1.8 MiB over data=4 x model=2")
    assert f"[stage_out] arguments: {summary}" in caplog.messages


def test_stage_outs_artifacts_name_the_tables_files(compose_run: Any) -> None:
    from jaxaot.stages import NODE_BY_NAME

    result = compose_run("program=mlp", "stop_after=stage_out")
    written = set(result.manifest["stages"]["stage_out"]["artifacts"])
    assert written == {f"stage_out/{n}" for n in NODE_BY_NAME["stage_out"].artifacts}
    assert {"stage_out/arguments.json", "stage_out/arguments.txt"} <= written


def test_no_mesh_run_writes_the_table(compose_run: Any) -> None:
    result = compose_run("program=transformer_train", "stop_after=stage_out")
    doc = json.loads((result.run_dir / "stage_out" / "arguments.json").read_text())
    assert doc["mesh"] is None
    assert [t["name"] for t in doc["subtrees"]] == ["params", "tokens", "targets", "lr"]
    assert all(r["bytes_per_device"] == r["bytes"] for r in doc["arguments"])
    # embed 256*128, 2 layers of 4*128*128 + 2*128*512 + 2*128, ln_f 128, unembed 128*256.
    params = 256 * 128 + 2 * (4 * 128 * 128 + 2 * 128 * 512 + 2 * 128) + 128 + 128 * 256
    assert sum(r["elements"] for r in doc["arguments"][:-3]) == params == 459_392
    assert doc["summary"] == (
        "params 459.4 K (1.8 MiB), tokens 1.0 KiB, targets 1.0 KiB, lr 4 B; total 1.8 MiB"
    )


# --- sweep progress lines and reports ---------------------------------------------------------------

TREE = (
    "["
    + ", ".join(f"{{_init_: pkg.model:init, _args_: [{{_key_: {i}}}]}}" for i in range(80))
    + "]"
)


def test_a_long_override_is_shortened_with_its_size_and_hash() -> None:
    assert len(TREE) > 3000
    shown = short_value(TREE)
    assert shown.startswith("[{_init_: pkg.model:init") and shown.endswith(">")
    assert "<80 items, " in shown and len(shown) < 80
    other = short_value(TREE.replace("_key_: 7}", "_key_: 8}"))
    assert other != shown  # two trees never read alike
    assert short_value("f32[8,256]") == "f32[8,256]"
    assert short_value("{a: 1}" * 20).count("keys") == 0  # not one mapping: no count
    line = progress_line(3, 4, [f"program.args={TREE}", "mesh.shape=[4,2]"], "failed", None, "x")
    assert len(line) < 140 and line.endswith("shape=[4,2] | failed | x")


def test_the_report_shortens_overrides_and_the_csv_keeps_them(tmp_path: Path) -> None:
    for num, tree in enumerate((TREE, TREE.replace("_key_: 0}", "_key_: 9}"))):
        d = tmp_path / str(num)
        (d / ".hydra").mkdir(parents=True)
        overrides = [f"program.args={tree}", "stop_after=lower"]
        (d / ".hydra" / "overrides.yaml").write_text("".join(f"- '{o}'\n" for o in overrides))
        write_job_record(d, {"num": num, "overrides": overrides, "status": "ok", "code": 0})
    table = report.collect(tmp_path)
    assert table.varying == ["program.args"]
    md = report.to_markdown(table)
    assert TREE not in md and max(len(line) for line in md.splitlines()) < 400
    assert short_value(TREE) in md
    assert TREE in report.to_csv(table)


def test_path_pattern_shardings_and_the_rule_that_gave_each(tmp_path: Path) -> None:
    cfg = jaxaot.compose(["program=mlp", "mesh=data4_model2", "stop_after=compile"])
    # Keys with '/' and '*' are no Hydra override keys: set on the composed config.
    cfg.lower.in_shardings = {"params/*/w": [None, "model"], "x": ["data", None]}
    result = jaxaot.run(cfg, run_dir=tmp_path / "run")
    doc = json.loads((result.run_dir / "stage_out" / "arguments.json").read_text())
    compiled = jax.tree.leaves(result["compile"].compiled.input_shardings)
    for row, sharding in zip(doc["arguments"], compiled, strict=True):
        assert row["shard_shape"] == list(sharding.shard_shape(tuple(row["shape"])))
    rows = {r["path"]: r for r in doc["arguments"]}
    assert rows["params/1/w"]["by"] == "'params/*/w'" and rows["params/1/w"]["shard_shape"] == [
        512,
        256,
    ]
    assert rows["params/1/b"]["sharding"] == "replicated" and "no rule" in rows["params/1/b"]["by"]


def test_overrides_joined_by_spaces_split_outside_quotes_and_brackets() -> None:
    line = "a=1 b='x y' c=[{k: 1}, {k: 2}] +d.e={f: [1, 2]}"
    assert split_overrides(line) == ["a=1", "b='x y'", "c=[{k: 1}, {k: 2}]", "+d.e={f: [1, 2]}"]


def test_the_launchers_job_line_is_shortened(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger(LAUNCHER_LOGGERS[0])
    try:
        shorten_launcher_lines()
        shorten_launcher_lines()  # installed once
        assert sum(isinstance(f, ShortOverrides) for f in logger.filters) == 1
        with caplog.at_level(logging.INFO, logger=logger.name):
            logger.info(f"\t#3 : program=mlp program.args={TREE} mesh.shape=[4,2]")
            logger.info("\t#4 : program=mlp")
        shown = [r.getMessage() for r in caplog.records if r.name == logger.name]
        assert shown == [
            f"\t#3 : program=mlp program.args={short_value(TREE)} mesh.shape=[4,2]",
            "\t#4 : program=mlp",
        ]
    finally:
        for f in [f for f in logger.filters if isinstance(f, ShortOverrides)]:
            logger.removeFilter(f)


def test_derived_arguments_with_path_patterns_match_the_executable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # derived_programs
    params = "{_init_: 'derived_programs:init', _args_: [{_key_: 0}], din: 8, dout: 8}"
    opt = (
        "{_init_: {_call_: 'derived_programs:Momentum', learning_rate: 0.1}, _method_: init, "
        "_args_: [{_ref_: 'program.args[0]'}]}"
    )
    cfg = jaxaot.compose(
        [
            "program.target=derived_programs:train_step",
            f"program.args=[{params}, {opt}, {{shape: [8, 8], init: arange}}]",
            "mesh=data4_model2",
            "stop_after=compile",
        ]
    )
    cfg.lower.in_shardings = {"**/w": [None, "model"], "x": ["data", None]}
    result = jaxaot.run(cfg, run_dir=tmp_path / "run")
    doc = json.loads((result.run_dir / "stage_out" / "arguments.json").read_text())
    compiled = jax.tree.leaves(result["compile"].compiled.input_shardings)
    assert [r["path"] for r in doc["arguments"]] == [
        "params/b",
        "params/w",
        "opt_state/count",
        "opt_state/mu/b",
        "opt_state/mu/w",
        "x",
    ]
    for row, sharding in zip(doc["arguments"], compiled, strict=True):
        assert row["shard_shape"] == list(sharding.shard_shape(tuple(row["shape"])))
    rows = {r["path"]: r for r in doc["arguments"]}
    assert rows["opt_state/mu/w"]["shard_shape"] == [8, 4]
    assert rows["opt_state/mu/w"]["by"] == "'**/w'"
    assert [t["name"] for t in doc["subtrees"]] == ["params", "opt_state", "x"]
    assert doc["summary"].startswith("params 72 (288 B), opt_state 292 B, x 256 B; total 836 B")


def test_a_per_replica_program_is_split_over_its_replicas(compose_run: Any) -> None:
    result = compose_run("program=collectives", "stop_after=compile")
    doc = json.loads((result.run_dir / "stage_out" / "arguments.json").read_text())
    (row,) = doc["arguments"]  # x: one f32 per replica, stacked over the 4 x 2 replicas
    assert (row["shape"], row["shard_shape"], row["bytes_per_device"]) == ([8], [1], 4)
    (sharding,) = jax.tree.leaves(result["compile"].compiled.input_shardings)
    assert tuple(row["shard_shape"]) == sharding.shard_shape((8,))
    assert doc["summary"] == "x 32 B; per device 4 B over i=4 x j=2"
