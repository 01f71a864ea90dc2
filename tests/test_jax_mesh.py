"""The private JAX internals stages/jax_mesh.py relies on (jax 0.10.2), against plain JAX in the
same test: the ``pjit.get_ctx_mesh`` replacement that lowers a program without arguments for
its mesh's devices holds only in the thread that asked for it, and each internal that a later
JAX lacks or lays out otherwise is refused in one line naming the jax version, never an
AttributeError or a program compiled wrong."""

from __future__ import annotations

import contextlib
import copy
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aot_mesh_programs as progs
import jax
import numpy as np
import pytest
from jax._src import pjit
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P
from jaxaot.errors import BackendError
from jaxaot.stages import jaxenv
from jaxaot.stages.jax_mesh import bound_context, tracing_on

AUTO = AbstractMesh((2,), ("data",), axis_types=(AxisType.Auto,))
VERSION = re.escape(jax.__version__)


@pytest.fixture(autouse=True)
def _programs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _two_devices() -> Iterator[None]:
    """2 virtual CPU devices, as a run with compile.num_devices=2 has."""
    previous = jaxenv.configure(backend="cpu", num_devices=2, x64=False)
    yield
    jaxenv.restore_config(previous)


def _module(amesh: AbstractMesh) -> str:
    """The argless program's module, lowered with ``amesh`` in this thread's context."""
    with jax.sharding.use_abstract_mesh(amesh):
        return jax.jit(progs.argless).trace().lower(lowering_platforms=("cpu",)).as_text()


def _partitions(module: str) -> int:
    found = re.search(r"mhlo\.num_partitions = (\d+)", module)
    assert found is not None
    return int(found.group(1))


def _concrete() -> Any:
    return jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])


def test_the_context_mesh_holds_only_in_the_thread_that_traces_inside_it() -> None:
    # JAX (jax 0.10.2): with an Auto AbstractMesh in context, jax.jit records no device context
    # and lowers the program for one device; under jax.set_mesh of the concrete mesh, for two.
    plain = _module(AUTO)
    assert _partitions(plain) == 1
    with jax.set_mesh(_concrete()):
        assert _partitions(jax.jit(progs.argless).lower().as_text()) == 2
    original = pjit.get_ctx_mesh
    inside, done = threading.Event(), threading.Event()
    got: dict[str, str] = {}
    failed: list[BaseException] = []

    def tracing() -> None:
        try:
            with tracing_on(AUTO, unplaced=True):
                got["inside"] = _module(AUTO)
                inside.set()
                assert done.wait(60)
                got["inside, after the other thread"] = _module(AUTO)
        except BaseException as exc:
            failed.append(exc)
            inside.set()

    def other() -> None:
        try:
            assert inside.wait(60)
            assert pjit.get_ctx_mesh is not original  # the replacement is in place meanwhile
            got["other thread"] = _module(AUTO)
        except BaseException as exc:
            failed.append(exc)
        finally:
            done.set()

    threads = [threading.Thread(target=tracing), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failed, failed
    assert _partitions(got["inside"]) == _partitions(got["inside, after the other thread"]) == 2
    assert got["other thread"] == plain  # plain JAX's lowering, not the mesh's
    assert pjit.get_ctx_mesh is original  # put back once no thread is inside
    assert _module(AUTO) == plain


def test_an_explicit_mesh_needs_no_replacement_as_jax_records_it_itself() -> None:
    # JAX records a context AbstractMesh with an Explicit axis as the jit's device context.
    explicit = AbstractMesh((2,), ("data",), axis_types=(AxisType.Explicit,))
    plain = _module(explicit)
    assert _partitions(plain) == 2
    original = pjit.get_ctx_mesh
    with tracing_on(explicit, unplaced=True):
        assert pjit.get_ctx_mesh is original
        assert jax.jit(progs.argless).trace().lower(lowering_platforms=("cpu",)).as_text() == plain


@pytest.mark.requires_jax("0.10.2")  # jax._src.pjit.get_ctx_mesh
@pytest.mark.parametrize("broken", ["missing", "other signature"])
def test_a_jax_without_get_ctx_mesh_is_refused_naming_the_version(
    monkeypatch: pytest.MonkeyPatch, broken: str
) -> None:
    if broken == "missing":
        monkeypatch.delattr(pjit, "get_ctx_mesh")
        found = r"AttributeError: .*'get_ctx_mesh'"
    else:
        monkeypatch.setattr(pjit, "get_ctx_mesh", lambda mesh_context: None)
        found = r"TypeError: get_ctx_mesh takes \(mesh_context\), not \(use_resource_env\)"
    with pytest.raises(BackendError) as refused, tracing_on(AUTO, unplaced=True):
        pass
    text = str(refused.value)
    assert re.match(
        rf"jax {VERSION}: jax\._src\.pjit\.get_ctx_mesh, which jaxaot uses to lower a program "
        rf"without arguments for its mesh's devices, is missing or changed \({found}\); expected "
        r"jax 0\.10\.2, which has it \(jax>=0\.6\.2,<0\.11 as jaxaot requires\): install that "
        r"jax, or a jaxaot made for this one$",
        text,
    ), text
    assert "\n" not in text


def test_binding_the_context_mesh_compiles_as_under_set_mesh() -> None:
    # JAX: under jax.set_mesh the argless program's outputs are on the concrete mesh (bound
    # to the devices as the compile stage binds it: device_assignment of the mesh's devices).
    with jax.set_mesh(_concrete()):
        want = jax.jit(progs.argless)()
    with tracing_on(AUTO, unplaced=True):
        live = jax.jit(progs.argless).trace().lower(lowering_platforms=("cpu",))
    devices = tuple(jax.devices()[:2])
    got = bound_context(live, devices).compile(device_assignment=devices)()
    assert got.sharding == want.sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _broken(live: Any, broken: str) -> Any:
    """A copy of ``live`` laid out as a later JAX might lay it out (``live`` untouched)."""
    odd = copy.copy(live)
    if broken == "no _lowering":
        del odd._lowering
    elif broken == "no compile_args":
        odd._lowering = object()
    elif broken == "no context_mesh":
        comp = copy.copy(live._lowering)
        comp.compile_args = {k: v for k, v in comp.compile_args.items() if k != "context_mesh"}
        odd._lowering = comp
    else:
        comp = copy.copy(live._lowering)
        del comp._executable
        odd._lowering = comp
    return odd


BROKEN = ["no _lowering", "no compile_args", "no context_mesh", "no _executable"]


@pytest.mark.parametrize("broken", BROKEN)
def test_a_lowering_laid_out_otherwise_is_refused_not_compiled_unreadable(broken: str) -> None:
    with tracing_on(AUTO, unplaced=True):
        live = jax.jit(progs.argless).trace().lower(lowering_platforms=("cpu",))
    with pytest.raises(BackendError) as refused:
        bound_context(_broken(live, broken), jax.devices()[:2])
    text = str(refused.value)
    assert text.startswith(
        f"jax {jax.__version__}: jax.stages.Lowered._lowering's compile_args['context_mesh'] "
        "and _executable, "
        "which jaxaot uses to bind a mesh lowering's context mesh to the devices it compiles "
        "for, is missing or changed ("
    )
    assert "expected jax 0.10.2" in text and "\n" not in text


@pytest.mark.parametrize("broken", BROKEN)
def test_a_lowering_with_nothing_to_rebind_compiles_whatever_its_layout(broken: str) -> None:
    # A program with arguments on an Auto mesh: jax.jit records no context mesh (jax 0.10.2),
    # its shardings name the mesh, and bound_context hands the lowering back as it is, without
    # reading the private internals a later JAX may lay out otherwise; it compiles and runs
    # as plain JAX's own lowering does.
    x = jax.ShapeDtypeStruct((4, 4), np.float32, sharding=jax.sharding.NamedSharding(AUTO, P()))
    with tracing_on(AUTO):
        live = jax.jit(progs.matmul).trace(x, x).lower(lowering_platforms=("cpu",))
    assert live._lowering.compile_args["context_mesh"].empty
    odd = _broken(live, broken)
    devices = tuple(jax.devices()[:2])
    assert bound_context(odd, devices) is odd
    assert bound_context(live, devices) is live
    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    got = live.compile(device_assignment=devices)(a, a)
    with jax.set_mesh(_concrete()):
        want = jax.jit(progs.matmul)(a, a)
    assert got.sharding == want.sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_jax_whose_jit_ignores_the_context_is_refused_not_lowered_for_one_device(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A later JAX that keeps get_ctx_mesh but no longer asks it: the argless program would be
    # lowered for one device and fail to compile; the lower stage refuses it instead.
    import jaxaot
    from jaxaot.compat import jax as compat_jax

    @contextlib.contextmanager
    def inert() -> Iterator[None]:
        yield

    monkeypatch.setattr(compat_jax, "auto_context_mesh", inert)
    overrides = [
        "program.target=aot_mesh_programs:argless",
        "program.args=[]",
        "mesh.shape=[2]",
        "mesh.axes=[data]",
        "stop_after=lower",
    ]
    with pytest.raises(BackendError) as refused:
        jaxaot.run(jaxaot.compose(overrides), run_dir=tmp_path / "r")
    text = str(refused.value)
    assert re.match(
        rf"jax {VERSION}: jax\._src\.pjit\.get_ctx_mesh \(its result no longer decides the "
        r"devices of a jit without arguments: lowered for 1\), which jaxaot uses to lower a "
        r"program without arguments for the mesh's 2 devices, is missing or changed",
        text,
    ), text
    assert "\n" not in text


def test_a_jax_without_the_donation_table_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from jax._src.interpreters import mlir
    from jaxaot.stages.export_rules import donating

    assert donating(("cpu",)) and not donating(("other",))  # jax 0.10.2's own table
    monkeypatch.delattr(mlir, "_platforms_with_donation")
    with pytest.raises(BackendError, match=rf"^jax {VERSION}: jax\._src\.interpreters\.mlir\."):
        donating(("cpu",))
