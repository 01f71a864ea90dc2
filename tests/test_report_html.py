"""The HTML report (``jaxaot-report --html``): a sweep's page and a run's, as headless Chromium
renders them (no console errors, no request, the expected tables and rows, sorting by a click,
images loaded, a screenshot that is not blank), and names that carry markup stay text."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import jaxaot
import pytest
from browser import Opened, browser, open_page
from jaxaot.cli.report_cmd import main as report_main
from jaxaot.snapshots.hlo_graph import graph_of_run
from jaxaot.sweeps import report
from jaxaot.sweeps.html_page import markdown_block
from jaxaot.sweeps.html_report import HTML_NAME, write_sweep_html
from jaxaot.sweeps.progress import SweepPlan, write_job_record

__all__ = ["browser"]  # the module's fixture, from tests/browser.py

ATTACK = "<script>window.pwned=1</script><img src=x onerror=window.pwned=2>"
pytestmark = pytest.mark.xdist_group("report_html")


def _stage(status: str, seconds: float, **metrics: Any) -> dict[str, Any]:
    return {"status": status, "seconds": seconds, "metrics": metrics, "artifacts": {}}


def _job(root: Path, num: int, overrides: list[str], status: str, **figures: Any) -> None:
    """A job folder as a sweep leaves it: the overrides, a manifest, the job record."""
    d = root / str(num)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {json.dumps(o)}\n" for o in overrides))
    stages = {"stage_out": _stage("ran", 0.01), "lower": _stage("ran", 0.02)}
    error = figures.pop("error", None)
    if status == "failed":
        stages["compile"] = _stage("failed", 0.5)
    else:
        stages["compile"] = _stage(
            "ran",
            0.1 + num / 100,
            flops=1e6 * (num + 1),
            bytes_accessed=4e5,
            argument_bytes=1000 * (num + 1),
            output_bytes=100,
            temp_bytes=400 * (num + 1),
            code_bytes=0,
        )
        stages["execute"] = _stage("ran", 0.04, stddev_s=1e-5, **figures)
    manifest = {
        "format_version": 1,
        "status": status,
        "error": error,
        "config": {"program": {"name": "axpy", "target": "jaxaot.examples.axpy:axpy"}},
        "stages": stages,
    }
    (d / "manifest.json").write_text(json.dumps(manifest))
    write_job_record(
        d, {"num": num, "overrides": overrides, "status": status, "code": 0, "error": error}
    )


def _sweep(root: Path, *, attack: bool = False) -> Path:
    """Four jobs over a shape: three ok (execute medians 3, 1, 2 ms) and one failed."""
    SweepPlan(total=4, varying=("program.args.1",)).write(root)
    shapes = ["f32[1024,256]", "f32[64,256]", "f32[256,256]", "f32[512,256]"]
    name = f"program.name={ATTACK}" if attack else "program=axpy"
    medians = {0: 3e-3, 1: 1e-3, 3: 2e-3}
    for num, shape in enumerate(shapes):
        overrides = [name, f"program.args.1={shape}"]
        if num == 2:
            _job(root, num, overrides, "failed", error=f"compile: XLA refused {ATTACK}")
        else:
            _job(root, num, overrides, "ok", median_s=medians[num], flops_per_s=1e9 / (num + 1))
    return root


@pytest.fixture(scope="module")
def sweep_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep's report.html, its plots drawn (matplotlib)."""
    root = _sweep(tmp_path_factory.mktemp("html") / "sweep")
    table = report.write_report(root)
    return write_sweep_html(table, draw_graph=False)


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run of the mlp example (every stage), with its report.html."""
    tmp = tmp_path_factory.mktemp("run")
    run_dir = tmp / "run"
    jaxaot.run(jaxaot.compose(["program=mlp", f"store.dir={tmp / 'store'}"]), run_dir=run_dir)
    assert report_main(["--html", str(run_dir)]) == 0
    return run_dir


def _column(opened: Opened, table_id: str, col: int) -> list[str]:
    return opened.page.eval_on_selector_all(
        f"#{table_id} tbody tr", f"rows => rows.map(r => r.cells[{col}].textContent.trim())"
    )


def _head_index(opened: Opened, table_id: str, text: str) -> int:
    heads = opened.page.eval_on_selector_all(
        f"#{table_id} thead th", "ths => ths.map(t => t.textContent.trim())"
    )
    return heads.index(text)


def _images(opened: Opened) -> list[dict[str, Any]]:
    return opened.page.eval_on_selector_all(
        "img",
        "imgs => imgs.map(i => ({alt: i.alt, complete: i.complete, width: i.naturalWidth,"
        " scheme: i.src.split(':')[0]}))",
    )


def _not_blank(opened: Opened) -> int:
    """The number of distinct colours in a screenshot of the page (a blank page has one)."""
    from PIL import Image

    shot = Image.open(io.BytesIO(opened.page.screenshot(full_page=True))).convert("RGB")
    colours = shot.getcolors(maxcolors=1 << 20)
    return len(colours) if colours is not None else 1 << 20


def _links(opened: Opened) -> list[str]:
    return opened.page.eval_on_selector_all("a", "as => as.map(a => a.getAttribute('href'))")


@pytest.mark.slow  # Chromium: a process
@pytest.mark.extra("sweep")  # matplotlib's plots, Pillow to read the screenshot
def test_the_sweep_page_renders_its_table_plots_and_links(browser: Any, sweep_page: Path) -> None:
    opened = open_page(browser, sweep_page)
    assert opened.problems == []
    assert opened.requests == [sweep_page.resolve().as_uri()]  # self-contained: no other fetch
    page = opened.page
    assert page.title() == f"Sweep report: {sweep_page.parent}"
    assert page.text_content("#summary").strip().startswith("4 jobs: 3 ok, 1 failed.")
    assert _column(opened, "jobs", 0) == ["0", "1", "2", "3"]
    statuses = _column(opened, "jobs", _head_index(opened, "jobs", "status"))
    assert statuses == ["ok", "ok", "failed", "ok"]
    assert _column(opened, "memory", 0) == ["0", "1", "2", "3"]
    images = _images(opened)
    # one plot per varying parameter (program.args.1), inline
    assert [i["alt"] for i in images] == ["program.args.1"]
    assert all(i["complete"] and i["width"] > 0 and i["scheme"] == "data" for i in images)
    assert _not_blank(opened) > 50
    # every link is relative and leads to a file or folder of the sweep
    hrefs = _links(opened)
    assert "sweep.csv" in hrefs and "sweep.md" in hrefs and "plots/program.args.1.png" in hrefs
    assert {f"{n}/{HTML_NAME}" for n in range(4)} <= set(hrefs)
    assert {"0/manifest.json", "0/.hydra/overrides.yaml", "2/job.json"} <= set(hrefs)
    for h in hrefs:
        assert not re.match(r"^[a-z]+:", h), h
        assert (sweep_page.parent / h).exists(), h


@pytest.mark.slow  # Chromium: a process
def test_a_click_sorts_the_jobs_by_a_column(browser: Any, sweep_page: Path) -> None:
    opened = open_page(browser, sweep_page)
    page = opened.page
    median = _head_index(opened, "jobs", "exec median")
    head = page.locator("#jobs thead th").nth(median)
    head.click()
    assert head.get_attribute("aria-sort") == "ascending"
    assert _column(opened, "jobs", 0) == ["1", "3", "0", "2"]  # 1, 2, 3 ms; no figure last
    head.click()
    assert head.get_attribute("aria-sort") == "descending"
    assert _column(opened, "jobs", 0) == ["0", "3", "1", "2"]
    shape = _head_index(opened, "jobs", "args.1")
    page.locator("#jobs thead th").nth(shape).click()  # text: the numbers in it by size
    assert _column(opened, "jobs", shape) == [
        "f32[64,256]",
        "f32[256,256]",
        "f32[512,256]",
        "f32[1024,256]",
    ]
    assert head.get_attribute("aria-sort") is None
    page.locator("#jobs thead th").nth(0).press("Enter")  # by keyboard too
    assert _column(opened, "jobs", 0) == ["0", "1", "2", "3"]
    # job 2 failed in compile: no execute stage, no memory figures; last either way
    execute = page.locator("#jobs thead th").nth(_head_index(opened, "jobs", "execute"))
    for _ in range(2):
        execute.click()
        assert _column(opened, "jobs", 0)[-1] == "2"
    bar = page.locator("#memory thead th").nth(2)  # argument + output + temp + code, as bars
    bar.click()
    assert _column(opened, "memory", 0) == ["0", "1", "3", "2"]
    bar.click()
    assert _column(opened, "memory", 0) == ["3", "1", "0", "2"]
    assert opened.problems == []


@pytest.mark.slow  # Chromium: a process
@pytest.mark.extra("sweep")  # matplotlib's plots
def test_long_tables_keep_their_heads_and_wide_plots_scroll(browser: Any, sweep_page: Path) -> None:
    opened = open_page(browser, sweep_page, width=480, height=400)
    page = opened.page
    box = page.evaluate(
        """() => {
        const body = document.querySelector('#jobs tbody');
        for (let i = 0; i < 80; i++) body.appendChild(body.rows[0].cloneNode(true));
        const scroll = document.querySelector('#jobs').closest('.scroll');
        scroll.scrollIntoView();
        scroll.scrollTop = 600;
        const head = document.querySelector('#jobs thead th').getBoundingClientRect();
        return {top: scroll.getBoundingClientRect().top, head: head.top, at: scroll.scrollTop};
        }"""
    )
    assert box["at"] == 600 and abs(box["head"] - box["top"]) < 1.5  # the head stays on top
    img = page.eval_on_selector(
        "figure img",
        "i => ({w: i.width, natural: i.naturalWidth, shown: i.closest('figure').clientWidth,"
        " whole: i.closest('figure').scrollWidth})",
    )
    # a plot wider than the window keeps its size; its figure scrolls sideways
    assert img["w"] == img["natural"] > img["shown"] and img["whole"] > img["shown"]
    assert opened.problems == []


@pytest.mark.slow  # Chromium: a process
@pytest.mark.extra("sweep")  # Pillow (with matplotlib) reads the screenshot
def test_the_run_page_shows_stages_memory_graph_and_every_artifact(
    browser: Any, real_run: Path
) -> None:
    page_path = real_run / HTML_NAME
    opened = open_page(browser, page_path)
    assert opened.problems == []
    assert opened.requests == [page_path.resolve().as_uri()]
    page = opened.page
    assert page.text_content("#status") == "ok"
    assert _column(opened, "stages", 0) == ["stage_out", "lower", "compile", "execute"]
    assert _column(opened, "stages", 1) == ["ran"] * 4
    # the buffers live at the peak: the largest is the 512x512 weight
    assert _column(opened, "peak-buffers", 0)[0] == "f32[512,512]"
    assert _column(opened, "peak-buffers", 1)[0] == "args[0][1]['w']"
    graph = page.eval_on_selector(
        "#hlo-graph", "i => ({w: i.naturalWidth, src: i.src.slice(0, 26)})"
    )
    assert graph["w"] > 0 and graph["src"] == "data:image/svg+xml;base64,"
    assert _not_blank(opened) > 50
    manifest = json.loads((real_run / "manifest.json").read_text())
    artifacts = {a for s in manifest["stages"].values() for a in s["artifacts"]}
    hrefs = set(_links(opened))
    assert len(artifacts) > 10
    # the run drew no graph (snapshot.graph off): the page's is in graph/report/
    drawn = {"graph/report/optimized.hlo.svg", "graph/report/optimized.hlo.dot"}
    assert artifacts | {"manifest.json"} | drawn <= hrefs
    assert all((real_run / h).is_file() for h in hrefs)


def test_a_run_page_without_graphviz_says_so(
    real_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "copy"
    shutil.copytree(real_run, run_dir)
    shutil.rmtree(run_dir / "graph")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert report_main(["--html", str(run_dir)]) == 0
    text = (run_dir / HTML_NAME).read_text()
    assert "Graphviz &#x27;dot&#x27; is not on PATH" in text
    assert 'href="graph/report/optimized.hlo.dot"' in text and "hlo-graph" not in text
    assert report_main(["--html", "--no-graph", str(tmp_path / "copy")]) == 0


@pytest.mark.slow  # Chromium: a process
def test_markup_in_names_and_errors_stays_text(browser: Any, tmp_path: Path) -> None:
    root = _sweep(tmp_path / "sweep", attack=True)
    assert report_main(["--html", "--no-plots", str(root)]) == 1  # job 2 failed
    shown = []
    for page_path in (root / HTML_NAME, root / "2" / HTML_NAME):  # the sweep's, the failed job's
        opened = open_page(browser, page_path)
        assert opened.page.evaluate("typeof window.pwned") == "undefined"
        assert opened.problems == []
        assert opened.page.locator("script").count() == 1  # the page's own
        assert opened.page.locator("img").count() == 0  # no plots, no graph: no image at all
        shown.append(opened.page.text_content("body"))
    assert (
        f"compile: XLA refused {ATTACK}" in shown[0]
        and f"error: compile: XLA refused {ATTACK}" in shown[1]
    )
    assert f"program.name={ATTACK}" in shown[1]  # the job's overrides


def test_html_escapes_every_name_it_shows(tmp_path: Path) -> None:
    root = _sweep(tmp_path / "sweep", attack=True)
    table = report.write_report(root, plots=False)
    text = write_sweep_html(table, plots=False, draw_graph=False).read_text()
    assert text.count("<script") == 1 and "<img" not in text
    assert "&lt;script&gt;window.pwned=1&lt;/script&gt;" in text
    job = (root / "2" / HTML_NAME).read_text()
    assert job.count("<script") == 1 and "&lt;img src=x onerror=window.pwned=2&gt;" in job


def test_the_markdown_report_is_the_same_with_html(tmp_path: Path) -> None:
    plain, html = _sweep(tmp_path / "a"), _sweep(tmp_path / "b")
    assert report_main(["--no-plots", str(plain)]) == 1
    assert report_main(["--html", "--no-plots", str(html)]) == 1
    for name in (report.MD_NAME, report.CSV_NAME):
        assert (plain / name).read_text().replace(str(plain), "X") == (
            html / name
        ).read_text().replace(str(html), "X")
    assert not (plain / HTML_NAME).exists() and (html / HTML_NAME).is_file()
    assert not (html / "plots").exists()


def test_cli_on_a_run_dir_and_on_no_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _sweep(tmp_path / "sweep")
    assert report_main(["--html", "--no-graph", str(root / "1")]) == 0
    assert capsys.readouterr().out == f"run ok: {root / '1' / HTML_NAME}\n"
    assert not (root / HTML_NAME).exists()  # a run dir's page only
    assert report_main(["--html", str(root / "2")]) == 1
    assert capsys.readouterr().out == f"run failed: {root / '2' / HTML_NAME}\n"
    assert report_main(["--html", str(tmp_path / "no/such")]) == 2
    assert capsys.readouterr().err == (
        f"jaxaot-report: error: {tmp_path / 'no/such'}: no such file or directory; expected "
        "a run directory or a sweep folder (hydra.sweep.dir)\n"
    )


def test_markdown_sections_become_tables_and_lists() -> None:
    html = markdown_block(
        [
            "## Fit search",
            "",
            "| choice | largest fit |",
            "|---|---|",
            "| a \\| b | **front** |",
            "",
            "fit search: Pareto front on v5e:2x2",
            "- `n=4` <b>",
        ]
    )
    assert html.splitlines()[0] == "<h2>Fit search</h2>"
    assert "<td>a | b</td><td><strong>front</strong></td>" in html
    assert "<li><code>n=4</code> &lt;b&gt;</li>" in html


def test_a_topology_search_shows_its_verdicts_and_best_trial(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    SweepPlan(total=2, varying=("program.args.1",)).write(root)
    for num, (fits, need) in enumerate(((True, 12 * 2**30), (False, 20 * 2**30))):
        d = root / str(num)
        d.mkdir(parents=True)
        status = "ok" if fits else "does_not_fit"
        verdict = dict(
            topology="v5e:2x2",
            fits=fits,
            hbm_fits=fits,
            hbm_bytes_needed=need,
            hbm_bytes_available=16 * 2**30,
            headroom_bytes=16 * 2**30 - need,
            est_step_s=0.01 * (num + 1),
        )
        manifest = {
            "format_version": 1,
            "status": status,
            "error": None if fits else "does not fit v5e:2x2: needs 20.0 GiB of 16.0 GiB",
            "stages": {"compile": _stage("ran" if fits else "failed", 1.0, **verdict)},
        }
        (d / "manifest.json").write_text(json.dumps(manifest))
        overrides = [f"program.args.1=f32[{1024 * (num + 1)}]"]
        write_job_record(d, {"num": num, "overrides": overrides, "status": status, "code": 0})
    best = {"job": 0, "value": 0.01, "overrides": ["program.args.1=f32[1024]"]}
    (root / report.AUTOTUNE_NAME).write_text(
        json.dumps({"objective": "compile.est_step_s", "direction": "minimize", "best": best})
    )
    table = report.write_report(root, plots=False)
    text = write_sweep_html(table, plots=False, draw_graph=False).read_text()
    assert "Best trial (minimize <code>compile.est_step_s</code>): job 0" in text
    rows = re.findall(r'<tr class="([a-z_]+)">(.*?)</tr>', text)
    assert [r[0] for r in rows[:2]] == ["ok", "does_not_fit"]
    assert '<span class="badge">best</span>' in rows[0][1]
    assert '<td class="num" data-sort="-4294967296">-4.0 GiB</td>' in rows[1][1]  # headroom
    assert "<td>no</td>" in rows[1][1] and "<td>yes</td>" in rows[0][1]
    job = (root / "1" / HTML_NAME).read_text()
    assert "verdict: does not fit v5e:2x2" in job
    # the figures as the sweep's row and the verdict print them (16.00 GiB: the verdict's limit)
    assert '<td class="num" data-sort="17179869184">16.00 GiB</td>' in rows[1][1]
    assert "does not fit: HBM needed 20.0 GiB of 16.00 GiB (headroom -4.0 GiB)" in job
    assert "No HLO to draw: the run stopped before lower." in job


def test_an_hlo_text_that_cannot_be_drawn_is_said_on_the_page(tmp_path: Path) -> None:
    root = _sweep(tmp_path / "sweep")
    run_dir = root / "0"
    (run_dir / "compile").mkdir()
    (run_dir / "compile" / "optimized.hlo.txt").write_text("not HLO\n")
    assert report_main(["--html", str(run_dir)]) == 0
    text = (run_dir / HTML_NAME).read_text()
    assert (
        'No graph: <a href="compile/optimized.hlo.txt">compile/optimized.hlo.txt</a> could not '
        "be drawn (no HLO computations in the text)." in text
    )


def _copy_run(real_run: Path, tmp_path: Path, **snapshot: Any) -> Path:
    """A copy of the real run without graph/, its config's snapshot section set as given."""
    if shutil.which("dot") is None:
        pytest.skip("needs Graphviz's dot on PATH (make graphviz)")
    run_dir = tmp_path / "copy"
    shutil.copytree(real_run, run_dir)
    shutil.rmtree(run_dir / "graph")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["config"]["snapshot"].update(snapshot)
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    return run_dir


def _graph_files(run_dir: Path) -> dict[str, bytes]:
    return {
        p.relative_to(run_dir).as_posix(): p.read_bytes()
        for p in sorted((run_dir / "graph").rglob("*"))
        if p.is_file()
    }


def test_a_graph_the_run_recorded_is_shown_as_it_is(real_run: Path, tmp_path: Path) -> None:
    run_dir = _copy_run(real_run, tmp_path, graph=True, graph_format="png", graph_max_nodes=5)
    record = graph_of_run(run_dir, image_format="png", max_nodes=5)  # as snapshot.graph draws
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["snapshot"] = {"graph": record}
    (run_dir / "manifest.json").write_text(json.dumps(manifest, default=str))
    before = _graph_files(run_dir)
    assert set(before) == {"graph/optimized.hlo.dot", "graph/optimized.hlo.png"}
    assert record["note"].startswith("showing the first 5 of ")
    for _ in range(2):  # again: the same page
        assert report_main(["--html", str(run_dir)]) == 0
        text = (run_dir / HTML_NAME).read_text()
        assert _graph_files(run_dir) == before  # nothing redrawn, nothing added
        assert 'src="data:image/png;base64,' in text
        assert f'<span class="note" id="graph-note">({record["note"]})</span>' in text


def test_a_graph_drawn_for_the_page_follows_the_run_and_keeps_its_note(
    real_run: Path, tmp_path: Path
) -> None:
    run_dir = _copy_run(real_run, tmp_path, graph_max_nodes=5)
    notes = []
    for _ in range(2):
        assert report_main(["--html", str(run_dir)]) == 0
        text = (run_dir / HTML_NAME).read_text()
        notes.append(re.findall(r'id="graph-note">\((showing the first 5 of \d+ [^)]*)\)', text))
        assert 'href="graph/report/optimized.hlo.svg"' in text
    assert notes[0] == notes[1] and len(notes[0]) == 1  # the run's graph_max_nodes, both times
    assert set(_graph_files(run_dir)) == {
        "graph/report/optimized.hlo.dot",
        "graph/report/optimized.hlo.source.json",
        "graph/report/optimized.hlo.svg",
    }
    source = json.loads((run_dir / "graph/report/optimized.hlo.source.json").read_text())
    assert source == {
        "source": "compile/optimized.hlo.txt",
        "source_sha256": _sha256(run_dir / "compile/optimized.hlo.txt"),
        "image": "optimized.hlo.svg",
        "image_sha256": _sha256(run_dir / "graph/report/optimized.hlo.svg"),
    }
    # jaxaot-graph's, into graph/: no manifest vouches for it, so the page keeps its own
    graph_of_run(run_dir, max_nodes=7)
    assert report_main(["--html", str(run_dir)]) == 0
    text = (run_dir / HTML_NAME).read_text()
    assert 'href="graph/report/optimized.hlo.svg"' in text and "(showing the first 5 of " in text
    assert "(showing the first 7 of " not in text


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _swap_hlo_keeping_mtime(run_dir: Path) -> None:
    """The optimized HLO replaced by the lowered one (a different graph), its mtime as it was."""
    hlo = run_dir / "compile/optimized.hlo.txt"
    stat = hlo.stat()
    hlo.write_bytes((run_dir / "lower/module.hlo.txt").read_bytes())
    os.utime(hlo, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _graph_note(text: str) -> str:
    found = re.findall(r'id="graph-note">\((showing the first \d+ of \d+ [^)]*)\)', text)
    assert len(found) == 1, text
    return str(found[0])


def test_a_graph_the_page_drew_is_redrawn_when_its_hlo_changes_within_the_same_mtime(
    real_run: Path, tmp_path: Path
) -> None:
    run_dir = _copy_run(real_run, tmp_path, graph_max_nodes=5)
    assert report_main(["--html", str(run_dir)]) == 0
    before = _graph_note((run_dir / HTML_NAME).read_text()), _graph_files(run_dir)
    _swap_hlo_keeping_mtime(run_dir)
    assert report_main(["--html", str(run_dir)]) == 0
    text = (run_dir / HTML_NAME).read_text()
    after = _graph_note(text), _graph_files(run_dir)
    assert 'href="graph/report/optimized.hlo.svg"' in text
    assert after[0] != before[0]  # the lowered module's instruction count
    assert after[1]["graph/report/optimized.hlo.svg"] != before[1]["graph/report/optimized.hlo.svg"]
    source = json.loads(after[1]["graph/report/optimized.hlo.source.json"])
    assert source["source_sha256"] == _sha256(run_dir / "lower/module.hlo.txt")


@pytest.mark.parametrize("changed", ["image", "hlo"])
def test_a_recorded_graph_is_shown_only_as_the_manifest_records_it(
    changed: str, real_run: Path, tmp_path: Path
) -> None:
    run_dir = _copy_run(real_run, tmp_path, graph=True, graph_format="png", graph_max_nodes=5)
    record = graph_of_run(run_dir, image_format="png", max_nodes=5)  # as snapshot.graph draws
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["snapshot"] = {"graph": record}
    (run_dir / "manifest.json").write_text(json.dumps(manifest, default=str))
    png = run_dir / "graph/optimized.hlo.png"
    if changed == "image":  # bytes that are not the recorded ones, the name and mtime kept
        stat = png.stat()
        png.write_bytes(png.read_bytes() + b"\0")
        os.utime(png, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    else:
        _swap_hlo_keeping_mtime(run_dir)
    assert report_main(["--html", str(run_dir)]) == 0
    text = (run_dir / HTML_NAME).read_text()
    assert 'src="data:image/png;base64,' not in text and 'href="graph/optimized.hlo.png"' in text
    assert 'full size: <a href="graph/report/optimized.hlo.svg"' in text
    assert 'src="data:image/svg+xml;base64,' in text


@pytest.mark.parametrize("html", [False, True])
def test_a_folder_that_is_no_sweep_nor_run_is_refused(
    html: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _sweep(tmp_path / "sweep")
    (root / "2" / "manifest.json").unlink()  # a job that stopped before its run
    (tmp_path / "empty").mkdir()
    (tmp_path / "golden").mkdir()
    (tmp_path / "golden" / "snapshot.json").write_text("{}")
    flag = ["--html"] if html else []
    markers = "multirun.yaml or .jaxaot/sweep.json"
    expected = (
        f"a run directory (manifest.json) or a sweep folder ({markers})"
        if html
        else f"a sweep folder (hydra.sweep.dir, holding {markers})"
    )
    fix = "name a run's or a sweep's folder" if html else "name the folder the sweep ran in"
    cases = {
        tmp_path / "empty": "an empty folder",
        tmp_path / "golden": "a snapshot folder (snapshot.json)",
        root / "2": "a sweep job's job.json and no manifest.json (the job stopped before its run)",
    }
    if not html:
        cases[root / "1"] = "a run's manifest.json (jaxaot-report --html DIR writes a run's page)"
    for folder, found in cases.items():
        assert report_main([*flag, "--no-plots", str(folder)]) == 2
        assert capsys.readouterr().err == (
            f"jaxaot-report: error: {folder}: expected {expected}, found {found}; {fix}\n"
        )
        assert not {report.CSV_NAME, report.MD_NAME, HTML_NAME} & {p.name for p in folder.iterdir()}
    # a sweep that has only started (Hydra's multirun.yaml): its report, as before
    (tmp_path / "started").mkdir()
    (tmp_path / "started" / "multirun.yaml").write_text("hydra: {}\n")
    assert report_main([*flag, "--no-plots", str(tmp_path / "started")]) == 0
    assert capsys.readouterr().out.startswith("0 jobs, 0 failed: ")


def _breakdown(**changes: Any) -> dict[str, Any]:
    """A compile/memory_breakdown.json (format 1) of two buffers, with ``changes``."""
    top = [
        {
            "shape": "f32[64,64]",
            "path": "args[0]",
            "kind": "argument",
            "bytes": 16384,
            "live": [0, 3],
        },
        {"shape": "f32[64]", "instruction": "add.1", "kind": "temp", "bytes": 256, "live": [1, 2]},
    ]
    data = {
        "format": 1,
        "source": "buffer_assignment_proto",
        "peak_bytes": 16640,
        "live_peak_bytes": 16640,
        "top": top,
        "peak_groups": {"arguments": {"args[0]": 16384}, "temporaries": 256, "outputs": 0},
        "groups": {"arguments": {"args[0]": 16384}, "temporaries": 256},
    }
    return {**data, **changes}


MALFORMED: dict[str, tuple[str, Any]] = {
    "bd_live_int": ("breakdown", _breakdown(top=[{"bytes": 4, "live": 5}])),
    "bd_groups_list": ("breakdown", _breakdown(peak_groups=[1])),
    "bd_args_list": ("breakdown", _breakdown(peak_groups={"arguments": [1, 2]})),
    "bd_bytes_str": ("breakdown", _breakdown(top=[{"bytes": "big", "live": ["a"]}])),
    "bd_top_str": ("breakdown", _breakdown(top="x")),
    "bd_format_2": ("breakdown", _breakdown(format=2)),
    "bd_list": ("breakdown", [1]),
    "m_versions_list": ("manifest", {"versions": ["jax"]}),
    "m_backend_str": ("manifest", {"backend": "cpu"}),
    "m_stages_list": ("manifest", {"stages": ["x"]}),
    "m_config_str": ("manifest", {"config": "x"}),
    "m_snapshot_str": ("manifest", {"snapshot": {"graph": "x"}, "started": "noon"}),
    "m_metrics_str": ("manifest", {"stages": {"execute": {"metrics": {"median_s": "fast"}}}}),
    "m_warnings_str": ("manifest", {"warnings": "one warning"}),
}


def test_malformed_files_of_a_job_are_left_out_of_its_page(tmp_path: Path) -> None:
    root = _sweep(tmp_path / "sweep")
    for num, (name, (which, value)) in enumerate(MALFORMED.items(), start=4):
        shutil.copytree(root / "0", root / str(num))
        d = root / str(num)
        write_job_record(d, {"num": num, "overrides": [f"case={name}"], "status": "ok", "code": 0})
        if which == "breakdown":
            (d / "compile").mkdir()
            (d / "compile" / "memory_breakdown.json").write_text(json.dumps(value))
        else:
            manifest = json.loads((d / "manifest.json").read_text())
            (d / "manifest.json").write_text(json.dumps({**manifest, **value}))
    table = report.write_report(root, plots=False)
    text = write_sweep_html(table, plots=False, draw_graph=False).read_text()
    assert "(no page:" not in text
    for num, name in enumerate(MALFORMED, start=4):
        assert f'<a href="{num}/{HTML_NAME}">{num}</a>' in text, name
        assert (root / str(num) / HTML_NAME).is_file(), name
    first = 4 + list(MALFORMED).index("bd_format_2")
    assert (
        "compile/memory_breakdown.json has format 2, this jaxaot reads format 1: the peak&#x27;s "
        "makeup is not shown" in (root / str(first) / HTML_NAME).read_text()
    )
    warned = (root / str(4 + list(MALFORMED).index("m_warnings_str")) / HTML_NAME).read_text()
    assert "<li>one warning</li>" in warned


def test_a_job_whose_page_fails_is_a_note_in_its_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jaxaot.sweeps import html_report

    real = html_report.run_page

    def page(folder: Path, **kw: Any) -> str:
        if folder.name == "1":
            raise ValueError("bad figure\nsecond line")
        return real(folder, **kw)

    monkeypatch.setattr(html_report, "run_page", page)
    root = _sweep(tmp_path / "sweep")
    table = report.write_report(root, plots=False)
    text = write_sweep_html(table, plots=False, draw_graph=False).read_text()
    assert '<span class="note">(no page: ValueError: bad figure)</span>' in text
    assert not (root / "1" / HTML_NAME).exists() and (root / "3" / HTML_NAME).is_file()
    assert f'href="1/{HTML_NAME}"' not in text


def test_the_run_page_says_what_it_cannot_read(tmp_path: Path) -> None:
    root = _sweep(tmp_path / "sweep")
    run_dir = root / "0"
    (run_dir / "compile").mkdir()
    breakdown = _breakdown(peak_bytes=None)  # XLA gave no peak (a deviceless compile)
    (run_dir / "compile" / "memory_breakdown.json").write_text(json.dumps(breakdown))
    assert report_main(["--html", "--no-graph", str(run_dir)]) == 0
    text = (run_dir / HTML_NAME).read_text()
    assert (
        '<p id="peak">XLA gives no peak figure; live at the peak (device memory, by what it '
        "holds): <strong>16.2 KiB</strong>;" in text
    )
    (run_dir / "manifest.json").write_text('{"format_version": 1, "status": "o')  # cut short
    assert report_main(["--html", "--no-graph", str(run_dir)]) == 1
    text = (run_dir / HTML_NAME).read_text()
    assert (
        '<p class="error" id="manifest-error">manifest.json is not valid JSON (Unterminated '
        "string starting at: line 1 column 33 (char 32)): the run&#x27;s record is unreadable</p>"
    ) in text


def test_a_job_page_links_to_its_sweep_and_a_sweep_page_says_when_jobs_are_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _sweep(tmp_path / "sweep")
    assert report_main(["--html", "--no-graph", str(root / "1")]) == 0
    assert '<a href="..">← the sweep</a>' in (root / "1" / HTML_NAME).read_text()
    SweepPlan(total=6, varying=("program.args.1",)).write(root)  # 2 jobs not begun yet
    assert report_main(["--html", "--no-plots", "--no-graph", str(root)]) == 1
    text = (root / HTML_NAME).read_text()
    assert re.search(
        r'<p class="note" id="written"><strong>4 of 6 jobs finished</strong> when this page was '
        r"written \(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC\)",
        text,
    )
    assert report_main(["--html", "--no-graph", str(root / "1")]) == 0
    assert f'<a href="../{HTML_NAME}">← the sweep</a>' in (root / "1" / HTML_NAME).read_text()
    SweepPlan(total=4, varying=("program.args.1",)).write(root)
    write_sweep_html(report.collect(root), plots=False, draw_graph=False)
    assert re.search(r'id="written">Written \d{4}-[^<]* UTC\.</p>', (root / HTML_NAME).read_text())


def test_browser_finds_chromium_by_either_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import browser as browser_module

    exe = tmp_path / "chromium-browser"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert browser_module.chromium_path() == str(exe)
    exe.rename(tmp_path / "chromium")
    assert browser_module.chromium_path() == str(tmp_path / "chromium")
    exe.with_name("chromium").unlink()
    assert browser_module.chromium_path() is None
