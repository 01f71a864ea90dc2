"""XLA metadata from config: visible in the StableHLO, the HLO and the optimized HLO."""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jaxaot
import pytest
from jax.experimental import xla_metadata
from jaxaot.errors import ConfigError, TargetError
from jaxaot.examples import transformer

ATTENTION = "jaxaot.examples.transformer:_attention"
NORM = "jaxaot.examples.transformer:_rms_norm"


def _read(run_dir: Path, name: str) -> str:
    return (run_dir / name).read_text()


def _ops_with(text: str, attribute: str) -> list[str]:
    return [ln for ln in text.splitlines() if attribute in ln]


def test_program_wide_attributes_reach_every_stage(compose_run: Any) -> None:
    result = compose_run(
        "program=mlp",
        "+lower.xla_metadata.team=jaxaot",
        "+lower.xla_metadata.priority=2",
        "stop_after=compile",
    )
    stablehlo = _read(result.run_dir, "lower/module.stablehlo.mlir")
    dots = [ln for ln in stablehlo.splitlines() if "stablehlo.dot_general" in ln]
    assert len(dots) == 3
    assert all('mhlo.frontend_attributes = {priority = "2", team = "jaxaot"}' in d for d in dots)
    assert len(_ops_with(_read(result.run_dir, "lower/module.hlo.txt"), 'team="jaxaot"')) >= 3
    optimized = _read(result.run_dir, "compile/optimized.hlo.txt")
    assert re.search(r'dot\(.*frontend_attributes=\{priority="2",team="jaxaot"\}', optimized)


def test_scoped_attributes_mark_only_their_sub_function(compose_run: Any) -> None:
    original = transformer._attention
    result = compose_run(
        "program=transformer",
        "stop_after=compile",
        f"lower.scoped_metadata=[{{target: '{ATTENTION}', must_fuse: '7'}}, "
        f"{{target: '{NORM}', fuse_limit: true, attributes: {{scope: norm}}}}]",
    )
    assert transformer._attention is original  # restored after the trace
    stablehlo = _read(result.run_dir, "lower/module.stablehlo.mlir")
    fused = _ops_with(stablehlo, 'MUST_FUSE = "7"')
    # Attention's einsums are in the group; the MLP matmuls (w1, w2) are not.
    assert sum("stablehlo.dot_general" in ln for ln in fused) == 6
    mlp = [ln for ln in stablehlo.splitlines() if "stablehlo.dot_general" in ln and "x512x" in ln]
    assert mlp and not any("MUST_FUSE" in ln for ln in mlp)
    assert _ops_with(stablehlo, 'FUSE_LIMIT = "true", scope = "norm"')
    optimized = _read(result.run_dir, "compile/optimized.hlo.txt")
    assert _ops_with(optimized, 'MUST_FUSE="7"')
    assert _ops_with(optimized, 'FUSE_LIMIT="true"')


def test_fuse_apis_are_used_where_jax_has_them(
    compose_run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On JAX 0.11+ ``must_fuse_call`` and ``fuse_limit`` exist; stand-ins prove they are used."""

    def must_fuse_call(identifier: str) -> Any:
        def wrap(fn: Any) -> Any:
            def call(*args: Any) -> Any:
                with xla_metadata.set_xla_metadata(VIA_MUST_FUSE_CALL=identifier):
                    return fn(*args)

            return call

        return wrap

    @contextmanager
    def fuse_limit() -> Any:
        with xla_metadata.set_xla_metadata(VIA_FUSE_LIMIT=True):
            yield

    monkeypatch.setattr(xla_metadata, "must_fuse_call", must_fuse_call, raising=False)
    monkeypatch.setattr(xla_metadata, "fuse_limit", fuse_limit, raising=False)
    result = compose_run(
        "program=transformer",
        "stop_after=lower",
        f"lower.scoped_metadata=[{{target: '{ATTENTION}', must_fuse: '1'}}, {{target: '{NORM}', fuse_limit: true}}]",
    )
    stablehlo = _read(result.run_dir, "lower/module.stablehlo.mlir")
    assert _ops_with(stablehlo, 'VIA_MUST_FUSE_CALL = "1"')
    assert _ops_with(stablehlo, 'VIA_FUSE_LIMIT = "true"')
    assert not _ops_with(stablehlo, "MUST_FUSE =")


def test_unknown_scoped_target_is_named(compose_run: Any) -> None:
    with pytest.raises(
        TargetError, match=r"lower.scoped_metadata\[0\].target='jaxaot.examples.transformer:_nope'"
    ):
        compose_run(
            "program=transformer",
            "stop_after=lower",
            "lower.scoped_metadata=[{target: 'jaxaot.examples.transformer:_nope', must_fuse: '1'}]",
        )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "+lower.xla_metadata.team=[1]",
            r"lower.xla_metadata.team: expected a string, number or bool",
        ),
        (
            "lower.scoped_metadata=[{target: nope}]",
            r"lower.scoped_metadata\[0\].target: expected 'package.module:function'",
        ),
        ("lower.scoped_metadata=[{target: 'a.b:c', fuse: 1}]", r"unknown key\(s\) \['fuse'\]"),
        (
            "lower.scoped_metadata=[{target: 'a.b:c'}]",
            r"expected attributes, must_fuse or fuse_limit: true",
        ),
        (
            "lower.scoped_metadata=[{target: 'a.b:c', fuse_limit: 3}]",
            r"fuse_limit: expected true or false",
        ),
    ],
)
def test_metadata_config_errors(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        jaxaot.validate(jaxaot.compose(["program=mlp", override]))
