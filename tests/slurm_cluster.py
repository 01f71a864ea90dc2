"""A throw-away single-node SLURM cluster for tests: munge, slurmctld and slurmd in a temp dir.

Needs root and Debian's ``slurm-wlm`` and ``munge`` (``make slurm`` installs them). Everything
the daemons write (munge key and socket, state, spool, logs, pid files, slurm.conf) lives in
one directory, so the cluster leaves nothing behind and never touches a system-wide SLURM.
Client commands find it through ``SLURM_CONF``: :meth:`SlurmCluster.env` gives an environment
with it set, and ``sbatch`` passes it on to the jobs.

``python tests/slurm_cluster.py`` starts one and keeps it up until Ctrl-C, for trying things by
hand (it prints the ``export SLURM_CONF=...`` line to paste).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "sinfo", "scontrol", "scancel", "srun")
PARTITION = "debug"
# A requeued job may start again only after the job credential's lifetime (slurm.conf:
# AuthInfo cred_expire, 120 s by default); a few seconds keeps the preemption test short.
CRED_EXPIRE_S = 5


def unavailable() -> str | None:
    """Why no cluster can start here (None when it can): not Linux, not root, no binaries."""
    if not sys.platform.startswith("linux"):
        return f"a SLURM test cluster needs Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "a SLURM test cluster needs root (SlurmUser=root; munged and slurmd as root)"
    missing = [b for b in (*DAEMONS, *CLIENTS) if _which(b) is None]
    if missing:
        return (
            f"SLURM/munge binaries missing ({', '.join(missing)}): run `make slurm` "
            "(apt-get install slurm-wlm munge) as root"
        )
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node_line(name: str) -> str:
    """The node's hardware as slurmd sees it (``slurmd -C``), so slurmd accepts the config."""
    out = subprocess.run(
        [_which("slurmd") or "slurmd", "-C"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    first = next(ln for ln in out.splitlines() if ln.startswith("NodeName="))
    fields = [f for f in first.split()[1:] if not f.startswith("UpTime")]
    return f"NodeName={name} NodeAddr=127.0.0.1 {' '.join(fields)} State=UNKNOWN"


class SlurmCluster:
    """One slurmctld + one slurmd (node named after ``hostname -s``) + munged, all in ``root``."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root or tempfile.mkdtemp(prefix="jaxaot-slurm-"))
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # -- environment ------------------------------------------------------------------------
    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with ``SLURM_CONF`` pointing here."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def cmd(self, *args: str, check: bool = True, timeout: float = 30) -> str:
        """Run a SLURM client command against this cluster; its stdout."""
        proc = subprocess.run(
            list(args), capture_output=True, text=True, env=self.env(), timeout=timeout
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: rc={proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, timeout_s: float = 60) -> SlurmCluster:
        try:
            self._write_files()
            self._start_munge()
            env = self.env()
            for name, args in (
                ("slurmctld", ["-D", "-i", "-f", str(self.conf)]),
                ("slurmd", ["-D", "-f", str(self.conf), "-N", self.node]),
            ):
                log = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 (kept open)
                self._procs[name] = subprocess.Popen(
                    [_which(name) or name, *args], env=env, stdout=log, stderr=subprocess.STDOUT
                )
                log.close()
            self._wait_idle(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _write_files(self) -> None:
        for d in ("munge", "state", "spool", "log", "run"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        r = self.root
        lines = [
            "ClusterName=jaxaottest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run' / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",  # no slurmdbd: sacct has nothing
            "JobCompType=jobcomp/none",
            "JobRequeue=1",  # batch jobs may be requeued (submitit's preemption/timeout path)
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            "ReturnToService=2",
            "KillWait=1",  # SIGTERM -> SIGKILL (submitit ignores SIGTERM) on scancel or requeue
            "MinJobAge=600",  # finished jobs stay visible to squeue/scontrol for 10 min
            "SchedulerParameters=sched_interval=2",
            "InactiveLimit=0",
            "SlurmdTimeout=60",
            _node_line(self.node),
            f"PartitionName={PARTITION} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _start_munge(self) -> None:
        m = self.root / "munge"
        args = [
            _which("munged") or "munged",
            "--foreground",
            "--force",
            f"--socket={self.munge_socket}",
            f"--key-file={m / 'munge.key'}",
            f"--pid-file={m / 'munged.pid'}",
            f"--seed-file={m / 'munged.seed'}",
            f"--log-file={self.root / 'log' / 'munged.log'}",
        ]
        self._procs["munged"] = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 15
        while not self.munge_socket.exists():
            if self._procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self._log_tail('munged.log')}")
            time.sleep(0.05)

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {proc.returncode}: {self._log_tail(name + '.log')}"
                    )
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"],
                capture_output=True,
                text=True,
                env=self.env(),
                timeout=15,
            )
            state = out.stdout.strip()
            if state == f"{self.node} idle":
                return
            time.sleep(0.3)
        raise RuntimeError(
            f"node not idle after {timeout_s:.0f} s (sinfo: {state!r}); "
            f"slurmd: {self._log_tail('slurmd.log')}"
        )

    def _log_tail(self, name: str, n: int = 6) -> str:
        try:
            lines = (self.root / "log" / name).read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-n:])

    def cancel_all(self, wait_s: float = 20) -> None:
        """Cancel every job and wait until the queue is empty (their processes gone)."""
        if "slurmctld" not in self._procs:
            return
        subprocess.run(
            ["scancel", "--partition", PARTITION], env=self.env(), timeout=30, capture_output=True
        )
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            out = subprocess.run(
                ["squeue", "-h", "-o", "%i"],
                capture_output=True,
                text=True,
                env=self.env(),
                timeout=15,
            )
            if out.returncode != 0 or not out.stdout.strip():
                return
            time.sleep(0.3)

    def stop(self) -> None:
        """Cancel the jobs, stop the daemons (the ones this object started), remove the dir."""
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            self.cancel_all()
        for name in reversed(DAEMONS):
            proc = self._procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    reason = unavailable()
    if reason:
        sys.exit(f"slurm_cluster: {reason}")
    with SlurmCluster() as cluster:
        print(f"cluster up in {cluster.root}\nexport SLURM_CONF={cluster.conf}", flush=True)
        # Ctrl-C, or a plain `kill` (a background process ignores SIGINT): tear down either way.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        with contextlib.suppress(KeyboardInterrupt, SystemExit):
            signal.pause()


if __name__ == "__main__":
    main()
