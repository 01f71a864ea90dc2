"""``jaxaot-store``: inspect and maintain the checkpoint store (stats, verify, gc, ls).

Every subcommand takes ``--store DIR`` (default ``$JAXAOT_STORE_DIR``, else
``$XDG_CACHE_HOME/jaxaot/store``, ``~/.cache/jaxaot/store`` when that variable is unset), or a
bucket store's URL, ``--store s3://BUCKET/PREFIX`` (``gs://``), which ls/stats/verify/gc read
and maintain in the bucket itself (:mod:`jaxaot.store.bucket_maintenance`).
``export-jax-cache DIR RUN_DIR...`` reads run directories instead, and files their CPU
executables in JAX's own persistent compilation cache (:mod:`jaxaot.store.jax_cache`).
Bad input prints one line on stderr and exits 2; ``verify`` exits 1 when an entry is corrupt
(or, with ``--deep``, unusable: it verifies but cannot be loaded and called in a fresh process).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from jaxaot.errors import JaxaotError
from jaxaot.store.cache import (
    ENV_STORE_DIR,
    STORE_FORMAT_VERSION,
    Store,
    parse_size,
    resolve_store_root,
)
from jaxaot.store.maintenance import TempInfo

if TYPE_CHECKING:
    from jaxaot.store.bucket_maintenance import BucketAdmin

    AnyStore = Store | BucketAdmin
from jaxaot.util.console import pipe_safe

PROG = "jaxaot-store"


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{message} (see `{self.prog} --help`)")


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]
    ]
    return "\n".join(line.rstrip() for line in lines)


def _build_parser() -> _Parser:
    store_help = (
        f"store root (default: ${ENV_STORE_DIR}, else $XDG_CACHE_HOME/jaxaot/store, "
        "~/.cache/jaxaot/store when XDG_CACHE_HOME is unset), or a bucket store's "
        "s3://BUCKET/PREFIX or gs://BUCKET/PREFIX"
    )
    parser = _Parser(prog=PROG, description="Inspect and maintain the jaxaot checkpoint store.")
    parser.add_argument("--store", metavar="DIR", default=None, help=store_help)
    # Accepted after the subcommand too; SUPPRESS keeps it from overwriting a value given before.
    common = _Parser(add_help=False)
    common.add_argument("--store", metavar="DIR", default=argparse.SUPPRESS, help=store_help)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("stats", parents=[common], help="entries, size, hits and misses per stage")
    p = sub.add_parser("verify", parents=[common], help="re-hash every entry")
    p.add_argument("--remove", action="store_true", help="delete corrupt (and unusable) entries")
    p.add_argument(
        "--deep",
        action="store_true",
        help="also load and call every executable in a fresh process; report unusable ones",
    )
    p = sub.add_parser("gc", parents=[common], help="remove stale temp folders and old entries")
    p.add_argument(
        "--max-size", metavar="SIZE", help="evict least recently used entries above SIZE (e.g. 2GB)"
    )
    p.add_argument(
        "--older-than-hours", metavar="N", type=float, help="remove entries unused for N hours"
    )
    p.add_argument(
        "--temp-grace-hours",
        metavar="N",
        type=float,
        default=1.0,
        help=(
            "remove interrupted writes older than N hours (default 1; in a bucket, payload "
            "without a manifest and claims are kept at least 10 minutes whatever N)"
        ),
    )
    p = sub.add_parser("ls", parents=[common], help="list entries")
    p.add_argument("--stage", metavar="S", help="only entries of stage S")
    p = sub.add_parser(
        "export-jax-cache",
        help="file runs' CPU executables in JAX's persistent compilation cache, where plain "
        "jax.jit loads them (run it with the job's environment: devices, XLA_FLAGS)",
    )
    p.add_argument(
        "cache_dir", metavar="DIR", help="the job's jax_compilation_cache_dir, as the job spells it"
    )
    p.add_argument("runs", metavar="RUN_DIR", nargs="+", help="jaxaot run directories")
    return parser


def _cmd_stats(store: AnyStore, args: argparse.Namespace) -> int:
    stats = store.stats()
    rows = []
    for name, s in [*stats.stages.items(), ("total", stats.total)]:
        asked = s.hits + s.misses
        rate = f"{100 * s.hits / asked:.0f}%" if asked else "-"
        rows.append(
            [
                name,
                str(s.entries),
                format_bytes(s.bytes),
                str(s.hits),
                str(s.misses),
                rate,
                f"{s.seconds_saved:.1f} s",
            ]
        )
    where = getattr(store, "location", store.root)
    print(f"store {where} (format v{STORE_FORMAT_VERSION})")
    print(_table(["stage", "entries", "size", "hits", "misses", "hit rate", "time saved"], rows))
    if where != store.root:
        print(
            "hits and misses are counted by each machine's local cache: "
            f"`{PROG} stats --store CACHE_DIR` there"
        )
    _print_temps(store, stats.temps)
    return 0


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _print_temps(store: AnyStore, temps: Sequence[TempInfo]) -> None:
    """Orphan temp folders: puts in progress, or killed ones that ``gc`` will remove."""
    if not temps:
        return
    print(
        f"{len(temps)} temp folder(s) (interrupted or running writes; `{PROG} gc` removes "
        "those older than an hour):"
    )
    for t in temps:
        print(f"  {t.path.relative_to(store.root)}  age {_age(t.age_s)}")


def _cmd_verify(store: AnyStore, args: argparse.Namespace) -> int:
    report = store.verify(remove=args.remove, deep=args.deep)
    for r in report.results:
        if r.ok:
            print(f"ok       {r.stage}/{r.key}" + (f" ({r.reason})" if r.reason else ""))
            continue
        if r.removed:
            note = " [removed]"
        elif r.remove_error:
            note = f" [NOT removed: {r.remove_error}]"
        else:
            note = ""
        print(f"{r.kind.upper():<8} {r.stage}/{r.key}: {r.reason}{note}")
    n_unusable = len(report.unusable)
    n_corrupt = len(report.corrupt) - n_unusable
    summary = f"{len(report.results)} entries: {len(report.results) - len(report.corrupt)} ok, "
    summary += f"{n_corrupt} corrupt" + (f", {n_unusable} unusable" if args.deep else "")
    if args.remove and report.corrupt:
        removed = sum(r.removed for r in report.corrupt)
        summary += f"; {removed} removed"
        if report.not_removed:
            summary += f", {len(report.not_removed)} could not be removed (read-only store?)"
    print(summary)
    _print_temps(store, report.temps)
    if report.corrupt and not args.remove:
        print(f"run `{PROG} verify --remove{' --deep' if args.deep else ''}` to delete them")
    return 1 if report.corrupt else 0


def _cmd_gc(store: AnyStore, args: argparse.Namespace) -> int:
    max_bytes = None if args.max_size is None else parse_size(args.max_size)
    for flag, value in (
        ("--older-than-hours", args.older_than_hours),
        ("--temp-grace-hours", args.temp_grace_hours),
    ):
        if value is not None and value < 0:
            raise _UsageError(f"{flag} must be >= 0, got {value}")
    older = None if args.older_than_hours is None else args.older_than_hours * 3600
    report = store.gc(
        max_bytes=max_bytes, older_than_s=older, temp_grace_s=args.temp_grace_hours * 3600
    )
    print(
        f"removed {report.temps_removed} temp folder(s), {report.locks_removed} idle lock(s) "
        f"and {report.entries_removed} entr{'y' if report.entries_removed == 1 else 'ies'} "
        f"({format_bytes(report.bytes_freed)}); store now holds "
        f"{format_bytes(report.bytes_remaining)}"
    )
    if report.log_lines_folded:
        print(f"hit/miss log: {report.log_lines_folded} lines folded into per-stage totals")
    return 0


def _cmd_ls(store: AnyStore, args: argparse.Namespace) -> int:
    infos = store.ls(stage=args.stage)
    rows = [
        [
            i.stage,
            i.key,
            format_bytes(i.size_bytes),
            str(i.files),
            _when(i.created),
            _when(i.last_used),
        ]
        for i in infos
    ]
    print(_table(["stage", "key", "size", "files", "created", "last used"], rows))
    print(f"{len(infos)} entries")
    return 0


def _open(given: str | None) -> AnyStore:
    """The store ``--store`` names: a folder that exists, or a bucket URL."""
    import os

    from jaxaot.store.bucket import is_bucket_url

    where = given if given else os.environ.get(ENV_STORE_DIR, "")
    if is_bucket_url(where):
        from jaxaot.store.bucket import Bucket, parse_bucket_url
        from jaxaot.store.bucket_maintenance import BucketAdmin

        return BucketAdmin(Bucket(parse_bucket_url(where, "--store" if given else ENV_STORE_DIR)))
    root = resolve_store_root(given)
    if not root.is_dir():
        raise _UsageError(f"no store at {root} (pass --store DIR or set ${ENV_STORE_DIR})")
    return Store(root)


def _cmd_export_jax_cache(args: argparse.Namespace) -> int:
    """One line per run (written/present KEY, or refused: why); 1 when any was refused."""
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the only platform exported
    from jaxaot.store.jax_cache import export_runs, report

    lines, rc = report(export_runs(args.runs, args.cache_dir))
    for line in lines:
        print(line)
    return rc


_COMMANDS = {"stats": _cmd_stats, "verify": _cmd_verify, "gc": _cmd_gc, "ls": _cmd_ls}


@pipe_safe
def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            args = _build_parser().parse_args(argv)
        except SystemExit as exc:  # --help
            return exc.code if isinstance(exc.code, int) else 0
        if args.command == "export-jax-cache":  # reads run directories, not the store
            return _cmd_export_jax_cache(args)
        return _COMMANDS[args.command](_open(args.store), args)
    except (_UsageError, JaxaotError, ValueError, OSError) as exc:
        # A bad stage name or size, a missing store, an unreadable file: one line, no traceback.
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
