"""Fingerprints of static data: equal across processes for equal data, different for different
data, never built from a repr that names a memory address."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import cli_env
from forked import Forker
from jaxaot.models.fingerprint import NoFingerprint, digest, fingerprint

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import equinox as eqx
    import flax.linen as nn
    import jax, jax.numpy as jnp, optax
    from flax import nnx
    from flax.training import train_state
    from jaxaot.stages.adapt import adapt

    lr, act = float(sys.argv[1]), getattr(jax.nn, sys.argv[2])

    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            return act(nn.Dense(3)(x))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 8, rngs=rngs)
            self.act = act

        def __call__(self, x):
            return self.act(self.l1(x))

    def scaled(factor):
        return lambda x: x * factor + lr

    x = jnp.ones((2, 4))
    module = Dense()
    state = train_state.TrainState.create(
        apply_fn=module.apply, params=module.init(jax.random.key(0), x), tx=optax.adamw(lr)
    )
    net = nnx.eval_shape(lambda: Net(nnx.Rngs(0)))
    opt = nnx.eval_shape(lambda: nnx.Optimizer(Net(nnx.Rngs(0)), optax.adamw(lr), wrt=nnx.Param))
    mlp = eqx.filter_eval_shape(eqx.nn.MLP, 4, 2, 8, 2, activation=act, key=jax.random.key(0))
    cases = {
        "train_state": adapt(lambda s: s, (state,), {}, ["state"]),
        "nnx": adapt(lambda m, o: 0, (net, opt), {}, ["model", "opt"]),
        "equinox": adapt(lambda m: 0, (mlp,), {}, ["model"]),
        "closure": adapt(lambda f, c: 0, (scaled(2.0), {"tags": {"a", "b", "c"}}), {}, None),
    }
    print(json.dumps({k: v.fingerprint for k, v in cases.items()}))
    """
)


# The slow imports done once, in the process each data set's process is forked from.
PRE_IMPORTS = ("equinox", "flax.linen", "flax.nnx", "flax.training.train_state", "jax", "optax")


def fingerprints(tmp_path: Path, *pairs: tuple[str, str], seed: str) -> list[dict[str, str]]:
    """SCRIPT's fingerprints for each (learning rate, activation) pair, each in a process of
    its own (as ``python fp_script.py lr act`` is), all forked from one Python started with
    ``PYTHONHASHSEED=seed``."""
    script = tmp_path / "fp_script.py"
    script.write_text(SCRIPT)
    found = []
    with Forker(*PRE_IMPORTS, env=cli_env(PYTHONHASHSEED=seed, JAX_PLATFORMS="cpu")) as forker:
        for lr, act in pairs:
            status, out, err = forker.run(tmp_path, path=script, argv=(lr, act))
            assert status == 0, f"fp_script.py {lr} {act}: exit status {status}\n{err[-2000:]}"
            found.append(json.loads(out.strip().splitlines()[-1]))
    return found


@pytest.mark.extra("models")
def test_fingerprints_agree_across_processes_and_follow_the_data(tmp_path: Path) -> None:
    first, other_lr, other_act = fingerprints(
        tmp_path, ("1e-3", "relu"), ("2e-3", "relu"), ("1e-3", "gelu"), seed="1"
    )
    (again,) = fingerprints(tmp_path, ("1e-3", "relu"), seed="2")  # another string-hash seed
    assert first == again
    assert all(len(v) == 64 for v in first.values())
    assert all(other_lr[k] != first[k] for k in ("train_state", "nnx", "closure"))
    assert other_lr["equinox"] == first["equinox"]  # the learning rate is not in the MLP
    assert all(other_act[k] != first[k] for k in ("train_state", "nnx", "equinox"))


def test_functions_by_code_closure_defaults_and_globals() -> None:
    def make(k: float) -> Any:
        return lambda x: x * k

    def fp(x: Any) -> str:
        return digest(fingerprint(x, "f"))

    assert fp(make(2.0)) == fp(make(2.0))
    assert fp(make(2.0)) != fp(make(3.0))

    def a(x: Any, n: int = 1) -> Any:
        return x + n

    def b(x: Any, n: int = 2) -> Any:
        return x + n

    def c(x: Any, n: int = 1) -> Any:
        return x - n

    assert len({fp(a), fp(b), fp(c)}) == 3
    assert fp(recursive) == fp(recursive)  # a function that reads itself through its globals


def recursive(n: int) -> int:
    return 1 if n <= 1 else n * recursive(n - 1)


def test_objects_without_a_stable_fingerprint_are_refused_with_their_path() -> None:
    with pytest.raises(NoFingerprint) as info:
        fingerprint({"opt": {"lock": threading.Lock()}}, "args[1]")
    assert info.value.path == "args[1]['opt']['lock']"
    assert "memory address" in info.value.why

    class Plain:
        def __init__(self) -> None:
            self.rate = 0.5

    assert digest(fingerprint(Plain(), "p")) == digest(fingerprint(Plain(), "p"))
    text = json.dumps(fingerprint(Plain(), "p"))
    assert "0x" not in text


def test_sets_and_dicts_do_not_depend_on_order() -> None:
    assert digest(fingerprint({"b": 1, "a": 2}, "d")) == digest(fingerprint({"a": 2, "b": 1}, "d"))
    assert digest(fingerprint({"x", "y"}, "s")) == digest(fingerprint({"y", "x"}, "s"))
    assert digest(fingerprint(1.0, "f")) != digest(fingerprint(1, "f"))
    assert digest(fingerprint(True, "f")) != digest(fingerprint(1, "f"))


def test_code_run_with_python_c_is_user_code(tmp_path: Path) -> None:
    """``__main__`` of ``python -c`` (or a notebook) has no file: still the user's code, keyed
    by its code and constants, never by its name alone."""
    code = (
        "import sys, jax\n"
        "from jaxaot.models.fingerprint import digest, fingerprint\n"
        "k = float(sys.argv[1])\n"
        "@jax.jit\n"
        "def step(x):\n"
        "    return x * k\n"
        "print(digest(fingerprint(step, 'f')))\n"
    )

    def run(k: str) -> str:
        env = cli_env(JAX_PLATFORMS="cpu")
        done = subprocess.run(
            [sys.executable, "-c", code, k], env=env, capture_output=True, text=True, cwd=tmp_path
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().splitlines()[-1]

    assert run("2.0") == run("2.0") != run("3.0")


def test_deep_static_data_is_refused_not_crashed() -> None:
    chain: Any = None
    for _ in range(5000):
        chain = [chain]
    with pytest.raises(NoFingerprint, match="deep"):
        fingerprint(chain, "cfg")
