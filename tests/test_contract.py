"""The stage contract through the runner, with fake stages: no JAX, no Hydra, milliseconds.

Each test drives ``jaxaot.engine.runner._Runner`` over two or three fake stages and a real store
in a temporary folder, and checks what the contract's docstrings say: which member fires when,
and what each steering outcome (EntryUnusable, NotLoadableHere, DoesNotFit) does.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from jaxaot.engine.resume import Checkpoint
from jaxaot.engine.runner import _Runner
from jaxaot.errors import (
    DoesNotFit,
    EntryUnusable,
    NotLoadableHere,
    StageError,
    StoreError,
)
from jaxaot.rundir.manifest import Manifest
from jaxaot.stages.contract import (
    Ahead,
    Cached,
    Entry,
    Loadable,
    Plan,
    Presentation,
    Stage,
    StageContext,
    Uncached,
    Upstream,
)
from jaxaot.store.cache import Store

FACTS: Any = SimpleNamespace(program="fake")  # what the runner itself reads of the run's facts
SOURCE_SHOWS = Presentation(
    verb="reading", noun="text", figures=dict, summarize=lambda m: f"{m.get('chars', 0)} chars"
)
UPPER_SHOWS = Presentation(
    verb="upper-casing", noun="upper text", figures=dict, summarize=lambda m: ""
)


@dataclass(frozen=True)
class Text:
    text: str
    early: bool = False


@dataclass(frozen=True)
class NoOptions:
    pass


@dataclass
class Source:
    """A plain Stage (and Loadable): writes its text, publishing an early record first."""

    text: str = "abc"
    calls: list[str] = field(default_factory=list)
    name: str = "src"
    Options: type[NoOptions] = NoOptions
    Record: type[Text] = Text
    inputs: tuple[str, ...] = ()
    live_inputs: tuple[str, ...] = ()
    sections: tuple[str, ...] = ("src",)
    artifacts: tuple[str, ...] = ("src.txt",)
    show: Presentation = SOURCE_SHOWS
    again: str = "read again"
    recomputed_differs: dict[str, str] = field(default_factory=dict)
    load_raises: Exception | None = None

    def check(self, opts: Any, facts: Any) -> None:
        return None

    def run(self, ctx: StageContext, up: Upstream) -> Text:
        self.calls.append("run")
        if ctx.publish_early is not None:
            ctx.publish_early(Text(self.text, early=True))
            time.sleep(0.02)  # the rest of the stage, which the consumer's job overlaps
        ctx.write("src.txt", self.text)
        ctx.metrics["chars"] = len(self.text)
        return Text(self.text)

    def load(self, ctx: StageContext, up: Upstream, entry: Entry) -> Text:
        self.calls.append("load")
        if self.load_raises is not None:
            raise self.load_raises
        return Text(entry.read("src.txt").decode())


@dataclass
class Upper:
    """Cached, Loadable and Ahead: the upper-cased text, keyed by the text."""

    calls: list[str] = field(default_factory=list)
    name: str = "upper"
    Options: type[NoOptions] = NoOptions
    Record: type[Text] = Text
    inputs: tuple[str, ...] = ("src",)
    live_inputs: tuple[str, ...] = ()
    sections: tuple[str, ...] = ("upper",)
    artifacts: tuple[str, ...] = ("upper.txt",)
    required: tuple[str, ...] = ("upper.txt",)
    show: Presentation = UPPER_SHOWS
    again: str = "computed again"
    recomputed_differs: dict[str, str] = field(default_factory=dict)
    keyed: bool = True
    load_raises: Exception | None = None
    not_storable: str | None = None
    threads: list[str] = field(default_factory=list)

    def check(self, opts: Any, facts: Any) -> None:
        return None

    def compat(self, backend: Any) -> dict[str, Any]:
        return {"platform": backend.get("platform")}

    def plan(self, opts: Any, facts: Any, up: Upstream, backend: Any) -> Plan[str] | Uncached[str]:
        text = up["src"].text
        self.calls.append("plan-early" if up["src"].early else "plan")
        if not self.keyed:
            return Uncached(text, why="this text cannot be keyed")
        return Plan(hashlib.sha256(text.encode()).hexdigest(), text)

    def run(self, ctx: StageContext, up: Upstream) -> Text:
        raise AssertionError("a Cached stage runs through run_planned")

    def run_planned(self, ctx: StageContext, up: Upstream, plan: Plan[str] | Uncached[str]) -> Text:
        self.calls.append("run_planned")
        ctx.write("upper.txt", plan.state.upper())
        return Text(plan.state.upper())

    def load_planned(self, ctx: StageContext, up: Upstream, entry: Entry, plan: Plan[str]) -> Text:
        self.calls.append("load_planned")
        if self.load_raises is not None:
            raise self.load_raises
        data = entry.read("upper.txt")
        ctx.write("upper.txt", data)
        return Text(data.decode())

    def load(self, ctx: StageContext, up: Upstream, entry: Entry) -> Text:
        self.calls.append("load")
        return Text(entry.read("upper.txt").decode())

    def storable(self, record: Text, plan: Plan[str]) -> str | None:
        return self.not_storable

    def begin(self, opts: Any, plan: Plan[str], out_dir: Path) -> Any:
        self.calls.append("begin")

        def job() -> str:
            self.threads.append(threading.current_thread().name)
            return plan.state.upper()

        return job

    def run_begun(self, ctx: StageContext, up: Upstream, plan: Plan[str], begun: str) -> Text:
        self.calls.append("run_begun")
        ctx.write("upper.txt", begun)
        return Text(begun)


def drive(
    stages: tuple[Any, ...], run_dir: Path, store: Store, hows: tuple[str, ...] | None = None
) -> Manifest:
    """The runner's loop over ``stages`` (``hows``: run, resume or recompute, per stage)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(run_dir=run_dir, config={})
    hows = hows or ("run",) * len(stages)
    checkpoint = Checkpoint(run_dir.parent / "src-run") if "resume" in hows else None
    running = {s.name for s, how in zip(stages, hows, strict=True) if how != "resume"}
    opts = {s.name: NoOptions() for s in stages}
    runner = _Runner(FACTS, opts, run_dir, manifest, store, checkpoint, {}, running, stages)
    try:
        for stage, how in zip(stages, hows, strict=True):
            runner.records[stage.name] = runner.step(stage, how)
    finally:
        runner.close()
    manifest.status = "ok"
    manifest.write()
    return manifest


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store", enabled=True)


def test_the_fakes_implement_what_they_say() -> None:
    src, up = Source(), Upper()
    assert isinstance(src, Stage) and isinstance(src, Loadable) and not isinstance(src, Cached)
    assert isinstance(up, Cached) and isinstance(up, Ahead) and isinstance(up, Loadable)


def test_a_miss_runs_and_stores_then_a_hit_loads_without_running(
    tmp_path: Path, store: Store
) -> None:
    first = Upper()
    m1 = drive((Source(), first), tmp_path / "a", store)
    assert m1.stages["upper"]["status"] == "ran" and m1.stages["src"]["status"] == "ran"
    key = m1.stages["upper"]["key"]
    assert key == hashlib.sha256(b"abc").hexdigest()
    assert first.calls[-1] in ("run_planned", "run_begun") and "load_planned" not in first.calls
    second = Upper()
    m2 = drive((Source(), second), tmp_path / "b", store)
    assert m2.stages["upper"]["status"] == "cached" and m2.stages["upper"]["key"] == key
    assert "load_planned" in second.calls
    assert not {"run_planned", "run_begun"} & set(second.calls)
    assert (tmp_path / "b" / "upper" / "upper.txt").read_text() == "ABC"


def test_an_ahead_stage_begins_on_the_early_record_on_a_worker_thread(
    tmp_path: Path, store: Store
) -> None:
    up = Upper()
    manifest = drive((Source(), up), tmp_path / "a", store)
    assert up.calls == ["plan-early", "begin", "plan", "run_begun"]
    assert up.threads and up.threads[0].startswith("jaxaot-ahead")
    assert "overlapped_seconds" in manifest.stages["upper"]


def test_entry_unusable_drops_the_entry_and_computes(tmp_path: Path, store: Store) -> None:
    drive((Source(), Upper()), tmp_path / "a", store)
    bad = Upper(load_raises=EntryUnusable("the bytes mean something else here"))
    manifest = drive((Source(), bad), tmp_path / "b", store)
    rec = manifest.stages["upper"]
    assert rec["status"] == "ran" and bad.calls.count("load_planned") == 1
    assert any("unusable (the bytes mean something else here)" in w for w in rec["warnings"])
    assert any("upper-casing instead" in w for w in rec["warnings"])
    again = Upper()  # the entry was dropped, then stored again by the computing run
    assert drive((Source(), again), tmp_path / "c", store).stages["upper"]["status"] == "cached"


def test_not_loadable_here_keeps_the_entry_and_computes(tmp_path: Path, store: Store) -> None:
    drive((Source(), Upper()), tmp_path / "a", store)
    cold = Upper(load_raises=NotLoadableHere("no kernel here"))
    rec = drive((Source(), cold), tmp_path / "b", store).stages["upper"]
    assert rec["status"] == "ran"
    assert any("not loaded cold (no kernel here)" in w for w in rec["warnings"])
    assert drive((Source(), Upper()), tmp_path / "c", store).stages["upper"]["status"] == "cached"


def test_uncached_runs_without_the_store_and_says_why(tmp_path: Path, store: Store) -> None:
    up = Upper(keyed=False)
    rec = drive((Source(), up), tmp_path / "a", store).stages["upper"]
    assert rec["status"] == "ran" and rec["key"] is None
    assert rec["warnings"] == ["this text cannot be keyed"]
    assert "begin" not in up.calls  # no key, nothing begun ahead
    assert drive((Source(), Upper()), tmp_path / "b", store).stages["upper"]["status"] == "ran"


def test_storable_refuses_a_result_the_key_does_not_describe(tmp_path: Path, store: Store) -> None:
    up = Upper(not_storable="upper text not stored: made with a debug option")
    rec = drive((Source(), up), tmp_path / "a", store).stages["upper"]
    assert rec["warnings"] == ["upper text not stored: made with a debug option"]
    assert drive((Source(), Upper()), tmp_path / "b", store).stages["upper"]["status"] == "ran"


def test_does_not_fit_is_the_stages_status_with_its_verdicts_metrics(
    tmp_path: Path, store: Store
) -> None:
    class TooBig(Source):
        def run(self, ctx: StageContext, up: Upstream) -> Text:
            raise DoesNotFit("needs 2 GiB, has 1 GiB", {"fits": False}, {"peak_bytes": 2 << 30})

    run_dir = tmp_path / "a"
    run_dir.mkdir()
    manifest = Manifest(run_dir=run_dir, config={})
    opts = {"src": NoOptions()}
    runner = _Runner(FACTS, opts, run_dir, manifest, store, None, {}, {"src"}, (TooBig(),))
    with pytest.raises(DoesNotFit):
        runner.step(TooBig(), "run")
    rec = manifest.stages["src"]
    assert rec["status"] == "does_not_fit" and rec["metrics"]["peak_bytes"] == 2 << 30


def test_a_checkpoint_that_cannot_serve_is_computed_again_with_the_reason(
    tmp_path: Path, store: Store
) -> None:
    drive((Source(),), tmp_path / "src-run", store)
    loaded = Source()
    manifest = drive((loaded,), tmp_path / "r", store, hows=("resume",))
    assert manifest.stages["src"]["status"] == "resumed" and loaded.calls == ["load"]
    # A stage with no live inputs to wait for is computed when its checkpoint cannot serve.
    refusing = Source(load_raises=EntryUnusable("made for another text"))
    rec = drive((refusing,), tmp_path / "s", store, hows=("resume",)).stages["src"]
    assert refusing.calls == ["load", "run"] and rec["status"] == "ran"
    assert rec["warnings"][0] == (
        "checkpoint text unusable here (made for another text); not loaded, read again"
    )


def test_a_corrupt_checkpoint_file_is_the_users_error(tmp_path: Path, store: Store) -> None:
    from jaxaot.errors import StoreError

    drive((Source(),), tmp_path / "src-run", store)
    (tmp_path / "src-run" / "src" / "src.txt").write_text("tampered")
    with pytest.raises(StoreError, match=r"checkpoint file .*src\.txt is corrupt"):
        drive((Source(),), tmp_path / "r", store, hows=("resume",))


def test_any_store_error_on_a_hit_drops_the_entry_and_computes(
    tmp_path: Path, store: Store
) -> None:
    drive((Source(), Upper()), tmp_path / "a", store)
    bad = Upper(load_raises=StoreError("upper.txt: not the bytes its manifest records"))
    rec = drive((Source(), bad), tmp_path / "b", store).stages["upper"]
    assert rec["status"] == "ran" and "run_planned" in bad.calls
    assert any(
        "unusable (upper.txt: not the bytes" in w and "entry removed" in w for w in rec["warnings"]
    )


def test_another_error_on_a_hit_ends_the_run(tmp_path: Path, store: Store) -> None:
    drive((Source(), Upper()), tmp_path / "a", store)
    broken = Upper(load_raises=StageError("upper", "a bug in load"))
    with pytest.raises(StageError, match="a bug in load"):
        drive((Source(), broken), tmp_path / "b", store)
    assert "run_planned" not in broken.calls
    assert drive((Source(), Upper()), tmp_path / "c", store).stages["upper"]["status"] == "cached"


def test_a_stored_executable_for_another_module_is_warned_dropped_and_compiled_again(
    tmp_path: Path, store: Store
) -> None:
    """jaxaot.stages.topology.load refuses a stored compile whose module is not this run's
    lowering with EntryUnusable: on a hit the entry is dropped and the stage computed."""
    from jaxaot.stages import topology

    class OtherModule(Upper):
        def load_planned(
            self, ctx: StageContext, up: Upstream, entry: Entry, plan: Plan[str]
        ) -> Text:
            self.calls.append("load_planned")
            files = {"compiled.json": json.dumps({"module_sha256": "another"}).encode()}
            lowered: Any = SimpleNamespace(module_sha256="this run's")
            return topology.load(ctx, lowered, files.__getitem__, ("compiled.json",), Text)

    drive((Source(), Upper()), tmp_path / "a", store)
    other = OtherModule()
    rec = drive((Source(), other), tmp_path / "b", store).stages["upper"]
    assert rec["status"] == "ran" and other.calls[-2:] == ["load_planned", "run_planned"]
    label = f"store entry upper/{rec['key'][:12]}"
    assert rec["warnings"] == [
        f"{label} unusable (stored executable is for another module); entry removed, "
        "upper-casing instead"
    ]
    assert drive((Source(), Upper()), tmp_path / "c", store).stages["upper"]["status"] == "cached"


def test_a_checkpoint_not_loadable_here_is_computed_again(tmp_path: Path, store: Store) -> None:
    drive((Source(),), tmp_path / "src-run", store)
    cold = Source(load_raises=NotLoadableHere("no kernel here"))
    rec = drive((cold,), tmp_path / "r", store, hows=("resume",)).stages["src"]
    assert cold.calls == ["load", "run"] and rec["status"] == "ran"
    assert rec["warnings"][0].startswith("checkpoint text unusable here (no kernel here)")


@pytest.mark.parametrize(
    "error",
    [StageError("src", "a bug in load"), StoreError("src.txt: not in the checkpoint")],
    ids=["stage-error", "store-error"],
)
def test_any_other_error_from_a_checkpoint_load_ends_the_run(
    tmp_path: Path, store: Store, error: Exception
) -> None:
    drive((Source(),), tmp_path / "src-run", store)
    failing = Source(load_raises=error)
    with pytest.raises(type(error)):
        drive((failing,), tmp_path / "r", store, hows=("resume",))
    assert failing.calls == ["load"]
