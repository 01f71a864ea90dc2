"""jaxaot-report: the table and plots of a finished sweep."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from jaxaot.cli.latest import sweep_dir
from jaxaot.errors import ConfigError
from jaxaot.sweeps.report import MD_NAME, write_report
from jaxaot.util.console import pipe_safe


@pipe_safe
def main(argv: Sequence[str] | None = None) -> int:
    """``jaxaot-report SWEEP_DIR``: (re)build a sweep's report; exit 1 if any job failed."""
    parser = argparse.ArgumentParser(
        prog="jaxaot-report",
        description="(Re)build a sweep's report (sweep.csv, sweep.md, plots/). "
        "Exit status: 0 all jobs ok, 1 a job failed, 2 not a sweep directory.",
    )
    parser.add_argument(
        "sweep_dir",
        help="a multirun folder (hydra.sweep.dir); latest: the newest sweep under "
        "./outputs/multirun",
    )
    parser.add_argument("--no-plots", action="store_true", help="write only the CSV and Markdown")
    args = parser.parse_args(argv)
    try:
        folder: Path = sweep_dir(args.sweep_dir)
    except ConfigError as exc:
        print(f"jaxaot-report: error: {exc}", file=sys.stderr)
        return 2
    if not folder.is_dir():
        print(f"jaxaot-report: error: {folder}: not a directory", file=sys.stderr)
        return 2
    table = write_report(folder, plots=not args.no_plots)
    print(f"{len(table.rows)} jobs, {len(table.failed)} failed: {folder / MD_NAME}")
    return 1 if table.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
