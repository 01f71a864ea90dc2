"""Scripts run each in a process of its own, forked from one that imported the slow imports once.

``python forked.py jax flax.nnx`` imports the named modules, then reads jobs from stdin, one JSON
line each: ``script`` (source text, run as ``python -c`` runs it) or ``path`` (run as ``python
path`` runs it), with ``argv``, ``cwd``, ``env`` and the files for ``stdout`` and ``stderr``. Each
job runs in a child forked for it; the answer is one stdout line, the child's exit status. A fork
is safe here while the imports start no thread and no backend (importing JAX, Flax, Equinox or
optax does not; importing jaxaot does, so scripts import it themselves). What a process reads
as it starts (``PYTHONHASHSEED``) comes from the forker's own environment.

:class:`Forker` starts one and hands it jobs.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import traceback
import types
from pathlib import Path
from typing import Any, NoReturn


def _child(job: dict[str, Any]) -> NoReturn:
    code = 1
    try:
        signal.alarm(600)
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(job[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        if "path" in job:
            sys.path[0] = os.path.dirname(os.path.abspath(job["path"]))
            sys.argv = [job["path"], *job["argv"]]
            runpy.run_path(job["path"], run_name="__main__")
        else:
            sys.path[0] = ""
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            sys.argv = ["-c", *job["argv"]]
            exec(compile(job["script"], "<string>", "exec"), main.__dict__)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(imports: list[str]) -> None:
    """Import ``imports``, then run each job read from stdin in a child of its own."""
    for name in imports:
        importlib.import_module(name)
    for line in iter(sys.stdin.readline, ""):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(json.loads(line))
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)


class Forker:
    """A started ``forked.py`` importing ``imports`` in environment ``env``; close it (or use it
    as a context manager) to end it."""

    def __init__(self, *imports: str, env: dict[str, str]) -> None:
        self.env = env
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *imports],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )

    def run(
        self,
        cwd: Path,
        *,
        script: str | None = None,
        path: Path | None = None,
        argv: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        name: str = "job",
    ) -> tuple[int, str, str]:
        """Run ``script`` (or the file ``path``) with ``argv`` in ``cwd``; its exit status, stdout
        and stderr (kept in ``cwd`` as ``<name>.stdout`` and ``<name>.stderr``)."""
        assert (script is None) != (path is None), "a script or a path"
        out, err = cwd / f"{name}.stdout", cwd / f"{name}.stderr"
        job: dict[str, Any] = {
            "argv": list(argv),
            "cwd": str(cwd),
            "env": self.env if env is None else env,
            "stdout": str(out),
            "stderr": str(err),
        }
        job.update({"script": script} if path is None else {"path": str(path)})
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        status = self.proc.stdout.readline().strip()
        texts = [f.read_text() if f.exists() else "" for f in (out, err)]
        return int(status) if status else -1, texts[0], texts[1]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # the end of its input: it exits
        self.proc.wait(timeout=60)
        assert self.proc.stdout is not None
        self.proc.stdout.close()

    def __enter__(self) -> Forker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    serve(sys.argv[1:])
