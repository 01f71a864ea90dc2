"""jax.extend.xla imported before jaxaot watched (flax and equinox import jax.extend): the
registrations made before then are ruled out or mirrored, never left unkeyed. Each case runs in
its own process, since jaxlib's registry and jaxaot's watch are once per process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import cli_env
from forked import Forker

RUN_TWICE = """
import json, logging, sys
{pre}
import jaxaot

logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
out = []
for i in range(2):
    r = jaxaot.run(jaxaot.compose(["program=axpy", "program.args=[3,4]"]), run_dir=f"run{{i}}")
    out.append(r.manifest["stages"]["compile"]["status"])
from jaxaot.stages import xla_passes
print(json.dumps({{"status": out, "blind": xla_passes.blind()}}))
"""

NO_OP = """
from jax.extend import xla as jxla

def no_op(b):
    return None

jxla.register_hlo_module_transformation(no_op, name="early", platforms="cpu")
"""

CHANGES = """
import jaxlib._hlo as hlo
from jax.extend import xla as jxla

def mul_to_add(proto):
    module = hlo.HloModule.from_serialized_hlo_module_proto(proto)
    text = module.to_string(hlo.HloPrintOptions.short_parsable()).replace("multiply(", "add(")
    return hlo.hlo_module_from_text(text).as_serialized_hlo_module_proto()

jxla.register_hlo_module_transformation(mul_to_add, name="early", platforms="cpu")
"""

CLEARED = NO_OP + 'assert jxla.clear_hlo_module_transformation("early", platforms="cpu")\n'


@pytest.fixture(scope="module")
def forker() -> Iterator[Forker]:
    """Each script runs as ``python -c`` runs it, in a child forked from a process that has
    imported JAX and nothing more: jaxlib's registry, jax.extend and jaxaot are untouched until
    the script runs."""
    with Forker("jax", env=cli_env()) as started:
        yield started


def _run(forker: Forker, tmp_path: Path, script: str) -> dict[str, Any]:
    """``python -c script`` in a process of its own in ``tmp_path``, with a store of its own;
    its last stdout line as JSON, and its stderr."""
    env = cli_env(JAXAOT_STORE_DIR=str(tmp_path / "store"))
    status, out, stderr = forker.run(tmp_path, script=script, env=env)
    assert status == 0, f"exit status {status}\n{stderr[-3000:]}"
    result = json.loads(out.strip().splitlines()[-1])
    result["stderr"] = stderr
    return result


@pytest.mark.parametrize(
    "pre",
    [
        "import jax.extend",
        pytest.param("import flax.nnx", marks=pytest.mark.extra("models")),
        CLEARED,
    ],
)
def test_jax_extend_imported_first_keeps_the_store(
    forker: Forker, tmp_path: Path, pre: str
) -> None:
    out = _run(forker, tmp_path, RUN_TWICE.format(pre=pre))
    assert out["blind"] is None
    assert out["status"] == ["ran", "cached"], out["stderr"][-2000:]
    assert "compiled without the store" not in out["stderr"]


@pytest.mark.parametrize("pre", [NO_OP, CHANGES])
def test_a_cpu_pass_registered_first_turns_the_store_off(
    forker: Forker, tmp_path: Path, pre: str
) -> None:
    out = _run(forker, tmp_path, RUN_TWICE.format(pre=pre))
    assert out["status"] == ["ran", "ran"]  # never a hit keyed without the pass
    assert "a compile on CPU handed a" in out["blind"]
    assert "compiled without the store" in out["stderr"]


PLUGIN = """
import json
from jax._src import xla_bridge
from jax._src.lib import _xla
from jax.extend import xla as jxla

class FakeClient:  # a plugin backend already initialized: the hook runs on it at once
    platform = "fakeplat"

seen = []
real = _xla.register_xla_transform_c_api
_xla.register_xla_transform_c_api = lambda client, name, stage, cb: seen.append(name)
xla_bridge._backends["fakeplat"] = FakeClient()
try:
    def plugin_pass(b):
        return None

    jxla.register_hlo_module_transformation(
        plugin_pass, name="on-plugin", platforms="fakeplat",
        stage=jxla.PipelineStage.POST_SCHEDULER,
    )
    jxla.register_hlo_module_transformation(plugin_pass, name="later-backend", platforms="other")
finally:
    _xla.register_xla_transform_c_api = real
assert seen == ["on-plugin"]

from jaxaot.stages import xla_passes

xla_passes.watch()
try:
    key = xla_passes.key_of("fakeplat")
finally:
    del xla_bridge._backends["fakeplat"]
print(json.dumps({
    "blind": xla_passes.blind(),
    "key": key,
    "same": key[0]["callback"] == xla_passes.identify(plugin_pass) if key else None,
    "cpu": xla_passes.key_of("cpu"),
    "other": xla_passes.key_of("other"),
}))
"""


def test_a_plugin_pass_registered_first_is_found_through_its_hook(
    forker: Forker, tmp_path: Path
) -> None:
    out = _run(forker, tmp_path, PLUGIN)
    assert out["blind"] is None
    assert [(e["name"], e["stage"]) for e in out["key"]] == [("on-plugin", 1)]
    assert out["same"] is True
    # the "other" backend never started: its hook registers through the wrapper when it does
    assert out["cpu"] == [] and out["other"] == []


UNREADABLE = """
import json
from jax._src import xla_bridge
from jax.extend import xla as jxla

jxla.register_hlo_module_transformation(lambda b: None, name="p", platforms="fakeplat")
hook = xla_bridge._backend_initialization_hooks[-1]

def register_on_client(client):  # same name, a closure jaxaot does not know
    return hook(client)

register_on_client.__qualname__ = hook.__qualname__
xla_bridge._backend_initialization_hooks[-1] = register_on_client
from jaxaot.stages import xla_passes

xla_passes.watch()
print(json.dumps({"blind": xla_passes.blind()}))
"""


def test_an_unreadable_hook_keeps_the_store_off(forker: Forker, tmp_path: Path) -> None:
    out = _run(forker, tmp_path, UNREADABLE)
    assert "closure cannot be read" in out["blind"]
