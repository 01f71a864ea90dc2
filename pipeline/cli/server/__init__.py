"""A resident ``jaxaot`` server: Python, JAX and Hydra imported once, a fresh child per run.

A warm ``jaxaot`` run spends most of its time starting up: importing JAX, Hydra and jaxaot
costs more than loading the executable and running it. ``jaxaot server start`` keeps one
process with those imports done and one config composed (no JAX backend started: that happens
per run). Every later ``jaxaot ...`` sends its argv, cwd, environment, and its
stdin/stdout/stderr (the file descriptors themselves, SCM_RIGHTS) over a per-user Unix socket;
the server forks a child that runs exactly what ``jaxaot`` would have run in-process. Each run
gets its own backend, device count and JAX config; output goes straight to the client's
terminal or pipes; Ctrl-C and SIGTERM are forwarded to the child's process group; the client
exits with the child's status; a client that dies takes its run with it. (Prior art: Bazel's
client/server, mypy's dmypy, Nailgun.)

The server never serves a run it could get wrong. It declines, and the client runs
in-process as if there were no server, when:
- an environment variable that JAX, XLA or Python read at import differs from the server's;
- the client would import another copy of a pre-imported package (another checkout or venv);
- a file of any module the server imported changed since it started (the server then
  re-executes itself, so the next run is served by fresh code);
- the ``jaxaot`` entry was called by a program that set up its own process first (imported
  JAX, Hydra or more of jaxaot, replaced stdio, a profiler; ``facts.own_setup``): its run is
  its own, and no server is asked;
- the request comes from a run the server itself forked (``jaxaot`` called from a run):
  a served run never waits on another served run, so runs cannot multiply through the
  server; and at most ``loop.MAX_RUNS`` runs are in flight.

The parts, each usable and tested alone:

- :mod:`.protocol`: the wire format (framing, messages, version) and the peer-credential check;
- :mod:`.folder`: where the socket lives, and whether its folder is the user's alone;
- :mod:`.facts`: what a client process is that its forked run must be too (sent, compared);
- :mod:`.client`: connect (folder, owner, peer checked before a byte is sent), run, ask;
- :mod:`.loop`: the serve loop (accept, decline or fork, report each end);
- :mod:`.child`: what a forked child does to become its client's ``jaxaot``, then run;
- :mod:`.compositions`: Hydra compositions remembered for the runs the server forks;
- :mod:`.daemon`: the server process (one per socket, warm imports, the loop, re-execution);
- :mod:`.commands`: ``jaxaot server start|stop|status|restart``.

This module is the ``jaxaot`` command's entry and imports only ``contextlib``, ``os`` and ``sys``: with the
server path off (``JAXAOT_SERVER=0``, or inside a served run) the entry imports nothing more;
with it on, the client is imported and connects (bench/entry_cost.py measures what that costs
a run with no server). One server per user and Python environment; it exits after
``JAXAOT_SERVER_IDLE`` seconds (default 3 hours) without a request.
"""

from __future__ import annotations

import contextlib
import os
import sys

# Set in a served run's environment (so also in everything it starts): its own `jaxaot`
# calls run in-process, and the server refuses requests that carry it.
CHILD_MARK = "JAXAOT_SERVED_BY"


def wanted() -> bool:
    """Whether this ``jaxaot`` may use a server: not inside a served run, and not
    ``JAXAOT_SERVER=0``. (``JAXAOT_SERVER=1`` also starts one for the runs after this one.)"""
    if os.environ.get(CHILD_MARK):
        return False
    return os.environ.get("JAXAOT_SERVER", "").lower() not in ("0", "false", "no", "off")


def try_server(argv: list[str]) -> None:
    """Handle ``jaxaot server ...``, or run ``jaxaot argv`` through a running server and exit
    with its status; return (having done nothing) when the run belongs in this process."""
    if argv[:1] == ["server"]:
        from jaxaot.cli.server.commands import command

        sys.exit(command(argv[1:]))
    if not wanted():
        return
    from jaxaot.cli.server.client import ask, run_via_server

    code = run_via_server(argv)
    if code is not None:
        sys.exit(code)
    if os.environ.get("JAXAOT_SERVER") == "1" and ask("status", quiet=True) is None:
        from jaxaot.cli.server.commands import spawn

        with contextlib.suppress(OSError):
            spawn()  # serves the next run; this one runs in-process, as it would have


def entry() -> None:
    """The ``jaxaot`` command: through the server when one is running, else in-process."""
    try_server(sys.argv[1:])
    from jaxaot.cli.main import main

    main()


__all__ = ["CHILD_MARK", "entry", "try_server", "wanted"]
