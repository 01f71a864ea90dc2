"""Bad input refused in one line naming its key, before JAX or XLA can misread it or abort the
process: each audit finding end to end through the ``jaxaot`` command, and the shape guard
(``jaxaot.stages.array_limits``) on traced programs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import read_manifest
from jaxaot.config.argspec import MAX_ARRAY_BYTES, bind
from jaxaot.errors import ArgSpecError
from jaxaot.stages.array_limits import check_traced, too_big

SIN = ("program.target=jax.numpy:sin", "program.args=[f32[4]]")


def _refused(proc: Any, run_dir: Path, line: str, manifest: str | None) -> None:
    """Exit 1, exactly one stderr line matching ``line`` (no traceback), and the manifest
    absent (refused before the run began) or ended with status ``manifest``."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 1 and re.fullmatch(line, lines[0]), proc.stderr
    if manifest is None:
        assert not (run_dir / "manifest.json").exists()
    else:
        assert read_manifest(run_dir)["status"] == manifest


@pytest.mark.parametrize(
    ("overrides", "line", "manifest"),
    [
        (
            ("program=axpy", "+jax.config.jax_enable_x64=banana"),
            r"jaxaot: error: jax\.config\.jax_enable_x64: expected a boolean \(true or false\), "
            r"found 'banana' \(a string\); write jax\.config\.jax_enable_x64=true or "
            r"jax\.config\.jax_enable_x64=false, unquoted .*",
            None,  # refused with the config, before JAX
        ),
        (
            ("program=axpy", "+jax.config.jax_enable_x64='false'"),
            r"jaxaot: error: jax\.config\.jax_enable_x64: expected a boolean .*found 'false' .*",
            None,
        ),
        (
            ("program=axpy", "+jax.config.jax_numpy_rank_promotion=maybe"),
            r"jaxaot: error: jax\.config\.jax_numpy_rank_promotion: expected one of allow, warn, "
            r"raise, found 'maybe' \(a string\); use one of those values",
            None,  # JAX's option table: refused as JAX is configured, before the run begins
        ),
        (
            ("program.target=jax.numpy:zeros", "program.args=[[99999999999,99999999999]]"),
            r"jaxaot: error: program\.args\[0\]: the static value \(99999999999, 99999999999\) "
            r"makes jax\.numpy:zeros build f32\[99999999999,99999999999\] \(1e\+22 elements, "
            r"4e\+22 bytes\) \(broadcast_in_dim\); XLA sizes arrays in int64 and aborts the "
            r"process on a larger one, so expected at most 9223372036854775807 bytes "
            r"\(2\*\*63 - 1\): use a smaller shape",
            "failed",
        ),
        (
            (
                SIN[0],
                "program.args=[f32[b,b]]",
                "+compile.shapes={b: 10000000000}",
                "stop_after=compile",  # no execute: compile alone must refuse the sizes
            ),
            r"jaxaot: error: program\.args\[0\] at compile\.shapes: "
            r"f32\[10000000000,10000000000\] has 1e\+20 elements \(4e\+20 bytes\); XLA sizes "
            r"arrays in int64, so expected at most 9223372036854775807 bytes .*",
            None,  # before JAX: XLA aborted the process compiling it
        ),
        (
            (SIN[0], "program.args=[f32[1e3]]"),
            r"jaxaot: error: program\.args\[0\]: cannot parse the dimension '1e3' of 'f32\[1e3\]': "
            r"'1e3' is not an integer: write sizes in digits \(1000\); expected an integer, .*",
            None,
        ),
        (
            (SIN[0], "program.args=[f32[b+,4]]"),
            r"jaxaot: error: program\.args\[0\]: cannot parse the dimension 'b\+' of "
            r"'f32\[b\+,4\]': a variable or an integer is missing at the end; expected .*",
            None,
        ),
        (
            (SIN[0], "program.args=[f32[]~heavy]"),
            r"jaxaot: error: program\.args\[0\]: unknown suffix '~heavy' in 'f32\[\]~heavy'; "
            r"expected ~weak \(weakly typed, as a Python scalar\) or ~strong .*",
            None,
        ),
        (
            (*SIN, "execute.inputs=[3.5]"),
            r"jaxaot: error: execute\.inputs\[0\]: expected f32\[4\] \(as program\.args\[0\] "
            r"declares\), found a float scalar 3\.5; give a \.npy file holding f32\[4\] "
            r"\(numpy\.save\), or an \.npz archive of every input \(execute\.inputs=<file>\.npz\)",
            "failed",
        ),
        (
            (*SIN, "execute.rtol=nan"),
            r"jaxaot: error: execute\.rtol: expected a finite number >= 0 or null, found nan; "
            r"null takes the output dtype's default, execute\.check=none skips the comparison",
            None,
        ),
        (
            (*SIN, "execute.atol=inf"),
            r"jaxaot: error: execute\.atol: expected a finite number >= 0 or null, found inf; .*",
            None,
        ),
    ],
)
def test_bad_input_is_one_line_naming_its_key(
    cli: Any, overrides: tuple[str, ...], line: str, manifest: str | None
) -> None:
    extra = ("stage_out.static_argnums=[0]",) if "zeros" in overrides[0] else ()
    proc, run_dir = cli(*overrides, *extra, expect_ok=False)
    _refused(proc, run_dir, line, manifest)


def test_unreadable_input_files_name_the_file_and_never_advise_unpickling(
    cli: Any, tmp_path: Path
) -> None:
    good = tmp_path / "x.npy"
    np.save(good, np.arange(4, dtype=np.float32))
    cut = tmp_path / "cut.npy"
    cut.write_bytes(good.read_bytes()[:-5])
    proc, run_dir = cli(*SIN, f"execute.inputs=[{cut}]", expect_ok=False)
    _refused(
        proc,
        run_dir,
        rf"jaxaot: error: execute\.inputs\[0\]: '{re.escape(str(cut))}' is not a readable \.npy "
        r"file \(Failed to read all data for array\. .*\); expected an array written by "
        r"numpy\.save",
        "failed",
    )
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"hello, not a zip")
    proc, run_dir = cli(*SIN, f"execute.inputs={bad}", expect_ok=False)
    _refused(
        proc,
        run_dir,
        rf"jaxaot: error: execute\.inputs='{re.escape(str(bad))}': not a \.npz archive \(not a "
        r"zip file\); expected a \.npz archive of arrays, as numpy\.savez writes",
        "failed",
    )
    assert "pickle" not in proc.stderr


def test_a_strong_suffix_runs_as_the_plain_type(compose_run: Any) -> None:
    run_dir = compose_run(  # the command line's overrides, run in this process
        "program.target=jax.numpy:add",
        "program.args=[f32[]~strong,f32[]~weak]",
        "stop_after=stage_out",
    ).run_dir
    signature = json.loads((run_dir / "stage_out" / "signature.json").read_text())
    assert [(i["type"], i["weak_type"]) for i in signature["inputs"]] == [
        ("f32[]", False),
        ("f32[]", True),
    ]


# --- the shape guard on traced programs -----------------------------------------------------


def test_too_big_is_xlas_int64_byte_limit() -> None:
    # jaxlib 0.10: f32[2**61 - 1] compiles, f32[2**61] aborts (2**63 bytes).
    assert not too_big((2**61 - 1,), 4) and too_big((2**61,), 4)
    assert too_big((2**31, 2**31), 4) and not too_big((2**31, 2**31), 1)
    assert too_big((MAX_ARRAY_BYTES + 1,), 1)


def _zeros_of(shape: Any) -> jax.Array:
    return jnp.zeros(shape)


def test_a_static_shape_too_big_for_xla_is_refused_naming_the_argument() -> None:
    bound = bind([[99999999999, 99999999999]], {}, static_argnums=[0])
    traced = jax.jit(_zeros_of, static_argnums=0).trace((99999999999, 99999999999))
    with pytest.raises(
        ArgSpecError,
        match=r"^program\.args\[0\]: the static value \(99999999999, 99999999999\) makes m:f "
        r"build f32\[99999999999,99999999999\]",
    ):
        check_traced(traced.jaxpr, bound, "m:f")


def _square_of(n: int, x: jax.Array) -> jax.Array:
    return x + jnp.zeros((n, n)).sum()  # an intermediate, not an output


def test_an_intermediate_built_from_a_static_int_names_it() -> None:
    bound = bind([2**40, "f32[]"], {}, static_argnums=[0])
    traced = jax.jit(_square_of, static_argnums=0).trace(2**40, jax.ShapeDtypeStruct((), "float32"))
    with pytest.raises(
        ArgSpecError,
        match=r"^program\.args\[0\]: the static value 1099511627776 makes m:f build "
        r"f32\[1099511627776,1099511627776\] \(1\.21e\+24 elements, 4\.84e\+24 bytes\)",
    ):
        check_traced(traced.jaxpr, bound, "m:f")


def _salted(salts: tuple[int, ...], x: jax.Array) -> jax.Array:
    return x + sum(s % 7 for s in salts)


def test_static_ints_that_are_no_shape_are_never_refused() -> None:
    salts = (10**12, 10**12 + 7, 10**12 + 9)  # their product passes int64; they are no shape
    bound = bind([list(salts), "f32[3]"], {}, static_argnums=[0])
    traced = jax.jit(_salted, static_argnums=0).trace(salts, jax.ShapeDtypeStruct((3,), "float32"))
    check_traced(traced.jaxpr, bound, "m:f")
