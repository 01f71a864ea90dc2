"""Command-line manners shared by the ``jaxaot*`` commands.

- ``jaxaot ... | head`` ends quietly: once the reader of stdout is gone, further output is
  dropped (stdout is pointed at ``/dev/null``) and the command carries on to its own exit
  status, with no ``BrokenPipeError`` traceback. A run is not cut short by a closed pipe.
- ``jaxaot --version`` names jaxaot, jax, jaxlib and the default backend, composing no config.
- ``program.target`` resolves modules in the current directory, as ``python -m`` does.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO

log = logging.getLogger("jaxaot")


class _PipeSafe:
    """A stdout that turns into a sink when its reader goes away (EPIPE)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.gone = False

    def _drop(self) -> None:
        self.gone = True
        # Also for what is already buffered: the interpreter flushes fd 1 again at exit.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)

    def write(self, text: str) -> int:
        if self.gone:
            return len(text)
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        if self.gone:
            return
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class Captured:
    """What a :func:`capture_fd2` block wrote to file descriptor 2 (set as the block ends)."""

    text = ""


@contextlib.contextmanager
def capture_fd2() -> Iterator[Captured]:
    """Within: file descriptor 2 goes to a temporary file. C++ libraries (libtpu, the CUDA
    plugin) write their start-up lines there directly, past ``sys.stderr``."""
    import tempfile

    caught = Captured()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as buf:
        os.dup2(buf.fileno(), 2)
        try:
            yield caught
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            buf.seek(0)
            caught.text = buf.read().decode(errors="replace")


@contextlib.contextmanager
def quiet_libtpu() -> Iterator[None]:
    """Keep libtpu's start-up noise on a machine without TPUs off the user's terminal.

    libtpu writes straight to file descriptor 2 while it initializes ("could not determine TPU
    accelerator type, please set env var TPU_ACCELERATOR_TYPE", "unexpected worker hostname",
    "Logging before InitGoogle()"): none of it applies to compiling for a described topology.
    Only for the topology path: fd 2 goes to a temporary file for the call, and what was
    written there is logged at DEBUG level (``hydra.verbose=jaxaot`` shows it).
    """
    # libtpu takes /tmp/libtpu_lockfile for the process's lifetime, as if it owned the chips;
    # compile-only devices own nothing, and sweep jobs, tests and other JAX processes would
    # otherwise fail with "Internal error when accessing libtpu multi-process lockfile".
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    fd2 = None
    try:
        with capture_fd2() as fd2:
            yield
    finally:
        noise = fd2.text.strip() if fd2 is not None else ""
        if noise:
            log.debug("libtpu said, while starting (hidden): %s", noise)


def pipe_safe(main: Callable[..., int]) -> Callable[..., int]:
    """A console script's ``main`` run under :func:`quiet_broken_pipe` (``jaxaot-diff | head``
    ends quietly, with the command's own exit status)."""

    @functools.wraps(main)
    def wrapped(*args: Any, **kwargs: Any) -> int:
        with quiet_broken_pipe():
            return main(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def quiet_broken_pipe() -> Iterator[None]:
    """Within: writes to a stdout whose reader has gone are dropped (see the module doc)."""
    saved = sys.stdout
    safe = _PipeSafe(saved)
    sys.stdout = safe
    try:
        yield
    except BrokenPipeError:  # a write that bypassed sys.stdout (e.g. a saved reference)
        safe._drop()
    finally:
        if sys.stdout is safe:
            sys.stdout = saved
        if not safe.gone:
            safe.flush()


# Hydra's launchers log each job as "\t#3 : key=value ...", with the values escaped for its
# grammar (f32\[8\,256\]); jaxaot's sweepers show them as written.
LAUNCHER_LOGGERS = (  # the loggers of Hydra's launchers' per-job lines
    "hydra._internal.core_plugins.basic_launcher",
    "hydra_plugins.hydra_joblib_launcher._core",
)
_HYDRA_ESCAPE = re.compile(r"\\([\\()\[\]{}:=, \t])")


class _Unescaped(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if msg.lstrip().startswith("#") and "\\" in msg:
            record.msg, record.args = _HYDRA_ESCAPE.sub(r"\1", msg), None
        return True


def unescape_launch_lines() -> None:
    """Show the launchers' per-job lines with values as the user wrote them (idempotent)."""
    add_launcher_filter(_Unescaped)


def add_launcher_filter(cls: type[logging.Filter]) -> None:
    """One ``cls()`` on each launcher logger (idempotent)."""
    for name in LAUNCHER_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls())


def cwd_importable() -> None:
    """Put the current directory first on ``sys.path``, as ``python -m`` does, so that
    ``program.target=mypkg.model:loss`` finds ``./mypkg`` without ``PYTHONPATH=.``."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


__all__ = ["cwd_importable", "quiet_broken_pipe", "unescape_launch_lines"]
