"""Peak memory and what makes it: memory_breakdown.json against plain JAX and XLA's own dump of
the same compile, on CPU and on a v5e:2x2 topology compile."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jaxaot
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxaot.rundir.metrics import CompileMetrics
from jaxaot.snapshots.diff import diff_report, load_side, render
from jaxaot.stages import buffer_assignment as ba
from jaxaot.stages import memory_breakdown as mb
from jaxaot.stages.compile import COMPILE
from jaxaot.util import protowire as pw
from jaxaot.util.humanize import human_bytes

# -- the wire format --------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def test_protowire_reads_varints_packed_and_nested_fields() -> None:
    inner = _field(1, 7) + _field(2, b"dot.3")
    packed = b"".join(_varint(v) for v in (1, 300, 2**40))
    data = _field(1, 150) + _field(3, inner) + _field(3, inner) + _field(4, packed) + _field(5, -2)
    msg = pw.message(data)
    assert pw.first_int(msg, 1) == 150 and pw.first_int(msg, 9, default=4) == 4
    assert [pw.text(m, 2) for m in pw.messages(msg, 3)] == ["dot.3", "dot.3"]
    assert pw.ints(msg, 4) == [1, 300, 2**40]
    assert pw.first_int(msg, 5) == -2  # int64 -2: ten bytes on the wire
    assert len(_field(5, -2)) == 11


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\x08", "truncated varint"),
        (b"\x0a", "truncated varint"),  # no length after a length-delimited tag
        (b"\x0a\x80", "truncated varint"),  # a length cut short
        (b"\x0a\x05ab", "past the end"),
        (b"\x0b", "groups"),
        (b"\x08" + b"\xff" * 10 + b"\x01", "varint longer than 10 bytes"),
        (b"\x00\x01", "field number 0"),
    ],
)
def test_protowire_refuses_what_is_not_a_message(data: bytes, match: str) -> None:
    with pytest.raises(pw.WireError, match=match):
        pw.message(data)


def test_protowire_spans_give_each_fields_own_bytes_to_write_back() -> None:
    inner = _field(1, 7) + _field(2, b"dot.3")
    data = _field(1, 150) + _field(3, inner) + b"\x1d\x01\x02\x03\x04" + _field(4, -2)
    spans = list(pw.spans(data))
    assert [(n, w) for n, w, _, _ in spans] == [(1, 0), (3, 2), (3, 5), (4, 0)]
    assert b"".join(raw for _, _, _, raw in spans) == data
    assert [v for _, _, v, _ in spans] == [150, inner, b"\x01\x02\x03\x04", 2**64 - 2]
    assert [(n, w, v) for n, w, v, _ in spans] == list(pw.fields(data))
    # A message less one field, its nested message rewritten: as if encoded so.
    kept = b"".join(raw for n, _, _, raw in spans if n != 1)
    assert kept == _field(3, inner) + b"\x1d\x01\x02\x03\x04" + _field(4, -2)
    assert pw.length_delimited(3, inner) == _field(3, inner)
    big = bytes(300)
    assert pw.length_delimited(3, big) == _field(3, big) and pw.encode_varint(300) == b"\xac\x02"
    with pytest.raises(pw.WireError, match="negative"):
        pw.encode_varint(-1)


_ENTRY = st.tuples(
    st.integers(1, 2**29 - 1),  # field numbers of one to five bytes' tags
    st.one_of(
        st.integers(0, 2**64 - 1).map(lambda v: (0, v)),
        st.binary(max_size=300).map(lambda v: (2, v)),  # lengths of one and two bytes
        st.binary(min_size=8, max_size=8).map(lambda v: (1, v)),
        st.binary(min_size=4, max_size=4).map(lambda v: (5, v)),
    ),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_ENTRY, max_size=20))
def test_protowire_fields_read_each_field_as_written(entries: list[Any]) -> None:
    """:func:`pw.fields` (one-byte tags and lengths read in place) reads back what was
    written, field for field, and :func:`pw.spans` gives each field's own bytes."""
    encoded = [_field(n, v) if w in (0, 2) else _varint(n << 3 | w) + v for n, (w, v) in entries]
    data = b"".join(encoded)
    read = list(pw.fields(data))
    assert read == [(n, w, v) for n, (w, v) in entries]
    spans = list(pw.spans(data))
    assert [(n, w, v) for n, w, v, _ in spans] == read
    assert [raw for *_, raw in spans] == encoded
    message = pw.message(data)
    assert list(message) == list(dict.fromkeys(n for n, _ in entries))
    assert all(message[n] == [v for m, (_, v) in entries if m == n] for n in message)


# -- CPU: the proto, the dump and plain JAX on one compile ------------------------------------


def _mlp(p: dict[str, Any], x: jax.Array) -> tuple[jax.Array, jax.Array]:
    h = jnp.tanh(x @ p["params"]["w1"])
    return (h @ p["params"]["w2"]).sum(), h


def _params() -> dict[str, Any]:
    return {
        "params": {"w1": jnp.zeros((64, 128)), "w2": jnp.zeros((128, 32))},
        "opt": {"unused": jnp.zeros((3,))},  # jax drops it from the entry parameters
    }


def _layer(h: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
    return jnp.tanh(h @ w), None


def _scan_loss(p: dict[str, Any], x: jax.Array) -> jax.Array:
    h, _ = jax.lax.scan(_layer, x, p["ws"])
    return (h * h).sum()


def _compiled(fn: Any, args: tuple[Any, ...], folder: Path) -> Any:
    return jax.jit(fn).lower(*args).compile(compiler_options=mb.dump_options(folder))


def _dumped(folder: Path, suffix: str) -> str:
    return next(folder.glob(f"*after_optimizations-{suffix}.txt")).read_text()


def _xla_peak(folder: Path) -> tuple[int, dict[str, int]]:
    """XLA's own live-range dump: the peak's time and the buffers it lists at it."""
    text = _dumped(folder, "live-range")
    at = int(re.search(r"Live ranges at (\d+) \(peak\)", text).group(1))  # type: ignore[union-attr]
    section = text.split("(peak):")[1].split("Stack trace")[0]
    return at, {m[1]: int(m[2]) for m in re.finditer(r"^\s+(\S+): (\d+) bytes", section, re.M)}


def _value(v: ba.Value) -> tuple[str, tuple[int, ...], int, int]:
    return (v.instruction, v.index, v.size, v.offset)


def _named(row: dict[str, Any]) -> str:
    """A top row's buffer as XLA's live-range dump names it: ``tuple.3{1}``, ``x.1{}``."""
    m = re.fullmatch(r"(.*?)(?:\[([\d, ]*)\])?", row["instruction"])
    assert m is not None
    return f"{m[1]}{{{(m[2] or '').replace(' ', '')}}}"


def _same_allocations(a: list[ba.Allocation], b: list[ba.Allocation]) -> None:
    def key(allocs: list[ba.Allocation]) -> list[Any]:
        return [
            (x.index, x.size, x.kind, x.parameter, sorted(_value(v) for v in x.values))
            for x in allocs
        ]

    assert key(a) == key(b)


def test_cpu_breakdown_is_xlas_peak_and_live_set(tmp_path: Path) -> None:
    args = (_params(), jnp.zeros((16, 64)))
    compiled = _compiled(_mlp, args, tmp_path)
    hlo = compiled.as_text()
    stats = compiled.memory_analysis()
    found = mb.from_proto(compiled, hlo, top=100)
    assert found is not None and found["source"] == "buffer_assignment_proto"
    assert found["peak_bytes"] == stats.peak_memory_in_bytes  # XLA's own figure

    # The proto's allocations are the dump's, allocation by allocation and value by value.
    module = ba.module_from_proto(
        compiled.runtime_executable().hlo_modules()[0].as_serialized_hlo_module_proto()
    )
    from_proto = ba.allocations_from_proto(stats.serialized_buffer_assignment_proto, module)
    from_dump = ba.parse_buffer_assignment(_dumped(tmp_path, "buffer-assignment"))
    _same_allocations(from_proto, from_dump)
    kinds = found["allocations"]["bytes"]
    assert kinds["argument"] == stats.argument_size_in_bytes
    assert kinds["temporary"] == stats.temp_size_in_bytes
    assert kinds["output"] + kinds["constant"] == stats.output_size_in_bytes + 4  # one f32 constant

    # The buffers live at the peak: XLA's live-range dump lists the same, at the same time.
    at, listed = _xla_peak(tmp_path)
    assert found["peak_time"] == at
    mine = {_named(r): r["bytes"] for r in found["top"]}
    assert mine == listed and found["live_peak_bytes"] == sum(listed.values())
    assert [r["bytes"] for r in found["top"]] == sorted(listed.values(), reverse=True)

    # Arguments by path: the unused argument is no entry parameter, so parameter 1 is w2's.
    params = {r["path"]: r for r in found["top"] if r["kind"] == "argument"}
    assert set(params) == {"args[0]['params']['w1']", "args[0]['params']['w2']", "args[1]"}
    assert params["args[0]['params']['w2']"]["parameter"] == 1
    assert params["args[0]['params']['w1']"]["subtree"] == "args[0]['params']"
    assert found["groups"]["arguments"] == {"args[0]['params']": 32768 + 16384, "args[1]": 4096}
    tanh = next(r for r in found["top"] if r["op_name"] == "jit(_mlp)/tanh")
    assert tanh["shape"] == "f32[16,128]" and tanh["kind"] == "output"
    assert tanh["source"].endswith(f"test_memory_breakdown.py:{_mlp.__code__.co_firstlineno + 1}")

    # The dump gives the same breakdown, named as the dump names it.
    dumped = mb.from_dump(tmp_path, hlo, compiled, top=100)
    assert dumped is not None and dumped["source"] == "xla_dump"
    assert {k: v for k, v in dumped.items() if k != "source"} == {
        k: v for k, v in found.items() if k != "source"
    }


def test_cpu_peak_never_the_roots_step(tmp_path: Path) -> None:
    """With the outputs as large as the rest, the step that only gathers the outputs (the
    root tuple's) would add its tuple: XLA's dump never takes that step as the peak."""
    params = {"params": {"w1": jnp.zeros((1024, 2048)), "w2": jnp.zeros((2048, 512))}}
    compiled = _compiled(_mlp, (params, jnp.zeros((256, 1024))), tmp_path)
    found = mb.from_proto(compiled, compiled.as_text(), top=100)
    assert found is not None
    at, listed = _xla_peak(tmp_path)
    assert found["peak_time"] == at < found["schedule_length"] - 1
    assert {_named(r): r["bytes"] for r in found["top"]} == listed


def _one_output(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.tanh(x) @ w


def _output_row(found: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in found["top"] if r["kind"] == "output")


def test_cpu_single_output_is_live_at_the_peak(tmp_path: Path) -> None:
    """A program's one (non-tuple) result is computed by the entry root's own step: it is live
    from there to the end, with the arguments and the root's operands, as XLA's dump lists."""
    args = (jnp.zeros((256, 512)), jnp.zeros((512, 1024)))
    compiled = _compiled(_one_output, args, tmp_path)
    hlo = compiled.as_text()
    found = mb.from_proto(compiled, hlo, top=100)
    assert found is not None
    stats = compiled.memory_analysis()
    out = _output_row(found)
    assert out["shape"] == "f32[256,1024]" and out["bytes"] == stats.output_size_in_bytes
    assert found["peak_groups"]["outputs"] == stats.output_size_in_bytes
    arguments = sum(found["peak_groups"]["arguments"].values())
    assert arguments == stats.argument_size_in_bytes
    assert found["live_peak_bytes"] >= arguments + found["peak_groups"]["outputs"]
    at, listed = _xla_peak(tmp_path)
    assert found["peak_time"] == at == found["schedule_length"] - 1  # the root's step
    assert {_named(r): r["bytes"] for r in found["top"]} == listed
    assert found["live_peak_bytes"] == sum(listed.values())
    dumped = mb.from_dump(tmp_path, hlo, compiled, top=100)
    assert dumped is not None
    assert {k: v for k, v in dumped.items() if k != "source"} == {
        k: v for k, v in found.items() if k != "source"
    }


def test_cpu_in_place_result_holds_its_operands_slice(tmp_path: Path) -> None:
    """tanh written over the dot's result: both are live at the root's step in one slice of one
    allocation, counted once and shown as the program's output (XLA's dump lists both)."""
    compiled = _compiled(
        lambda x, w: jnp.tanh(x @ w), (jnp.zeros((256, 512)), jnp.zeros((512, 1024))), tmp_path
    )
    found = mb.from_proto(compiled, compiled.as_text(), top=100)
    assert found is not None
    at, listed = _xla_peak(tmp_path)
    out = _output_row(found)
    assert found["peak_time"] == at and out["opcode"] == "fusion"
    assert out["live"][1] == found["schedule_length"]
    mine = {_named(r): r["bytes"] for r in found["top"]}
    shared = {k: v for k, v in listed.items() if k not in mine}
    assert len(shared) == 1 and list(shared.values()) == [out["bytes"]]
    assert found["live_peak_bytes"] == sum(listed.values()) - out["bytes"]


def test_cpu_loop_program_live_set_at_xlas_peak(tmp_path: Path) -> None:
    args = ({"ws": jnp.zeros((4, 128, 128))}, jnp.zeros((32, 128)))
    compiled = _compiled(jax.grad(_scan_loss), args, tmp_path)
    hlo = compiled.as_text()
    found = mb.from_proto(compiled, hlo, top=5)
    assert found is not None and len(found["top"]) == 5
    assert found["peak_bytes"] == compiled.memory_analysis().peak_memory_in_bytes
    module = ba.module_of(compiled, hlo)
    assert module is not None
    allocs = ba.parse_buffer_assignment(_dumped(tmp_path, "buffer-assignment"))
    proto = compiled.memory_analysis().serialized_buffer_assignment_proto
    _same_allocations(ba.allocations_from_proto(proto, module), allocs)
    # The flattened schedule is XLA's (loop condition, body, then the while), and at the time
    # XLA calls its peak the device bytes live are the ones it lists there.
    text = _dumped(tmp_path, "live-range")
    sequence = re.findall(r"^\s+(\d+):(\S+)$", text, re.M)
    ranges = mb.LiveRanges(module)
    assert {name: int(t) for t, name in sequence} == ranges.time
    at, listed = _xla_peak(tmp_path)
    live = [x for x in mb._live_values(allocs, ranges) if x.start <= at <= x.end]
    by_alloc: dict[int, list[Any]] = {}
    for x in live:
        by_alloc.setdefault(x.alloc.index, []).append(x)
    assert sum(mb._occupied(v) for v in by_alloc.values()) == sum(listed.values())
    # this live-range analysis keeps a loop's carried values to the loop's end: never less
    assert found["live_peak_bytes"] >= sum(listed.values())
    dumped = mb.from_dump(tmp_path, hlo, compiled, top=5)
    assert dumped is not None
    assert {k: v for k, v in dumped.items() if k != "source"} == {
        k: v for k, v in found.items() if k != "source"
    }


# -- a v5e:2x2 topology compile: the dump is the source -----------------------------------------


@pytest.mark.slow
def test_topology_breakdown_from_xlas_dump(tmp_path: Path) -> None:
    from jaxaot.targets.tpu import resolve, topology_devices

    devs = topology_devices(resolve("v5e:2x2", 1))
    mesh = jax.sharding.Mesh(devs[:4], ("x",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    spec = {
        "params": {
            "w1": jax.ShapeDtypeStruct((256, 512), jnp.float32),
            "w2": jax.ShapeDtypeStruct((512, 128), jnp.float32),
        },
        "opt": {"unused": jax.ShapeDtypeStruct((3,), jnp.float32)},
    }
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    lowered = jax.jit(_mlp, in_shardings=rep, out_shardings=rep).trace(spec, x)
    compiled = lowered.lower(lowering_platforms=("tpu",)).compile(
        compiler_options=mb.dump_options(tmp_path)
    )
    hlo = compiled.as_text()
    assert mb.from_proto(compiled, hlo, top=10) is None  # jaxlib gives no proto here
    found = mb.from_dump(tmp_path, hlo, compiled, top=10)
    assert found is not None and found["source"] == "xla_dump"
    stats = compiled.memory_analysis()
    assert found["peak_bytes"] == stats.peak_memory_in_bytes
    # Totals per memory space are those of XLA's memory-usage report of the same compile.
    report = next(tmp_path.glob("*memory-usage-report.txt")).read_text()
    spaces = {
        int(m[1]): int(m[2]) for m in re.finditer(r"\(color=(\d+)\)\nTotal bytes: (\d+)", report)
    }
    allocs = ba.parse_buffer_assignment(_dumped(tmp_path, "buffer-assignment"))
    assert spaces[0] == sum(a.size for a in allocs if a.color == 0)
    on_chip = sum(found["groups"]["on_chip"].values())
    assert on_chip == sum(v for c, v in spaces.items() if c != 0)
    assert sum(found["groups"]["arguments"].values()) == stats.argument_size_in_bytes
    assert found["groups"]["arguments"] == {"args[0]['params']": 524288 + 262144, "args[1]": 65536}
    params = {r["path"] for r in found["top"] if r["kind"] == "argument"}
    assert params == {"args[0]['params']['w1']", "args[0]['params']['w2']", "args[1]"}
    # The live set at the peak is device memory only (no VMEM buffer), largest first.
    assert all(r["kind"] in ("argument", "output", "temporary", "constant") for r in found["top"])
    sizes = [r["bytes"] for r in found["top"]]
    assert sizes == sorted(sizes, reverse=True)


@pytest.mark.slow
def test_topology_single_output_is_live_at_the_peak(tmp_path: Path) -> None:
    """v5e:2x2, a program whose result is one array (the entry root computes it): the result
    is in the live set at the peak with every argument, and XLA's dump names the same step."""
    from jaxaot.targets.tpu import resolve, topology_devices

    devs = topology_devices(resolve("v5e:2x2", 1))
    mesh = jax.sharding.Mesh(devs[:4], ("x",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    w = jax.ShapeDtypeStruct((512, 1024), jnp.float32)
    lowered = jax.jit(_one_output, in_shardings=rep, out_shardings=rep).trace(x, w)
    compiled = lowered.lower(lowering_platforms=("tpu",)).compile(
        compiler_options=mb.dump_options(tmp_path)
    )
    found = mb.from_dump(tmp_path, compiled.as_text(), compiled, top=10)
    assert found is not None
    stats = compiled.memory_analysis()
    out = _output_row(found)
    assert out["shape"] == "f32[256,1024]" and out["bytes"] == stats.output_size_in_bytes
    assert out["live"][1] == found["schedule_length"]  # to the end of the program
    assert found["peak_groups"]["outputs"] == stats.output_size_in_bytes
    assert sum(found["peak_groups"]["arguments"].values()) == stats.argument_size_in_bytes
    needed = stats.argument_size_in_bytes + stats.output_size_in_bytes
    assert found["live_peak_bytes"] >= needed
    assert found["peak_time"] == _xla_peak(tmp_path)[0]


# -- the pipeline: artifact, metrics, summary, store, jaxaot-diff ------------------------------


def _run(tmp_path: Path, name: str, *overrides: str) -> jaxaot.RunResult:
    return jaxaot.run(jaxaot.compose(["program=mlp", *overrides]), run_dir=tmp_path / name)


def test_a_run_writes_the_breakdown_and_a_store_hit_serves_it(tmp_path: Path) -> None:
    first = _run(tmp_path, "a", "compile.memory_top=3")
    stage = first.manifest["stages"]["compile"]
    written = (tmp_path / "a" / "compile" / mb.ARTIFACT).read_bytes()
    assert "compile/memory_breakdown.json" in stage["artifacts"]
    found = json.loads(written)
    assert len(found["top"]) == 3 and found["live_at_peak"] > 3
    # The peak is plain JAX's for the same program.
    from jaxaot.examples.mlp import mlp

    spec = [
        {"w": jnp.zeros((256, 512)), "b": jnp.zeros((512,))},
        {"w": jnp.zeros((512, 512)), "b": jnp.zeros((512,))},
        {"w": jnp.zeros((512, 128)), "b": jnp.zeros((128,))},
    ]
    plain = jax.jit(mlp).lower(spec, jnp.zeros((64, 256))).compile().memory_analysis()
    assert stage["metrics"]["peak_bytes"] == plain.peak_memory_in_bytes == found["peak_bytes"]
    assert stage["metrics"]["peak_top"].startswith("f32[512,512] args[0][1]['w'] (1.0 MiB), ")
    line = COMPILE.show.line(stage["metrics"])
    assert f"peak {human_bytes(found['peak_bytes'])}: f32[512,512]" in line

    again = _run(tmp_path, "b", "compile.memory_top=3")
    hit = again.manifest["stages"]["compile"]
    assert hit["status"] == "cached"
    assert (tmp_path / "b" / "compile" / mb.ARTIFACT).read_bytes() == written  # bit for bit
    assert hit["metrics"]["peak_top"] == stage["metrics"]["peak_top"]
    assert hit["metrics"]["peak_bytes"] == stage["metrics"]["peak_bytes"]


def test_jaxaot_diff_says_what_grew_at_the_peak(tmp_path: Path) -> None:
    _run(tmp_path, "small", "store.enabled=false")
    _run(tmp_path, "big", "store.enabled=false", "program.args.1.shape=[512,256]")
    a, b = load_side(tmp_path / "small"), load_side(tmp_path / "big")
    peak = diff_report(a, b)["stages"]["compile"]["peak"]
    fig = {f["key"]: f for f in peak["figures"]}
    assert fig["peak_bytes"]["b"] > fig["peak_bytes"]["a"]
    assert fig["peak_bytes"]["a"] == a.memory["peak_bytes"]  # type: ignore[index]
    groups = {g["key"]: g for g in peak["groups"]}
    assert groups["args[1]"]["delta"] == (512 - 64) * 256 * 4  # the batch argument grew
    assert "args[0][0]" not in groups  # the weights did not
    grew = {r["buffer"]: r for r in peak["grew"]}
    assert grew["args[1]"]["a"] == 64 * 256 * 4 and grew["args[1]"]["b"] == 512 * 256 * 4
    text = render(diff_report(a, b), a, b, lines=0, full=False)
    assert "memory: XLA peak" in text and "live at the peak, new or larger in B:" in text
    assert re.search(r"args\[1\]\s+512\.0 KiB \(was 64\.0 KiB, argument\)", text)


def test_a_platform_without_the_proto_gets_the_breakdown_from_xlas_dump(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA executables carry an empty buffer assignment: compile.start has XLA dump it instead.
    With cpu among those platforms, the dump's breakdown is the proto's for the same compile,
    the executable the same bytes run to run, and compile.dump's own folder serves as well."""
    import jaxaot.stages.compile as compile_stage

    proto = _run(tmp_path, "proto", "store.enabled=false")
    monkeypatch.setattr(compile_stage, "BREAKDOWN_FROM_DUMP", frozenset({"cpu"}))
    dumped = _run(tmp_path, "dump", "store.enabled=false")
    # The same lowering compiled with the same options in this process: JAX serves its own
    # compile and XLA dumps nothing; the dump comes from the same compile run again for it.
    _run(tmp_path, "again", "store.enabled=false")
    kept = _run(
        tmp_path, "kept", "store.enabled=false", "compile.dump=true", "compile.dump_keep=[hlo]"
    )

    def breakdown(name: str) -> dict[str, Any]:
        return json.loads((tmp_path / name / "compile" / mb.ARTIFACT).read_text())

    a = breakdown("proto")
    assert a["source"] == "buffer_assignment_proto" and a["top"]
    for name in ("dump", "again", "kept"):
        b = breakdown(name)
        assert b["source"] == "xla_dump"
        assert {**b, "source": a["source"]} == a
    for run in (dumped, kept):
        m = run.manifest["stages"]["compile"]["metrics"]
        assert m["peak_bytes"] == proto.manifest["stages"]["compile"]["metrics"]["peak_bytes"]
        assert m["peak_top"] == proto.manifest["stages"]["compile"]["metrics"]["peak_top"]
    # The dump folder is named by what is compiled: the executable (which records it) is the
    # same bytes in two runs.
    exe = [(tmp_path / n / "compile" / "executable.bin").read_bytes() for n in ("dump", "again")]
    assert exe[0] == exe[1]
    # compile.dump: read from the run's dump before dump_keep removed the buffer assignment
    files = kept.manifest["stages"]["compile"]["xla_dump"]["files"]
    assert files and not any("buffer-assignment" in f for f in files)
    assert not list((tmp_path / "kept" / "compile" / "xla_dump").glob("*buffer-assignment*"))


def test_the_summary_shows_xlas_peak_only_where_no_verdict_stands_beside_it() -> None:
    """libtpu's peak counts on-chip (VMEM) and host memory: beside a topology's HBM verdict the
    summary names what is live at the peak, and leaves the figure to the verdict."""
    figures = CompileMetrics.from_metrics
    plain = mb.summary(figures({"peak_bytes": 2048, "peak_top": "f32[512] args[0] (2.0 KiB)"}))
    assert plain == ["peak 2.0 KiB: f32[512] args[0] (2.0 KiB)"]
    beside = mb.summary(
        figures({"peak_bytes": 4096, "peak_top": "f32[512] args[0] (2.0 KiB)", "fits": True})
    )
    assert beside == ["live at the peak: f32[512] args[0] (2.0 KiB)"]
    assert mb.summary(figures({"peak_bytes": None})) == []
