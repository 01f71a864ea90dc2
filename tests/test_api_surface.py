"""The Python API's surface: ``dir(jaxaot)`` lists every public name without importing JAX,
and what a run returns reads in a few lines (its repr), stage records included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jaxaot
import pytest
from conftest import REPO, cli_env
from jaxaot.util.reprs import cut, tree_text


def test_dir_lists_every_public_name_and_importing_loads_no_jax() -> None:
    code = (
        "import json, sys, jaxaot; "
        "print(json.dumps([dir(jaxaot), jaxaot.__all__, "
        "[m for m in ('jax', 'hydra', 'omegaconf') if m in sys.modules]]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    names, public, loaded = json.loads(proc.stdout)
    assert {"run", "compose", "RunResult", "validate", "JaxaotConfig"} <= set(names)
    assert set(public) <= set(names)
    assert names == sorted(names)
    assert loaded == []  # dir() named the lazy ones without importing them


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> jaxaot.RunResult:
    tmp = tmp_path_factory.mktemp("api")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXAOT_STORE_DIR", str(tmp / "store"))
        cfg = jaxaot.compose(["program=mlp", "execute.repeats=3", "execute.warmup=1"])
        return jaxaot.run(cfg, run_dir=tmp / "run")


def test_a_run_results_repr_is_a_few_lines_of_key_facts(result: jaxaot.RunResult) -> None:
    text = repr(result)
    lines = text.splitlines()
    assert len(text) < 800 and len(lines) == 6, text
    assert lines[0] == f"RunResult(ok: program jaxaot.examples.mlp:mlp, run_dir {result.run_dir}"
    for line, stage in zip(lines[1:5], ("stage_out", "lower", "compile", "execute"), strict=True):
        assert line.split()[:2] == [stage, "ran"], line
        assert line.split()[3] == "s"  # its seconds
    flops = result.manifest["stages"]["compile"]["metrics"]["flops"]
    assert f"{flops / 1e6:.2f} MFLOP" in lines[3] and "temp " in lines[3]
    assert "median " in lines[4] and "(sd " in lines[4]
    assert (
        lines[5]
        == '  records: result["stage_out"|"lower"|"compile"|"execute"]; everything: .manifest)'
    )
    assert str(result) == text


def test_each_stage_records_repr_names_its_types_not_its_data(result: jaxaot.RunResult) -> None:
    staged, lowered, compiled, executed = (
        result[s] for s in ("stage_out", "lower", "compile", "execute")
    )
    for record in (staged, lowered, compiled, executed):
        assert len(repr(record)) < 300 and "\n" not in repr(record), repr(record)
    assert repr(staged).startswith("StagedOut(fn=mlp, args=([{w: f32[256,512], b: f32[512]}, ")
    assert "f32[64,256]" in repr(lowered) and f"'{lowered.module_sha256[:12]}'" in repr(lowered)
    assert repr(compiled).startswith("Compiled(backend='cpu', ") and "temp " in repr(compiled)
    assert repr(executed).startswith("Executed(outputs=f32[64,128], median ")
    assert repr(executed).endswith(" over 3 calls)")


def test_a_failed_runs_repr_says_the_error_in_one_line(tmp_path: Path) -> None:
    manifest = {
        "status": "failed",
        "error": "stage 'compile' failed: " + "x" * 500,
        "config": {"program": {"name": "axpy", "target": "jaxaot.examples.axpy:axpy"}},
        "stages": {"stage_out": {"status": "ran", "seconds": 0.1}, "lower": {"status": "failed"}},
    }
    text = repr(jaxaot.RunResult(run_dir=tmp_path, manifest=manifest))
    lines = text.splitlines()
    assert lines[0] == f"RunResult(failed: program jaxaot.examples.axpy:axpy, run_dir {tmp_path}"
    assert lines[1].startswith("  error: stage 'compile' failed: xxx") and "(524 chars)" in lines[1]
    assert len(lines[1]) == len("  error: ") + 200 + len(" (524 chars)")
    assert lines[-1].split() == ["lower", "failed)"]


def test_trees_and_texts_are_cut_saying_how_much_there_was() -> None:
    import numpy as np

    tree = {"a": [np.zeros((2, 3), np.float32)] * 50, "b": np.int32(1)}
    text = tree_text(tree, width=60)
    assert text.startswith("{a: [f32[2,3], f32[2,3],") and text.endswith("… (51 leaves)")
    assert len(text) <= 60 + len(" (51 leaves)")
    assert tree_text((np.ones(4, np.float16), 3)) == "(f16[4], 3)"
    assert cut("a\n  b", 10) == "a b" and cut("y" * 30, 10) == "yyyyyyyyy… (30 chars)"


def test_compose_refuses_a_mistyped_name_in_the_cli_s_one_line() -> None:
    from hydra.errors import ConfigCompositionException
    from jaxaot.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        jaxaot.compose(["progam=mlp"])
    assert str(info.value).startswith(
        "unknown config group 'progam' (did you mean program=mlp? groups: "
    )
    assert isinstance(info.value.__cause__, ConfigCompositionException)  # Hydra's, chained
    with pytest.raises(ConfigError, match=r"^Error merging override execute.repeats=abc \(Value "):
        jaxaot.compose(["execute.repeats=abc"])


def test_compose_refuses_an_unknown_added_key_and_takes_free_form_ones() -> None:
    from jaxaot.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        jaxaot.compose(["+execute.repet=3"])
    assert str(info.value) == "unknown key 'execute.repet' (did you mean execute.repeats?)"
    cfg = jaxaot.compose(
        ["+compile.compiler_options.xla_cpu_enable_fast_math=true", "+program.kwargs.scale=2"]
    )
    assert cfg.compile.compiler_options.xla_cpu_enable_fast_math is True
    assert cfg.program.kwargs.scale == 2


def test_dir_shows_the_public_names_and_dunders_only() -> None:
    assert callable(jaxaot.compose)  # loaded: its submodules become attributes of jaxaot
    names = dir(jaxaot)
    extra = {n for n in names if not (n.startswith("__") and n.endswith("__"))} - set(
        jaxaot.__all__
    )
    assert extra == set(), extra  # no Any, TYPE_CHECKING, annotations, errors, api, ...
    assert {"__version__", "__doc__", "__name__"} <= set(names)
    assert "TYPE_CHECKING" in vars(jaxaot)  # there, but not shown
