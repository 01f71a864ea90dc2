"""The ``jaxaot`` command freezes (``gc.freeze``) what its process holds when the first run
starts (Hydra, jaxaot, the composed config), so the collector's full passes during the run (JAX's
import, tracing) skip it; later jobs of an in-process sweep freeze nothing more."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import cli_env, run_cli

# Runs the command in this process and prints how many objects were frozen when the engine
# started each run, and for each full collection during a run whether it examined an object made
# before the command started (a list; no object in a generation is skipped, only frozen ones).
_PROBE = """
import gc, json, runpy, sys
import jaxaot.engine.runner as runner
made_before = [object()]
frozen, full = [], []
def probe(phase, info):
    if phase == "start" and info["generation"] == 2 and frozen:
        full.append(any(o is made_before for o in gc.get_objects()))
gc.callbacks.append(probe)
run = runner.run
def counted(*a, **k):
    frozen.append(gc.get_freeze_count())
    return run(*a, **k)
runner.run = counted
sys.argv = ["jaxaot", *sys.argv[1:]]
try:
    runpy.run_module("jaxaot", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    assert not exc.code, exc.code
print("PROBE " + json.dumps({"frozen": frozen, "full": full}))
"""


def _probe(tmp_path: Path, *args: str) -> dict[str, list[int]]:
    (tmp_path / "probe.py").write_text(_PROBE)
    proc = run_cli(
        [*args, "store.enabled=false", "stop_after=stage_out"],
        cwd=tmp_path,
        module="probe",
        env=cli_env(JAXAOT_SERVER="0", PYTHONPATH=f"{tmp_path}:{cli_env()['PYTHONPATH']}"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PROBE "))
    return json.loads(line[len("PROBE ") :])


def test_a_run_starts_with_the_process_heap_frozen_and_full_collections_skip_it(
    tmp_path: Path,
) -> None:
    seen = _probe(tmp_path, "program=transformer")
    assert len(seen["frozen"]) == 1
    assert seen["frozen"][0] > 10_000  # Hydra's, jaxaot's and the config's objects
    # JAX's import makes enough objects for a full collection; it skips what was frozen.
    assert seen["full"] and not any(seen["full"]), seen


def test_an_in_process_sweep_freezes_once(tmp_path: Path) -> None:
    seen = _probe(tmp_path, "-m", "program=axpy,transformer")
    assert len(seen["frozen"]) == 2
    assert seen["frozen"][0] > 10_000
    # The second job froze nothing more (frozen objects the first job dropped are freed as
    # usual: the count can only fall; a second freeze would add JAX's modules and more).
    assert seen["frozen"][1] <= seen["frozen"][0]
