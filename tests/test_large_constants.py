"""Captured constants: texts elide them, the compile key never does."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jaxaot
import numpy as np
import pytest
from jaxaot.errors import ConfigError
from jaxaot.stages import module_text
from jaxaot.util.canonical import canonical_stablehlo

# 64x64 = 4096 elements: over the default limit (1024). B differs from A in one value.
_A = (np.arange(4096, dtype=np.float32).reshape(64, 64) / 4096).astype(np.float32)
_B = _A.copy()
_B[37, 5] += np.float32(0.5)


def project_a(x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ jnp.asarray(_A))


def project_b(x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ jnp.asarray(_B))


_X = "program.args=[{shape: [4, 64], dtype: f32, init: normal}]"


def _run(compose_run: Any, name: str, *extra: str) -> Any:
    return compose_run(
        f"program.target=test_large_constants:{name}", _X, "execute.repeats=1", *extra
    )


def _out(result: Any) -> np.ndarray:
    return np.load(Path(result.run_dir) / "execute" / "outputs.npz")["out0"]


def _lowered_text(run: Any, name: str) -> str:
    return (Path(run.run_dir) / "lower" / name).read_text()


def test_programs_differing_only_in_a_large_constant_never_share_a_store_entry(compose_run):
    a = _run(compose_run, "project_a")
    b = _run(compose_run, "project_b")
    # The texts cannot tell them apart (the constant is elided) ...
    text_a, text_b = (
        canonical_stablehlo(_lowered_text(r, "module.stablehlo.mlir")) for r in (a, b)
    )
    assert module_text.ELIDED in text_a
    strip = lambda t: "\n".join(ln for ln in t.splitlines() if "jaxaot: constants" not in ln)  # noqa: E731
    assert strip(text_a) == strip(text_b)
    # ... but the compile key does: B compiled (a miss), never loaded A's executable.
    ka, kb = (r.manifest["stages"]["compile"]["key"] for r in (a, b))
    assert ka != kb
    assert [r.manifest["stages"]["compile"]["status"] for r in (a, b)] == ["ran", "ran"]
    assert not np.array_equal(_out(a), _out(b))
    # Warm runs hit their own entries, and every output equals a store-off run bit for bit.
    warm_b = _run(compose_run, "project_b")
    assert warm_b.manifest["stages"]["compile"]["status"] == "cached"
    for name, got in (("project_a", _out(a)), ("project_b", _out(b)), ("project_b", _out(warm_b))):
        off = _run(compose_run, name, "store.enabled=false")
        assert np.array_equal(got, _out(off)) and got.tobytes() == _out(off).tobytes()


def test_texts_elide_large_constants_and_keep_them_on_request(compose_run, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxaot"):
        elided = _run(compose_run, "project_a", "stop_after=lower")
    stablehlo = _lowered_text(elided, "module.stablehlo.mlir")
    hlo = _lowered_text(elided, "module.hlo.txt")
    assert "dense_resource<__elided__> : tensor<64x64xf32>" in stablehlo
    assert "constant({...})" in hlo
    digest = json.loads(_lowered_text(elided, "lowered.json"))["module_sha256"]
    assert stablehlo.rstrip().endswith(digest) and hlo.rstrip().endswith(digest)
    kept = _run(compose_run, "project_a", "stop_after=lower", "lower.elide_constants_over=null")
    full = _lowered_text(kept, "module.stablehlo.mlir")
    assert module_text.ELIDED not in full and "dense<" in full
    assert "{...}" not in _lowered_text(kept, "module.hlo.txt")
    # 16 KiB is below the warning's 1 MiB: no advice for a small table.
    assert not [r for r in caplog.records if "large constant" in r.getMessage()]


def test_bad_elide_option_is_one_line_naming_the_key() -> None:

    with pytest.raises(ConfigError, match=r"lower\.elide_constants_over: expected .* found -1"):
        jaxaot.validate(jaxaot.compose(["lower.elide_constants_over=-1"]))  # before any stage


def test_warning_names_large_captured_constants() -> None:
    big = np.ones((600, 600), np.float32)
    big[0, 0] = 2.0  # not a splat

    def f(x: jax.Array) -> jax.Array:
        return x @ jnp.asarray(big)

    lowered = jax.jit(f).lower(jax.ShapeDtypeStruct((2, 600), jnp.float32))
    found = module_text.large_constants(lowered, 1024)
    assert [(c.type, c.nbytes) for c in found] == [("tensor<600x600xf32>", 600 * 600 * 4)]
    assert found[0].where.startswith("test_large_constants.py:")
    line = module_text.warning(found)
    assert line is not None and "\n" not in line
    assert "tensor<600x600xf32> (1.4 MB)" in line and "pass large arrays as arguments" in line
    # A splat (jnp.zeros) is no captured data: nothing is named.
    zeros = jax.jit(lambda x: x + jnp.zeros((600, 600))).lower(
        jax.ShapeDtypeStruct((600, 600), jnp.float32)
    )
    assert module_text.large_constants(zeros, 1024) == []


def test_complex_constants_are_named_with_their_bytes_beside_the_others() -> None:
    """A complex constant is two parts an element (complex64: 8 bytes), and reading it cannot
    hide the module's other constants: the MLIR bindings cannot hand its attribute to Python
    (jaxlib 0.10: TypeError by name, an abort by index), so the sizes come from its type."""
    c64 = (np.arange(600 * 600, dtype=np.complex64) * (1 + 2j)).reshape(600, 600)
    real = np.arange(300 * 300, dtype=np.float32).reshape(300, 300)

    def f(x: jax.Array) -> jax.Array:
        return (x @ jnp.asarray(c64)).real[:300, :300] + jnp.asarray(real)

    lowered = jax.jit(f).lower(jax.ShapeDtypeStruct((600, 600), jnp.complex64))
    found = module_text.large_constants(lowered, 1024)
    assert [(c.type, c.nbytes) for c in found] == [
        ("tensor<600x600xcomplex<f32>>", 600 * 600 * 8),
        ("tensor<300x300xf32>", 300 * 300 * 4),
    ]
    line = module_text.warning(found)
    assert line is not None and "\n" not in line
    assert line.startswith("the program captures 1 large constant(s), 2.9 MB in all: ")
    assert "tensor<600x600xcomplex<f32>> (2.9 MB) used at test_large_constants.py:" in line
    # A complex splat is no captured data, and complex128 takes 16 bytes an element.
    with jax.enable_x64(True):
        c128 = c64.astype(np.complex128)[:200, :200]
        splat = jax.jit(lambda x: x + jnp.full((500, 500), 1 + 2j, jnp.complex64)).lower(
            jax.ShapeDtypeStruct((500, 500), jnp.complex64)
        )
        wide = jax.jit(lambda x: x + jnp.asarray(c128)).lower(
            jax.ShapeDtypeStruct((200, 200), jnp.complex128)
        )
    assert module_text.large_constants(splat, 1024) == []
    assert [(c.type, c.nbytes) for c in module_text.large_constants(wide, 1024)] == [
        ("tensor<200x200xcomplex<f64>>", 200 * 200 * 16)
    ]


def test_module_digest_ignores_locations_and_names_but_not_values() -> None:
    def g(x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ jnp.asarray(_A))

    spec = jax.ShapeDtypeStruct((4, 64), jnp.float32)
    da, db, dg = (
        module_text.module_digest(jax.jit(f).lower(spec)) for f in (project_a, project_b, g)
    )
    assert dg == da  # another name, another source line: the same program
    assert db != da  # one value of the captured constant differs


def test_module_digest_is_the_sha256_of_the_whole_stripped_bytecode() -> None:
    """The digest is hashed while the bytecode is written (no copy of the constants): the
    same value as hashing the written bytes."""
    import hashlib
    import io

    from jax._src.lib.mlir import ir, passmanager

    lowered = jax.jit(project_a).lower(jax.ShapeDtypeStruct((4, 64), jnp.float32))
    module = lowered.compiler_ir("stablehlo")
    with module.context:
        op = module.operation.clone()
        passmanager.PassManager.parse("builtin.module(strip-debuginfo)").run(op)
        op.attributes["sym_name"] = ir.StringAttr.get("main_module")
        buf = io.BytesIO()
        op.write_bytecode(buf)
        op.erase()
    assert len(buf.getvalue()) > _A.nbytes  # the constant's every byte is in what is hashed
    assert module_text.module_digest(lowered) == hashlib.sha256(buf.getvalue()).hexdigest()


def test_exported_bin_is_byte_for_byte_jax_serialize() -> None:
    """exported.bin's flatbuffer is built at its final size at once: the same bytes as jax's
    ``serialize()`` (derivatives, vjp_order > 0, go through jax's own call)."""
    from jaxaot.stages.lower import _serialize

    exported = jax.export.export(jax.jit(project_a))(jax.ShapeDtypeStruct((4, 64), jnp.float32))
    ours = _serialize(exported, 0)
    assert bytes(ours) == bytes(exported.serialize())
    back = jax.export.deserialize(bytearray(ours))
    x = jnp.ones((4, 64), jnp.float32)
    assert np.array_equal(np.asarray(back.call(x)), np.asarray(project_a(x)))


class _FakeLibc:
    """Records mallopt/malloc_trim calls instead of changing this process's heap."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append(("mallopt", param, value))
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad, 0))
        return 1


def test_the_heap_is_tuned_while_lowering_big_constants_and_put_back_after(
    compose_run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A program whose constants reach heap.WORTH_BYTES lowers with glibc's thresholds raised,
    put back (and the kept memory trimmed) when the stage ends; every artifact and output is
    byte for byte what an untuned run writes."""
    from jaxaot.util import heap

    fake = _FakeLibc()
    monkeypatch.setattr(heap, "_libc", lambda: fake)
    monkeypatch.setattr(heap, "WORTH_BYTES", 10 << 30)  # _A (16 KiB) is not worth it
    plain = _run(compose_run, "project_a", "store.enabled=false")
    monkeypatch.setattr(heap, "WORTH_BYTES", 1)
    monkeypatch.setattr(heap, "MAX_BYTES", _A.nbytes - 1)  # too big to afford
    _run(compose_run, "project_a", "store.enabled=false", "stop_after=lower")
    assert fake.calls == []
    monkeypatch.setattr(heap, "WORTH_BYTES", _A.nbytes)
    monkeypatch.setattr(heap, "MAX_BYTES", _A.nbytes)
    tuned = _run(compose_run, "project_a", "store.enabled=false")
    mmap, trim = heap._M_MMAP_THRESHOLD, heap._M_TRIM_THRESHOLD
    assert fake.calls == [
        ("mallopt", mmap, heap.LIMIT),
        ("mallopt", trim, heap.LIMIT),
        ("mallopt", mmap, heap._MMAP_DEFAULT),
        ("mallopt", trim, heap._TRIM_DEFAULT),
        ("malloc_trim", 0, 0),
    ]
    assert not heap._active
    for rel in ("lower/exported.bin", "lower/module.stablehlo.mlir", "lower/module.hlo.txt"):
        assert (Path(tuned.run_dir) / rel).read_bytes() == (Path(plain.run_dir) / rel).read_bytes()
    assert _out(tuned).tobytes() == _out(plain).tobytes()


def test_heap_tuning_nests_and_is_skipped_where_not_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from jaxaot.util import heap

    fake = _FakeLibc()
    monkeypatch.setattr(heap, "_libc", lambda: fake)
    with heap.reusing_big_buffers(False) as tuned:
        assert tuned is False and fake.calls == []
    with heap.reusing_big_buffers() as outer:
        with heap.reusing_big_buffers() as inner:
            assert outer and inner and len(fake.calls) == 2  # set once, by the outer
        assert len(fake.calls) == 2 and heap._active
    assert len(fake.calls) == 5 and not heap._active
    monkeypatch.setattr(heap, "_libc", lambda: None)  # not glibc (macOS, musl)
    with heap.reusing_big_buffers() as tuned:
        assert tuned is False


def test_heap_tuning_works_on_this_c_library() -> None:
    from jaxaot.util import heap

    glibc = heap._libc() is not None
    with heap.reusing_big_buffers() as tuned:
        assert tuned is glibc
    assert not heap._active
