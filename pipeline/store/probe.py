"""``jaxaot-store verify --deep``: load every entry in a fresh process, as a cold run would.

An entry can verify (every sha256 matches) and still be unusable: what it holds was written by
another jaxlib, names a class that was renamed since, needs more devices than there are, or
crashes when called. The parent (:func:`probe_entries`) starts :data:`PROBE_MODULE` (above the
store: it loads what the stages stored, the store only names it) on a batch of entry folders;
the child re-verifies each entry, loads what it holds and calls it, printing one JSON line per
entry. A child killed by a signal (a segfault in a custom call) marks the entry it was on as
unusable, and a new child goes on with the rest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_PROBE_TIMEOUT_S = 600.0
NOT_CHECKED = "not checked: "  # a reason that leaves the entry counted as usable


@dataclass(frozen=True)
class ProbeResult:
    dir: Path
    usable: bool
    reason: str = ""


# The child: it loads executables, so it lives above the store (jaxaot.engine.probe_child);
# named here, not imported, so the store never imports JAX or the stages.
PROBE_MODULE = "jaxaot.engine.probe_child"


def probe_entries(entry_dirs: Sequence[Path], trust: bool) -> list[ProbeResult]:
    """Load each entry in a fresh subprocess (several per process, a new one after a crash);
    one result per entry, in order. What loading an entry means is the child's to say: one
    with nothing to load is usable."""
    results: dict[Path, ProbeResult] = {}
    pending = list(entry_dirs)
    env = dict(os.environ)
    if trust:
        env["JAXAOT_TRUST_STORE"] = "1"
    solo = False  # after a batch timed out: the next entry gets a child (and a timeout) alone
    while pending:
        batch = pending[:1] if solo else pending
        try:
            proc = subprocess.run(
                [sys.executable, "-m", PROBE_MODULE, *map(str, batch)],
                capture_output=True,
                text=True,
                env=env,
                timeout=_PROBE_TIMEOUT_S,
            )
            stdout, rc, stderr = proc.stdout, proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout or ""
            stdout = out.decode() if isinstance(out, bytes) else out
            rc, stderr = None, f"timed out after {_PROBE_TIMEOUT_S:.0f} s"
        for line in stdout.splitlines():
            try:
                rec = json.loads(line)
                d = Path(rec["dir"])
            except (ValueError, KeyError, TypeError):
                continue
            reason = str(rec.get("reason", ""))
            results[d] = ProbeResult(d, not reason or reason.startswith(NOT_CHECKED), reason)
        done = [d for d in batch if d in results]
        pending = [d for d in pending if d not in results]
        if len(done) == len(batch):  # the batch finished (all of it, or a solo re-probe)
            solo = False
            continue
        if rc is None and len(batch) > 1:
            # The timeout was the whole batch's: slow entries before it say nothing about
            # pending[0]. Probe it alone before calling it unusable (--remove deletes those).
            solo = True
            continue
        solo = False
        # The child died on pending[0] (or before any entry): that one is unusable.
        if rc is not None and rc < 0:
            why = f"loading it killed the process ({signal.Signals(-rc).name})"
        elif rc is None:
            why = f"loading it did not finish ({stderr})"
        else:
            tail = stderr.strip().splitlines()[-1:] or [f"exit status {rc}"]
            why = f"the loading process failed: {tail[0][:300]}"
        if not done and rc is not None and rc > 0 and len(pending) == len(entry_dirs):
            # The child could not start at all (no JAX?): nothing about the entries is known.
            raise RuntimeError(f"verify --deep: cannot start a probe process: {why}")
        results[pending[0]] = ProbeResult(pending[0], False, why)
        pending = pending[1:]
    return [results[d] for d in entry_dirs]
