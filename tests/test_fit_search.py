"""Fit search: probes in processes of their own, crashes as rows, resume from
fit.json, progress bounds that hold, any number of axes and the Pareto front per topology.

The search logic is checked against brute force on fake probes (fast); the sweeper itself on
v5e/v6e 2x2 topology compiles of tiny programs (tests/fit_programs.py), marked slow: each probe
a fresh process of ~3 s where that process is what is tested (a crash, SIGTERM, a killed
search resumed), in the search's own process (``hydra.sweeper.isolate=false``) for the fronts.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jaxaot.errors import ConfigError
from jaxaot.sweeps import fit_search
from jaxaot.sweeps.fit_search import FitOptions, Search, bisect, fronts, initial_bound

HERE = Path(__file__).parent
SHAPE = "program.args.0=bf16[{n},1048576]"  # 2 MiB per n


@pytest.fixture(autouse=True)
def _on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))


# -- the search ----------------------------------------------------------------------------


def _search(
    boundary: int, crash: set[int], low: int, high: int, multiple: int, max_failures: int = 99
) -> tuple[Search, list[int], list[int]]:
    """A bisection against ``n <= boundary`` with no verdict at ``crash``; the values probed and
    each probe's bound (probes so far + at most remaining)."""
    opts = FitOptions(
        overrides=["x={n}"], low=low, high=high, multiple=multiple, max_failures=max_failures
    )
    search = Search(fixed=[])
    probed: list[int] = []
    bounds: list[int] = []

    def probe(n: int) -> bool | None:
        bounds.append(len(probed) + search.remaining)
        probed.append(n)
        verdict = None if n in crash else n <= boundary
        search.probes.append({"n": n, "fits": verdict, "status": "crashed"})
        return verdict

    bisect(opts, probe, search)
    return search, probed, bounds


@pytest.mark.parametrize(
    ("low", "high", "multiple"), [(1, 16, 1), (32, 512, 32), (1, 1000, 1), (4, 4, 4), (2, 6, 2)]
)
def test_bisection_takes_at_most_its_bound_and_finds_the_boundary(
    low: int, high: int, multiple: int
) -> None:
    values = list(range(low, high + 1, multiple))
    worst = 0
    for boundary in [low - multiple, *values]:
        search, probed, bounds = _search(boundary, set(), low, high, multiple)
        expected = boundary if boundary >= low else None
        assert search.largest_fit == expected
        assert search.smallest_misfit == (
            None if expected == high else (low if expected is None else expected + multiple)
        )
        assert len(set(probed)) == len(probed) and all(n % multiple == 0 for n in probed)
        # [k/≤B]: each probe's bound holds, never grows, and is exact at the last probe.
        assert all(b >= len(probed) for b in bounds)
        assert bounds == sorted(bounds, reverse=True)
        worst = max(worst, len(probed))
    assert worst == initial_bound(
        FitOptions(overrides=["x={n}"], low=low, high=high, multiple=multiple)
    )


@pytest.mark.parametrize(
    ("boundary", "crash"),
    [
        (7, {8}),  # right above the boundary
        (7, {16}),  # the top of the range (a crash on the largest shape)
        (7, {4, 12}),  # the first midpoints
        (7, {1}),  # the bottom: the next value up is tried
        (7, {7}),  # the boundary itself: n=6 fits, n=8 does not, n=7 unknown
        (0, {2}),
        (16, {9, 16}),
    ],
)
def test_a_value_without_a_verdict_is_searched_around(boundary: int, crash: set[int]) -> None:
    search, probed, _ = _search(boundary, crash, 1, 16, 1)
    values = range(1, 17)
    known_fit = max((n for n in values if n <= boundary and n not in crash), default=None)
    known_misfit = min((n for n in values if n > boundary and n not in crash), default=None)
    assert search.largest_fit == known_fit and search.error is None
    # the smallest misfit found is the first one above the largest fit with a verdict
    above = [n for n in values if n > (known_fit or 0) and n not in crash]
    assert search.smallest_misfit == (above[0] if above and above[0] == known_misfit else None)
    assert len(set(probed)) == len(probed)
    assert [p["n"] for p in search.probes if p["fits"] is None] == [n for n in probed if n in crash]
    assert (
        len(probed)
        <= initial_bound(FitOptions(overrides=["x={n}"], low=1, high=16)) + len(crash) + 1
    )


def test_max_failures_ends_the_search_and_says_so() -> None:
    search, probed, _ = _search(7, set(range(1, 17)), 1, 16, 1, max_failures=3)
    assert probed == [1, 2, 3]
    assert search.largest_fit is None and search.smallest_misfit is None
    assert (
        search.error == "3 probes without a verdict (n=1, n=2, n=3); hydra.sweeper.max_failures=3"
    )
    line = fit_search.summary_line(search.to_json(FitOptions(overrides=["x={n}"], low=1, high=16)))
    assert "stopped: 3 probes without a verdict" in line


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"^hydra.sweeper.max_failures: expected >= 1, found 0$"):
        FitOptions(overrides=["a={n}"], max_failures=0).check()
    with pytest.raises(ConfigError, match=r"^hydra.sweeper.timeout_s: expected seconds >= 0"):
        FitOptions(overrides=["a={n}"], timeout_s=-1).check()


def test_labels_read_as_written() -> None:
    search = Search(
        fixed=["compile.topology=v5e\\:2x2", "program.remat=full"],
        label=" ".join(
            fit_search.shown(o) for o in ["compile.topology=v5e\\:2x2", "program.remat=full"]
        ),
    )
    assert search.label == "compile.topology=v5e:2x2 program.remat=full"
    assert search.choice == "program.remat=full" and search.topology == "v5e:2x2"
    result = search.to_json(FitOptions(overrides=["x={n}"]))
    assert fit_search.summary_line(result).startswith(
        "fit search [compile.topology=v5e:2x2 program.remat=full]: "
    )


# -- the Pareto front ----------------------------------------------------------------------


def _result(topology: str, choice: str, n: int | None, est: float | None, need: int) -> dict:
    return {
        "topology": topology,
        "choice": choice,
        "largest_fit": n,
        "est_step_s_at_fit": est,
        "hbm_bytes_needed_at_fit": need,
    }


def _brute_front(points: list[dict[str, Any]]) -> set[str]:
    """The choices no other beats in every objective: largest n, estimated step per n (the
    step at the largest fit over that n), HBM needed."""

    def key(p: dict[str, Any]) -> tuple[float, float, float]:
        est = p["est_step_s"] / p["largest_fit"] if p["est_step_s"] is not None else float("inf")
        return (-p["largest_fit"], est, p["hbm_bytes_needed"])

    return {
        p["choice"]
        for p in points
        if not any(
            all(a <= b for a, b in zip(key(q), key(p), strict=True)) and key(q) != key(p)
            for q in points
        )
    }


def test_fronts_per_topology_against_brute_force() -> None:
    results = [
        # 1.0 s for 64: 15.6 ms per n; full does twice the work in 1.6 s (12.5 ms per n).
        _result("v5e:2x2", "remat=none", 64, 1.0, 15 << 30),  # dominated by full
        _result("v5e:2x2", "remat=full", 128, 1.6, 15 << 30),
        _result("v5e:2x2", "remat=dots", 64, 1.2, 15 << 30),  # dominated by none
        _result("v5e:2x2", "remat=offload", 64, 1.1, 12 << 30),  # the least HBM
        _result("v5e:2x2", "remat=broken", None, None, 0),  # nothing fits: not a point
        _result("v5e:2x2", "remat=minimal", 32, 0.3, 15 << 30),  # the least time per n
        _result("v6e:2x2", "remat=none", 256, None, 30 << 30),
        _result("v6e:2x2", "remat=full", 256, 5.0, 30 << 30),  # a figure beats none
    ]
    found = {f["topology"]: f for f in fronts(results)}
    assert set(found) == {"v5e:2x2", "v6e:2x2"}
    for f in found.values():
        on = {p["choice"] for p in f["points"] if p["on_front"]}
        assert on == _brute_front(f["points"])
        for p in f["points"]:
            per_n = p["est_step_s"] / p["largest_fit"] if p["est_step_s"] is not None else None
            assert p["est_s_per_n"] == per_n
    # remat=none has the shortest step of the three at 64 or more, but full's is shorter per n.
    assert {p["choice"] for p in found["v5e:2x2"]["points"] if p["on_front"]} == {
        "remat=full",
        "remat=offload",
        "remat=minimal",
    }
    assert [r["on_front"] for r in results] == [False, True, False, True, None, True, False, True]
    assert found["v5e:2x2"]["objectives"] == {
        "largest_fit": "max",
        "est_s_per_n": "min",
        "hbm_bytes_needed": "min",
    }
    lines = fit_search.front_lines(list(found.values()))
    assert lines[0] == (
        "fit search: Pareto front on v5e:2x2 (largest n, est. step per n, HBM needed at it): "
        "3 of 5 choices"
    )
    assert lines[1] == "  remat=full: n=128, 15.0 GiB, est. step 1.60 s, 12.50 ms per n"
    assert any(line.startswith("  dominated: remat=none: n=64") for line in lines)
    assert any(line.startswith("  dominated: remat=dots: n=64") for line in lines)


# -- progress ------------------------------------------------------------------------------


def test_a_bound_reads_as_one(tmp_path: Path) -> None:
    from jaxaot.sweeps.progress import AtMost, SweepPlan, progress_line

    SweepPlan(total=14, varying=("x",), bound=True).write(tmp_path)
    plan = SweepPlan.read(tmp_path)
    assert isinstance(plan.total, AtMost) and plan.total == 14
    line = progress_line(3, plan.total, ["x=1"], "ok", None, None)
    assert line.startswith("[3/≤14] x=1 | ok")
    assert json.loads((tmp_path / ".jaxaot" / "sweep.json").read_text())["total"] == 14
    SweepPlan(total=5, varying=()).write(tmp_path)
    assert progress_line(5, SweepPlan.read(tmp_path).total, [], "ok", None, None).startswith(
        "[5/5]"
    )


# -- plots ---------------------------------------------------------------------------------


def test_plot_values_sort_by_their_numbers_and_share_a_label() -> None:
    from jaxaot.sweeps.plots import _x_values, compact

    values = ["bf16[16384,1048576]", "bf16[1024,1048576]", "bf16[2048,1048576]"]
    xs = _x_values([{"p": v} for v in values], "p")
    assert xs == ["bf16[1024,1048576]", "bf16[2048,1048576]", "bf16[16384,1048576]"]
    assert compact(xs) == (["1024", "2048", "16384"], "bf16[·,1048576]")
    assert compact(["remat=none", "remat=full"]) == (["none", "full"], "remat=·")
    assert compact(["a", "b"]) == (["a", "b"], "")
    assert _x_values([{"p": v} for v in ("10", "9", "1e3")], "p") == ["9", "10", "1e3"]


def test_the_pareto_plot_shows_the_fronts_time_objective() -> None:
    """y is est_s_per_n (the front's objective), not the step at each choice's own n."""
    from jaxaot.sweeps.plots import _pareto_figure

    results = [
        _result("v5e:2x2", "remat=none", 64, 1.0, 15 << 30),
        _result("v5e:2x2", "remat=full", 128, 1.6, 15 << 30),
        _result("v5e:2x2", "remat=offload", 64, 1.1, 12 << 30),
    ]
    fig = _pareto_figure({"fronts": fronts(results)})
    assert fig is not None
    (ax,) = fig.axes
    assert ax.get_ylabel() == "estimated step per n (roofline)"
    front, dominated = ax.lines
    assert list(front.get_xdata()) == [64, 128]  # joined along n: offload, then full
    assert list(front.get_ydata()) == [1.1 / 64, 1.6 / 128]
    assert list(dominated.get_ydata()) == [1.0 / 64]


# -- one probe, one process ----------------------------------------------------------------


@pytest.fixture
def in_a_job(tmp_path: Path) -> Iterator[Any]:
    """Hydra's state as run_job leaves it for a task function (job folder: tmp_path); the
    task's config, {value: 3}. Hydra's global config is put back after."""
    from hydra.conf import HydraConf
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"hydra": OmegaConf.structured(HydraConf), "value": 3})
    cfg.hydra.job_logging = {"version": 1, "root": {"level": "WARNING"}}
    cfg.hydra.runtime.output_dir = str(tmp_path)
    saved = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(cfg)
    try:
        yield OmegaConf.create({"value": 3})
    finally:
        HydraConfig.instance().cfg = saved


def test_a_probe_that_crashes_is_an_outcome(tmp_path: Path, in_a_job: Any) -> None:
    import fit_programs
    from jaxaot.sweeps.probe_process import IsolatedTask
    from jaxaot.sweeps.progress import JobOutcome

    task_cfg = in_a_job

    out = IsolatedTask.of(fit_programs.segv_task)(task_cfg)
    assert out == JobOutcome(128 + signal.SIGSEGV, out.error)
    assert out.error.startswith("crashed: SIGSEGV before its first stage (Python's stacks: ")
    assert "fit_programs.py" in (tmp_path / "crash.txt").read_text()
    assert IsolatedTask.of(fit_programs.returning_task)(task_cfg) == 3
    with pytest.raises(ValueError, match=r"^no good: 3$"):
        IsolatedTask.of(fit_programs.raising_task)(task_cfg)
    assert not (tmp_path / "crash.txt").exists()  # no crash, no stacks file


def does_not_fit_task(cfg: Any) -> int:
    """A task function (not jaxaot's own) that raises DoesNotFit with a breakdown."""
    from jaxaot.errors import DoesNotFit

    exc = DoesNotFit(f"needs {cfg.value} GiB", {"fits": False}, {"hbm_bytes_needed": 3 << 30})
    exc.breakdown = {"peak_bytes": 3 << 30}
    raise exc


def test_a_probe_raises_does_not_fit_back_whole(in_a_job: Any) -> None:
    from jaxaot.errors import DoesNotFit
    from jaxaot.sweeps.probe_process import IsolatedTask

    with pytest.raises(DoesNotFit, match=r"^needs 3 GiB$") as err:
        IsolatedTask.of(does_not_fit_task)(in_a_job)
    assert err.value.fit == {"fits": False}
    assert err.value.metrics == {"hbm_bytes_needed": 3 << 30}
    assert err.value.breakdown == {"peak_bytes": 3 << 30}


def test_a_probe_past_its_time_is_killed(in_a_job: Any) -> None:
    import fit_programs
    from jaxaot.sweeps.probe_process import IsolatedTask

    task_cfg = in_a_job

    t0 = time.monotonic()
    out = IsolatedTask.of(fit_programs.sleeping_task, timeout_s=1.0)(task_cfg)
    assert time.monotonic() - t0 < 20
    assert out.code == 124 and out.error == "timed out after 1 s before its first stage"


def test_where_a_probe_stopped(tmp_path: Path) -> None:
    from jaxaot.sweeps.probe_process import where_it_stopped
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"start_at": "stage_out", "stop_after": "execute"})
    assert where_it_stopped(tmp_path, cfg) == "before its first stage"
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"stages": {}}))
    assert where_it_stopped(tmp_path, cfg) == "while tracing (stage_out)"
    manifest.write_text(json.dumps({"stages": {"stage_out": {}, "lower": {}}}))
    assert where_it_stopped(tmp_path, cfg) == "in the compiler"


def test_isolation_needs_a_task_function_importable_by_name() -> None:
    from jaxaot.sweeps.probe_process import IsolatedTask

    with pytest.raises(ConfigError, match=r"^hydra.sweeper.isolate=true: expected a task function"):
        IsolatedTask.of(lambda cfg: 0)


def test_a_fit_json_of_another_search_is_not_resumed(tmp_path: Path) -> None:
    from hydra_plugins.jaxaot_fit_sweeper.fit_sweeper import _Previous

    opts = FitOptions(overrides=[SHAPE])
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"overrides": [SHAPE], "searches": []}))
    with pytest.raises(ConfigError, match=r"fit.json is format 1, this jaxaot resumes format 2"):
        _Previous(path, opts)
    path.write_text(json.dumps({**opts.header(), "overrides": ["x={n}"], "searches": []}))
    with pytest.raises(ConfigError, match=r"a search of hydra.sweeper.overrides=\['x=\{n\}'\]"):
        _Previous(path, opts)


def test_a_resumed_search_takes_only_verdicts(tmp_path: Path) -> None:
    from hydra_plugins.jaxaot_fit_sweeper.fit_sweeper import _Previous

    opts = FitOptions(overrides=[SHAPE])
    statuses = ("fits", "does_not_fit", "crashed", "timed_out", "failed")
    probes = [
        {"n": n, "fits": {"fits": True, "does_not_fit": False}.get(st), "status": st, "job": n}
        for n, st in enumerate(statuses)
    ]
    search = {"fixed": ["a=1"], "probes": probes}
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({**opts.header(), "next_job": 9, "searches": [search]}))
    previous = _Previous(path, opts)
    assert [previous.get(["a=1"], n) for n in range(5)] == [*probes[:2], None, None, None]
    assert [previous.without_verdict(["a=1"], n) for n in range(5)] == [None, None, *probes[2:]]
    assert previous.get(["a=2"], 0) is None and previous.without_verdict(["a=2"], 2) is None
    assert (previous.count, previous.next_job) == (5, 9)  # every job done counts


def test_report_section_and_plots_from_fit_json(tmp_path: Path) -> None:
    from jaxaot.sweeps.plots import write_plots
    from jaxaot.sweeps.report import collect

    opts = FitOptions(overrides=["x={n}"], low=1, high=16)
    searches = []
    for choice, boundary in (("remat=none", 7), ("remat=full", 12)):
        search = Search(fixed=[choice], label=f"compile.topology=v5e:2x2 {choice}")

        def probe(n: int, search: Search = search, boundary: int = boundary) -> bool | None:
            fits = None if n == 16 else n <= boundary
            search.probes.append(
                {
                    "n": n,
                    "fits": fits,
                    "status": "crashed" if fits is None else "fits" if fits else "does_not_fit",
                    "error": "crashed: SIGSEGV in the compiler" if fits is None else None,
                    "hbm_bytes_needed": n << 30,
                    "hbm_bytes_available": 15 << 30,
                    "est_step_s": n / (1 if "none" in search.label else 2),
                    "topology": "v5e:2x2",
                }
            )
            return fits

        searches.append(bisect(opts, probe, search).to_json(opts))
    fit = {**opts.header(), "searches": searches, "fronts": fronts(searches)}
    (tmp_path / "fit.json").write_text(json.dumps(fit))
    lines = fit_search.report_section(tmp_path)
    assert lines[0] == "## Fit search"
    assert any("| remat=full | v5e:2x2 | 12 | 13 |" in line for line in lines)
    assert any("n=16 crashed: SIGSEGV in the compiler" in line for line in lines)
    paths = write_plots(collect(tmp_path), tmp_path / "plots")
    assert {p.name for p in paths} >= {"fit_search.png", "fit_pareto.png"}
    assert all(p.stat().st_size > 1000 for p in paths)


# -- the sweeper, end to end (each probe a process of its own) -----------------------------


def _fit_args(sweep: Path, target: str, low: int, high: int, multiple: int) -> list[str]:
    return [
        "-m",
        "hydra/sweeper=jaxaot_fit",
        f"program.target={target}",
        "program.args=[bf16[8,8]]",
        f"hydra.sweeper.overrides=['{SHAPE}']",
        f"hydra.sweeper.low={low}",
        f"hydra.sweeper.high={high}",
        f"hydra.sweeper.multiple={multiple}",
        f"hydra.sweep.dir={sweep}",
    ]


def _probes(sweep: Path) -> list[dict[str, Any]]:
    try:
        fit = json.loads((sweep / "fit.json").read_text())
    except (OSError, ValueError):
        return []
    return [p for s in fit["searches"] for p in s["probes"]]


def _progress(stdout: str) -> list[tuple[int, str]]:
    return [(int(k), b) for k, b in re.findall(r"^\[(\d+)/(≤?\d+)\] ", stdout, re.M)]


@pytest.mark.slow
@pytest.mark.extra("tpu")
def test_a_crash_is_a_row_and_a_killed_search_resumes(tmp_path: Path) -> None:
    from conftest import cli_env, run_cli
    from jaxaot.util.fsio import flock_file

    sweep = tmp_path / "fit"
    args = [
        *_fit_args(sweep, "tests.fit_programs:crash_from", 6144, 12288, 2048),
        "compile.topology=v5e:2x2",
        "hydra.callbacks.sweep.plots=false",  # the report's text is checked, not its plots
    ]
    env = cli_env()
    first = subprocess.Popen(
        [sys.executable, "-m", "jaxaot", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while first.poll() is None and time.monotonic() < deadline:
        if len([p for p in _probes(sweep) if p["status"] != "running"]) >= 2:
            break
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)  # the search and the probe it is running
    first.wait()
    # A served search outlives its killed client by the SIGTERM the server then sends it (and
    # its probe's grace time): what it left is read once it ended, when its lock is free.
    with flock_file(sweep / ".jaxaot" / "fit.lock"):
        before = {p["n"]: p for p in _probes(sweep)}
    assert len(before) >= 2
    assert before[6144]["status"] == "fits"
    assert before[12288]["status"] == "crashed"  # low, then high: the second probe
    # As when kills land after a probe's progress line numbered it and before fit.json
    # recorded it (a race the kill above can also win; two killed runs, two such jobs): finish
    # slots fit.json does not know of. The resumed lines go on after them, within their bound.
    finished = sweep / ".jaxaot" / "finished"
    last = max(int(p.name) for p in finished.iterdir())
    for orphan in (last + 1, last + 2):
        (finished / str(orphan)).touch()

    proc = run_cli(args, cwd=tmp_path, env=env)
    fit = json.loads((sweep / "fit.json").read_text())
    (search,) = fit["searches"]
    # 2 MiB per n: 6144 (12 GiB) fits in 15.75 GiB, 8192 (16 GiB) does not; n >= 12288 crashes.
    # Resumed: 6144 taken from fit.json, 12288 run again (crashes), then 8192 (below the crash).
    assert (search["largest_fit"], search["smallest_misfit"]) == (6144, 8192), proc.stderr[-2000:]
    crash = next(p for p in search["probes"] if p["n"] == 12288)
    assert crash["fits"] is None and crash["status"] == "crashed"
    assert crash["error"].startswith("crashed: SIGSEGV while tracing (stage_out)")
    assert search["no_verdict"] == [12288]
    # the first run's verdicts were taken; its probes without one ran again, as new jobs
    verdicts = {n for n, p in before.items() if p["fits"] is not None}
    assert fit["reused_probes"] == len(verdicts)
    later = [p for p in search["probes"] if p["n"] not in verdicts]
    assert all(p["job"] >= max(q["job"] for q in before.values()) + 1 for p in later)
    assert {n for n, p in before.items() if p["fits"] is None} <= {p["n"] for p in later}
    assert [p["n"] for p in later].count(12288) == 1
    rerun = "n=12288: fit.json records no verdict (crashed: SIGSEGV while tracing (stage_out)"
    assert rerun in proc.stdout + proc.stderr
    for p in later:
        record = json.loads((sweep / str(p["job"]) / "job.json").read_text())
        assert any(f"bf16[{p['n']},1048576]" in o for o in record["overrides"])
    job = json.loads((sweep / str(crash["job"]) / "job.json").read_text())
    assert job["code"] == 128 + signal.SIGSEGV and job["error"] == crash["error"]
    assert "n=6144 fits, n=8192 does not" in proc.stdout
    assert "no verdict: n=12288 crashed: SIGSEGV" in proc.stdout
    counts = _progress(proc.stdout)
    assert counts and counts[0][0] == last + 3
    assert all(k <= int(b.lstrip("≤")) for k, b in counts), proc.stdout
    assert counts[-1][0] >= len(search["probes"])  # finish slots count the first run's jobs too
    report = (sweep / "sweep.md").read_text()
    assert "crashed: SIGSEGV while tracing (stage_out)" in report


@pytest.mark.slow
@pytest.mark.extra("tpu")
def test_two_axes_give_a_front_per_topology(tmp_path: Path) -> None:
    from conftest import cli_env, run_cli

    sweep = tmp_path / "fit"
    # 1 MiB per n, n in {2048, 4096}: two probes a search. scale needs 2 MiB per n, twice 4.2:
    # all four fit at 2048; at 4096 twice (17.2 GiB) fits v6e's 31.25 GiB, not v5e's 15.75.
    args = _fit_args(sweep, "tests.fit_programs:scale,tests.fit_programs:twice", 2048, 4096, 2048)
    # The probes run in this process: their verdicts (exit codes) and figures (manifests) make
    # fit.json and the fronts as an isolated probe's do (those: the crash and SIGTERM tests).
    args[-1:-1] = ["compile.topology=v5e:2x2,v6e:2x2", "hydra.sweeper.isolate=false"]
    args = [a.replace("1048576", "524288") for a in args]
    proc = run_cli(args, cwd=tmp_path, env=cli_env())
    fit = json.loads((sweep / "fit.json").read_text())
    assert len(fit["searches"]) == 4, proc.stderr[-2000:]
    for s in fit["searches"]:
        # each boundary is what the probes say: the largest value that fits, the next does not
        fits = [p["n"] for p in s["probes"] if p["fits"]]
        misfits = [p["n"] for p in s["probes"] if p["fits"] is False]
        assert s["largest_fit"] == max(fits) and all(n > s["largest_fit"] for n in misfits)
        at = next(p for p in s["probes"] if p["n"] == s["largest_fit"])
        assert s["est_step_s_at_fit"] == at["est_step_s"] and at["est_step_s"] > 0
        assert s["hbm_bytes_needed_at_fit"] == at["hbm_bytes_needed"]
        assert "\\" not in s["label"] and s["topology"] in ("v5e:2x2", "v6e:2x2")
    assert any(p["fits"] is False for s in fit["searches"] for p in s["probes"])  # a boundary
    assert {f["topology"] for f in fit["fronts"]} == {"v5e:2x2", "v6e:2x2"}
    for f in fit["fronts"]:
        mine = [s for s in fit["searches"] if s["topology"] == f["topology"]]
        assert {p["choice"] for p in f["points"]} == {s["choice"] for s in mine}
        on = {p["choice"] for p in f["points"] if p["on_front"]}
        assert on == _brute_front(f["points"]) and on
        assert on == {s["choice"] for s in mine if s["on_front"]}
        assert f"Pareto front on {f['topology']}" in proc.stdout
    assert "fit search [program.target=tests.fit_programs:scale compile.topology=v5e:2x2]: " in (
        proc.stdout
    )
    assert "\\:" not in "".join(line for line in proc.stdout.splitlines() if "fit search" in line)
    counts = _progress(proc.stdout)
    assert [k for k, _ in counts] == list(range(1, len(counts) + 1))
    assert len(counts) == sum(s["compiles"] for s in fit["searches"])
    assert all(k <= int(b.lstrip("≤")) for k, b in counts)
    assert (sweep / "plots" / "fit_pareto.png").stat().st_size > 1000
    assert list(itertools.chain.from_iterable(s["no_verdict"] for s in fit["searches"])) == []


@pytest.mark.slow
@pytest.mark.extra("tpu")
def test_a_second_search_in_a_sweep_dir_waits_for_the_first(tmp_path: Path) -> None:
    """A search started while another holds its sweep dir (the command run twice, or a resume
    while a served search whose client was killed still winds down) says so, launches nothing
    until the first ends, then resumes from what it recorded."""
    import threading

    from conftest import cli_env, run_cli, start_cli
    from jaxaot.util.fsio import flock_file

    sweep = tmp_path / "fit"
    args = [
        *_fit_args(sweep, "tests.fit_programs:scale", 2048, 4096, 2048),
        "compile.topology=v5e:2x2",
        "hydra.sweeper.isolate=false",
    ]
    run_cli(args, cwd=tmp_path, env=cli_env())
    recorded = (sweep / "fit.json").read_text()
    lines: list[str] = []
    with flock_file(sweep / ".jaxaot" / "fit.lock"):  # as a running search holds it
        second = start_cli(args, cwd=tmp_path)
        assert second.stdout is not None
        reader = threading.Thread(target=lambda: lines.extend(second.stdout or ()), daemon=True)
        reader.start()
        deadline = time.monotonic() + 120
        while not any("waiting for it" in line for line in lines):
            assert second.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        time.sleep(0.5)
        assert (sweep / "fit.json").read_text() == recorded  # nothing taken or written yet
        assert len(lines) == 1
    _, err = second.communicate(timeout=300)
    reader.join(timeout=10)
    assert second.returncode == 0, err[-2000:]
    assert lines[0] == f"fit search: another search is running in {sweep}; waiting for it\n"
    fit = json.loads((sweep / "fit.json").read_text())
    (mine,), (first,) = fit["searches"], json.loads(recorded)["searches"]
    assert fit["reused_probes"] == 2 and mine["compiles"] == 0
    assert (mine["largest_fit"], mine["smallest_misfit"]) == (first["largest_fit"], 4096)


@pytest.mark.slow
@pytest.mark.extra("tpu")
@pytest.mark.parametrize("to", ["group", "search"])
def test_sigterm_ends_the_search_in_one_line_and_a_resume_supersedes_its_job(
    tmp_path: Path, to: str
) -> None:
    """SIGTERM to the process group (as ``timeout`` sends it) or to the search alone: one line,
    exit 143, the probe's process ended and its run recorded as interrupted. Run again (after
    the group's SIGTERM: either way the search leaves its slow job interrupted and recorded as
    running, asserted below, for the resume to start from), the search takes job 0's verdict,
    runs n=4096 again as job 2 and exits 0: the interrupted job 1 is superseded (out of
    sweep.md), and the summary counts 1 compile, 1 reused. The search alone is signalled in
    its first job (n=4096 only), which needs no job before it."""
    from conftest import cli_env, run_cli

    sweep, mark = tmp_path / "fit", tmp_path / "slow.pid"
    low, slow = (2048, 1) if to == "group" else (4096, 0)  # slow: the job signalled
    args = [
        *_fit_args(sweep, "tests.probe_signal_programs:slow_from", low, 4096, 2048),
        "compile.topology=v5e:2x2",
        "hydra.callbacks.sweep.plots=false",  # the report's text is checked, not its plots
    ]
    first = subprocess.Popen(
        [sys.executable, "-m", "jaxaot", *args],
        cwd=tmp_path,
        env=cli_env(JAXAOT_TEST_SLOW_FROM="4096", JAXAOT_TEST_SLOW_MARK=str(mark)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not mark.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # until n=4096 is in its minute of tracing
    probe_pid = int(mark.read_text())
    if to == "group":
        os.killpg(first.pid, signal.SIGTERM)
    else:
        os.kill(first.pid, signal.SIGTERM)
    _, stderr = first.communicate(timeout=60)
    assert first.returncode == 128 + signal.SIGTERM
    # One line of jaxaot's (libtpu may have logged its own start-up warnings before).
    ours = [line for line in stderr.splitlines() if line.startswith("jaxaot")]
    assert ours == ["jaxaot: terminated by SIGTERM"], stderr[-3000:]
    assert "Traceback" not in stderr and "Terminated" not in stderr, stderr[-3000:]
    for _ in range(50):  # the probe's process ended too
        try:
            os.kill(probe_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the probe's process {probe_pid} outlived the search")
    job = json.loads((sweep / str(slow) / "manifest.json").read_text())
    assert job["status"] == "interrupted", job
    assert job["error"] == "terminated by SIGTERM during stage 'stage_out'"
    running = [p for p in _probes(sweep) if p["status"] == "running"]
    assert [(p["n"], p["job"]) for p in running] == [(4096, slow)]
    if to == "search":
        return  # the resume below starts from the group's

    proc = run_cli(args, cwd=tmp_path, env=cli_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    fit = json.loads((sweep / "fit.json").read_text())
    (search,) = fit["searches"]
    assert (search["largest_fit"], search["compiles"], search["reused"]) == (4096, 1, 1)
    top = next(p for p in search["probes"] if p["n"] == 4096)
    assert (top["job"], top["supersedes"], top["status"]) == (2, 1, "fits")
    assert not (sweep / "1").exists()
    moved = sweep / ".jaxaot" / "superseded" / "1" / "manifest.json"  # kept, out of the report
    assert json.loads(moved.read_text())["status"] == "interrupted"
    assert "1 compile, 1 reused (a linear scan: 2)" in proc.stdout
    assert "sweep: 2 jobs, 2 ok, 0 failed" in proc.stdout
    assert "interrupted" not in (sweep / "sweep.md").read_text()
    csv_jobs = [line.split(",")[0] for line in (sweep / "sweep.csv").read_text().splitlines()]
    assert csv_jobs[1:] == ["0", "2"]


def test_the_summary_prints_the_boundarys_memory_as_the_verdict_does() -> None:
    """The limit reads 15.75 GiB, as in the verdict and the run summaries (not 15.8)."""
    search, _, _ = _search(7, set(), 1, 16, 1)
    result = search.to_json(FitOptions(overrides=["x={n}"], low=1, high=16))
    result["hbm_bytes_needed_at_fit"], result["hbm_bytes_available"] = 16231849574, 16911433728
    assert "15.1 GiB of 15.75 GiB per device at the boundary" in fit_search.summary_line(result)
