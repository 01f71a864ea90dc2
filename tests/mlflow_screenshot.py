"""Regenerate docs/img/mlflow-sweep.png: MLflow's UI comparing the nested runs of a tracked sweep.

    .venv/bin/python tests/mlflow_screenshot.py [docs/img/mlflow-sweep.png]

Starts a real ``mlflow server`` on loopback (tests/mlflow_server.py), runs a 3-job sweep of the
shipped MLP at three batch sizes with ``+tracking=mlflow``, opens MLflow's run comparison of the
sweep's three nested runs in headless Chromium (Playwright driving /usr/bin/chromium, ``make
chromium``) and saves the page. Needs the [testing] extra; about a minute.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import quote

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlflow_server import start_server, stop_server  # noqa: E402

SWEEP = [
    "-m",
    "program=mlp",
    "program.args.1=f32[8,256],f32[64,256],f32[512,256]",
    "execute.repeats=5",
    "+tracking=mlflow",
    "hydra.callbacks.tracking.experiment=mlp-batch-sweep",
]


PARAMETERS = ["program.args.1"]
METRICS = ["compile.flops", "compile.peak_bytes", "compile.seconds", "execute.median_s"]


def _pick(page: Any, box_id: str, name: str) -> None:
    """Choose ``name`` in one of the comparison's searchable selects (its first match)."""
    box = page.locator(f"#{box_id}")
    box.click()
    box.fill(name)
    page.wait_for_timeout(300)
    page.keyboard.press("Enter")
    page.keyboard.press("Escape")


def _compare(page: Any) -> None:
    """The parallel-coordinates plot of the swept shape against four figures, and the
    parameter and metric tables showing only what differs between the jobs."""
    page.get_by_role("button", name="Close").click()  # MLflow's assistant side panel
    page.get_by_role("button", name="Clear All").click()
    for name in PARAMETERS:
        _pick(page, "dubois-select-1", name)
    for name in METRICS:
        _pick(page, "dubois-select-2", name)
    page.get_by_label("Parameters - Show diff only").click()
    page.get_by_label("Metrics - Show diff only").click()
    page.set_viewport_size({"width": 1400, "height": 1700})
    page.get_by_text("Comparing 3 Runs").scroll_into_view_if_needed()
    page.wait_for_timeout(1500)  # the plot redraws last


def main(out: Path) -> None:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="jaxaot-mlflow-shot-") as tmp:
        root = Path(tmp)
        server, proc = start_server(root / "server")
        try:
            env = {
                **os.environ,
                "JAXAOT_STORE_DIR": str(root / "store"),
                "JAXAOT_SERVER": "0",
            }
            sweep_dir = root / "sweep"
            args = [*SWEEP, f"hydra.callbacks.tracking.uri={server.uri}"]
            args.append(f"hydra.sweep.dir={sweep_dir}")
            done = subprocess.run(
                [sys.executable, "-m", "jaxaot", *args],
                cwd=root,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            if done.returncode != 0:
                raise SystemExit(f"the sweep failed:\n{done.stdout}\n{done.stderr}")
            parent = json.loads((sweep_dir / "mlflow_parent.json").read_text())
            client = server.client()
            children = client.search_runs(
                [parent["experiment_id"]],
                filter_string=f"tags.mlflow.parentRunId = '{parent['run_id']}'",
                order_by=["tags.`jaxaot.job` ASC"],
            )
            ids = json.dumps([r.info.run_id for r in children], separators=(",", ":"))
            exps = json.dumps([parent["experiment_id"]], separators=(",", ":"))
            url = f"{server.uri}/#/compare-runs?runs={quote(ids)}&experiments={quote(exps)}"
            with sync_playwright() as p:
                browser = p.chromium.launch(
                    executable_path=shutil.which("chromium"),
                    args=["--no-sandbox", "--disable-gpu"],
                )
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(url, wait_until="networkidle")
                page.get_by_text("execute.median_s").first.wait_for(timeout=60_000)
                _compare(page)
                out.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(out))
                browser.close()
        finally:
            stop_server(proc)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "docs" / "img" / "mlflow-sweep.png")
