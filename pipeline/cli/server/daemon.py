"""The server process: one per socket, its imports warmed once, then the serve loop.

Started detached by ``jaxaot server start`` (jaxaot.cli.server.commands) as
``python -c`` :data:`SERVE`, in ``/``, logging beside its socket. It takes the socket's flock
(a second server on the same socket returns at once), imports and warms what every run needs
short of starting a JAX backend (:func:`preimport`), freezes what that made out of the garbage
collector's way, and runs :class:`jaxaot.cli.server.loop.Server` until it stops. When a watched
file changed, it re-executes itself with the environment it started with.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any

SERVE = "from jaxaot.cli.server.daemon import serve_forever; serve_forever()"

# Modules a run imports on its way (lowering rules, store, snapshots, examples), measured with
# a sys.modules diff around a warm run of program=transformer_train.
_RUN_IMPORTS = (
    "jax.experimental.multihost_utils",
    "jax.extend",
    "jax.extend.backend",
    "jax.extend.core",
    "jax.extend.core.primitives",
    "jax.extend.linear_util",
    "jax.extend.mlir",
    "jax.extend.random",
    "jax.extend.sharding",
    "jax.extend.source_info_util",
    "jaxaot.examples.axpy",
    "jaxaot.examples.collectives",
    "jaxaot.examples.mlp",
    "jaxaot.examples.transformer",
    "jaxaot.snapshots.snapshot",
    "jaxaot.store.cache",
    "jaxaot.store.maintenance",
    "jaxaot.sweeps.snapshot_check",
    "jaxaot.targets.cuda",
    "jaxaot.util.textdiff",
)


def preimport() -> None:
    """What every run imports and warms up, short of starting a JAX backend: JAX, Hydra,
    jaxaot and its stages, Hydra's plugins, one composition (Hydra's first costs ~0.3 s more
    than later ones: lazy imports, plugin discovery, OmegaConf's grammar) and one trace."""
    import importlib

    import jax
    import jax.numpy as jnp
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.plugins import Plugins

    for name in (
        "jax.export",
        "jax.experimental.serialize_executable",
        "jax.experimental.shard_map",
        "jaxaot.cli.main",
        "jaxaot.engine.runner",
        "jaxaot.engine.summary",
        "jaxaot.sweeps.callbacks",
        "jaxaot.stages.stage_out",
        "jaxaot.stages.lower",
        "jaxaot.stages.compile",
        "jaxaot.stages.execute",
        "jaxaot.stages.inputs",
        "jaxaot.cli.server.compositions",
    ):
        importlib.import_module(name)
    from jaxaot.compat import hydra as compat_hydra
    from jaxaot.compat import jax as compat_jax

    # What a run imports as it goes (~80 ms): optional, none starts a backend (checked below).
    for name in (*_RUN_IMPORTS, *compat_jax.preimport()):
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    with contextlib.suppress(Exception):
        compat_hydra.logging_configurator()  # hydra._internal.logging_config, where Hydra has it
    from jaxaot.api import compose

    Plugins.instance()  # discovers Hydra's plugins (search path, launchers, sweepers) once
    compose(["program=axpy"])
    # The config repository a run's composition starts from, on the command line's search path
    # (pkg://jaxaot.conf): each forked run takes it while its files are as they were (~40 ms).
    from hydra import initialize_config_module
    from jaxaot.sweeps.compose_cache import repository_for

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="jaxaot.conf", version_base="1.3"):
        repository_for(GlobalHydra.instance().config_loader(), "config")
    GlobalHydra.instance().clear()  # each run initializes its own
    spec = jax.ShapeDtypeStruct((2, 2), jnp.float32)
    jax.jit(lambda x: jnp.tanh(x @ x).sum()).trace(spec)  # tracing starts no backend
    from jaxaot.stages import jaxenv

    jaxenv.imported_before_logging()  # before any run's logging was configured
    if compat_jax.backends_started():  # forked children must start their own (fails closed)
        raise RuntimeError("jaxaot server: a JAX backend started while warming up")
    # Nor may plugins be discovered here: each child discovers them with its client's
    # environment (facts.BACKEND_START_ENV is not compared).
    if compat_jax.plugins_discovered():
        raise RuntimeError("jaxaot server: JAX's plugins were discovered while warming up")


def keep_import_filters(before: list[Any], after: list[Any]) -> None:
    """The warning filters the imports added (``after`` less ``before``, the filters as they
    were when they started) installed again, as they are, where the imports put them: ahead of
    the others, or after them (``append=True``), as in a process that imported them itself
    (NumPy's ``always`` for its RankWarning, its ``ignore`` of binary-compatibility messages)."""
    import warnings

    start = after.index(before[0]) if before and before[0] in after else len(after)
    front, back = after[:start], [f for f in after[start:] if f not in before]
    rest = [f for f in warnings.filters if f not in front and f not in back]
    filters: list[Any] = warnings.filters  # type: ignore[assignment]
    filters[:] = [*front, *rest, *back]
    getattr(warnings, "_filters_mutated", lambda: None)()  # as warnings.filterwarnings does


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def serve_forever() -> None:
    """The server process (see the module's docstring)."""
    import warnings

    from jaxaot.cli.server import facts
    from jaxaot.cli.server.folder import check_folder, socket_path
    from jaxaot.cli.server.loop import Server
    from jaxaot.errors import UnsafeSocketError
    from jaxaot.util.fsio import flock_file

    path = socket_path()
    try:
        check_folder(path.parent, create=True)
    except UnsafeSocketError as exc:
        print(f"jaxaot: error: {exc}", file=sys.stderr)  # to the log: `start` said it first
        sys.exit(2)
    # One server per socket: a second one (two `JAXAOT_SERVER=1` runs at once) leaves.
    lock = flock_file(path.with_suffix(".lock"), wait=False)
    if lock.busy:
        return
    env_before = dict(os.environ)
    facts.record_lookups()  # every module name the imports look for (facts.path_mismatch)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("default")  # what an in-process run shows, once each
        ours = list(warnings.filters)
        preimport()
        imported = list(warnings.filters)
    keep_import_filters(ours, imported)
    import gc

    # What the imports made stays put: children's collections skip it, and fewer of its pages
    # are copied into each child (CPython's gc.freeze, meant for exactly this).
    gc.collect()
    gc.freeze()
    server = Server(path, env_before, list(warned), lock)
    server.open()
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    if server.loop():  # an imported file changed: start again from fresh code
        # To the log (the server's stderr): why its counts start again from 0.
        print(
            f"jaxaot server: {server.restart_reason} changed; restarting",
            file=sys.stderr,
            flush=True,
        )
        # With the environment it started with, not the one its imports added to.
        os.execve(sys.executable, [sys.executable, "-c", SERVE], env_before)


__all__ = ["SERVE", "keep_import_filters", "preimport", "serve_forever"]
