"""``python -m jaxaot``: the ``jaxaot`` command."""

from __future__ import annotations

from jaxaot.cli.main import main

if __name__ == "__main__":
    main()
