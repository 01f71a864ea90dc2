"""The ``jaxaot`` command: a Hydra app over the shipped ``conf/``.

Quiet by default: the screen gets the summary, warnings and errors; the stage log lines go to
the run's ``jaxaot.log``, and to the screen too with ``-v`` / ``--verbose`` (``verbose=true``;
jaxaot.rundir.logs). A run refused before it starts leaves no folder in ``outputs/``.

Errors that jaxaot raises on purpose are printed as one line on stderr with a non-zero exit;
``debug=true`` (or ``JAXAOT_DEBUG=1``) shows the traceback too. Ctrl-C and SIGTERM end a run as
``interrupted`` in its manifest, with one line and the status ``128 + signal`` (130, 143).
"""

from __future__ import annotations

import gc
import logging
import os
import re
import signal
import sys
import traceback
from typing import Any

import hydra
from jaxaot.api import compose
from jaxaot.compat.hydra import share_help_repository, skip_mode_probe
from jaxaot.config.argspec import quote_array_types
from jaxaot.config.sections import name_after_target
from jaxaot.config.trust import (
    ENV_COMMAND_LINE,
    check_task_config,
    install_command_line,
    install_guards,
)
from jaxaot.engine.own_args import check_own_arguments
from jaxaot.engine.resume import resolve_latest_argv
from jaxaot.errors import ConfigError, DoesNotFit, JaxaotError
from jaxaot.rundir.dirs import (
    check_user_dirs,
    print_only,
    register_resolver,
    remove_unstarted,
    remove_unstarted_runs,
)
from jaxaot.rundir.logs import release_stage_warnings, show_info, verbose_argv
from jaxaot.schema import JaxaotConfig, register_configs
from jaxaot.sweeps.callbacks import last_sweep_failures
from jaxaot.sweeps.progress import JobOutcome
from jaxaot.util.exits import describe_interrupt, exit_code, raise_terminated
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("jaxaot")

# conf/config.yaml's run and sweep dirs use ${unique_dir:...}; registered on import too, so a
# launcher's worker process that unpickles this module's task function can resolve them.
register_resolver()
# What Hydra composes, instantiates and logs with goes through the import policy, in this
# process and in every launcher worker or SLURM job that unpickles the task function below.
# On a Hydra the policy was not tested on (jaxaot.compat.hydra.HYDRA_KNOWN) a worker of a
# jaxaot command line fails to load it; the command line itself refuses in main().
try:
    install_guards()
except ConfigError:
    if os.environ.get(ENV_COMMAND_LINE):
        raise


def _debug(cfg: DictConfig | None) -> bool:
    if os.environ.get("JAXAOT_DEBUG", "") not in ("", "0"):
        return True
    return bool(cfg is not None and cfg.get("debug", False))


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _progress_lines() -> bool:
    """Whether this sweep prints a progress line per job (jaxaot.sweeps.callbacks), with its error."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg: Any = HydraConfig.get()
    sweep = OmegaConf.select(hydra_cfg, "callbacks.sweep") or {}
    return bool(sweep.get("progress", False) and "_target_" in sweep)


DEFAULT_BACKEND = "cpu"  # conf/compile/default.yaml compile.backend


def version_text() -> str:
    """``jaxaot --version``: jaxaot, jax, jaxlib and the backend a run uses by default.

    That backend is ``compile.backend``'s default (conf/compile/default.yaml); like a run, only
    its platform is started, so no other installed plugin (CUDA, TPU) is probed or complains.
    """
    from jaxaot.version import __version__

    lines = [f"jaxaot {__version__}"]
    try:
        from jaxaot.stages.jaxenv import configure

        configure(backend=DEFAULT_BACKEND, num_devices=None, x64=False)
        import jax
        import jaxlib

        lines += [f"jax {jax.__version__}", f"jaxlib {getattr(jaxlib, '__version__', '?')}"]
        devices = jax.devices()
        lines.append(
            f"backend {jax.default_backend()} (compile.backend default): "
            f"{len(devices)} x {devices[0].device_kind}"
        )
    except Exception as exc:  # a broken JAX install is what --version is often run to find
        lines.append(f"jax: unavailable ({type(exc).__name__}: {exc})")
    return "\n".join(lines)


def _remove_if_unstarted() -> None:
    """A single run refused before it started: its folder goes (when jaxaot made it and it
    holds only Hydra's .hydra/ and the log). A sweep keeps its job folders: the sweep's report
    lists the failed job."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized() and not _is_multirun():
        remove_unstarted(HydraConfig.get().runtime.output_dir)


# Sweepers that run one job per value like Hydra's own; any other (a search) needs -m.
_PLAIN_SWEEPERS = ("jaxaot_basic", "basic")


def _check_sweeper_mode() -> None:
    """A search sweeper (``hydra/sweeper=jaxaot_fit``, ``jaxaot_optuna``) chosen without ``-m``:
    Hydra would run the job once and search nothing, so the run is refused naming the fix."""
    from hydra.core.hydra_config import HydraConfig

    if _is_multirun():
        return
    choice = HydraConfig.get().runtime.choices.get("hydra/sweeper")
    if choice and choice not in _PLAIN_SWEEPERS:
        raise ConfigError(
            f"hydra/sweeper={choice}: a search runs only as a sweep, and this command line has "
            f"no -m; expected jaxaot -m hydra/sweeper={choice} ... (without -m, Hydra runs the "
            "job once and searches nothing)"
        )


@hydra.main(version_base="1.3", config_path="pkg://jaxaot.conf", config_name="config")
def _app(cfg: DictConfig) -> int | JobOutcome:
    from hydra.core.hydra_config import HydraConfig
    from jaxaot.engine.runner import run

    show_info(bool(cfg.get("verbose", False)))  # -v: the stage log lines on the screen too
    # In a sweep each job prints one progress line (jaxaot.sweeps.callbacks) instead of the summary,
    # unless it writes or verifies a snapshot: the summary carries that verdict and diff.
    snapshot = OmegaConf.select(cfg, "snapshot.write") or OmegaConf.select(cfg, "snapshot.verify")
    try:
        if HydraConfig.initialized():
            _check_sweeper_mode()
            overrides = list(HydraConfig.get().overrides.task)
            name_after_target(cfg, overrides)
            check_own_arguments(cfg, overrides)
        check_task_config(cfg)  # trust.* and store.trust: the command line's, in every job
        if gc.get_freeze_count() == 0:
            # What this process holds now (Hydra, jaxaot, the composed config) lives as long
            # as it does: frozen, the collector's full passes during the run (JAX's import,
            # tracing) skip it. Once per process; a served run's server froze its own. Cycles
            # already unreachable here (the composition's leftovers) stay for the process's
            # life: a collection first would cost what freezing saves.
            gc.freeze()
        result = run(cfg, print_summary=bool(snapshot) or not _is_multirun())
    except JaxaotError as exc:
        _remove_if_unstarted()
        if _debug(cfg):
            traceback.print_exc()
        code = DoesNotFit.exit_code if isinstance(exc, DoesNotFit) else 1
        # In a sweep the job's progress line shows the error: printed once.
        if not _is_multirun() or not _progress_lines():
            print(f"jaxaot: {'error: ' if code == 1 else ''}{exc}", file=sys.stderr, flush=True)
        if _is_multirun():
            return JobOutcome(code, str(exc))
        sys.exit(code)
    except Exception as exc:
        from jaxaot.util.exits import raise_pending

        raise_pending()  # an interrupt that surfaced as another error (a half-imported module)
        _remove_if_unstarted()
        if _debug(cfg):
            traceback.print_exc()
        print(
            f"jaxaot: internal error: {type(exc).__name__}: {' '.join(str(exc).split())} "
            "(rerun with debug=true for the traceback)",
            file=sys.stderr,
            flush=True,
        )
        if _is_multirun():
            return JobOutcome(
                2, f"internal error: {type(exc).__name__}: {' '.join(str(exc).split())}"
            )
        sys.exit(2)
    return 0 if result.ok else 1


# Arguments that could bring in a config setting ``hydra.mode``: the key itself, a group choice
# under hydra/, an experiment (a global package), or another primary config or config dir.
_MODE_SOURCES = re.compile(r"^[+~]*(hydra\.mode\b|hydra/|experiment\b|-c|--config)")


def _skip_mode_probe(argv: list[str]) -> None:
    """Save Hydra's first of two config compositions when it cannot change anything.

    Hydra composes the whole config once only to read ``hydra.mode`` (``Hydra.get_mode``) and
    then again to run. ``get_mode`` returning None means "RUN, or MULTIRUN under -m", which is
    what it returns anyway unless some config sets ``hydra.mode``; the shipped base config does
    not, so when no argument could bring in one that does, the probe is skipped (~0.2 s).
    """
    if any(_MODE_SOURCES.match(a.strip()) for a in argv):
        return
    skip_mode_probe()  # on a Hydra outside jaxaot.compat.hydra.HYDRA_KNOWN: Hydra probes


def _share_help_repository(argv: list[str]) -> None:
    """Let ``--help`` build Hydra's config repository once instead of once per config group.

    Hydra's help lists every group's options through ``ConfigLoaderImpl.get_group_options``,
    and each call deep-copies the whole repository (the ConfigStore's schemas included) for the
    same config name and overrides: ~100 copies, 2-3 s of ``jaxaot --help``. One
    help process reads one unchanging repository, so one copy per (config, overrides) serves
    every call with the same answers.
    """
    if any(a in ("--help", "-h", "--hydra-help") for a in argv):
        share_help_repository()  # on a Hydra outside HYDRA_KNOWN: one copy per call, as Hydra's


def _one_line(exc: BaseException) -> str:
    """Hydra's multi-line composition errors (and their causes) as one line; a mistyped group,
    option or key as the closest names (jaxaot.config.suggest)."""
    from jaxaot.config.suggest import config_dirs_of, config_names, one_line

    try:
        names = config_names(config_dirs_of(sys.argv[1:]), schema=JaxaotConfig)
    except Exception:  # naming the closest names must never hide the error itself
        names = None
    return one_line(exc, names)


def _is_multirun_argv(args: list[str]) -> bool:
    return any(
        a in ("-m", "--multirun") or a.replace(" ", "") == "hydra.mode=MULTIRUN" for a in args
    )


def main() -> None:
    """Console-script entry point; a sweep in which some job failed exits with status 1."""
    # SIGTERM (a batch system's kill, `timeout`) ends the run like Ctrl-C: recorded, one line.
    signal.signal(signal.SIGTERM, raise_terminated)
    from jaxaot.util.console import quiet_broken_pipe

    if "--version" in sys.argv[1:]:  # jaxaot's, not Hydra's: no config is composed
        with quiet_broken_pipe():
            print(version_text(), flush=True)
        return
    try:
        install_guards()
    except ConfigError as exc:  # a Hydra the import policy was not tested on: no run
        print(f"jaxaot: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)  # as every other error of the config: 2 is an internal error
    try:
        with quiet_broken_pipe():  # `jaxaot ... | head`: the run goes on, its output dropped
            _main()
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM, at any point
        notes = getattr(exc, "__notes__", None)
        print(
            f"jaxaot: {notes[-1] if notes else describe_interrupt(exc)}",
            file=sys.stderr,
            flush=True,
        )
        tracking = sys.modules.get("jaxaot.sweeps.tracking")
        if tracking is not None:  # os._exit skips atexit: log the run or sweep KILLED now
            tracking.end_interrupted()
        # The run is recorded; end now rather than wait for threads an interrupt left running
        # (JAX's backend-start timer, an XLA compile that cannot be cancelled).
        logging.shutdown()
        sys.stdout.flush()
        os._exit(exit_code(exc))


def _main() -> None:
    register_configs()
    # -v / --verbose: the override verbose=true, so that Hydra (and a served run) sees one spelling.
    args = [quote_array_types(a) for a in verbose_argv(sys.argv[1:])]
    _skip_mode_probe(args)
    _share_help_repository(args)
    if any(a in ("--cfg", "-c") for a in args):  # prints the config, runs nothing: no new dirs
        print_only()
    sys.argv = [sys.argv[0], *args]
    # Hydra's own errors (unknown key, wrong type, bad override) would print several lines and
    # a hint about HYDRA_FULL_ERROR; with it set they reach us and become one line here.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        # The import policy's command-line rules, read before Hydra composes or instantiates
        # anything; the guards again, outermost (a served run's composition memo wraps Hydra's).
        install_command_line(args)
        install_guards()
        # resume_from=latest: the run dir it means, chosen once here for every job of a sweep.
        sys.argv = [sys.argv[0], *(args := resolve_latest_argv(args, compose))]
        # A run dir named on the command line that holds a run: refused before Hydra writes in it.
        check_user_dirs(args, _is_multirun_argv(args))
        try:
            _app()
        finally:  # a run that exits (sys.exit) skips the callback that shows or drops them
            release_stage_warnings()
    except Exception as exc:
        remove_unstarted_runs()  # e.g. a logging config refused after Hydra made the run dir
        if _debug(None) or any(a.replace(" ", "").lower() == "debug=true" for a in args):
            traceback.print_exc()
        print(f"jaxaot: error: {_one_line(exc)}", file=sys.stderr, flush=True)
        sys.exit(1)
    from jaxaot.sweeps.snapshot_check import exit_status

    # A sweep job failed (jaxaot.sweeps.callbacks) or its snapshot did not verify.
    if last_sweep_failures() or exit_status():
        sys.exit(1)


if __name__ == "__main__":
    main()
