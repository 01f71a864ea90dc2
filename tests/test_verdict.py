"""One fit verdict everywhere (stages/fit_verdict.py): at the boundary, for XLA's rounded
refusals, with a reserve, and for host memory; status, exit code, manifest, summary and report
agree on every job.

The boundary is set with ``compile.hbm_reserve``: the program's needs come from plain JAX's
memory analysis of the same compile, and the reserve makes available exactly that (fits) or
one byte less (does not). XLA's own refusal with equal rounded figures is real: an argument of
XLA's limit, which libtpu refuses as "(15.75G) exceeds available HBM (15.75G)".
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import jaxaot
import pytest
from conftest import cli_env, read_manifest, run_cli, run_numbered
from hypothesis import given
from hypothesis import strategies as st
from jaxaot.engine.summary import render
from jaxaot.errors import EXIT_DOES_NOT_FIT, ConfigError, DoesNotFit
from jaxaot.schema import validate
from jaxaot.stages import fit_verdict, memory_breakdown
from jaxaot.targets.tpu import GENERATIONS, GiB, resolve
from test_topology import head  # x[:8]: what it needs is its argument

V5E = resolve("v5e:2x2")
LIMIT = GENERATIONS["v5e"].hbm_usable_bytes  # XLA's limit per v5e device (15.75 GiB)
SMALL = "bf16[1024]"
# XLA's limit in bf16 elements: libtpu refuses it, printing the same rounded figure twice.
AT_LIMIT = f"bf16[{LIMIT // 2}]"


def _plain_needed(arg: str) -> dict[str, int]:
    """Plain JAX's memory analysis of ``head`` on one v5e:2x2 device."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding
    from jaxaot.stages.executable import memory_of
    from jaxaot.targets.tpu import quiet_libtpu

    with quiet_libtpu():
        topo = topologies.get_topology_desc(
            platform="tpu", topology_name="v5e:2x2", chip_config_name="default"
        )
    n = int(arg.split("[")[1].rstrip("]"))
    x = jax.ShapeDtypeStruct((n,), jnp.bfloat16, sharding=SingleDeviceSharding(topo.devices[0]))
    memory = memory_of(jax.jit(head).lower(x).compile())
    assert memory is not None
    return memory


# -- the verdict itself ----------------------------------------------------------------------


def test_needed_equal_to_available_fits_and_one_byte_more_does_not() -> None:
    memory = _plain_needed(SMALL)
    needed = fit_verdict.needed_bytes(memory)
    assert needed == (
        memory["argument_size_in_bytes"]
        + memory["output_size_in_bytes"]
        + memory["temp_size_in_bytes"]
        + memory["generated_code_size_in_bytes"]
        - memory["alias_size_in_bytes"]
    )
    exact = type("Compile", (), {"hbm_reserve": LIMIT - needed, "host_memory_bytes": None})()
    fit = fit_verdict.verdict(V5E, exact, memory=memory)
    assert fit["hbm_bytes_available"] == fit["hbm_bytes_needed"] == needed
    assert fit["fits"] is True and fit["headroom_bytes"] == 0
    over = type("Compile", (), {"hbm_reserve": LIMIT - needed + 1, "host_memory_bytes": None})()
    fit = fit_verdict.verdict(V5E, over, memory=memory)
    assert fit["fits"] is False and fit["headroom_bytes"] == -1
    assert fit["hbm_reserve_bytes"] == LIMIT - needed + 1


@pytest.mark.parametrize(
    ("text", "exceeded"),
    [
        (
            "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
            "temporaries (15.75G) exceeds available HBM (15.75G).",
            None,
        ),
        (
            "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran "
            "out of memory in memory space hbm. Used 15.75G of 15.75G hbm. Exceeded hbm capacity "
            "by 1.50M.",
            int(1.5 * 1024**2),
        ),
    ],
)
def test_a_rejection_with_equal_rounded_figures_never_fits(text: str, exceeded: int | None) -> None:
    refusal = fit_verdict.parse_rejection(RuntimeError(text))
    assert refusal is not None and refusal.needed == refusal.available == int(15.75 * GiB)
    assert refusal.exceeded_by == exceeded
    fit = fit_verdict.verdict(V5E, rejection=refusal)
    assert fit["fits"] is False and fit["hbm_fits"] is False and fit["source"] == "xla"
    # XLA's limit plus what it says it was exceeded by, else one byte over
    assert fit["hbm_bytes_needed"] == LIMIT + (exceeded or 1)
    assert fit["headroom_bytes"] < 0 and fit["xla"] == refusal.to_json()
    message = fit_verdict.message(fit)
    assert message.startswith("does not fit: needs ") and "of 15.75 GiB per device" in message
    need, have = message.split("needs ")[1].split(" per device")[0].split(" of ")
    assert float(need.split()[0]) > float(have.split()[0])  # printed, it still needs more


@given(
    st.integers(min_value=1, max_value=2**40),
    st.integers(min_value=-(2**30), max_value=2**30),
)
def test_printed_figures_compare_as_the_bytes_do(available: int, delta: int) -> None:
    needed = max(0, available + delta)
    for scale, _ in (fit_verdict.unit_of(available), (GiB, "GiB")):
        a, b = fit_verdict.figures(needed, available, scale)
        assert (float(a) > float(b)) == (needed > available)
        assert (float(a) == float(b)) == (needed == available)


def test_reserve_bytes_fraction_and_platform_defaults() -> None:
    cfg = type("Compile", (), {"hbm_reserve": 0.25, "host_memory_bytes": None})()
    assert fit_verdict.reserve_bytes(V5E, 0.25)[0] == round(LIMIT * 0.25)
    assert fit_verdict.verdict(V5E, cfg, memory={})["hbm_bytes_available"] == LIMIT - round(
        LIMIT * 0.25
    )
    assert fit_verdict.reserve_bytes(V5E, 1 << 30) == (1 << 30, "compile.hbm_reserve=1073741824")
    assert fit_verdict.reserve_bytes(V5E, None)[0] == 0  # TPU: XLA's limit is all there is
    h100 = resolve("h100x8")
    kept, why = fit_verdict.reserve_bytes(h100, None)
    gen = h100.generation
    assert kept == gen.hbm_bytes - gen.hbm_usable_bytes and "75%" in why  # JAX's GPU default
    assert fit_verdict.verdict(h100, memory={})["hbm_bytes_available"] == gen.hbm_usable_bytes
    # a fraction on a GPU is of the device's memory: 1 - XLA_PYTHON_CLIENT_MEM_FRACTION
    assert fit_verdict.reserve_bytes(h100, 0.1)[0] == round(gen.hbm_bytes * 0.1)


def test_host_memory_is_its_own_verdict() -> None:
    memory = {"host_temp_size_in_bytes": 3 * GiB, "host_argument_size_in_bytes": GiB}
    per_device = GENERATIONS["v5e"].host_memory_bytes // GENERATIONS["v5e"].chips_per_host
    fit = fit_verdict.verdict(V5E, memory=memory)
    assert fit["host_bytes_needed"] == 4 * GiB and fit["host_bytes_available"] == per_device
    assert fit["host_fits"] is True and fit["fits"] is True
    cfg = type("Compile", (), {"hbm_reserve": None, "host_memory_bytes": 4 * GiB - 1})()
    fit = fit_verdict.verdict(V5E, cfg, memory=memory)
    assert fit["hbm_fits"] is True and fit["host_fits"] is False and fit["fits"] is False
    assert fit_verdict.message(fit).startswith("does not fit in host memory: needs 4.0")
    memory["argument_size_in_bytes"] = 16 * GiB
    fit = fit_verdict.verdict(V5E, cfg, memory=memory)
    assert "per device, and " in fit_verdict.message(fit) and "of host memory" in (
        fit_verdict.message(fit)
    )


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["compile.hbm_reserve=1.5"], r"^compile.hbm_reserve: expected a fraction .* found 1.5$"),
        (["compile.hbm_reserve=-3"], r"^compile.hbm_reserve: expected a fraction .* found -3$"),
        (["compile.hbm_reserve=2GiBs"], r"^compile.hbm_reserve: .* found '2GiBs'$"),
        (
            ["compile.hbm_reserve=2"],
            r"^compile.hbm_reserve=2 keeps back 2 byte\(s\) per device, surely not what was "
            r"meant; .* Fix: compile.hbm_reserve=2GiB or compile.hbm_reserve=0.02 \(2%\)$",
        ),
        (["compile.hbm_reserve=4096"], r"^compile.hbm_reserve=4096 .* Fix: .*=4096GiB$"),
        (["compile.hbm_reserve=17000000000"], r"^compile.hbm_reserve=17000000000: keeps back"),
        (["compile.host_memory_bytes=0"], r"^compile.host_memory_bytes: expected .* found 0$"),
        (["compile.memory_top=0"], r"^compile.memory_top: expected .* int >= 1, found 0;"),
    ],
)
def test_bad_memory_keys_are_one_line_config_errors(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        validate(jaxaot.compose(["program=mlp", "compile.topology=v5e:2x2", *overrides]))


def test_reserve_and_host_memory_need_a_topology() -> None:
    for key in ("hbm_reserve=0.1", "host_memory_bytes=1000"):
        with pytest.raises(ConfigError, match=rf"^compile.{key.split('=')[0]}=.* needs compile"):
            validate(jaxaot.compose(["program=mlp", f"compile.{key}"]))


# -- everywhere: status, exit code, manifest, summary, report --------------------------------


def _rows(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "sweep.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.extra("tpu")
def test_status_exit_code_manifest_summary_and_report_agree_at_the_boundary(
    tmp_path: Path,
) -> None:
    """Six jobs: a small program with available == needed, one byte less, and the platform's
    own; the same with an argument of XLA's limit, refused by XLA with equal rounded figures."""
    needed = fit_verdict.needed_bytes(_plain_needed(SMALL))
    exact, short = LIMIT - needed, LIMIT - needed + 1
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            "program.target=tests.test_topology:head",
            f"program.args=[{SMALL}],[{AT_LIMIT}]",
            "compile.topology=v5e:2x2",
            f"compile.hbm_reserve={exact},{short},null",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=tmp_path,
        env=cli_env(JAXAOT_STORE_DIR=str(tmp_path / "store")),
    )
    assert "sweep: 6 jobs, 2 ok, 4 do not fit, 0 failed" in proc.stdout, proc.stderr[-3000:]
    rows = _rows(sweep_dir)
    md = (sweep_dir / "sweep.md").read_text()
    assert len(rows) == 6
    for row in rows:
        job = sweep_dir / row["dir"]
        manifest = read_manifest(job)
        record = json.loads((job / "job.json").read_text())
        metrics = manifest["stages"]["compile"]["metrics"]
        small = SMALL in row["program.args"]
        reserve = None if row["compile.hbm_reserve"] == "null" else int(row["compile.hbm_reserve"])
        fits = small and reserve in (exact, None)
        # one verdict: the manifest's, the stage's columns, the status and the exit code
        assert manifest["fit"]["fits"] is metrics["fits"] is fits, row
        assert manifest["status"] == record["status"] == row["status"]
        assert row["status"] == ("ok" if fits else "does_not_fit")
        # the compile stage's status too, whether the verdict came from XLA or from its
        # memory analysis (the executable then still comes from a compile or the store)
        stage = manifest["stages"]["compile"]
        assert stage["status"] == row["compile.status"]
        assert (stage["status"] == "does_not_fit") is not fits
        if not fits and small:
            assert stage["computed"] in ("ran", "cached")
        assert record["code"] == (0 if fits else EXIT_DOES_NOT_FIT)
        assert row["compile.fits"] == str(fits)
        summary = render(manifest)
        assert ("fits: " in summary) is fits and ("DOES NOT FIT: " in summary) is not fits
        if not fits:
            assert f"verdict: {manifest['error']}" in summary
            assert manifest["error"].startswith("does not fit: needs ")
        need, have = metrics["hbm_bytes_needed"], metrics["hbm_bytes_available"]
        assert (need <= have) is fits and metrics["headroom_bytes"] == have - need
        assert (
            metrics["hbm_reserve_bytes"] == (reserve or 0) == manifest["fit"]["hbm_reserve_bytes"]
        )
        if small:
            assert need == needed and manifest["fit"]["source"] == "memory_analysis"
            assert have == (needed if reserve == exact else needed - 1 if reserve else LIMIT)
        else:  # refused: XLA printed its limit twice, and the program still does not fit
            xla = manifest["fit"]["xla"]
            assert manifest["fit"]["source"] == "xla" and xla["needed"] == xla["available"]
            assert need == max(xla["needed"], have + 1) and need > have
            assert metrics["peak_top"].startswith(f"bf16[{LIMIT // 2}]")  # what is live
            # ... and memory_breakdown.json in the run's compile folder (never stored)
            breakdown = json.loads((job / "compile" / "memory_breakdown.json").read_text())
            assert "compile/memory_breakdown.json" in stage["artifacts"]
            assert breakdown["source"] == "xla_dump" and breakdown["peak_bytes"] is None
            assert breakdown["top"][0]["shape"] == AT_LIMIT
            assert breakdown["top"][0]["kind"] == "argument"
            assert breakdown["top"][0]["path"] == "args[0]"  # named by the lowering
            assert metrics["peak_top"] == memory_breakdown.top_text(breakdown)
            assert "executable.bin" not in str(stage["artifacts"])
        line = next(ln for ln in md.splitlines() if ln.startswith(f"| {row['job']} |"))
        assert (" | yes | " in line) is fits and (" | **no** | " in line) is not fits
    plain = next(
        r for r in rows if AT_LIMIT in r["program.args"] and r["compile.hbm_reserve"] == "null"
    )
    fit = read_manifest(sweep_dir / plain["dir"])["fit"]
    # the case: XLA's "15.75G of 15.75G" is one byte over what is available
    assert fit["hbm_bytes_available"] == LIMIT and fit["hbm_bytes_needed"] == LIMIT + 1
    # the store holds the small program's compile (the reserve is not keyed), nothing refused
    stored = list((tmp_path / "store").glob("v*/compile/*/*/memory_breakdown.json"))
    assert len(stored) == 1
    assert json.loads(stored[0].read_text())["source"] == "xla_dump"
    assert json.loads(stored[0].read_text())["peak_bytes"] is not None


def test_host_memory_verdict_of_an_offloading_program(tmp_path: Path) -> None:
    """program=offload_train offloads activations to pinned host memory: its host bytes are
    plain JAX's, and host memory one byte short is a verdict of its own."""
    first = run_numbered(tmp_path, "program=offload_train", "compile.topology=v5e:2x2")
    memory = json.loads((first.run_dir / "compile" / "memory_analysis.json").read_text())
    host = fit_verdict.host_needed_bytes(memory)
    assert host > 0 and host == memory["host_temp_size_in_bytes"] + memory.get(
        "host_argument_size_in_bytes", 0
    ) + memory.get("host_output_size_in_bytes", 0) - memory.get("host_alias_size_in_bytes", 0)
    m = first.manifest["stages"]["compile"]["metrics"]
    assert m["host_bytes_needed"] == host and m["host_fits"] is True and m["fits"] is True
    exact = run_numbered(
        tmp_path,
        "program=offload_train",
        "compile.topology=v5e:2x2",
        f"compile.host_memory_bytes={host}",
    )
    assert exact.ok and exact.manifest["fit"]["host_bytes_available"] == host
    with pytest.raises(
        DoesNotFit, match=r"^does not fit in host memory: needs .* \(v5e, v5e:2x2\)$"
    ):
        run_numbered(
            tmp_path,
            "program=offload_train",
            "compile.topology=v5e:2x2",
            f"compile.host_memory_bytes={host - 1}",
        )
    manifest = read_manifest(sorted(tmp_path.glob("run*"))[-1])
    assert manifest["status"] == "does_not_fit" and manifest["fit"]["host_fits"] is False
    assert manifest["fit"]["hbm_fits"] is True
    assert "host memory" in render(manifest) and "(DOES NOT FIT)" in render(manifest)
    assert "DOES NOT FIT in host memory (HBM fits: " in render(manifest)  # not "HBM: no"


def test_a_need_far_below_the_limit_reads_in_its_own_unit() -> None:
    assert fit_verdict.pair_text(9122611, 16911433728) == "8.7 MiB of 15.75 GiB"
    assert fit_verdict.pair_text(0, 48000000000) == "0 B of 44.70 GiB"
    assert fit_verdict.pair_text(16911433729, 16911433728) == "15.8 GiB of 15.75 GiB"
    assert fit_verdict.pair_text(1905152, 1000) == "1.8 MiB of 1000 B"  # far above a small one
    assert fit_verdict.pair_text(2814464, 169114) == "2.7 MiB of 165.15 KiB"


def test_a_store_hit_gives_this_runs_verdict_never_the_storing_runs(tmp_path: Path) -> None:
    """compile.hbm_reserve is no part of the store key: a run served the executable another run
    stored with a reserve gets its own verdict, and no stored file carries the other's."""
    reserved = run_numbered(
        tmp_path, "program=mlp", "compile.topology=v5e:2x2", "compile.hbm_reserve=0.5"
    )
    plain = run_numbered(tmp_path, "program=mlp", "compile.topology=v5e:2x2")
    assert plain.manifest["stages"]["compile"]["status"] == "cached"
    limit = GENERATIONS["v5e"].hbm_usable_bytes
    assert reserved.manifest["fit"]["hbm_bytes_available"] == limit // 2
    assert plain.manifest["fit"]["hbm_bytes_available"] == limit
    assert plain.manifest["stages"]["compile"]["metrics"]["hbm_bytes_available"] == limit
    for run in (reserved, plain):
        assert "fit" not in json.loads((run.run_dir / "compile" / "compiled.json").read_text())


def test_a_reserve_written_as_a_whole_float_is_bytes() -> None:
    """``compile.hbm_reserve=1e9`` (YAML reads a float) keeps back 10**9 bytes, as 1000000000."""
    target = resolve("v5e:2x2", 1)
    assert fit_verdict.reserve_bytes(target, 1e9)[0] == fit_verdict.reserve_bytes(target, 10**9)[0]
    validate(jaxaot.compose(["program=mlp", "compile.topology=v5e:2x2", "compile.hbm_reserve=1e9"]))
    with pytest.raises(ConfigError, match=r"^compile.hbm_reserve: expected a fraction"):
        validate(
            jaxaot.compose(["program=mlp", "compile.topology=v5e:2x2", "compile.hbm_reserve=1.5"])
        )


@pytest.mark.parametrize(("size", "expected"), [("2GiB", 2 << 30), ("1.5GB", 1_500_000_000)])
def test_a_reserve_may_be_a_size(size: str, expected: int) -> None:
    """``compile.hbm_reserve=2GiB``: a size with its unit, as the store's sizes are written."""
    target = resolve("v5e:2x2", 1)
    assert fit_verdict.reserve_bytes(target, size) == (expected, f"compile.hbm_reserve={size}")
    validate(
        jaxaot.compose(["program=mlp", "compile.topology=v5e:2x2", f"compile.hbm_reserve={size}"])
    )
    assert fit_verdict.reserve_bytes(target, 0) == (0, "compile.hbm_reserve=0")


def test_jaxaot_diff_says_when_the_verdict_changed(tmp_path: Path) -> None:
    """Two topology compiles of one program, the second with 99.99999% of the HBM held back:
    jaxaot-diff names the verdict on each side and the headroom that went away."""
    from jaxaot.snapshots.diff import diff_report, load_side
    from jaxaot.snapshots.diff import render as render_diff

    fits = run_numbered(tmp_path, "program=axpy", "compile.topology=v5e:2x2")
    with pytest.raises(DoesNotFit):
        run_numbered(
            tmp_path, "program=axpy", "compile.topology=v5e:2x2", "compile.hbm_reserve=0.9999999"
        )
    a, b = load_side(fits.run_dir), load_side(tmp_path / "run1")
    fit = diff_report(a, b)["stages"]["compile"]["fit"]
    assert (fit["a"], fit["b"], fit["changed"]) == (
        "fits (v5e:2x2)",
        "does not fit (v5e:2x2)",
        True,
    )
    assert fit["headroom_bytes"]["a"] == fits.manifest["fit"]["headroom_bytes"] > 0
    assert fit["headroom_bytes"]["b"] < 0
    text = render_diff(diff_report(a, b), a, b, lines=0, full=False)
    assert "verdict changed: fits (v5e:2x2) -> does not fit (v5e:2x2); headroom " in text
    same = render_diff(diff_report(a, a), a, a, lines=0, full=False)
    assert "verdict: fits (v5e:2x2); headroom " in same
