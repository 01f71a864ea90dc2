"""Programs for the interrupt and resume tests of tests/test_fit_search.py
(``tests.probe_signal_programs:<name>`` from the repository root)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

SLOW_ENV = "JAXAOT_TEST_SLOW_FROM"
MARK_ENV = "JAXAOT_TEST_SLOW_MARK"  # a file written (the process id) when the slow part starts


def slow_from(x: Any) -> Any:
    """``x[:8]``, after a minute of tracing when n reaches $JAXAOT_TEST_SLOW_FROM (a compile
    that takes long, to signal the search while it runs; unset: never), saying so in
    $JAXAOT_TEST_SLOW_MARK."""
    slow = os.environ.get(SLOW_ENV)
    if slow and x.shape[0] >= int(slow):
        mark = os.environ.get(MARK_ENV)
        if mark:
            Path(mark).write_text(str(os.getpid()))
        time.sleep(60)
    return x[:8]
