"""``execute.inputs`` (``jaxaot.stages.inputs``): .npy and .npz files, never converted silently."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jaxaot.config.argspec import bind
from jaxaot.errors import ConfigError
from jaxaot.stages.inputs import expected_keys, user_inputs

AXPY = "program=axpy"
TREE = (
    "program.target=aot_programs:tree_fn",
    "program.args=[{w:f32[2,3],b:{shape:[2],init:zeros}},f32[3],2]",
    "program.kwargs={scale:0.5}",
    "stage_out.static_argnums=[2]",
)


@pytest.fixture(autouse=True)
def _programs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # aot_programs


def _out(run_dir: Path) -> dict[str, np.ndarray]:
    with np.load(run_dir / "execute" / "outputs.npz") as z:
        return {k: z[k] for k in z.files}


def test_an_f64_npy_for_an_f32_argument_is_refused_naming_the_input(
    compose_run: Any, tmp_path: Path
) -> None:
    x = tmp_path / "x.npy"
    np.save(x, np.arange(4, dtype=np.float64) + 1e-9)  # not representable in float32
    with pytest.raises(ConfigError) as info:
        compose_run(AXPY, "program.args=[f32[4],f32[4]]", f"execute.inputs=[{x},{x}]")
    # Every mismatched input is named in the one line (JAX lists every mismatched argument).
    one = (
        "execute.inputs[{i}]: {x!r} holds f64[4], expected f32[4] (as program.args[{i}] "
        "declares; inputs are never converted): declare f64 in program.args[{i}] to run in "
        "64-bit (x64), or save it as float32"
    )
    assert str(info.value) == (
        "execute.inputs: 2 inputs differ from the types declared for them: "
        + "; ".join(one.format(i=i, x=str(x)) for i in range(2))
    )


def test_an_f64_npy_for_an_f64_argument_runs_in_64_bit(compose_run: Any, tmp_path: Path) -> None:
    values = np.arange(4, dtype=np.float64) + 1e-9
    x = tmp_path / "x.npy"
    np.save(x, values)
    result = compose_run(AXPY, "program.args=[f64[4],f64[4]]", f"execute.inputs=[{x},{x}]")
    out = _out(result.run_dir)["out0"]
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, 2 * values + values)  # bit for bit, no f32 round trip


def test_a_wrong_shape_names_the_file_and_the_spec(compose_run: Any, tmp_path: Path) -> None:
    a = tmp_path / "a.npy"
    np.save(a, np.arange(3, dtype=np.int32))
    with pytest.raises(ConfigError) as info:
        compose_run(AXPY, "program.args=[i32[],i32[]]", f"execute.inputs=[{a},{a}]")
    b = tmp_path / "b.npy"
    np.save(b, np.int32(1))
    with pytest.raises(ConfigError) as info:
        compose_run(AXPY, "program.args=[i32[],i32[]]", f"execute.inputs=[{a},{b}]")
    assert str(info.value) == (
        f"execute.inputs[0]: {str(a)!r} holds i32[3], expected i32[] (as program.args[0] "
        "declares; inputs are never converted): save it as i32[], or change program.args[0]"
    )


def test_npz_keys_are_the_signature_input_paths(compose_run: Any, tmp_path: Path) -> None:
    result = compose_run(*TREE, "stop_after=stage_out")
    signature = json.loads((result.run_dir / "stage_out" / "signature.json").read_text())
    assert expected_keys(result["stage_out"].bound) == [i["path"] for i in signature["inputs"]]


def test_an_npz_archive_holds_every_input_by_path(compose_run: Any, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    w, b, x = (rng.normal(size=s).astype(np.float32) for s in ((2, 3), (2,), (3,)))
    archive = tmp_path / "in.npz"
    # kwargs['scale'] is a traced literal (0.5): it may be left out and keeps its value.
    np.savez(archive, **{"args[0]['w']": w, "args[0]['b']": b, "args[1]": x})
    from_npz = compose_run(*TREE, f"execute.inputs={archive}", "execute.check=reference")
    got = _out(from_npz.run_dir)
    np.testing.assert_allclose(got["out1"], (w @ x) * 2 * 0.5 + b, rtol=1e-6)
    assert got["out0"] == np.float32(x.sum())
    # The same arrays as .npy files give the same outputs bit for bit.
    paths = {}
    for name, arr in (("w", w), ("b", b), ("x", x)):
        paths[name] = tmp_path / f"{name}.npy"
        np.save(paths[name], arr)
    from_npy = compose_run(
        *TREE,
        f"execute.inputs={{args:[{{w:{paths['w']},b:{paths['b']}}},{paths['x']}],kwargs:{{scale:0.5}}}}",
    )
    for k, v in _out(from_npy.run_dir).items():
        np.testing.assert_array_equal(got[k], v)


def _archive(tmp_path: Path, **arrays: Any) -> Path:
    path = tmp_path / "in.npz"
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        (
            {"args[0]": np.ones(4, np.float32)},
            r"no array 'args\[1\]' \(expected keys: args\[0\], args\[1\]\)",
        ),
        (
            {
                "args[0]": np.ones(4, np.float32),
                "args[1]": np.ones(4, np.float32),
                "args[2]": np.ones(1),
            },
            r"unexpected array\(s\) \['args\[2\]'\]; expected keys: args\[0\], args\[1\]",
        ),
        (
            {"args[0]": np.ones(4, np.float64), "args[1]": np.ones(4, np.float32)},
            r"\['args\[0\]'\] holds f64\[4\], expected f32\[4\] \(as program\.args\[0\] declares",
        ),
    ],
)
def test_npz_errors_name_the_archive_and_the_key(
    compose_run: Any, tmp_path: Path, arrays: dict[str, Any], match: str
) -> None:
    path = _archive(tmp_path, **arrays)
    with pytest.raises(ConfigError, match=r"^execute\.inputs='.*in\.npz'.*" + match):
        compose_run(AXPY, "program.args=[f32[4],f32[4]]", f"execute.inputs={path}")


def test_a_missing_or_unreadable_npz_is_one_line(compose_run: Any, tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"^execute\.inputs='.*nope\.npz': no such file; expected a \.npz archive of arrays",
    ):
        compose_run(AXPY, "program.args=[f32[4],f32[4]]", f"execute.inputs={tmp_path}/nope.npz")
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(
        ConfigError, match=r"^execute\.inputs='.*bad\.npz': not a \.npz archive \(not a zip file\)"
    ):
        compose_run(AXPY, "program.args=[f32[4],f32[4]]", f"execute.inputs={bad}")


@pytest.mark.parametrize(
    ("leaf", "match"),
    [
        (
            "a.npz",
            r"^execute\.inputs\[0\]: 'a\.npz' is a string; an archive names every "
            r"argument: give it alone, execute\.inputs=<file>\.npz$",
        ),
        (
            "hello",
            r"^execute\.inputs\[0\]: 'hello' is a string; expected a \.npy path or a number$",
        ),
    ],
)
def test_a_string_leaf_is_not_passed_to_the_program(
    compose_run: Any, leaf: str, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        compose_run(AXPY, "program.args=[f32[4],f32[4]]", f"execute.inputs=[{leaf},1.0]")


def test_expected_keys_of_positional_dict_and_keyword_arguments() -> None:
    bound = bind(
        [{"w": "f32[2]", "b": ["f32[1]", 3]}, "i32[]", 7], {"z": "f32[4]"}, static_argnums=[2]
    )
    assert expected_keys(bound) == [
        "args[0]['b'][0]",
        "args[0]['b'][1]",
        "args[0]['w']",
        "args[1]",
        "kwargs['z']",
    ]


# --- numbers and unreadable files, checked against the specs (user_inputs) --------------------


@pytest.mark.parametrize(
    ("spec", "value", "match"),
    [
        (
            "f32[4]",
            3.5,
            r"^execute\.inputs\[0\]: expected f32\[4\] \(as program\.args\[0\] declares\), found "
            r"a float scalar 3\.5; give a \.npy file holding f32\[4\] \(numpy\.save\), or an "
            r"\.npz archive of every input \(execute\.inputs=<file>\.npz\)$",
        ),
        ("i32[]", 3.5, r"^execute\.inputs\[0\]: expected i32\[\] .*found a float scalar 3\.5, "),
        ("i32[]", 2**40, r"found an int scalar 1099511627776, which is no int32 value"),
        ("f32[]", True, r"found the bool True, which is no float32 value"),
        ("bool[]", 1, r"found an int scalar 1, which is no bool value"),
        ("f32[]", 1e39, r"found a float scalar 1e\+39, which is no float32 value"),
    ],
)
def test_a_number_for_an_array_is_refused_unless_it_is_that_scalar(
    spec: str, value: Any, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        user_inputs(bind([spec], {}), [value])


def test_a_number_for_a_scalar_array_is_given_its_declared_dtype() -> None:
    (f,), _ = user_inputs(bind(["f32[]"], {}), [3.5])
    assert isinstance(f, np.ndarray) and f.dtype == np.float32 and f.shape == () and f == 3.5
    (i,), _ = user_inputs(bind(["u8[]"], {}), [255])
    assert i.dtype == np.uint8 and i == 255
    (w,), _ = user_inputs(bind(["f32[]~weak"], {}), [2])
    assert w.dtype == np.float32 and w.weak_type and float(w) == 2.0


def test_a_number_for_a_traced_literal_keeps_the_literal_type() -> None:
    bound = bind([3, 1.5], {})
    args, _ = user_inputs(bound, [4, 2])
    assert args == [4, 2.0] and isinstance(args[1], float)
    with pytest.raises(
        ConfigError,
        match=r"^execute\.inputs\[0\]: expected an int \(program\.args\[0\] is 3, traced as a "
        r"weakly typed int scalar\), found a float scalar 3\.5; give an int, or change "
        r"program\.args\[0\]$",
    ):
        user_inputs(bound, [3.5, 1.0])


def _never_advises_unpickling(message: str) -> None:
    assert "allow_pickle" not in message and "pickle.load" not in message


def test_a_truncated_npy_names_the_file_and_the_key(tmp_path: Path) -> None:
    good = tmp_path / "x.npy"
    np.save(good, np.arange(4, dtype=np.float32))
    cut = tmp_path / "cut.npy"
    cut.write_bytes(good.read_bytes()[:-5])  # the header is whole, the data is not
    with pytest.raises(ConfigError) as info:
        user_inputs(bind(["f32[4]"], {}), [str(cut)])
    assert str(info.value).startswith(
        f"execute.inputs[0]: {str(cut)!r} is not a readable .npy file (Failed to read all data"
    )
    assert str(info.value).endswith("; expected an array written by numpy.save")
    _never_advises_unpickling(str(info.value))


def test_a_truncated_npy_init_names_the_argument(tmp_path: Path) -> None:
    from jaxaot.stages.inputs import spec_inputs

    good = tmp_path / "x.npy"
    np.save(good, np.arange(4, dtype=np.float32))
    bound = bind([{"init": str(good)}], {})
    good.write_bytes(good.read_bytes()[:-5])  # cut after the spec read its header
    with pytest.raises(
        ConfigError, match=r"^program\.args\[0\]: '.*x\.npy' is not a readable \.npy"
    ):
        spec_inputs(bound, 0)


def test_a_npz_that_is_no_zip_or_holds_objects_is_never_unpickled(tmp_path: Path) -> None:
    pickled = tmp_path / "p.npz"
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (tmp_path / "p.npz.npy").rename(pickled)  # a pickle-bearing .npy named .npz
    bound = bind(["f32[4]"], {})
    with pytest.raises(ConfigError) as info:
        user_inputs(bound, str(pickled))
    assert str(info.value) == (
        f"execute.inputs={str(pickled)!r}: not a .npz archive (not a zip file); expected a .npz "
        "archive of arrays, as numpy.savez writes"
    )
    objects = tmp_path / "o.npz"
    np.savez(objects, **{"args[0]": np.array([None, 1], dtype=object)})
    with pytest.raises(ConfigError) as info:
        user_inputs(bound, str(objects))
    assert str(info.value).startswith(
        f"execute.inputs={str(objects)!r}: unreadable (array 'args[0]'): it holds pickled Python "
        "objects"
    )
    _never_advises_unpickling(str(info.value))


def test_an_npy_of_objects_or_strings_names_the_file_and_is_never_unpickled(
    tmp_path: Path,
) -> None:
    objects, strings = tmp_path / "o.npy", tmp_path / "s.npy"
    np.save(objects, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(strings, np.array(["ab"]))
    bound = bind(["f32[1]"], {})
    with pytest.raises(ConfigError) as info:
        user_inputs(bound, [str(objects)])
    assert str(info.value) == (
        f"execute.inputs[0]: {str(objects)!r} holds Python objects (dtype object), which jaxaot "
        "never loads (no unpickling); expected a numeric array"
    )
    with pytest.raises(
        ConfigError,
        match=rf"^execute\.inputs\[0\]: '{re.escape(str(strings))}': unknown dtype 'str64'; "
        "expected one of bool, ",
    ):
        user_inputs(bound, [str(strings)])
