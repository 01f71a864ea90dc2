"""Every example in README.md, executed verbatim: documentation that cannot drift.

Extracted from README.md: fenced code blocks and 4-space indented blocks whose first line is a
command (``jaxaot``, ``jaxaot-*``, ``python``, ``pytest``, ``make``, ...) run under bash with
``set -e``; `````python`` blocks run under Python (through pytest when they define ``test_*``
functions), and a line ``expr  # value`` in them asserts that ``expr`` equals that value (or
that its ``repr`` is it). Output samples (a summary, a progress line, an error line) are not
commands and are left alone.

Only where things are written is redirected: each README section (``## ...``) runs its blocks
in order in a fresh temporary directory, so the README's relative ``outputs/`` and
``golden/`` land there, with ``JAXAOT_STORE_DIR`` pointing at one store shared by the sections.
The sections run in two xdist groups of about equal time (:data:`SECOND_GROUP`), one worker
each under ``make test``; each worker has its own examples' server and store.
The ``jaxaot`` commands run as written and reach a resident ``jaxaot server`` of the examples'
own, as after the README's ``jaxaot server start`` (served runs are what in-process runs are:
tests/test_server.py), except from the example that starts a server of its own to the end of
its section; with ``JAXAOT_TEST_SERVER=0`` every one is a plain process.
A block is left out only by an explicit marker right before it, with its reason:

    <!-- readme-test: skip (needs a TPU host) -->

and ``<!-- readme-test: file mypkg/model.py -->`` writes the block to that path of the
section's directory instead of running it (a file the next example imports). The skipped
blocks are listed, with their reasons, by ``test_readme_skips_are_explicit``.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, SuiteServer, cli_env, extra_reason

README = REPO / "README.md"
COMMAND = re.compile(
    r"^(jaxaot(-[a-z]+)?|python3?|pytest|make|sudo|mkdir|chgrp|chmod|umask|export|ls|cd)(\s|$)"
)
MARKER = re.compile(r"^<!-- readme-test: (skip|file) (.+?) -->$")
# Console scripts as the tests run them: from this checkout, whatever is installed; each the
# module of pyproject.toml's [project.scripts] entry (test_readme_scripts_are_pyprojects).
SCRIPTS = {
    "jaxaot": "jaxaot",  # the console script's path: through a running server, else in-process
    "jaxaot-store": "jaxaot.cli.store_cmd",
    "jaxaot-diff": "jaxaot.cli.diff_cmd",
    "jaxaot-graph": "jaxaot.cli.graph_cmd",
    "jaxaot-report": "jaxaot.cli.report_cmd",
}
# The bucket the examples name: in a section that has one, they reach moto's S3 server on
# loopback (the testing extra), where it exists, and run as written.
BUCKET = "team-bucket"


@dataclass(frozen=True)
class Block:
    section: str
    line: int  # 1-based line of the block's first line in README.md
    kind: str  # "shell" | "python"
    text: str
    skip: str | None = None  # the reason given by a skip marker
    file: str | None = None  # a file marker's path

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.section}): {self.text.splitlines()[0][:70]}"


def _is_command(text: str) -> bool:
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    # "jaxaot · mlp ..." opens a summary and "jaxaot: error: ..." an error line: output.
    return bool(COMMAND.match(first)) and not re.match(r"^jaxaot( ·|:)", first)


def readme_blocks(text: str | None = None) -> list[Block]:
    """The README's examples, in order, with the markers that precede them."""
    lines = (text if text is not None else README.read_text()).splitlines()
    blocks: list[Block] = []
    section, marker, i = "", None, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section, marker = line[3:].strip(), None
        m = MARKER.match(line.strip())
        if m:
            marker = (m[1], m[2].strip().removeprefix("(").removesuffix(")"))
            i += 1
            continue
        if line.startswith("```"):
            lang = line[3:].strip()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            body = "\n".join(lines[i + 1 : end]) + "\n"
            kind = "python" if lang == "python" else "shell" if _is_command(body) else None
            if marker and marker[0] == "file":
                kind = kind or "text"  # a config file (YAML) the next example reads
            if kind:
                blocks.append(_block(section, i + 2, kind, body, marker))
            marker, i = None, end + 1
            continue
        if line.startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            while not lines[end - 1].strip():
                end -= 1
            body = textwrap.dedent("\n".join(lines[i:end])) + "\n"
            if _is_command(body):
                blocks.append(_block(section, i + 1, "shell", body, marker))
            marker, i = None, end
            continue
        if line.strip():
            marker = None if not line.startswith("<!--") else marker
        i += 1
    return blocks


def _block(section: str, line: int, kind: str, body: str, marker: tuple[str, str] | None) -> Block:
    if marker and marker[0] == "skip":
        return Block(section, line, kind, body, skip=marker[1])
    if marker and marker[0] == "file":
        return Block(section, line, kind, body, file=marker[1])
    return Block(section, line, kind, body)


def _checked(source: str) -> str:
    """``expr  # value`` lines become assertions that ``expr`` is that value (or its repr)."""
    out = []
    for line in source.splitlines():
        code, sep, comment = line.partition("  # ")
        if sep and not line.startswith((" ", "#")) and comment.strip():
            try:
                tree = ast.parse(code)
            except SyntaxError:
                tree = None
            value = comment.strip()
            if tree and len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr):
                try:
                    ast.literal_eval(value)
                    out.append(f"assert ({code}) == {value}, ({code!r}, {code})")
                    continue
                except (ValueError, SyntaxError):
                    if re.fullmatch(r"[A-Za-z_]\w*\(.*\)", value):
                        out.append(f"assert repr({code}) == {value!r}, repr({code})")
                        continue
        out.append(line)
    return "\n".join(out) + "\n"


BLOCKS = readme_blocks()
SECTIONS = list(dict.fromkeys(b.section for b in BLOCKS if not b.skip))

# The sections of the second xdist group, led by the topology compiles (the 8B step's ~1.5
# minutes): about half of the sections' time, measured quiet with --durations; the others run
# in the first group, on the other worker.
SECOND_GROUP = frozenset(
    {
        "Compiling for hardware you don't have",
        "Parallel programs: axis_env, meshes, shardings, platforms",
        "Lowering snapshots: pin what your program compiles to",
        "The store: compile once",
        "Resume from any stage",
        "Errors",
    }
)


# Examples that start and stop a `jaxaot server` of their own: from the first of them to the end
# of its section, the examples get a socket of their own, and run in-process where no server of
# theirs runs; the section's examples before it reach the examples' shared server.
OWN_SERVER = frozenset(b for b in BLOCKS if not b.skip and "jaxaot server" in b.text)


@pytest.fixture(scope="module")
def readme_env(
    tmp_path_factory: pytest.TempPathFactory, suite_server: SuiteServer | None
) -> Iterator[dict[str, str]]:
    """The examples' environment: this checkout's console scripts first on PATH, one store,
    and (unless ``JAXAOT_TEST_SERVER=0``) a resident ``jaxaot server`` of the examples' own
    that the ``jaxaot`` commands reach, as after the README's ``jaxaot server start``."""
    bin_dir = tmp_path_factory.mktemp("bin")
    for name, module in SCRIPTS.items():
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m {module} "$@"\n')
        script.chmod(0o755)
    # `python` is this venv's: a link would not be (a venv is found beside the path started)
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    store = tmp_path_factory.mktemp("store")
    env = cli_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", JAXAOT_STORE_DIR=str(store)
    )
    env.pop("JAXAOT_SERVER", None)
    server = None
    if suite_server is not None:
        server = SuiteServer(tmp_path_factory.mktemp("server"), env)
        env["JAXAOT_SERVER_SOCKET"] = server.start()
    try:
        yield env
    finally:
        if server is not None:
            server.stop()


def _own_server_env(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    # The section's `jaxaot server start` starts the examples' own server, not a developer's
    # nor the one the other sections share; a failed example may leave it running: none
    # outlives its section (the caller stops it).
    folder = tmp_path / "own-server"
    folder.mkdir(mode=0o700)
    return {**env, "JAXAOT_SERVER_SOCKET": str(folder / "server.sock")}


def _run(block: Block, cwd: Path, env: dict[str, str], n: int) -> None:
    if block.file:
        path = cwd / block.file
        path.parent.mkdir(parents=True, exist_ok=True)
        init = path.parent / "__init__.py"
        if path.suffix == ".py" and not init.exists() and path.parent != cwd:
            init.write_text("")
        path.write_text(block.text)
        return
    if block.kind == "python":
        script = cwd / f"test_readme_snippet_{n}.py"
        script.write_text(_checked(block.text))
        defines_tests = re.search(r"^def test_", block.text, re.M)
        cmd = (
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", script.name]
            if defines_tests
            else [sys.executable, script.name]
        )
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", block.text]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=540)
    if proc.returncode != 0:
        pytest.fail(
            f"{block} exited {proc.returncode}\n--- block ---\n{block.text}"
            f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}",
            pytrace=False,
        )


@pytest.mark.parametrize(
    "section",
    [
        pytest.param(
            s, marks=pytest.mark.xdist_group(f"test_readme_{2 if s in SECOND_GROUP else 1}")
        )
        for s in SECTIONS
    ],
)
def test_readme_section_runs_verbatim(
    section: str, tmp_path: Path, readme_env: dict[str, str]
) -> None:
    """Every example of one README section, in order, in one fresh directory."""
    work = tmp_path / "work"
    work.mkdir()
    blocks = [b for b in BLOCKS if b.section == section]
    with contextlib.ExitStack() as stack:
        base = readme_env
        if any(f"s3://{BUCKET}/" in b.text for b in blocks if not b.skip):
            base = stack.enter_context(_bucket_env(readme_env))
        env = base
        try:
            for n, block in enumerate(blocks):
                if block.skip:
                    print(f"readme-test: skipped {block}: {block.skip}")
                    continue
                if block in OWN_SERVER and env is base:
                    env = _own_server_env(base, tmp_path)
                _run(block, work, env, n)
        finally:
            if env is not base:
                stop = [sys.executable, "-m", "jaxaot", "server", "stop"]
                subprocess.run(stop, env=env, capture_output=True, timeout=120)


@contextlib.contextmanager
def _bucket_env(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """``env`` reaching an S3 server on loopback that has :data:`BUCKET`, for its duration."""
    pytest.importorskip("moto.server", reason=extra_reason("testing"))
    pytest.importorskip("s3fs", reason=extra_reason("s3"))
    from s3_server import start_s3_server

    server = start_s3_server()
    try:
        server.client().create_bucket(Bucket=BUCKET)  # type: ignore[attr-defined]
        yield {**env, **server.env}
    finally:
        server.server.stop()  # type: ignore[attr-defined]


def test_readme_scripts_are_pyprojects() -> None:
    """The examples run each console script as the module pyproject.toml installs it as."""
    with open(REPO / "pyproject.toml", "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    for name, module in SCRIPTS.items():
        if name != "jaxaot":  # the server-or-in-process entry: `python -m jaxaot` is both
            assert scripts[name].split(":")[0] == module, name
    assert sorted(scripts) == sorted(SCRIPTS)


def test_readme_groups_name_sections() -> None:
    """A renamed section must be renamed in SECOND_GROUP too, or the groups drift apart."""
    assert sorted(SECOND_GROUP - set(SECTIONS)) == []
    assert len(SECOND_GROUP) < len(SECTIONS)


def test_readme_skips_are_explicit() -> None:
    """The examples not run here, each with its reason; a new one is a deliberate change."""
    skipped = [b for b in BLOCKS if b.skip]
    for b in skipped:
        print(f"readme-test: not run: {b}: {b.skip}")
    assert len(skipped) == 13, [str(b) for b in skipped]
    assert len([b for b in BLOCKS if not b.skip and not b.file]) >= 13  # the rest all run


def test_the_extractor_finds_commands_markers_and_skips_output() -> None:
    text = textwrap.dedent(
        """\
        ## One
        ```
        jaxaot program=axpy   # a comment
        ```
        ```
        jaxaot · axpy (jaxaot.examples.axpy:axpy) · cpu x1 (cpu)
        ```

            jaxaot: error: program.target='os:system' imports ...

        <!-- readme-test: skip (needs a TPU host) -->
        ```
        jaxaot resume_from=x start_at=compile
        ```
        ## Two
        <!-- readme-test: file mypkg/model.py -->
        ```python
        def loss(x):
            return x
        ```

            jaxaot program=mlp \\
                stop_after=lower

        ```python
        1 + 1  # 2
        ```
        """
    )
    blocks = readme_blocks(text)
    assert [(b.section, b.kind, b.skip, b.file) for b in blocks] == [
        ("One", "shell", None, None),
        ("One", "shell", "needs a TPU host", None),
        ("Two", "python", None, "mypkg/model.py"),
        ("Two", "shell", None, None),
        ("Two", "python", None, None),
    ]
    assert blocks[3].text == "jaxaot program=mlp \\\n    stop_after=lower\n"
    assert _checked(blocks[4].text).startswith("assert (1 + 1) == 2")
    assert _checked("x.outputs  # array(10, dtype=int32)\n").startswith(
        "assert repr(x.outputs) == 'array(10, dtype=int32)'"
    )


def test_the_examples_server_listens_where_the_examples_look(tmp_path: Path) -> None:
    """The examples' server is started on its own socket, the one their environment names,
    whatever socket the environment it was given named (the suite's, or none)."""
    folder = tmp_path / "server"
    folder.mkdir(mode=0o700)
    server = SuiteServer(folder, {"JAXAOT_SERVER_SOCKET": str(tmp_path / "elsewhere.sock")})
    assert server.env["JAXAOT_SERVER_SOCKET"] == server.socket == str(folder / "server.sock")
