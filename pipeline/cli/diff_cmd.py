"""jaxaot-diff: compare two runs or snapshots stage by stage."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from jaxaot.cli.latest import run_or_path
from jaxaot.errors import JaxaotError
from jaxaot.snapshots.diff import diff_report, load_side, render
from jaxaot.util.console import pipe_safe


@pipe_safe
def main(argv: Sequence[str] | None = None) -> int:
    """``jaxaot-diff A B``: compare two runs or snapshots stage by stage.

    Exit 0 same, 1 different, 2 unreadable; the same when stdout is closed early (``| head``).
    """
    ap = argparse.ArgumentParser(
        prog="jaxaot-diff",
        description="Compare two runs or snapshots stage by stage: artifacts, cost and memory, "
        "and for runs what grew at the memory peak (compile/memory_breakdown.json). "
        "Exit status: 0 same, 1 different, 2 unreadable.",
    )
    side = "run directory or snapshot folder; latest: the newest run under ./outputs"
    ap.add_argument("a", help=side)
    ap.add_argument("b", help=side)
    ap.add_argument(
        "--diff-lines",
        type=int,
        default=40,
        help="lines of the first difference's unified diff to print (0: none)",
    )
    ap.add_argument("--full", action="store_true", help="print every differing artifact's diff")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    try:
        expected = "a run directory or a snapshot folder"
        a, b = (load_side(run_or_path(x, expected)) for x in (args.a, args.b))
    except (JaxaotError, OSError, ValueError) as exc:
        print(f"jaxaot-diff: error: {exc}", file=sys.stderr)
        return 2
    report = diff_report(a, b)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print(render(report, a, b, lines=args.diff_lines, full=args.full))
    return 1 if report["differs"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
