"""The compile key holds what XLA actually sees: XLA_FLAGS and LIBTPU_INIT_ARGS parsed as XLA and
libtpu parse them (order, repeats, the file XLA_FLAGS may name, which backend reads which
variable), and the HLO module transformations registered in the process.

The differential tests run one program in two environments, each in its own process, through
one shared store, then the second environment again with the store off: the second run must
compile (not load the first's executable), and its outputs must equal the store-off run's bit
for bit. Each pair is checked to change the outputs, so serving one to the other would show.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import cli_env, read_manifest, run_cli
from jaxaot.errors import ConfigError
from jaxaot.stages import jaxenv, xla_passes
from jaxaot.stages.xla_flags import (
    FlagSource,
    libtpu_effective,
    libtpu_words,
    parse,
    read_source,
    xla_effective,
    xla_words,
)

FAST = "--xla_cpu_enable_fast_math"

# ---------------------------------------------------------------------------------------------
# The parser, word by word (xla/parse_flags_from_env.cc ParseArgvFromString).


@pytest.mark.parametrize(
    ("text", "words", "ignored"),
    [
        ("", [], ""),
        ("  --a=1\t--b\n--c=x  ", ["--a=1", "--b", "--c=x"], ""),
        ('--a="x y" --b=2', ["--a=x y", "--b=2"], ""),
        ('--a="q\\"uote\\\\" --b', ['--a=q"uote\\', "--b"], ""),
        ("--a='x\\y z' --b", ["--a=x\\y z", "--b"], ""),  # single quotes: backslash literal
        ('--a=x"y z"', ['--a=x"y'], 'z"'),  # quotes only right after '='
        ("--a=1 junk --b=2", ["--a=1"], "junk --b=2"),  # parsing stops, silently
        ("--a=1 # a comment\n--b=2", ["--a=1"], "# a comment\n--b=2"),
        ('--a="x"y --b=2', ["--a=x"], "y --b=2"),
        ('--a="unterminated', ["--a=unterminated"], ""),
        ("-single --b", ["-single", "--b"], ""),  # a word XLA rejects (it ends the process)
        ("--flagfile=f.txt", ["--flagfile=f.txt"], ""),  # no such XLA flag: not a file
    ],
)
def test_xla_words(text: str, words: list[str], ignored: str) -> None:
    assert xla_words(text) == (words, ignored)


def test_xla_effective_last_value_wins_and_output_only_flags_are_left_out() -> None:
    on_off = [f"{FAST}=true", f"{FAST}=false"]
    assert xla_effective(on_off) == {FAST: "false"}
    assert xla_effective(on_off[::-1]) == {FAST: "true"}
    assert xla_effective([FAST]) == xla_effective([f"{FAST}=true"]) == {FAST: "true"}
    # Forms that are one value only for a bool flag stay apart (a miss, never a wrong hit).
    assert xla_effective([f"{FAST}=1"]) != xla_effective([f"{FAST}=true"])
    words = ["--xla_dump_to=/tmp/d", "--b=2", "--xla_dump_hlo_as_text", "--a=1", "--b=3"]
    assert xla_effective(words) == {"--a": "1", "--b": "3"}
    assert list(xla_effective(["--b=1", "--a=1"])) == ["--a", "--b"]  # other flags: any order


def test_libtpu_words_are_split_at_spaces_only() -> None:
    assert libtpu_words("--a=1  --b=x\ty") == ["--a=1", "--b=x\ty"]
    assert libtpu_effective(["--b=1", "--a=2", "--b=3"]) == {"--a": "2", "--b": ["1", "3"]}
    assert libtpu_effective(["--b=3", "--a=2", "--b=1"]) == {"--a": "2", "--b": ["3", "1"]}
    # A bare flag may take the next word as its value: every word is kept, in order.
    assert libtpu_effective(["--a", "--b=1"]) == {"words": ["--a", "--b=1"]}
    assert libtpu_effective(["--xla_dump_to=/d", "--a=1"]) == {"--a": "1"}


def test_xla_flags_naming_a_file_reads_the_file(tmp_path: Path, monkeypatch: Any) -> None:
    (tmp_path / "flags.txt").write_text(f"{FAST}=true\n  --b=1 # off\n--c=2\n")
    monkeypatch.chdir(tmp_path)
    src = read_source("XLA_FLAGS", {"XLA_FLAGS": "flags.txt"})  # relative to the cwd
    assert src.path == str(tmp_path / "flags.txt") and src.error is None
    parsed = parse(src)
    assert parsed.words == [f"{FAST}=true", "--b=1"] and parsed.ignored == "# off\n--c=2\n"
    assert parsed.effective == {FAST: "true", "--b": "1"}
    assert parsed.to_json()["file_sha256"]
    # Leading whitespace is part of the file name (XLA opens the value as given).
    assert read_source("XLA_FLAGS", {"XLA_FLAGS": " flags.txt"}).error is not None
    # LIBTPU_INIT_ARGS never names a file.
    assert read_source("LIBTPU_INIT_ARGS", {"LIBTPU_INIT_ARGS": "flags.txt"}).path is None


@pytest.mark.parametrize(
    ("value", "why"), [("missing.txt", "cannot be read"), (".", "directory"), ("   ", "read")]
)
def test_a_flag_file_that_cannot_be_read_is_refused(
    value: str, why: str, tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.chdir(tmp_path)
    src = read_source("XLA_FLAGS", {"XLA_FLAGS": value})
    assert src.error is not None and why in src.error
    assert parse(src).effective == {}  # never keyed as "no flags": _note_flags refuses it
    monkeypatch.setenv("XLA_FLAGS", value)
    monkeypatch.setattr(jaxenv, "_in_effect", None)
    monkeypatch.setattr(jaxenv, "_env_in_effect", None)
    monkeypatch.setattr(jaxenv, "_backends_started", lambda: False)
    with pytest.raises(ConfigError, match=r"^XLA_FLAGS=.*expected flags .* or a readable file"):
        jaxenv._note_flags()


def test_the_flag_file_is_snapshot_when_xla_reads_it(
    tmp_path: Path, monkeypatch: Any, caplog: Any
) -> None:
    flags = tmp_path / "flags.txt"
    flags.write_text(f"{FAST}=true")
    monkeypatch.setenv("XLA_FLAGS", str(flags))
    monkeypatch.setattr(jaxenv, "_in_effect", None)
    monkeypatch.setattr(jaxenv, "_env_in_effect", None)
    monkeypatch.setattr(jaxenv, "_warned_changed", False)
    monkeypatch.setattr(jaxenv, "_backends_started", lambda: False)
    jaxenv._note_flags()  # XLA reads the file as the backends start, right after this
    flags.write_text(f"{FAST}=false")
    with caplog.at_level(logging.WARNING, logger="jaxaot"):
        jaxenv._note_flags()
    assert any("changed after XLA read it" in r.getMessage() for r in caplog.records)
    assert jaxenv.flags_in_effect()["XLA_FLAGS"].effective == {FAST: "true"}


def _sources(xla: str = "", libtpu: str = "") -> dict[str, FlagSource]:
    return {
        "XLA_FLAGS": FlagSource("XLA_FLAGS", xla),
        "LIBTPU_INIT_ARGS": FlagSource("LIBTPU_INIT_ARGS", libtpu),
    }


def test_each_platform_keys_the_variables_it_reads(monkeypatch: Any) -> None:
    monkeypatch.setattr(jaxenv, "_in_effect", _sources(f"{FAST}=true", f"{FAST}=false"))
    cpu = jaxenv.key_environment("cpu")
    tpu = jaxenv.key_environment("tpu")
    assert sorted(cpu["flags"]) == ["XLA_FLAGS"]  # XLA:CPU ignores LIBTPU_INIT_ARGS
    assert sorted(tpu["flags"]) == ["LIBTPU_INIT_ARGS", "XLA_FLAGS"]
    assert tpu["flags"]["LIBTPU_INIT_ARGS"]["effective"] == {FAST: "false"}
    assert cpu["flags"]["XLA_FLAGS"]["effective"] == {FAST: "true"}
    assert "host_cpu" in cpu and "host_cpu" not in tpu
    monkeypatch.setattr(jaxenv, "_in_effect", _sources("", f"{FAST}=true"))
    moved = jaxenv.key_environment("cpu")
    assert moved["flags"]["XLA_FLAGS"]["effective"] == {}
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    monkeypatch.setattr(jaxenv, "_env_in_effect", {"NVIDIA_TF32_OVERRIDE": "0"})
    assert jaxenv.key_environment("cuda")["env"] == {"NVIDIA_TF32_OVERRIDE": "0"}
    assert jaxenv.key_environment("cpu")["env"] == {}


def test_a_variable_changed_after_the_backends_started_is_not_keyed(monkeypatch: Any) -> None:
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    monkeypatch.delenv("TF_FP16_CONV_USE_FP32_COMPUTE", raising=False)
    monkeypatch.setattr(jaxenv, "_in_effect", None)
    monkeypatch.setattr(jaxenv, "_env_in_effect", None)
    monkeypatch.setattr(jaxenv, "_backends_started", lambda: False)
    jaxenv._note_flags()  # the backends start right after: cuBLAS reads the snapshot's value
    assert jaxenv.key_environment("cuda")["env"]["NVIDIA_TF32_OVERRIDE"] == "0"
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "1")  # a sweep job's env_set, same process
    jaxenv._note_flags()  # the next job's configure keeps the first snapshot
    with pytest.raises(xla_passes.Unkeyable, match=r"NVIDIA_TF32_OVERRIDE='1' \(was '0'\)"):
        jaxenv.key_environment("cuda")
    assert jaxenv.key_environment("cpu")["env"] == {}  # XLA:CPU reads none of them
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    monkeypatch.setenv("TF_FP16_CONV_USE_FP32_COMPUTE", "1")  # set only after the start
    with pytest.raises(xla_passes.Unkeyable, match=r"TF_FP16_CONV_USE_FP32_COMPUTE='1' \(was None"):
        jaxenv.key_environment("rocm")
    monkeypatch.delenv("TF_FP16_CONV_USE_FP32_COMPUTE")
    assert jaxenv.key_environment("cuda")["env"] == {"NVIDIA_TF32_OVERRIDE": "0"}  # back again


# What XLA itself applied, read back from a fresh process (XLA parses XLA_FLAGS once per
# process): the parser's effective values must agree with it. XLA parses the variable in
# jaxlib's extension; jax's Python only reads it (jax/_src/cache_key.py), so the process
# imports jaxlib alone (~0.3 s; with jax, ~1.3 s).
_XLA_SAYS = (
    "import json\n"
    "from jaxlib import xla_client as xc\n"
    "d = xc.CompileOptions().executable_build_options.debug_options\n"
    "print(json.dumps([d.xla_cpu_enable_fast_math, d.xla_cpu_fast_math_honor_division]))\n"
)
_BOOL = {"true": True, "1": True, "TRUE": True, "True": True, "false": False, "0": False}


@pytest.mark.parametrize(
    "value",
    [
        f"{FAST}=true {FAST}=false",
        f"{FAST}=false {FAST}",
        f"{FAST}=1 --xla_cpu_fast_math_honor_division=0",
        f'{FAST}="TRUE" junk --xla_cpu_fast_math_honor_division=false',
        "@file",
    ],
)
def test_the_parser_agrees_with_xla(value: str, tmp_path: Path) -> None:
    if value == "@file":
        (tmp_path / "f.txt").write_text(f"{FAST}\n--xla_cpu_fast_math_honor_division=false\n")
        value = "f.txt"
    env = {**cli_env(), "XLA_FLAGS": value}
    proc = subprocess.run(
        [sys.executable, "-c", _XLA_SAYS], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    xla = json.loads(proc.stdout.strip().splitlines()[-1])
    is_file = (tmp_path / value).is_file()
    ours = parse(
        read_source("XLA_FLAGS", {"XLA_FLAGS": str(tmp_path / value) if is_file else value})
    )
    fast = _BOOL[ours.effective.get(FAST, "false")]
    honor = _BOOL[ours.effective.get("--xla_cpu_fast_math_honor_division", "true")]
    assert [fast, honor] == xla


# ---------------------------------------------------------------------------------------------
# HLO module transformations: identity and the mirrored registry.

SCALE = 2.0


def _scaled(x: float) -> float:
    return x * SCALE


def _uses_global(b: bytes) -> bytes | None:
    return None if _scaled(1.0) else b


def _no_op(b: bytes) -> bytes | None:
    return None


def _also_no_op(b: bytes) -> bytes | None:
    del b
    return None


class _Callable:
    def __call__(self, b: bytes) -> bytes | None:
        return None


def test_identify_keys_code_closures_and_globals(monkeypatch: Any) -> None:
    import functools

    ident = xla_passes.identify
    assert ident(_no_op) == ident(_no_op) is not None
    assert ident(_no_op) != ident(_also_no_op)
    before = ident(_uses_global)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 3.0)  # read through a helper
    assert ident(_uses_global) != before

    def make(k: int) -> Any:
        def closure(b: bytes) -> bytes | None:
            return None if k else b

        return closure

    assert ident(make(1)) == ident(make(1)) != ident(make(2))
    assert ident(functools.partial(make(1), b"")) is not None
    assert ident(_Callable()) is None  # its state is not known
    assert ident(_Callable().__call__) is None
    assert ident(print) is None

    def recursive(b: bytes) -> bytes | None:
        return recursive(b) if not b else None

    assert ident(recursive) is not None


@pytest.mark.requires_jax("0.10.2")  # jax.extend.xla's HLO module transformations
def test_a_callback_reading_a_user_module_is_unkeyable(tmp_path: Path, monkeypatch: Any) -> None:
    (tmp_path / "xp_settings.py").write_text("FACTOR = 2.0\n")
    (tmp_path / "xp_helpers.py").write_text("def transform(b):\n    return b\n")
    (tmp_path / "xp_cbs.py").write_text(
        "import json\nimport math\n\nimport jaxlib._hlo as hlo\nimport numpy as np\n"
        "import xp_helpers\nimport xp_settings\n\n\n"
        "def reads(b):\n    return None if xp_settings.FACTOR else b\n\n\n"
        "def calls(b):\n    return xp_helpers.transform(b)\n\n\n"
        "def installed(b):\n    return json.dumps([math.pi, np.pi, hlo.__name__]).encode()\n"
    )
    xla_passes.watch()  # before jax.extend is imported: jaxaot's runs watch from configure()
    monkeypatch.syspath_prepend(str(tmp_path))
    import xp_cbs  # type: ignore[import-not-found]

    # settings.FACTOR may change at run time and helpers.py may be edited: no name says so
    assert xla_passes.identify(xp_cbs.reads) is None
    assert xla_passes.identify(xp_cbs.calls) is None
    ident = xla_passes.identify(xp_cbs.installed)
    assert ident is not None and ident == xla_passes.identify(xp_cbs.installed)
    keyed = [value for _, value in ident["globals"]["dict"]]
    modules = {v["module"]: v for v in keyed if isinstance(v, dict) and "module" in v}
    assert modules["jaxlib._hlo"]["distribution"] == "jaxlib"
    assert modules["numpy"]["version"] and "python" in modules["json"]
    from jax.extend import xla as jxla

    jxla.register_hlo_module_transformation(xp_cbs.reads, name="t-user", platforms="cpu")
    try:
        with pytest.raises(xla_passes.Unkeyable, match=r"'t-user'.*not user code"):
            xla_passes.key_of("cpu")
    finally:
        while jxla.clear_hlo_module_transformation("t-user", platforms="cpu"):
            pass


@pytest.mark.requires_jax("0.10.2")  # jax.extend.xla's HLO module transformations
def test_the_registry_is_mirrored_in_order_and_on_clear() -> None:
    xla_passes.watch()  # before jax.extend is imported: jaxaot's runs watch from configure()
    from jax.extend import xla as jxla

    assert xla_passes.blind() is None, "this process registered before jaxaot watched"
    stage = jxla.PipelineStage
    jxla.register_hlo_module_transformation(_no_op, name="t-a", platforms="cpu")
    jxla.register_hlo_module_transformation(
        _also_no_op, name="t-b", platforms="cpu", stage=stage.POST_SCHEDULER
    )
    jxla.register_hlo_module_transformation(_also_no_op, name="t-a", platforms="cpu")
    try:
        names = [(e["name"], e["stage"]) for e in xla_passes.key_of("cpu")]
        assert names == [("t-a", 0), ("t-a", 0), ("t-b", 1)]
        assert xla_passes.key_of("tpu") == []  # registered for cpu only
        assert jxla.clear_hlo_module_transformation("t-a", platforms="cpu")
        key = xla_passes.key_of("cpu")
        assert [e["name"] for e in key] == ["t-a", "t-b"]  # the first "t-a" went
        assert key[0]["callback"] == xla_passes.identify(_also_no_op)
        jxla.register_hlo_module_transformation(_Callable(), name="t-c", platforms="cpu")
        with pytest.raises(xla_passes.Unkeyable, match=r"'t-c'.*cannot be identified"):
            xla_passes.key_of("cpu")
    finally:
        for name, st in (("t-a", stage.PRE_SCHEDULER), ("t-b", stage.POST_SCHEDULER)):
            while jxla.clear_hlo_module_transformation(name, st, platforms="cpu"):
                pass
        while jxla.clear_hlo_module_transformation("t-c", platforms="cpu"):
            pass
    assert xla_passes.key_of("cpu") == []


# ---------------------------------------------------------------------------------------------
# Differential runs through the CLI: one store, two environments, separate processes.

# exp/log1p/sqrt/tanh: XLA:CPU's fast-math changes the output bits (checked in each test).
FAST_MATH_PROGRAM = (
    "import jax.numpy as jnp\n\n"
    "def f(x):\n    return jnp.exp(x) * jnp.log1p(x) / jnp.sqrt(x + 1.0) + jnp.tanh(x)\n"
)
ARGS = [
    "program.target=xprog:f",
    "program.args=[{shape:[4096],dtype:f32,init:uniform,low:0.001,high:50}]",
    "execute.repeats=1",
]

# A registered pass that turns every multiply into an add (x * 3 + 1 becomes x + 3 + 1).
TRANSFORM_PROGRAM = """
import os

import jaxlib._hlo as hlo
import xprog_settings
from jax.extend import xla as jxla


def mul_to_add(proto):
    module = hlo.HloModule.from_serialized_hlo_module_proto(proto)
    text = module.to_string(hlo.HloPrintOptions.short_parsable()).replace("multiply(", "add(")
    return hlo.hlo_module_from_text(text).as_serialized_hlo_module_proto()


class Opaque:
    def __call__(self, proto):
        return mul_to_add(proto)


def per_setting(proto):  # reads a user module, whose attribute may change at run time
    return mul_to_add(proto) if xprog_settings.ON else proto


if os.environ.get("PROG_TRANSFORM") == "1":
    jxla.register_hlo_module_transformation(mul_to_add, name="mul_to_add", platforms="cpu")
if os.environ.get("PROG_TRANSFORM") == "opaque":
    jxla.register_hlo_module_transformation(Opaque(), name="opaque", platforms="cpu")
if os.environ.get("PROG_TRANSFORM") == "user":
    jxla.register_hlo_module_transformation(per_setting, name="user", platforms="cpu")


def f(x):
    return x * 3.0 + 1.0
"""


class _Run:
    def __init__(self, tmp_path: Path, program: str) -> None:
        self.tmp = tmp_path
        (tmp_path / "xprog.py").write_text(program)
        (tmp_path / "xprog_settings.py").write_text("ON = True\n")
        base = cli_env(PYTHONPATH=f"{cli_env()['PYTHONPATH']}:{tmp_path}")
        for name in ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "PROG_TRANSFORM"):
            base.pop(name, None)
        self.base = base

    def __call__(self, name: str, env: dict[str, str], *extra: str) -> tuple[str, np.ndarray]:
        run_dir = self.tmp / name
        proc = run_cli(
            [*ARGS, *extra, f"hydra.run.dir={run_dir}"], cwd=self.tmp, env={**self.base, **env}
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        compile_stage = read_manifest(run_dir)["stages"]["compile"]
        return compile_stage["status"], np.load(run_dir / "execute" / "outputs.npz")["out0"]


def _differential(
    run: _Run, env_a: dict[str, str], env_b: dict[str, str], before_b: Any = None
) -> np.ndarray:
    """Runs a (store on), b (store on, the same store), b with the store off; returns a's
    outputs."""
    status_a, out_a = run("a", env_a)
    assert status_a == "ran"
    if before_b is not None:
        before_b()
    status_b, out_b = run("b", env_b)
    _, off_b = run("b_off", env_b, "store.enabled=false")
    assert out_a.tobytes() != off_b.tobytes(), "the two environments compute the same bits"
    assert status_b == "ran", "the second environment loaded the first's executable"
    assert out_b.tobytes() == off_b.tobytes()
    return out_a


def test_a_repeated_flag_in_the_other_order_is_another_executable(tmp_path: Path) -> None:
    run = _Run(tmp_path, FAST_MATH_PROGRAM)
    _differential(
        run,
        {"XLA_FLAGS": f"{FAST}=true {FAST}=false"},  # the last wins: no fast math
        {"XLA_FLAGS": f"{FAST}=false {FAST}=true"},
    )


def test_a_changed_flag_file_is_another_executable(tmp_path: Path) -> None:
    run = _Run(tmp_path, FAST_MATH_PROGRAM)
    flags = tmp_path / "xla_flags.txt"
    flags.write_text(f"{FAST}=true\n")
    env = {"XLA_FLAGS": str(flags)}
    _differential(run, env, env, before_b=lambda: flags.write_text(f"{FAST}=false\n"))
    assert run("b_again", env)[0] == "cached"  # the same file again: a hit
    recorded = read_manifest(tmp_path / "b")["environment"]["flag_variables"]["XLA_FLAGS"]
    assert recorded["file"] == str(flags) and recorded["effective"] == {FAST: "false"}


def test_a_flag_moved_to_libtpu_init_args_is_not_applied_on_cpu(tmp_path: Path) -> None:
    run = _Run(tmp_path, FAST_MATH_PROGRAM)
    _differential(run, {"XLA_FLAGS": f"{FAST}=true"}, {"LIBTPU_INIT_ARGS": f"{FAST}=true"})


def test_a_registered_hlo_transformation_is_keyed(tmp_path: Path) -> None:
    run = _Run(tmp_path, TRANSFORM_PROGRAM)
    out_a = _differential(run, {"PROG_TRANSFORM": "1"}, {})
    status, out = run("a_again", {"PROG_TRANSFORM": "1"})
    assert status == "cached"  # identified the same in another process: the store still serves
    assert out.tobytes() == out_a.tobytes()
    key = read_manifest(tmp_path / "a")["environment"]["hlo_transformations"]
    assert [(t["name"], t["platform"]) for t in key] == [("mul_to_add", "cpu")]


@pytest.mark.parametrize("mode", ["opaque", "user"])  # a callable object; a user module read
def test_an_unidentifiable_hlo_transformation_runs_without_the_store(
    tmp_path: Path, mode: str
) -> None:
    run = _Run(tmp_path, TRANSFORM_PROGRAM)
    env = {"PROG_TRANSFORM": mode}
    for name in ("first", "second"):
        status, _ = run(name, env)
        assert status == "ran"
        warnings = read_manifest(tmp_path / name)["stages"]["compile"]["warnings"]
        assert any(f"'{mode}'" in w and "cannot be identified" in w for w in warnings), warnings
