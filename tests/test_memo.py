"""jaxaot.util.memo: a sweep's later jobs reuse what JAX already did in this process, never stale."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jaxaot.util import memo


class _Key:
    """A weakly referenceable stand-in for a JAX lowering."""


@pytest.fixture(autouse=True)
def fresh_memo() -> None:
    memo.clear()


def test_derived_computes_once_per_object_and_name() -> None:
    calls: list[str] = []
    a, b = _Key(), _Key()

    def compute(tag: str) -> str:
        calls.append(tag)
        return tag.upper()

    assert [memo.derived(a, "text", lambda: compute("a")) for _ in range(3)] == ["A"] * 3
    assert memo.derived(a, "hlo", lambda: compute("a-hlo")) == "A-HLO"
    assert memo.derived(b, "text", lambda: compute("b")) == "B"
    assert calls == ["a", "a-hlo", "b"]
    assert memo.stats()["derived_hits"] == 2


def test_derived_forgets_an_object_jax_dropped() -> None:
    a = _Key()
    memo.derived(a, "text", lambda: "x")
    del a
    gc.collect()
    assert len(memo._DERIVED) == 0


def test_objects_without_weak_references_are_never_memoized() -> None:
    calls = []
    for _ in range(2):
        memo.derived(None, "text", lambda: calls.append(1))
        memo.executable(None, "k", lambda: calls.append(2))
    assert calls == [1, 2, 1, 2]


def test_executables_are_kept_per_client_and_bounded() -> None:
    c1, c2 = _Key(), _Key()
    assert memo.executable(c1, "k", lambda: "e1") == "e1"
    assert memo.executable(c1, "k", lambda: "other") == "e1"
    assert memo.executable(c2, "k", lambda: "e2") == "e2"  # another client: its own
    for i in range(memo._MAX_EXECUTABLES):
        memo.executable(c1, i, lambda: "filler")
    assert memo.executable(c1, "k", lambda: "reloaded") == "reloaded"  # evicted, least recent


def _artifact_hashes(result: Any, stage: str) -> dict[str, str]:
    arts = result.manifest["stages"][stage]["artifacts"]
    return {name: a["sha256"] for name, a in arts.items()}


def test_second_run_in_a_process_reuses_lowering_and_executable(compose_run: Any) -> None:
    cold = compose_run("program=mlp", "execute.repeats=1")
    before = memo.stats()
    warm = compose_run("program=mlp", "execute.repeats=1")
    after = memo.stats()
    # The jaxpr text, and the lowering's texts, digest and cost analysis (one memo entry); the
    # executable the cold run compiled and stored is the one the warm run loads.
    assert after["derived_hits"] - before["derived_hits"] >= 2
    assert after["executable_hits"] - before["executable_hits"] == 1
    assert warm.manifest["stages"]["compile"]["status"] == "cached"
    for stage in ("stage_out", "lower", "compile"):
        assert _artifact_hashes(warm, stage) == _artifact_hashes(cold, stage), stage
    assert np.array_equal(cold["execute"].outputs, warm["execute"].outputs)


def test_a_changed_program_is_never_served_from_the_memo(compose_run: Any, tmp_path: Path) -> None:
    small = compose_run("program=mlp", "execute.repeats=1")
    wide = compose_run("program=mlp", "program.args.1=f32[32,256]", "execute.repeats=1")
    ran = [wide.manifest["stages"][s]["status"] for s in ("stage_out", "lower", "compile")]
    assert ran == ["ran", "ran", "ran"]
    for name in ("lower/module.stablehlo.mlir", "lower/module.hlo.txt", "stage_out/jaxpr.txt"):
        assert (
            _artifact_hashes(small, name.split("/")[0])[name]
            != _artifact_hashes(wide, name.split("/")[0])[name]
        ), name
    keys = [r.manifest["stages"]["compile"]["key"] for r in (small, wide)]
    assert keys[0] != keys[1]
