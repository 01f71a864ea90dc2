"""Argument specs (the package ``jaxaot.config.argspec``, tested through its public names):
parsing leaves and pytrees (grammar), quoting, bind(), sizes and the inputs-fit check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jaxaot
import numpy as np
import pytest
from jaxaot.config.argspec import (
    DTYPES,
    ArraySpec,
    Literal,
    bind,
    canonical_dtype,
    check_inputs_fit,
    leaves,
    nbytes,
    parse_leaf_or_tree,
    parse_type,
    quote_array_types,
    short_name,
    symbols,
    to_static_value,
)
from jaxaot.errors import ArgSpecError, ConfigError

# --- array types written the way JAX prints them ------------------------------------------


@pytest.mark.parametrize(
    ("text", "shape", "dtype"),
    [
        ("f32[128,512]", (128, 512), "float32"),
        ("bf16[2,8]", (2, 8), "bfloat16"),
        ("i32[]", (), "int32"),
        ("bool[4]", (4,), "bool"),
        ("u8[3]", (3,), "uint8"),
        ("c64[2,2]", (2, 2), "complex64"),
        ("f8_e4m3fn[16]", (16,), "float8_e4m3fn"),
        ("f16[1]", (1,), "float16"),
        ("f64[]", (), "float64"),
        ("i8[0]", (0,), "int8"),
        ("i4[6]", (6,), "int4"),
        ("u32[5]", (5,), "uint32"),
        ("c128[]", (), "complex128"),
        ("float32[1, 2, 3]", (1, 2, 3), "float32"),
        ("bfloat16[5]", (5,), "bfloat16"),
        ("int64[2]", (2,), "int64"),
        ("complex64[]", (), "complex64"),
        ("float8_e5m2[4]", (4,), "float8_e5m2"),
        (" F32 [ 2 ] ", (2,), "float32"),
        ("pred[3]", (3,), "bool"),
        ("s32[2]", (2,), "int32"),
    ],
)
def test_parse_type_reads_jax_spellings(text: str, shape: tuple[int, ...], dtype: str) -> None:
    spec = parse_type(text, "program.args[0]")
    assert spec == ArraySpec(shape=shape, dtype=dtype)
    assert spec.init == "normal"


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_has_a_short_and_a_long_spelling_jax_knows(dtype: str) -> None:
    import jax.numpy as jnp

    short = parse_type(f"{short_name(dtype)}[2,3]", "x")
    long = parse_type(f"{dtype}[2,3]", "x")
    assert short == long == ArraySpec(shape=(2, 3), dtype=dtype)
    assert short is not None and short.type_str == f"{short_name(dtype)}[2,3]"
    assert jnp.dtype(dtype).name == dtype


def test_type_str_is_how_jax_prints_the_type() -> None:
    assert str(ArraySpec(shape=(128, 512), dtype="float32")) == "f32[128,512]"
    assert ArraySpec(shape=(), dtype="bfloat16").type_str == "bf16[]"
    assert short_name("uint8") == "u8"
    assert short_name("complex64") == "c64"


def test_canonical_dtype_accepts_long_and_short_names() -> None:
    assert canonical_dtype("bf16", "k") == "bfloat16"
    assert canonical_dtype("float32", "k") == "float32"
    with pytest.raises(ArgSpecError, match=r"k: unknown dtype 'f33'; expected one of .*bf16"):
        canonical_dtype("f33", "k")


def test_parse_type_returns_none_for_text_that_is_not_a_type() -> None:
    assert parse_type("ij,jk->ik", "x") is None
    assert parse_type("f32", "x") is None


def test_symbolic_dimensions_and_weak_types_parse() -> None:
    spec = parse_type("f32[b, 2*b + 1, 4]~weak", "x")
    assert spec is not None and spec.shape == ("b", "2*b + 1", 4) and spec.weak_type
    assert spec.type_str == "f32[b,2*b + 1,4]~weak"
    assert spec.concrete({"b": 3}, "x").shape == (3, 7, 4)
    with pytest.raises(ConfigError, match=r"compile\.shapes: x has the symbolic dimension 'b'"):
        spec.concrete({}, "x")


_GRAMMAR = (
    r"; expected an integer, or an expression of dimension variables and integers with \+ - \*, "
    r"\^<integer>, floordiv\(a, b\), mod\(a, b\), max\(a, b\), min\(a, b\) \(e\.g\. b, "
    r"2\*b \+ 1, floordiv\(b, 2\)\)$"
)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (
            "f32[1e3]",
            r"'1e3' of 'f32\[1e3\]': '1e3' is not an integer: write sizes in digits \(1000\)",
        ),
        ("f32[b+,4]", r"'b\+' of 'f32\[b\+,4\]': a variable or an integer is missing at the end"),
        ("f32[2b]", r"'2b' of 'f32\[2b\]': '2b': write a product with \* \(2\*b\)"),
        ("f32[b**2]", r"'b\*\*2' of 'f32\[b\*\*2\]': write a power with \^ \(b\^2\), not \*\*"),
        ("f32[(b+1)*2]", r"'\(b\+1\)\*2' of .*: JAX's dimension expressions have no grouping"),
        ("f32[max(b)]", r"'max\(b\)' of .*: ',' is missing before '\)'"),
        ("f32[b c]", r"'b c' of .*: unexpected 'c' after 'b'"),
        ("f32[1.5]", r"'1\.5' of .*: '1\.5' is not an integer"),
        ("f32[_]", r"'_' of .*: '_' is not a dimension variable name"),
    ],
)
def test_a_bad_dimension_is_named_with_the_argument_and_the_grammar(text: str, why: str) -> None:
    with pytest.raises(
        ArgSpecError,
        match=r"^program\.args\[0\]: cannot parse the dimension " + why + ".*" + _GRAMMAR,
    ):
        parse_leaf_or_tree(text, "program.args[0]")


def test_a_bad_dimension_in_a_mapping_names_its_shape_key() -> None:
    with pytest.raises(
        ArgSpecError,
        match=r"^program\.args\[1\]\.shape: cannot parse the dimension 'b\+' of shape "
        r"\['b\+', 4\]: a variable or an integer is missing at the end",
    ):
        parse_leaf_or_tree({"shape": ["b+", 4]}, "program.args[1]")


EXPRESSIONS = [
    "b", "2*b", "b + 1", "-b + 8", "b*-2", "b - -2", "b^2", "b ^ 2", "2*b*c", "1_000",
    "floordiv(b, 2)", "mod(b, 3)", "max(b, c)", "min(b, 4)", "floordiv(b+1, 2) * 4",
    "max(2*b, c + 1) - min(b, c)", "mod(floordiv(b, 2), 3) + c^2",
]  # fmt: skip


@pytest.mark.parametrize("text", EXPRESSIONS)
def test_the_dimension_grammar_agrees_with_jax(text: str) -> None:
    """What jax.export.symbolic_shape reads, dim_expr reads, to the same value."""
    import jax
    from jaxaot.config import dim_expr

    (jax_dim,) = jax.export.symbolic_shape(text)
    tree = dim_expr.parse(text)
    for sizes in ({"b": 7, "c": 3}, {"b": 16, "c": 40}):
        want = jax_dim if isinstance(jax_dim, int) else jax_dim._evaluate(sizes)  # jax 0.10
        assert dim_expr.evaluate(tree, sizes) == int(want)
    spec = parse_type(f"f32[{text}]", "x")
    assert spec is not None and spec.symbolic == bool(dim_expr.variables(tree))


@pytest.mark.parametrize("text", ["(b+1)*2", "1e3", "b+", "2b", "b**2", "non_negative(b)", "_"])
def test_what_jax_refuses_is_refused(text: str) -> None:
    import jax
    from jaxaot.config import dim_expr

    with pytest.raises(ValueError, match="syntax error in symbolic shape"):
        jax.export.symbolic_shape(text)
    with pytest.raises(dim_expr.DimSyntaxError):
        dim_expr.parse(text)


def test_calls_in_dimensions_parse_evaluate_and_name_their_variables() -> None:
    spec = parse_type("f32[floordiv(b, 2), max(b, c)]", "x")
    assert spec is not None and spec.shape == ("floordiv(b, 2)", "max(b, c)")
    assert symbols("floordiv(b, 2) + max(b, c)") == ["b", "c"]
    assert spec.concrete({"b": 9, "c": 4}, "x").shape == (4, 9)
    const = parse_type("f32[2*3, 4]", "x")  # no variables: folded, as JAX folds it
    assert const is not None and const.shape == (6, 4) and not const.symbolic
    with pytest.raises(
        ArgSpecError, match=r"^x: the dimension '3-5' of 'f32\[3-5\]' is -2; expected"
    ):
        parse_type("f32[3-5]", "x")


def test_shapes_at_compile_sizes_must_fit_xla() -> None:
    spec = parse_type("f32[b,b]", "program.args[0]")
    assert spec is not None
    with pytest.raises(
        ArgSpecError,
        match=r"^program\.args\[0\] at compile\.shapes: f32\[10000000000,10000000000\] has 1e\+20 "
        r"elements .*XLA sizes arrays in int64",
    ):
        spec.concrete({"b": 10**10}, "program.args[0]")
    with pytest.raises(ConfigError, match=r"^compile\.shapes: program\.args\[0\] is f32\[b - 4\]"):
        parse_type("f32[b - 4]", "x").concrete({"b": 2}, "program.args[0]")  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("text", "weak"), [("f32[]~weak", True), ("f32[]~strong", False), ("f32[2] ~ strong", False)]
)
def test_suffixes_say_weak_or_strong(text: str, weak: bool) -> None:
    spec = parse_type(text, "x")
    assert spec is not None and spec.weak_type is weak


@pytest.mark.parametrize("text", ["f32[]~bogus", "f32[]~", "f32[2]~Weak"])
def test_an_unknown_suffix_lists_the_accepted_ones(text: str) -> None:
    with pytest.raises(
        ArgSpecError,
        match=r"^program\.args\[0\]: unknown suffix '~\w*' in .*; expected ~weak \(weakly typed, "
        r"as a Python scalar\) or ~strong \(the default: the dtype as written\), or none$",
    ):
        parse_leaf_or_tree(text, "program.args[0]")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("x32[3]", r"program\.args\[0\]: unknown dtype 'x32'"),
        ("f32[3,]", r"program\.args\[0\]: cannot parse array type 'f32\[3,\]': empty dimension"),
        ("f32[,]", r"cannot parse array type 'f32\[,\]'"),
        (
            "f32[a/b]",
            r"program\.args\[0\]: cannot parse the dimension 'a/b' of 'f32\[a/b\]': '/' is not "
            r"allowed in a dimension; expected an integer, or an expression",
        ),
        ("f32[3", r"cannot parse array type 'f32\[3'"),
        ("notatype[2]", r"unknown dtype 'notatype'"),
    ],
)
def test_unparsable_array_types_are_errors(text: str, match: str) -> None:
    with pytest.raises(ArgSpecError, match=match):
        parse_leaf_or_tree(text, "program.args[0]")


# --- mappings {shape, dtype, init, ...} -------------------------------------------------------


def test_mapping_defaults() -> None:
    assert parse_leaf_or_tree({"shape": [2, 3]}, "a") == ArraySpec(shape=(2, 3), dtype="float32")


def test_mapping_with_every_option() -> None:
    spec = parse_leaf_or_tree(
        {
            "shape": [4],
            "dtype": "bf16",
            "init": "uniform",
            "scale": 2,
            "low": -1,
            "high": 3,
            "seed": 7,
        },
        "a",
    )
    assert spec == ArraySpec(
        shape=(4,), dtype="bfloat16", init="uniform", scale=2.0, low=-1.0, high=3.0, seed=7
    )


@pytest.mark.parametrize("init", ["normal", "uniform", "zeros", "ones", "arange"])
def test_mapping_inits(init: str) -> None:
    assert parse_leaf_or_tree({"shape": [2], "init": init}, "a").init == init


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (
            {"shape": [2], "init": "gaussian"},
            r"a\.init: expected one of normal, uniform, zeros, ones, arange or a \.npy path, found 'gaussian'",
        ),
        ({"shape": [2], "init": "file"}, r"a\.init: expected one of .* found 'file'"),
        ({"shape": [512], "dtyp": "bf16"}, r"a: unknown array-spec key\(s\) \['dtyp'\]"),
        ({"shape": 3}, r"a\.shape: expected a list of ints, found 3"),
        ({"shape": "2,3"}, r"a\.shape: expected a list of ints, found '2,3'"),
        ({"shape": [2, -1]}, r"a\.shape: expected non-negative ints, found \[2, -1\]"),
        ({"shape": [2, 1.5]}, r"a\.shape: expected non-negative ints"),
        ({"shape": [2], "dtype": "f33"}, r"a\.dtype: unknown dtype 'f33'"),
        ({"shape": [2], "scale": "big"}, r"a\.scale: expected a number, found 'big'"),
        ({"shape": [2], "low": True}, r"a\.low: expected a number, found True"),
        ({"shape": [2], "seed": True}, r"a\.seed: expected an int >= 0, found True"),
        ({"shape": [2], "seed": 1.5}, r"a\.seed: expected an int >= 0, found 1\.5"),
        ({"shape": [2], "seed": -1}, r"a\.seed: expected an int >= 0, found -1"),
        (
            {"shape": [2**31, 2**31]},
            r"a: f32\[2147483648,2147483648\] has 4\.61e\+18 elements \(1\.84e\+19 bytes\); XLA sizes arrays in int64",
        ),
        ({"init": "zeros"}, r"a: array spec needs 'shape'"),
    ],
)
def test_bad_mappings_are_errors(spec: dict[str, Any], match: str) -> None:
    with pytest.raises(ArgSpecError, match=match):
        parse_leaf_or_tree(spec, "a")


# --- .npy leaves ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "array",
    [
        np.zeros((3, 4), np.float32),
        np.arange(5, dtype=np.int32),
        np.array(True),
        np.ones(2, np.uint8),
    ],
    ids=["f32", "i32", "bool-scalar", "u8"],
)
def test_npy_path_leaf_reads_shape_and_dtype_from_the_header(
    tmp_path: Path, array: np.ndarray
) -> None:
    path = tmp_path / "x.npy"
    np.save(path, array)
    spec = parse_leaf_or_tree(str(path), "program.args[0]")
    assert spec == ArraySpec(shape=array.shape, dtype=array.dtype.name, init="file", path=str(path))


def test_npy_version_2_header(tmp_path: Path) -> None:
    path = tmp_path / "v2.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array(f, np.zeros((2, 3), np.float16), version=(2, 0))
    assert parse_leaf_or_tree(str(path), "a") == ArraySpec(
        shape=(2, 3), dtype="float16", init="file", path=str(path)
    )


def test_npy_as_init_of_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "w.npy"
    np.save(path, np.zeros((2, 3), np.float32))
    spec = parse_leaf_or_tree({"init": str(path), "dtype": "bf16"}, "a")
    assert spec == ArraySpec(shape=(2, 3), dtype="bfloat16", init="file", path=str(path))
    assert parse_leaf_or_tree({"init": str(path), "shape": [2, 3]}, "a").shape == (2, 3)
    with pytest.raises(
        ArgSpecError, match=r"a\.shape: \[3, 2\] differs from .*w\.npy'.s shape \[2, 3\]"
    ):
        parse_leaf_or_tree({"init": str(path), "shape": [3, 2]}, "a")


def test_missing_and_unreadable_npy_files(tmp_path: Path) -> None:
    with pytest.raises(ArgSpecError, match=r"a: \.npy file '.*nope\.npy' does not exist"):
        parse_leaf_or_tree(str(tmp_path / "nope.npy"), "a")
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"not numpy at all")
    with pytest.raises(ArgSpecError, match=r"a: '.*bad\.npy' is not a readable \.npy file"):
        parse_leaf_or_tree(str(bad), "a")
    with pytest.raises(ArgSpecError, match=r"a\.init: \.npy file .* does not exist"):
        parse_leaf_or_tree({"init": str(tmp_path / "nope.npy")}, "a")


# --- literals and pytrees ---------------------------------------------------------------------


@pytest.mark.parametrize("value", [3, 2.5, True, "ij,jk->ik", None])
def test_literals(value: Any) -> None:
    assert parse_leaf_or_tree(value, "a") == Literal(value)


def test_unsupported_values_are_errors() -> None:
    with pytest.raises(ArgSpecError, match=r"a: unsupported value .* of type object"):
        parse_leaf_or_tree(object(), "a")


def test_nested_pytrees_and_their_leaf_paths() -> None:
    tree = parse_leaf_or_tree(
        {
            "layers": [{"w": "f32[2,3]", "b": {"shape": [3], "init": "zeros"}}],
            "lr": 0.1,
            "embed": "bf16[8,2]",
        },
        "program.args[0]",
    )
    assert tree["layers"][0]["b"] == ArraySpec(shape=(3,), dtype="float32", init="zeros")
    assert tree["lr"] == Literal(0.1)
    # Dict keys in sorted order, as jax.tree_util flattens them.
    assert [(p, str(leaf)) for p, leaf in leaves(tree) if isinstance(leaf, ArraySpec)] == [
        ("embed", "bf16[8,2]"),
        ("layers[0].b", "f32[3]"),
        ("layers[0].w", "f32[2,3]"),
    ]
    assert [p for p, _ in leaves(tree)] == ["embed", "layers[0].b", "layers[0].w", "lr"]


def test_a_dict_of_arguments_is_not_mistaken_for_a_spec() -> None:
    tree = parse_leaf_or_tree({"shape": "f32[3]", "w": {"shape": [2]}}, "a")
    assert tree == {"shape": ArraySpec((3,), "float32"), "w": ArraySpec((2,), "float32")}


# --- quoting for Hydra's override grammar -----------------------------------------------------


@pytest.mark.parametrize(
    ("override", "quoted"),
    [
        (
            "program.args=[f32[128,512],{shape:[512],dtype:bf16,init:normal}]",
            "program.args=['f32[128,512]',{shape:[512],dtype:bf16,init:normal}]",
        ),
        ("program.args=[f32[4,8], f32[8,2]]", "program.args=['f32[4,8]', 'f32[8,2]']"),
        ("program.args=[i32[],i32[]]", "program.args=['i32[]','i32[]']"),
        ("program.args=[[f32[2],{a:i32[]}]]", "program.args=[['f32[2]',{a:'i32[]'}]]"),
        ("+program.kwargs.x=f32[3]", "+program.kwargs.x='f32[3]'"),
        ("program.args=[f8_e4m3fn[2],bool[4]]", "program.args=['f8_e4m3fn[2]','bool[4]']"),
        # unknown dtypes and bad shapes are quoted too, so argspec (not Hydra) reports them
        ("program.args=[x32[3]]", "program.args=['x32[3]']"),
        ("program.args=[f32[a,b]]", "program.args=['f32[a,b]']"),
        # every ~suffix and a dimension with a call: argspec names a bad one, not Hydra's lexer
        ("program.args=[f32[]~strong,f32[]~weak]", "program.args=['f32[]~strong','f32[]~weak']"),
        ("program.args=[f32[]~bogus]", "program.args=['f32[]~bogus']"),
        ("program.args=[f32[floordiv(b,2),4]]", "program.args=['f32[floordiv(b,2),4]']"),
    ],
)
def test_quote_array_types_quotes_types(override: str, quoted: str) -> None:
    assert quote_array_types(override) == quoted


@pytest.mark.parametrize(
    "override",
    [
        "program.args=['f32[128,512]', \"bf16[2]\"]",
        "program.args=['ij,jk->ik', 'f32[4,8]']",
        "stage_out.axis_env=[[i,4],[j,2]]",
        "program.args=[3,4]",
        "stage_out.static_argnums=[0]",
        "stop_after=lower",
        "program=axpy",
        "hydra.searchpath=[file:///tmp/conf]",
        "program.args=[${program.args[1]},2]",
        "--cfg",
    ],
)
def test_quote_array_types_leaves_other_text_alone(override: str) -> None:
    assert quote_array_types(override) == override


def test_quoted_overrides_compose_to_the_types() -> None:

    cfg = jaxaot.compose(
        ["program=axpy", "program.args=[f32[128,512],{shape:[512],dtype:bf16,init:normal},3]"]
    )
    assert cfg.program.args[0] == "f32[128,512]"
    assert dict(cfg.program.args[1]) == {"shape": [512], "dtype": "bf16", "init": "normal"}
    assert cfg.program.args[2] == 3


# --- bind: static and donated positions -------------------------------------------------------


def test_literals_at_traced_positions_are_weak_scalars() -> None:
    bound = bind([3, 4], {})
    assert bound.static_argnums == ()
    assert bound.traced_args() == [("program.args[0]", Literal(3)), ("program.args[1]", Literal(4))]


def test_static_positions_and_names() -> None:
    bound = bind(["ij,jk->ik", "f32[4,8]", "f32[8,2]"], {}, static_argnums=[0])
    assert bound.is_static(0) and not bound.is_static(1)
    assert [p for p, _ in bound.traced_args()] == ["program.args[1]", "program.args[2]"]

    by_name = bind(["f32[2]", 3], {}, static_argnames=["n"], names_of_positions=["x", "n"])
    assert by_name.static_argnums == (1,)
    assert by_name.static_argnames == ("n",)

    kw = bind([], {"x": "f32[2]", "causal": True}, static_argnames=["causal"])
    assert kw.is_static("causal") and not kw.is_static("x")
    assert kw.traced_args() == [("program.kwargs.x", ArraySpec((2,), "float32"))]


def test_static_literal_lists_become_tuples() -> None:
    bound = bind(["f32[2,6]", [3, [4, 1]]], {}, static_argnums=[1])
    value = to_static_value(bound.args[1], "program.args[1]")
    assert value == (3, (4, 1))
    assert isinstance(value, tuple) and isinstance(value[1], tuple)


def test_donation() -> None:
    bound = bind(["f32[4]", "f32[4]"], {}, donate_argnums=[0])
    assert bound.donate_argnums == (0,)
    named = bind(["f32[4]", "f32[4]"], {}, donate_argnames=["y"], names_of_positions=["x", "y"])
    assert named.donate_argnums == (1,)


def test_needs_x64_only_for_traced_64_bit_arrays() -> None:
    assert bind(["f64[3]"], {}).needs_x64
    assert bind([], {"z": "c128[2]"}).needs_x64
    assert not bind(["f32[3]", 3], {}).needs_x64


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"static_argnums": [5]},
            ConfigError,
            r"stage_out\.static_argnums: position 5 is out of range; program\.args has 2 positional argument\(s\) \(positions 0\.\.1\)",
        ),
        (
            {"donate_argnums": [2]},
            ConfigError,
            r"lower\.donate_argnums: position 2 is out of range; program\.args has 2",
        ),
        (
            {"static_argnums": [0], "donate_argnums": [0]},
            ConfigError,
            r"lower\.donate_argnums: argument 0 is static \(stage_out\.static_argnums\); only traced array arguments can be donated",
        ),
        (
            {"static_argnums": [0], "donate_argnames": ["x"], "names_of_positions": ["x", "y"]},
            ConfigError,
            r"lower\.donate_argnums: argument 0 is static",
        ),
        (
            {"static_argnames": ["y"], "donate_argnames": ["y"]},
            ConfigError,
            r"lower\.donate_argnames: 'y' is static",
        ),
        (
            {"static_argnames": ["nope"], "names_of_positions": ["x", "y"]},
            ConfigError,
            r"stage_out\.static_argnames: 'nope' is neither a parameter of the target nor a key of program\.kwargs \(parameters: x, y\)",
        ),
        (
            {"static_argnums": [1]},
            ArgSpecError,
            r"program\.args\[1\] is marked static but is an array spec \(f32\[4\]\); static arguments must be values",
        ),
    ],
)
def test_bind_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        bind([3, "f32[4]"], {}, **kwargs)


def test_string_at_a_non_static_position_says_to_make_it_static() -> None:
    with pytest.raises(
        ArgSpecError,
        match=r"program\.args\[0\]: 'ij,jk->ik' is a str at a non-static position; JAX can only "
        r"trace arrays and numbers: add it to stage_out\.static_argnums",
    ):
        bind(["ij,jk->ik", "f32[4,8]"], {})
    with pytest.raises(
        ArgSpecError, match=r"program\.kwargs\.mode: .* add it to stage_out\.static_argnames"
    ):
        bind([], {"mode": "fast"})
    with pytest.raises(ArgSpecError, match=r"program\.args\[0\]\.opt\[1\]: 'x' is a str"):
        bind([{"opt": [1, "x"]}], {})


def test_a_static_dict_is_an_error() -> None:
    with pytest.raises(ArgSpecError, match=r"program\.args\[0\] is marked static but is a dict"):
        bind([{"a": 1}], {}, static_argnums=[0])


def test_arg_spec_errors_are_config_errors_and_value_errors() -> None:
    assert issubclass(ArgSpecError, ConfigError)
    assert issubclass(ArgSpecError, ValueError)


# --- sizes XLA cannot represent or this machine cannot hold ----------------------------------


def test_an_element_count_that_overflows_int64_names_the_argument() -> None:
    # Unrefused, this aborts the process at compile (SIGABRT in XLA's shape checks).
    with pytest.raises(
        ArgSpecError,
        match=r"^program\.args\[0\]: f32\[99999999999,99999999999\] "
        r"has 1e\+22 elements \(4e\+22 bytes\); XLA sizes arrays in int64",
    ):
        bind(["f32[99999999999,99999999999]"], {})
    with pytest.raises(ArgSpecError, match=r"^program\.kwargs\.w\.shape|^program\.kwargs\.w: "):
        bind([], {"w": {"shape": [2**40, 2**40], "dtype": "bf16"}})


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("f32[1152921504606846976]", True),  # 2**60 elements, 2**62 bytes: XLA compiles it
        ("f32[2305843009213693952]", False),  # 2**61 elements, 2**63 bytes: XLA aborts
        ("i8[4611686018427387904]", True),  # 2**62 bytes
        ("i8[9223372036854775808]", False),  # 2**63 elements
        ("i4[9223372036854775807]", True),  # 2**63 - 1 int4 elements: 2**62 bytes
        ("c128[576460752303423488]", False),  # 2**59 * 16 bytes = 2**63
    ],
)
def test_the_size_limit_is_int64_bytes(text: str, ok: bool) -> None:
    if ok:
        assert parse_type(text, "a") is not None
    else:
        with pytest.raises(ArgSpecError, match=r"expected at most 9223372036854775807 bytes"):
            parse_type(text, "a")


def test_nbytes_rounds_sub_byte_types_up() -> None:
    assert [nbytes((3,), d) for d in ("int4", "int2", "bool", "float8_e4m3fn", "bfloat16")] == [
        2,
        1,
        3,
        3,
        6,
    ]
    assert nbytes((2, 3), "complex128") == 96 and nbytes((), "float32") == 4


def test_inputs_larger_than_memory_are_refused_naming_the_argument() -> None:
    bound = bind(["f32[1024,1024]", {"a": "f32[256]", "b": "i32[4]"}, 3], {})
    check_inputs_fit(bound, memory=4 * 2**20 + 1024 + 16)  # exactly fits
    with pytest.raises(
        ArgSpecError,
        match=r"^program\.args\[0\] alone is 4\.0 MiB, more than "
        r"this machine's 1\.0 MiB of memory: .*stop_after=compile",
    ):
        check_inputs_fit(bound, memory=2**20)
    with pytest.raises(
        ArgSpecError,
        match=r"^the arguments total 4\.0 MiB \(the largest, "
        r"program\.args\[0\], 4\.0 MiB\)",
    ):
        check_inputs_fit(bound, memory=4 * 2**20 + 1024)
    # Static arguments are values, not buffers.
    check_inputs_fit(bind(["f32[2]", [1, 2]], {}, static_argnums=[1]), memory=8)
