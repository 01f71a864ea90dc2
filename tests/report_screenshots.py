"""Screenshots of the HTML report for the README: docs/img/report-sweep.png (a sweep's page,
sorted by execute median) and docs/img/report-run.png (the page of one of its jobs).

Runs the README's sweep (six jobs of the mlp example) in a temporary folder with a store of
its own, writes its pages with ``jaxaot-report --html`` and photographs them in headless
Chromium, as the tests render them (tests/browser.py). From the repository root:

    .venv/bin/python tests/report_screenshots.py [OUT_DIR]   # default: docs/img
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from browser import launch, open_page

REPO = Path(__file__).resolve().parents[1]
SWEEP = [
    "-m",
    "program=mlp",
    "program.args.1=f32[64,256],f32[256,256],f32[1024,256]",
    "compile.compiler_options.xla_cpu_enable_fast_math=true,false",
]


def main(out_dir: Path) -> None:
    from jaxaot.cli.report_cmd import main as report_main
    from playwright.sync_api import sync_playwright

    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jaxaot-screenshots-") as tmp:
        env = dict(os.environ, JAXAOT_STORE_DIR=str(Path(tmp) / "store"), JAXAOT_SERVER="0")
        sweep = Path("outputs/multirun/2026-11-29/10-00-00")
        subprocess.run(
            [sys.executable, "-m", "jaxaot", *SWEEP, f"hydra.sweep.dir={sweep}"],
            cwd=tmp,
            env=env,
            check=True,
            capture_output=True,
        )
        os.chdir(tmp)  # the page names the sweep dir as it was given: relative
        assert report_main(["--html", str(sweep)]) == 0
        with sync_playwright() as p:
            browser = launch(p)
            try:
                opened = open_page(browser, sweep / "report.html", width=1920, height=1150)
                median = opened.page.locator("#jobs thead th", has_text="exec median")
                median.click()
                # the click scrolled the table to its column: back to its first columns
                opened.page.evaluate(
                    "document.querySelectorAll('.scroll').forEach(e => { e.scrollLeft = 0; })"
                )
                assert opened.problems == [], opened.problems
                opened.page.screenshot(path=str(out_dir / "report-sweep.png"))
                job = open_page(browser, sweep / "0" / "report.html", width=1280, height=1500)
                assert job.problems == [], job.problems
                job.page.screenshot(path=str(out_dir / "report-run.png"))
            finally:
                browser.close()
    for name in ("report-sweep.png", "report-run.png"):
        print(out_dir / name)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "docs" / "img")
