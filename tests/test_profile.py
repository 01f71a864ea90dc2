"""``execute.profile=true``: a jax.profiler trace of the timed calls that
XProf and Perfetto read, and per-op time of the executable from it."""

from __future__ import annotations

import csv
import gzip
import io
import json
import re
from pathlib import Path

import jaxaot
import numpy as np
import pytest
from jaxaot.engine.summary import render
from jaxaot.stages.profile import _self_times


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> jaxaot.RunResult:
    out = tmp_path_factory.mktemp("prof") / "run"
    cfg = jaxaot.compose(["program=transformer", "execute.profile=true", "store.enabled=false"])
    return jaxaot.run(cfg, run_dir=out)


def test_the_trace_is_written_listed_and_read_by_xprof_and_perfetto(
    profiled: jaxaot.RunResult,
) -> None:
    stage = profiled.manifest["stages"]["execute"]
    folder = profiled.run_dir / "execute" / "profile"
    on_disk = {
        str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()
    }
    assert stage["profile"]["files"] == on_disk and stage["profile"]["dir"] == "execute/profile"
    (xplane,) = folder.glob("plugins/profile/*/*.xplane.pb")  # where XProf looks for a session
    from xprof.convert import raw_to_tool_data

    tools = raw_to_tool_data.xspace_to_tool_names([str(xplane)])
    assert "trace_viewer" in " ".join(tools), tools
    (perfetto,) = folder.glob("plugins/profile/*/perfetto_trace.json.gz")
    events = json.loads(gzip.decompress(perfetto.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert any(e.get("name") for e in events)
    summary = render(profiled.manifest)
    assert f"profile: xprof server --logdir {folder}" in summary
    assert "ui.perfetto.dev" in summary


def test_per_op_time_names_the_executables_ops(profiled: jaxaot.RunResult) -> None:
    doc = json.loads((profiled.run_dir / "execute" / "profile.json").read_text())
    hlo = (profiled.run_dir / "compile" / "optimized.hlo.txt").read_text()
    instructions = set(re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = ", hlo, re.M))
    assert doc["module"] == re.search(r"^HloModule ([^\s,]+)", hlo, re.M).group(1)
    assert doc["ops"] and doc["n_ops"] >= len(doc["ops"])
    assert {o["op"] for o in doc["ops"]} <= instructions
    assert any("fusion" in o["op"] for o in doc["ops"])
    calls = profiled.manifest["stages"]["execute"]["metrics"]
    repeats = profiled.manifest["config"]["execute"]["repeats"]
    assert doc["calls"] == repeats
    assert all(o["count"] % repeats == 0 for o in doc["ops"])  # every call ran every op
    shares = [o["share"] for o in doc["ops"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
    assert all(0 <= o["self_s"] <= o["total_s"] for o in doc["ops"])
    assert calls["profile_top_op"] == doc["ops"][0]["op"]
    assert calls["profile_ops"] == doc["n_ops"]


def test_no_trace_without_the_option(tmp_path: Path) -> None:
    result = jaxaot.run(jaxaot.compose(["program=axpy"]), run_dir=tmp_path / "r")
    assert not (tmp_path / "r" / "execute" / "profile").exists()
    assert "profile" not in result.manifest["stages"]["execute"]
    assert "profile:" not in render(result.manifest)


def test_self_time_subtracts_the_ops_an_op_encloses() -> None:
    # a while (0-100) enclosing two fusions (10-40, 50-60), then a copy (100-110)
    events = [(0, 100, "while"), (10, 40, "fusion.1"), (50, 60, "fusion.2"), (100, 110, "copy")]
    got = {op: (inc, own) for op, inc, own in _self_times(events)}
    assert got == {"while": (100, 60), "fusion.1": (30, 30), "fusion.2": (10, 10), "copy": (10, 10)}


def test_the_sweep_report_shows_the_top_op(tmp_path: Path) -> None:
    from jaxaot.sweeps.report import collect, to_csv, to_markdown

    sweep = tmp_path / "multirun"
    for i, extra in enumerate((["execute.profile=true"], [])):
        cfg = jaxaot.compose(["program=mlp", *extra])
        jaxaot.run(cfg, run_dir=sweep / str(i))
    table = collect(sweep)
    assert table.profiled
    csv_head = to_csv(table).splitlines()[0]
    assert "execute.profile_top_op" in csv_head.split(",")
    md = to_markdown(table)
    assert "top op (share of op time)" in md
    assert re.search(r"\| \S+ \(\d+%\) \|", md)


def test_compile_breakdown_says_where_the_compile_time_goes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """compile.breakdown=true: XLA's phases and hot spots from a trace of the
    compile, in compile_trace/breakdown.json and the manifest, the summary, the sweep report and jaxaot-diff; not in the key."""
    from jaxaot.cli.diff_cmd import main as diff_main

    plain = jaxaot.run(jaxaot.compose(["program=mlp"]), run_dir=tmp_path / "plain")
    traced = jaxaot.run(
        jaxaot.compose(["program=mlp", "compile.breakdown=true", "store.enabled=false"]),
        run_dir=tmp_path / "traced",
    )
    stage = traced.manifest["stages"]["compile"]
    assert stage["status"] == "ran" and stage["key"] == plain.manifest["stages"]["compile"]["key"]
    trace = tmp_path / "traced" / "compile" / "compile_trace"
    breakdown = json.loads((trace / "breakdown.json").read_text())
    assert breakdown == stage["compile_trace"]["breakdown"]
    # not in compiled.json: a stored artifact, which a store hit would hand to another run
    compiled = json.loads((tmp_path / "traced" / "compile" / "compiled.json").read_text())
    assert "breakdown" not in compiled
    assert breakdown["threads_s"] > 0
    roots = [p for p in breakdown["phases"] if p["depth"] == 0]
    assert any("Compile" in p["name"] for p in roots)  # the compiler's own outermost event
    hot = [h["self_s"] for h in breakdown["hot"]]
    assert hot == sorted(hot, reverse=True) and hot[0] > 0
    assert stage["metrics"]["breakdown_top"] == breakdown["hot"][0]["name"]
    assert "compile threads" in render(traced.manifest)
    assert (tmp_path / "traced" / "compile" / "compile_trace").is_dir()

    # A store hit asked for a breakdown compiles again only for it, and says so.
    hit = jaxaot.run(
        jaxaot.compose(["program=mlp", "compile.breakdown=true"]), run_dir=tmp_path / "hit"
    )
    stage = hit.manifest["stages"]["compile"]
    assert stage["status"] == "cached"
    assert "compiled again only for its breakdown" in stage["compile_trace"]["note"]
    assert stage["compile_trace"]["breakdown"]["hot"]

    # jaxaot-diff shows the change between two traced compiles, as text and JSON.
    capsys.readouterr()  # what the runs printed
    diff_main([str(tmp_path / "traced"), str(tmp_path / "hit"), "--json"])
    report = json.loads(capsys.readouterr().out)
    rows = report["stages"]["compile"]["breakdown"]["hot"]
    assert rows and all(r["delta"] == (r["b"] or 0) - (r["a"] or 0) for r in rows)
    diff_main([str(tmp_path / "traced"), str(tmp_path / "hit")])
    text = capsys.readouterr().out
    assert "compile threads" in text


def test_the_sweep_report_has_the_compile_breakdown(tmp_path: Path) -> None:
    from jaxaot.sweeps.report import collect, to_csv

    sweep = tmp_path / "multirun"
    jaxaot.run(
        jaxaot.compose(["program=axpy", "compile.breakdown=true", "store.enabled=false"]),
        run_dir=sweep / "0",
    )
    table = collect(sweep)
    cols = next(csv.DictReader(io.StringIO(to_csv(table))))
    assert float(cols["compile.breakdown_threads_s"]) > 0 and cols["compile.breakdown_top"]


def test_a_dump_and_a_breakdown_together(tmp_path: Path) -> None:
    """Both of one compile: the dump is written (the breakdown's own way to make XLA compile
    again must not filter it away) and the breakdown is taken."""
    cfg = jaxaot.compose(
        ["program=mlp", "compile.dump=true", "compile.breakdown=true", "store.enabled=false"]
    )
    stage = jaxaot.run(cfg, run_dir=tmp_path / "r").manifest["stages"]["compile"]
    assert stage["xla_dump"]["files"] and stage["metrics"]["xla_dump_files"] > 0
    assert stage["compile_trace"]["breakdown"]["threads_s"] > 0
    assert any(n.endswith("after_optimizations.txt") for n in stage["xla_dump"]["files"])


def test_an_executable_compiled_for_a_breakdown_is_not_stored(tmp_path: Path) -> None:
    """A traced compile carries an extra (no-op) dump filter that the executable records: it is
    not stored, the next plain run compiles and stores its own, and all compute the same."""
    from jaxaot.stages.execute import load_outputs

    traced = jaxaot.run(
        jaxaot.compose(["program=mlp", "compile.breakdown=true"]), run_dir=tmp_path / "t"
    )
    assert traced.manifest["stages"]["compile"]["status"] == "ran"
    assert any("executable not stored" in w for w in traced.manifest["warnings"])
    plain = jaxaot.run(jaxaot.compose(["program=mlp"]), run_dir=tmp_path / "plain")
    assert plain.manifest["stages"]["compile"]["status"] == "ran"  # nothing stored to hit
    hit = jaxaot.run(jaxaot.compose(["program=mlp"]), run_dir=tmp_path / "hit")
    assert hit.manifest["stages"]["compile"]["status"] == "cached"
    fresh = jaxaot.run(
        jaxaot.compose(["program=mlp", "store.enabled=false"]), run_dir=tmp_path / "fresh"
    )
    runs = [load_outputs(tmp_path / r / "execute") for r in ("t", "hit", "fresh")]
    assert all(
        r.keys() == runs[0].keys() and all(np.array_equal(r[k], runs[0][k]) for k in r)
        for r in runs
    )
    assert fresh.manifest["stages"]["compile"]["status"] == "ran"
