"""The child process of ``jaxaot-store verify --deep`` (:mod:`jaxaot.store.probe` spawns it):
each compile entry named on the command line is loaded and called on zeros; one JSON line per
entry says why it cannot be used here, or "" when it loads and runs."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxaot.store.probe import NOT_CHECKED


def _zeros(info: Any) -> Any:
    import numpy as np

    return np.zeros(info.shape, info.dtype)


def _device_count(entry_dirs: Sequence[Path]) -> int:
    """Enough devices for every compile entry named: one more than the highest device id its
    ``compiled.json`` records."""
    count = 1
    for d in entry_dirs:
        try:
            meta = json.loads((d / "compiled.json").read_bytes())
            count = max(count, max(int(i) for i in meta["device_ids"]) + 1)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return count


def probe_one(entry_dir: Path, trust: bool) -> str:
    """Why the compile entry at ``entry_dir`` cannot be used here, or "" when it loads and runs."""
    import pickle
    from types import SimpleNamespace

    import jax
    from jax.experimental import serialize_executable
    from jaxaot.errors import ColdLoadError
    from jaxaot.stages import custom_calls
    from jaxaot.store.entries import Refused, load_entry

    key, stage = entry_dir.name, entry_dir.parent.parent.name
    try:
        entry = load_entry(entry_dir, stage, key, None, trust)
    except Refused as bad:
        return bad.reason
    if entry is None:
        return "entry vanished"
    if "executable.bin" not in entry.files:
        return ""  # nothing to load (the backend could not serialize it)
    meta = json.loads(entry.read_bytes("compiled.json"))
    backend, ids = meta["backend"], [int(i) for i in meta["device_ids"]]
    try:
        by_id = {d.id: d for d in jax.devices(backend)}
    except RuntimeError:
        return f"{NOT_CHECKED}no {backend} backend here"
    if any(i not in by_id for i in ids):
        return f"compiled for {backend} devices {ids}, this host has {sorted(by_id)}"
    hlo = entry.read_bytes("optimized.hlo.txt") if "optimized.hlo.txt" in entry.files else None
    try:
        custom_calls.prepare(hlo, backend, SimpleNamespace(state="loaded"), "entry")
    except ColdLoadError:
        return f"{NOT_CHECKED}it calls custom calls its program registers (never loaded cold)"
    try:
        payload, in_tree, out_tree = pickle.loads(entry.read_bytes("executable.bin"))
    except Exception as exc:
        return f"cannot unpickle executable.bin: {type(exc).__name__}: {exc}"
    try:
        compiled = serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, backend=backend, execution_devices=[by_id[i] for i in ids]
        )
    except Exception as exc:
        return f"cannot load the executable: {type(exc).__name__}: {' '.join(str(exc).split())}"
    try:
        args, kwargs = jax.tree_util.tree_map(_zeros, compiled.args_info)
        out = jax.block_until_ready(compiled(*args, **kwargs))
    except Exception as exc:
        return f"calling it failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    if jax.tree_util.tree_structure(out) != out_tree:
        return f"its outputs are {jax.tree_util.tree_structure(out)}, it declares {out_tree}"
    return ""


def main(argv: Sequence[str]) -> int:
    import jax
    from jaxaot.util.fsio import trust_from_env

    # Enough virtual CPU devices for every entry, and x64 so f64 arguments keep their type.
    jax.config.update("jax_num_cpu_devices", _device_count([Path(a) for a in argv]))
    jax.config.update("jax_enable_x64", True)
    trust = trust_from_env()
    for arg in argv:
        d = Path(arg)
        try:
            reason = probe_one(d, trust)
        except Exception as exc:  # anything else: this entry is unusable, go on
            reason = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        print(json.dumps({"dir": str(d), "reason": reason}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
