"""``execute.inputs`` (``jaxaot.stages.inputs``): .npy and .npz files, never converted silently."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jaxaot.config.argspec import bind
from jaxaot.errors import ConfigError
from jaxaot.stages.inputs import expected_keys

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
    assert str(info.value) == (
        f"execute.inputs[0]: {str(x)!r} holds f64[4], expected f32[4] (as program.args[0] "
        "declares; inputs are never converted): declare f64 in program.args[0] to run in "
        "64-bit (x64), or save it as float32"
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
    with pytest.raises(ConfigError, match=r"^execute\.inputs='.*nope\.npz': no such file$"):
        compose_run(AXPY, "program.args=[f32[4],f32[4]]", f"execute.inputs={tmp_path}/nope.npz")
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match=r"^execute\.inputs='.*bad\.npz': not a readable \.npz"):
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
