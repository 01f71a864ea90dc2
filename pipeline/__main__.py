"""``python -m jaxaot``: the ``jaxaot`` command."""

from __future__ import annotations

from jaxaot.cli.server import entry

if __name__ == "__main__":
    entry()  # through a running `jaxaot server`, else in this process
