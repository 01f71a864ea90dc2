"""``python -m pipeline``: the ``jaxaot`` command (issue 14; ``python -m jaxaot`` arrives with the
import name ``jaxaot``, issue 13)."""

from __future__ import annotations

from jaxaot.cli.main import main

if __name__ == "__main__":
    main()
