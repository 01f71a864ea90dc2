"""The ``jax.config`` section typed (``jaxaot.config.jax_options``): each value of its option's
own type, a boolean never read from a string."""

from __future__ import annotations

from typing import Any

import jax
import pytest
from jaxaot.config.jax_options import KNOWN_BOOLEANS, check_before_import, check_option
from jaxaot.errors import ConfigError
from jaxaot.stages import jaxenv


@pytest.mark.parametrize("value", ["banana", "false", "true", "0", 1, 0.0, "yes"])
def test_a_boolean_option_takes_booleans_only_before_jax(value: Any) -> None:
    with pytest.raises(
        ConfigError,
        match=r"^jax\.config\.jax_enable_x64: expected a boolean \(true or false\), found "
        + repr(value).replace(".", r"\.")
        + r" \((a string|an int|a float)\); write jax\.config\.jax_enable_x64=true or "
        r"jax\.config\.jax_enable_x64=false, unquoted",
    ):
        check_before_import("jax_enable_x64", value)


@pytest.mark.parametrize("value", [True, False, None])
def test_booleans_and_null_pass(value: Any) -> None:
    check_before_import("jax_enable_x64", value)
    check_option("jax_enable_x64", value)


def test_a_list_is_no_option_value() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^jax\.config\.jax_log_compiles: expected one value \(a boolean, number or "
        r"string\), found \[1\] \(a list\)",
    ):
        check_before_import("jax_log_compiles", [1])


def test_the_known_booleans_are_booleans_in_jax() -> None:
    meta = jax.config.meta  # type: ignore[attr-defined]
    assert set(meta) >= KNOWN_BOOLEANS
    assert {name: meta[name][0] for name in KNOWN_BOOLEANS} == dict.fromkeys(KNOWN_BOOLEANS, bool)


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("jax_debug_log_modules", 1, r"expected a string, found 1 \(an int\); quote it"),
        ("jax_compilation_cache_max_size", 1.5, r"expected an int, found 1\.5 \(a float\)"),
        ("jax_compilation_cache_max_size", True, r"expected an int, found True \(a boolean\)"),
        ("jax_persistent_cache_min_compile_time_secs", "1", r"expected a number, found '1'"),
        (
            "jax_numpy_rank_promotion",
            "maybe",
            r"expected one of allow, warn, raise, found 'maybe' \(a string\); use one of those",
        ),
        pytest.param(
            "jax_explicit_x64_dtypes",
            "sometimes",
            r"expected one of warn, error, allow, found 'sometimes'",
            marks=pytest.mark.requires_jax("0.8.0"),  # the option is jax 0.8.0's
        ),
        ("jax_numpy_dtype_promotion", "loose", r"expected one of standard, strict, found 'loose'"),
        ("jax_log_compiles", "false", r"expected a boolean \(true or false\), found 'false'"),
    ],
)
def test_values_are_typed_by_jaxs_own_option_table(name: str, value: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=rf"^jax\.config\.{name}: {match}"):
        check_option(name, value)


def test_enum_options_take_their_spellings() -> None:
    check_option("jax_explicit_x64_dtypes", "allow")
    check_option("jax_numpy_rank_promotion", "raise")
    check_option("jax_default_matmul_precision", None)  # optional: JAX's default


def test_a_refused_value_changes_nothing_and_null_leaves_a_boolean_alone() -> None:
    before = jax.config.jax_debug_nans  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"^jax\.config\.jax_debug_nans: expected a boolean"):
        jaxenv.run_config({"jax_debug_nans": "banana"}, needs_x64=False)
    assert jax.config.jax_debug_nans == before  # type: ignore[attr-defined]
    previous = jaxenv.run_config({"jax_debug_nans": not before}, needs_x64=False)
    try:
        # null keeps what the process has (bool(None) would have turned it off)
        assert jaxenv.run_config({"jax_debug_nans": None}, needs_x64=False) == {}
        assert jax.config.jax_debug_nans is (not before)  # type: ignore[attr-defined]
    finally:
        jaxenv.restore_config(previous)
    assert jax.config.jax_debug_nans == before  # type: ignore[attr-defined]
