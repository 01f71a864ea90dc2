"""jaxaot-graph: draw a run's or snapshot's optimized HLO."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from jaxaot.cli.latest import run_or_path
from jaxaot.snapshots.hlo_graph import _is_snapshot, graph_of_run, write_graph
from jaxaot.util.console import pipe_safe


@pipe_safe
def main(argv: Sequence[str] | None = None) -> int:
    """``jaxaot-graph SOURCE``: draw a run's, a snapshot's or an HLO text file's graph."""
    ap = argparse.ArgumentParser(
        prog="jaxaot-graph",
        description="Draw the optimized HLO of a run directory, a snapshot folder or an HLO text "
        "file as a DOT graph (and SVG/PNG with Graphviz). A golden snapshot folder is never "
        "written to: its graph goes to ./<snapshot name>.graph/ unless -o says where.",
    )
    ap.add_argument(
        "source",
        help="run directory, snapshot folder or HLO text file; latest: the newest run under "
        "./outputs",
    )
    ap.add_argument("-o", "--out", type=Path, help="DOT file to write (default: beside the HLO)")
    ap.add_argument("--format", choices=("svg", "png"), default="svg", help="image format")
    ap.add_argument("--max-nodes", type=int, default=250, help="node limit before collapsing")
    args = ap.parse_args(argv)
    try:
        source = run_or_path(args.source, "a run directory, a snapshot folder or an HLO text file")
        if source != Path(args.source):  # latest: say which run
            print(f"run: {source}")
        if source.is_dir() and args.out is None and not _is_snapshot(source):
            result = graph_of_run(source, image_format=args.format, max_nodes=args.max_nodes)
            print(result["summary"])
            return 0 if result["source"] else 1
        if source.is_dir():
            rel = next(
                (
                    r
                    for r in ("compile/optimized.hlo.txt", "lower/module.hlo.txt")
                    if (source / r).is_file()
                ),
                "compile/optimized.hlo.txt",
            )
            text = (source / rel).read_text()
            default = Path(f"{source.resolve().name}.graph") / Path(rel).name.replace(
                ".txt", ".dot"
            )
        else:
            text = source.read_text()
            default = source.with_suffix(".dot")
            if _is_snapshot(source.parent) or _is_snapshot(source.parent.parent):
                # a file inside a golden snapshot: its graph goes to the current directory
                default = Path(source.with_suffix(".dot").name)
        dot_path = args.out or default
        dot_path.parent.mkdir(parents=True, exist_ok=True)
        out = write_graph(text, dot_path, image_format=args.format, max_nodes=args.max_nodes)
    except (OSError, ValueError) as exc:  # a ConfigError is a ValueError
        print(f"jaxaot-graph: error: {_said(exc)}", file=sys.stderr)
        return 2
    for key in ("dot", "image", "note", "render_note"):
        if out[key]:
            print(f"{key}: {out[key]}")
    return 0


def _said(exc: Exception) -> str:
    """An OSError as ``path: what happened``, without its errno."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror.lower()}"
    return str(exc)


if __name__ == "__main__":
    raise SystemExit(main())
