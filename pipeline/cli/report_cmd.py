"""jaxaot-report: the table and plots of a finished sweep, and its HTML page (or a run's)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from jaxaot.cli.latest import LATEST, existing, sweep_dir
from jaxaot.errors import ConfigError
from jaxaot.rundir.manifest import MANIFEST_NAME
from jaxaot.sweeps.report import MD_NAME, RESULT_STATUSES, write_report
from jaxaot.util.console import pipe_safe


@pipe_safe
def main(argv: Sequence[str] | None = None) -> int:
    """``jaxaot-report [--html] DIR``: (re)build a sweep's report, or with ``--html`` also its
    page (a run dir: the run's page only); exit 1 if any job (the run) failed."""
    parser = argparse.ArgumentParser(
        prog="jaxaot-report",
        description="(Re)build a sweep's report (sweep.csv, sweep.md, plots/); with --html also "
        "report.html, one self-contained page, in the sweep dir and in each job's folder, or "
        "in a run dir for that run alone. Exit status: 0 all jobs (the run) ok or found not "
        "to fit, 1 one failed, 2 not a sweep folder (multirun.yaml or .jaxaot/sweep.json in "
        "it) nor, with --html, a run directory (manifest.json).",
    )
    parser.add_argument(
        "sweep_dir",
        help="a multirun folder (hydra.sweep.dir), or with --html a run directory; latest: "
        "the newest sweep under ./outputs/multirun",
    )
    parser.add_argument("--no-plots", action="store_true", help="write only the CSV and Markdown")
    parser.add_argument(
        "--html",
        action="store_true",
        help="also write report.html (plots inline unless --no-plots, each run's HLO graph)",
    )
    parser.add_argument(
        "--no-graph",
        action="store_true",
        help="with --html: draw no HLO graph that jaxaot-graph has not drawn already",
    )
    args = parser.parse_args(argv)
    try:
        if args.html and args.sweep_dir != LATEST:
            folder: Path = existing(
                args.sweep_dir, "a run directory or a sweep folder (hydra.sweep.dir)"
            )
        else:
            folder = sweep_dir(args.sweep_dir)
    except ConfigError as exc:
        print(f"jaxaot-report: error: {exc}", file=sys.stderr)
        return 2
    if not folder.is_dir():
        print(f"jaxaot-report: error: {folder}: not a directory", file=sys.stderr)
        return 2
    from jaxaot.sweeps.html_run import SWEEP_FILES

    is_run = (folder / MANIFEST_NAME).is_file()
    if args.html and is_run:  # a run dir, not a sweep's
        from jaxaot.sweeps.html_report import write_run_html

        page, status = write_run_html(folder, draw_graph=not args.no_graph)
        print(f"run {status}: {page}")
        return 0 if status in RESULT_STATUSES else 1
    if not any((folder / m).is_file() for m in SWEEP_FILES):
        print(f"jaxaot-report: error: {_not_a_sweep(folder, is_run, args.html)}", file=sys.stderr)
        return 2
    table = write_report(folder, plots=not args.no_plots)
    print(f"{len(table.rows)} jobs, {len(table.failed)} failed: {folder / MD_NAME}")
    if args.html:
        from jaxaot.sweeps.html_report import write_sweep_html

        print(
            f"html: {write_sweep_html(table, plots=not args.no_plots, draw_graph=not args.no_graph)}"
        )
    return 1 if table.failed else 0


def _not_a_sweep(folder: Path, is_run: bool, html: bool) -> str:
    """The one line for a folder that is neither a sweep's nor (with --html) a run's."""
    from jaxaot.sweeps.html_run import SWEEP_FILES
    from jaxaot.sweeps.progress import JOB_NAME

    if is_run:
        found = f"a run's {MANIFEST_NAME} (jaxaot-report --html DIR writes a run's page)"
    elif (folder / JOB_NAME).is_file():
        found = f"a sweep job's {JOB_NAME} and no {MANIFEST_NAME} (the job stopped before its run)"
    elif (folder / "snapshot.json").is_file():
        found = "a snapshot folder (snapshot.json)"
    elif not any(folder.iterdir()):
        found = "an empty folder"
    else:
        found = "neither"
    markers = " or ".join(SWEEP_FILES)
    expected = (
        f"a run directory ({MANIFEST_NAME}) or a sweep folder ({markers})"
        if html
        else f"a sweep folder (hydra.sweep.dir, holding {markers})"
    )
    fix = "name a run's or a sweep's folder" if html else "name the folder the sweep ran in"
    return f"{folder}: expected {expected}, found {found}; {fix}"


if __name__ == "__main__":
    raise SystemExit(main())
