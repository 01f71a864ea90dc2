"""The server's wire protocol and process facts (jaxaot.cli.server.protocol, .facts), alone:
round trips and refusals over a socket pair, no server process, no JAX."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import struct
import sys
import time
import types

import pytest
from jaxaot.cli.server import facts, protocol


def test_messages_arrive_whole_and_one_at_a_time() -> None:
    """A reply with the pid and the exit status that arrive in one read are two messages:
    each is received whole, and none takes a byte of the next."""
    a, b = socket.socketpair()
    with a, b:
        protocol.send(a, {"pid": 7})
        protocol.send(a, {"exit": 0, "pad": "x" * 100_000})
        assert protocol.recv(b) == ({"pid": 7}, [])
        assert protocol.recv(b)[0] == {"exit": 0, "pad": "x" * 100_000}


def test_descriptors_travel_with_the_request(tmp_path) -> None:
    (tmp_path / "f").write_text("passed")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    a, b = socket.socketpair()
    with a, b:
        protocol.send(a, {"v": protocol.PROTOCOL, "argv": ["x"]}, [fd])
        msg, fds = protocol.recv(b, maxfds=3)
    os.close(fd)
    assert msg == {"v": protocol.PROTOCOL, "argv": ["x"]} and len(fds) == 1
    assert os.pread(fds[0], 6, 0) == b"passed"  # the same open file, another number
    os.close(fds[0])


def test_received_descriptors_are_close_on_exec_and_closed_with_a_bad_message(tmp_path) -> None:
    """The descriptors of a request the receiver cannot read are closed, not leaked (into a
    server that re-executes itself, say); those it can read are close-on-exec."""
    fd = os.open(tmp_path, os.O_RDONLY)
    a, b = socket.socketpair()
    with a, b:
        opened = set(os.listdir("/proc/self/fd"))
        socket.send_fds(a, [struct.pack("!I", 3) + b"{no"], [fd])
        with pytest.raises(ValueError):
            protocol.recv(b, maxfds=3)
        assert set(os.listdir("/proc/self/fd")) == opened  # the received copy is closed
        protocol.send(a, {"v": protocol.PROTOCOL}, [fd])
        _, fds = protocol.recv(b, maxfds=3)
    os.close(fd)
    assert len(fds) == 1 and not os.get_inheritable(fds[0])
    os.close(fds[0])


def test_a_deadline_bounds_a_message_that_comes_a_byte_at_a_time() -> None:
    """However the bytes come (here: half a header, then nothing), past the deadline recv
    gives up, and the descriptors that came with the first bytes are closed."""
    a, b = socket.socketpair()
    with a, b:
        socket.send_fds(a, [b"\x00\x00"], [a.fileno()])
        opened = set(os.listdir("/proc/self/fd"))
        with pytest.raises(TimeoutError):
            protocol.recv(b, maxfds=3, deadline=time.monotonic() + 0.2)
        assert set(os.listdir("/proc/self/fd")) == opened


@pytest.mark.parametrize("sent", [b"", b"\x00\x00", struct.pack("!I", 10) + b'{"a":'])
def test_a_peer_that_closes_mid_message_gives_none(sent: bytes) -> None:
    a, b = socket.socketpair()
    with b:
        with a:
            a.sendall(sent)
        assert protocol.recv(b, maxfds=3) == (None, [])


def test_bytes_that_are_not_json_are_refused() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("!I", 3) + b"{no" + struct.pack("!I", 0))
        with pytest.raises(ValueError):
            protocol.recv(b)
        with pytest.raises(ValueError):  # an empty message is not an object either
            protocol.recv(b)


def test_operations_carry_the_version() -> None:
    assert protocol.operation("status") == {"v": protocol.PROTOCOL, "op": "status"}
    assert json.loads(json.dumps(protocol.operation("stop")))["op"] == "stop"


def test_exit_messages_from_wait_statuses() -> None:
    assert protocol.exit_message(3 << 8) == {"exit": 3}  # exited with 3
    assert protocol.exit_message(0) == {"exit": 0}
    killed = int(signal.SIGKILL)  # a wait status of a process killed by a signal: the signal
    assert protocol.exit_message(killed) == {"exit": 128 + killed, "signal": killed}


def test_the_peer_judge_trusts_the_same_uid_only() -> None:
    me = os.geteuid()
    assert protocol.peer_problem(1, me, me + 7) is None  # gid is not judged
    assert protocol.peer_problem(99, me + 1, 0) == (
        f"runs as uid {me + 1} (pid 99), not as you (uid {me})"
    )
    a, b = socket.socketpair()
    with a, b:
        assert protocol.peer_credentials(a) == (os.getpid(), me, os.getegid())


def test_process_facts_compare_what_a_fork_cannot_change() -> None:
    mine = facts.process()
    assert facts.process_mismatch(mine, mine) is None
    assert facts.process_mismatch({**mine, "nice": mine["nice"] + 1}, mine) == "priority"
    assert facts.process_mismatch({**mine, "identity": []}, mine) == "user or groups"
    # Given to the child, not compared: a client with another umask is served.
    assert facts.process_mismatch({**mine, "umask": 0o777}, mine) is None


def test_environment_variables_read_at_import_must_agree() -> None:
    mine = {"JAX_ENABLE_X64": "0", "HOME": "/h", "LANG": "C.UTF-8"}
    assert facts.env_mismatch({**mine, "HOME": "/other"}, mine, {}) is None
    assert facts.env_mismatch({**mine, "JAX_ENABLE_X64": "1"}, mine, {}) == (
        "environment (JAX_ENABLE_X64)"
    )
    assert facts.env_mismatch({"XLA_FLAGS": "x", "HOME": "/h"}, mine, {}) == (
        "environment (JAX_ENABLE_X64, LANG, XLA_FLAGS)"
    )
    # What the server's imports set: a client may lack it, not set it otherwise.
    added = {"TF_CPP_MIN_LOG_LEVEL": "1"}
    assert facts.env_mismatch(mine, mine, added) is None
    assert facts.env_mismatch({**mine, "TF_CPP_MIN_LOG_LEVEL": "0"}, mine, added) == (
        "environment (TF_CPP_MIN_LOG_LEVEL)"
    )
    # ... or have it as the imports left it (a client started from a process that imported
    # JAX), where the server's environment lacked it before its imports
    assert facts.env_mismatch({**mine, "TF_CPP_MIN_LOG_LEVEL": "1"}, mine, added) is None
    before = {**mine, "TF_CPP_MIN_LOG_LEVEL": "3"}  # the imports changed it: not the same start
    assert facts.env_mismatch({**mine, "TF_CPP_MIN_LOG_LEVEL": "1"}, before, added) == (
        "environment (TF_CPP_MIN_LOG_LEVEL)"
    )
    assert facts.import_env(mine) == {"JAX_ENABLE_X64": "0", "LANG": "C.UTF-8"}


def test_variables_read_as_a_backend_starts_may_differ(monkeypatch) -> None:
    """The child starts JAX's backends after it took on the client's environment: a variable
    read only then (a process that compiled for a GPU has the CUDA plugin's check skipped)
    is not compared, and an import-time variable beside it still is."""
    mine = {"JAX_ENABLE_X64": "0"}
    skipped = {**mine, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
    assert facts.env_mismatch(skipped, mine, {}) is None
    assert facts.env_mismatch(mine, skipped, {}) is None
    assert facts.env_mismatch({**skipped, "JAX_ENABLE_X64": "1"}, mine, {}) == (
        "environment (JAX_ENABLE_X64)"
    )
    # What jaxaot's CUDA target sets in its process is among them.
    from jaxaot.targets import cuda

    for key in facts.BACKEND_START_ENV:  # restored after the test, set or not
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    before = dict(os.environ)
    cuda.prepare()
    set_by_prepare = {k for k, v in os.environ.items() if before.get(k) != v}
    assert set_by_prepare and set_by_prepare <= facts.BACKEND_START_ENV


def test_a_client_path_may_add_entries_that_hold_nothing_the_server_imported(
    tmp_path, monkeypatch
) -> None:
    """PYTHONPATH is compared by what it does: the client's sys.path. Its own entries may hold
    the user's modules (and their metadata), not one named as a module the server looked up
    (imported, or failed to), a start-up hook or a plugin namespace; the server's entries keep
    their order, those it imported from stay, and gained no such module since it started."""
    monkeypatch.setattr(facts, "looked_up_names", lambda: {"numpy", "yaml", "zstandard"})
    lib, site = tmp_path / "lib", tmp_path / "site-packages"
    for folder in (lib, site / "numpy"):
        folder.mkdir(parents=True)
    mine = facts.ImportPath(
        ["/", str(lib), str(site)],  # "/": the server's cwd, as "" was read there
        {str(lib), str(site)},
        {str(lib): set(), str(site): {"numpy"}},
    )
    project = tmp_path / "project"
    for made in ("mypkg", "mypkg.egg-info"):
        (project / made).mkdir(parents=True)
    (project / "train.py").write_text("")
    (project / "notes.txt").write_text("")
    theirs = [str(project), str(lib), str(site)]
    assert facts.import_env({"PYTHONPATH": str(project)}) == {}
    assert facts.path_mismatch(theirs, "/home/u", mine) is None
    # a relative entry is the client's cwd's; a missing one holds nothing; a repeat is no entry
    rel = ["project", "gone", str(lib), str(site), str(lib)]
    assert facts.path_mismatch(rel, str(tmp_path), mine) is None
    shadows = ("numpy", "yaml.py", "zstandard.py", "sitecustomize.py", "usercustomize.py")
    for name in (*shadows, "hydra_plugins", "jax_plugins"):
        shadow = tmp_path / name.replace(".", "_") / name
        shadow.parent.mkdir()
        (shadow.mkdir() if "." not in name else shadow.write_text(""))
        reason = facts.path_mismatch([str(shadow.parent), *theirs], "/", mine)
        assert reason == f"import path ({name.split('.')[0]} in {shadow.parent})"
    assert facts.path_mismatch(theirs[::-1], "/", mine) == "import path (order)"
    assert facts.path_mismatch(theirs[:2], "/", mine) == f"import path ({site} missing)"
    zipped = tmp_path / "deps.zip"
    zipped.write_bytes(b"PK")
    assert facts.path_mismatch([str(zipped), *theirs], "/", mine) == (
        f"import path ({zipped} is not a folder)"
    )
    # A folder both have: what it held at the server's start is the server's; a module the
    # server looked up, or a start-up hook, that appeared there since is not.
    (lib / "zstandard.py").write_text("")
    assert facts.path_mismatch(theirs, "/", mine) == f"import path (zstandard in {lib})"
    (lib / "zstandard.py").unlink()
    (lib / "sitecustomize.py").write_text("")
    assert facts.path_mismatch(theirs, "/", mine) == f"import path (sitecustomize in {lib})"
    (lib / "sitecustomize.py").unlink()
    (lib / "unrelated.py").write_text("")
    assert facts.path_mismatch(theirs, "/", mine) is None
    assert facts.module_names(str(project)) == {"mypkg", "mypkg.egg-info", "train"}
    # A symbolic link loop is no module to import (ModuleNotFoundError), nor a reason to decline.
    (project / "loop").symlink_to(project / "loop")
    assert facts.module_names(str(project)) == {"mypkg", "mypkg.egg-info", "train"}


def test_an_import_path_is_read_once_from_this_process(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here.py").write_text("")
    monkeypatch.setattr(sys, "path", ["", str(tmp_path), *sys.path])
    mine = facts.ImportPath.of_this_process()
    assert mine.entries[0] == str(tmp_path) and mine.entries.count(str(tmp_path)) == 1
    assert "here" in mine.names[str(tmp_path)]


def test_every_name_a_process_looks_for_is_recorded(monkeypatch, tmp_path) -> None:
    """A library's optional import that failed in the server (jax's zstandard: not found; or
    found and raising as it was imported) stays failed in every child: a client folder that
    has it must not be served."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(facts._Lookups, "names", set())
    (tmp_path / "jaxaot_broken_module.py").write_text("raise ImportError('no')")
    monkeypatch.syspath_prepend(str(tmp_path))
    facts.record_lookups()
    facts.record_lookups()  # once
    assert sys.meta_path.count(facts._Lookups) == 1 and sys.meta_path[0] is facts._Lookups
    for name in ("jaxaot_no_such_module", "jaxaot_broken_module"):
        assert name not in facts.looked_up_names()
        with pytest.raises(ImportError):
            __import__(name)
        assert name in facts.looked_up_names() and name not in sys.modules
    facts.stop_recording()
    assert facts._Lookups not in sys.meta_path


def test_a_process_that_set_things_up_first_is_not_a_jaxaot_process(monkeypatch) -> None:
    """What the entry imports (and the standard library), as `python -m jaxaot` or the
    installed script, is a `jaxaot` process; JAX, NumPy, Hydra, OmegaConf or more of jaxaot
    imported first, replaced stdio, a tracer, or another program as __main__ is a set-up of
    its own."""
    from jaxaot.cli.server import entry

    as_module = types.SimpleNamespace(__spec__=types.SimpleNamespace(name="jaxaot.__main__"))
    script = types.SimpleNamespace(__spec__=None, entry=entry)
    modules: dict[str, object] = dict.fromkeys(
        [*facts.ENTRY_MODULES, "jaxaot.cli.server", "jaxaot.cli.server.client", "json"]
    )
    out, err = io.StringIO(), io.StringIO()
    fake = types.SimpleNamespace(
        modules=modules,
        stdin=sys.stdin,
        stdout=out,
        stderr=err,
        __stdin__=sys.stdin,
        __stdout__=out,
        __stderr__=err,
        gettrace=lambda: None,
        getprofile=lambda: None,
    )
    monkeypatch.setattr(facts, "sys", fake)
    for main in (as_module, script):
        modules["__main__"] = main
        assert facts.own_setup() is None
        for name in ("jax", "numpy.linalg", "hydra", "omegaconf", "jaxaot.store.tiered"):
            modules[name] = object()
            assert facts.own_setup() == f"imported {name}"
            del modules[name]
    fake.stdout = io.StringIO()  # contextlib.redirect_stdout
    assert facts.own_setup() == "replaced stdio"
    fake.stdout = out
    fake.getprofile = lambda: print  # python -m cProfile, a profiler's hook
    assert facts.own_setup() == "a tracer or profiler"
    fake.getprofile = lambda: None
    modules["__main__"] = types.SimpleNamespace(__spec__=None, f=len)  # a script of its own
    assert facts.own_setup() == "called from another program"


def test_the_entries_imports_came_from_are_found(tmp_path, monkeypatch) -> None:
    pkg = tmp_path / "a" / "server_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "server_mod.py").write_text("")
    (tmp_path / "c" / "server_ns").mkdir(parents=True)  # a namespace package's portion
    (tmp_path / "unused").mkdir()
    entries = [str(tmp_path / x) for x in ("a", "b", "c", "unused")]
    monkeypatch.syspath_prepend(str(tmp_path / "c"))
    monkeypatch.syspath_prepend(str(tmp_path / "b"))
    monkeypatch.syspath_prepend(str(tmp_path / "a"))
    for name in ("server_pkg", "server_mod", "server_ns"):
        monkeypatch.delitem(sys.modules, name, raising=False)
        __import__(name)
    try:
        assert facts.entries_used(["b", *entries[::2], entries[3]], str(tmp_path)) == {
            str(tmp_path / x) for x in ("a", "b", "c")
        }
    finally:
        for name in ("server_pkg", "server_mod", "server_ns"):
            sys.modules.pop(name, None)


def test_inherited_descriptors_are_the_inheritable_ones_above_2() -> None:
    r, w = os.pipe()
    try:
        assert r not in facts.inherited_fds()  # pipes are made non-inheritable
        os.set_inheritable(r, True)
        assert r in facts.inherited_fds() and w not in facts.inherited_fds()
    finally:
        os.close(r)
        os.close(w)
