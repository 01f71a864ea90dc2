"""``XLA_FLAGS`` and ``LIBTPU_INIT_ARGS`` read the way XLA and libtpu read them, for the compile
key: which variable a backend reads, the words it sees, and each flag's value in effect.

XLA (xla/parse_flags_from_env.cc and xla/tsl/util/command_line_flags.cc, as in jaxlib 0.10.2):

- ``XLA_FLAGS`` is read once per process, when XLA first needs its options (the first backend's
  start). Every XLA backend reads it: the CPU client, and plugins through the options jaxlib
  sends them.
- A value whose first character after whitespace is not ``-`` is a file name, opened as given
  (relative to the working directory, any leading whitespace part of the name); the file's
  contents are parsed like the variable's. A file that cannot be opened ends the process; a
  file naming another file is not followed; there is no ``--flagfile=`` (an unknown flag, which
  also ends the process).
- Words are separated by whitespace; ``--name="a b"`` and ``--name='a b'`` quote a value
  (backslash escapes in double quotes only). Parsing stops, silently, at the first word that
  does not start with ``-``: the rest is ignored.
- Flags apply in order, so the last value of a flag wins. A bool flag takes ``--name`` or
  ``--name=true|false|1|0`` (true/false in any case); ``--noname`` is an unknown flag.

Only libtpu reads ``LIBTPU_INIT_ARGS`` (the tpu backend, and compile.topology's TPU compiles);
TensorFlow's loader (tensorflow/core/tpu/tpu_initializer_helper.cc) splits it at single spaces,
with no quoting and no file, and hands the words to libtpu, whose parser is not public: a
repeated flag keys every value in order rather than assuming that the last wins.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

XLA_FLAGS = "XLA_FLAGS"
LIBTPU_INIT_ARGS = "LIBTPU_INIT_ARGS"
FLAG_ENV_VARS = (XLA_FLAGS, LIBTPU_INIT_ARGS)

# Which lowering platforms read which variable: every XLA backend reads XLA_FLAGS; only libtpu
# (the tpu backend and compile.topology's TPU compiles) reads LIBTPU_INIT_ARGS.
READ_BY: Mapping[str, frozenset[str]] = {
    XLA_FLAGS: frozenset({"cpu", "cuda", "rocm", "tpu"}),
    LIBTPU_INIT_ARGS: frozenset({"tpu"}),
}

# Flags that change only what XLA writes out (dumps) or what it is told about the host, never
# the executable: JAX's own persistent-cache key leaves out exactly these
# (jax/_src/cache_key.py ``xla_flags_to_exclude_from_cache_key``, jax 0.10.2). The device count
# flag is left out because the compile key has the device count itself.
OUTPUT_ONLY_XLA_FLAGS = frozenset(
    {
        "--xla_dump_compress_protos",
        "--xla_dump_module_metadata",
        "--xla_dump_max_hlo_modules",
        "--xla_dump_include_timestamp",
        "--xla_dump_hlo_pass_re",
        "--xla_dump_hlo_module_re",
        "--xla_dump_hlo_snapshots",
        "--xla_dump_fusion_visualization",
        "--xla_dump_hlo_as_url",
        "--xla_dump_hlo_as_proto",
        "--xla_dump_hlo_as_text",
        "--xla_dump_hlo_as_long_text",
        "--xla_dump_hlo_as_html",
        "--xla_dump_hlo_as_dot",
        "--xla_dump_to",
        "--xla_force_host_platform_device_count",
        "--xla_dump_disable_metadata",
        "--xla_dump_hlo_pipeline_re",
        "--xla_tpu_sdc_checker_streamz_metric",
        "--xla_tpu_sdc_checker_enable_sdc_event_callbacks",
        "--xla_tpu_sdc_checker_enable_coresweep_ng_callbacks",
        "--xla_tpu_sdc_checker_no_logging_if_callbacks_are_present",
        "--xla_gpu_cuda_data_dir",
        "--xla_gpu_experimental_autotune_cache_mode",
    }
)

_WS = " \t\r\n"  # parse_flags_from_env.cc kWS


@dataclass(frozen=True)
class FlagSource:
    """What one flag variable held when its reader read it: the value, and for an
    ``XLA_FLAGS`` that names a file, the file's contents (or why it cannot be read)."""

    var: str
    raw: str
    path: str | None = None  # the file XLA_FLAGS names, absolute
    text: str | None = None  # its contents, bytes as latin-1 (XLA reads bytes)
    error: str | None = None  # why XLA could not use it (it ends the process)

    @property
    def flag_text(self) -> str:
        """The text the flags are parsed from: the file's contents (none when unreadable) or
        the value itself."""
        return (self.text or "") if self.path is not None else self.raw


def read_source(var: str, environ: Mapping[str, str] | None = None) -> FlagSource:
    """The variable ``var`` of ``environ`` (default: this process's), with the file it names
    read now; a file that cannot be read is recorded in ``error``, never read as empty."""
    env = os.environ if environ is None else environ
    raw = env.get(var, "")
    if var != XLA_FLAGS or not raw or raw.lstrip(_WS).startswith("-"):
        return FlagSource(var, raw)
    path = os.path.abspath(raw)
    try:
        with open(raw, "rb") as fh:  # as given: relative to the working directory
            return FlagSource(var, raw, path=path, text=fh.read().decode("latin-1"))
    except OSError as exc:
        why = (
            "names a directory"
            if isinstance(exc, IsADirectoryError)
            else f"names a file that cannot be read ({exc.strerror or type(exc).__name__})"
        )
        return FlagSource(var, raw, path=path, error=why)


def error_line(src: FlagSource) -> str:
    """A one-line refusal for a source with an ``error``."""
    return (
        f"{src.var}={src.raw!r}: XLA reads a value that does not start with '-' as the name "
        f"of a file of flags, and this one {src.error}; expected flags (--xla_...=...) or a "
        "readable file of them (XLA has no --flagfile=)"
    )


def xla_words(text: str) -> tuple[list[str], str]:
    """The words XLA's ParseArgvFromString makes of ``text``, and the rest it ignores (from
    the first word that does not start with '-')."""
    words: list[str] = []
    n = len(text)
    b = _skip_ws(text, 0)
    while b < n and text[b] == "-":
        e = b
        while e < n and text[e].isascii() and (text[e] in "-_" or text[e].isalnum()):
            e += 1
        if e + 1 < n and text[e] == "=" and text[e + 1] in "'\"":
            quote, value, e = text[e + 1], [], e + 2
            name_end = e - 1  # just past '='
            while e < n and text[e] != quote:
                if quote == '"' and text[e] == "\\" and e + 1 < n:
                    e += 1
                value.append(text[e])
                e += 1
            if e < n:  # the closing quote
                e += 1
            words.append(text[b:name_end] + "".join(value))
        else:
            e = _find_ws(text, e)
            words.append(text[b:e])
        b = _skip_ws(text, e)
    return words, text[b:]


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _find_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] not in _WS:
        i += 1
    return i


def libtpu_words(raw: str) -> list[str]:
    """The words libtpu gets: the value split at single spaces (empty words dropped)."""
    return [w for w in raw.split(" ") if w]


def flag_name(word: str) -> str:
    """``--name`` of a word ``--name=value`` or ``--name``."""
    return word.split("=", 1)[0]


def xla_effective(words: list[str]) -> dict[str, str]:
    """Each flag's value in effect after XLA applied ``words`` in order (the last one wins),
    output-only flags left out. ``--name`` is ``--name=true``: only a bool flag takes the bare
    form (any other flag is unknown to XLA, which ends the process), so the two are the same
    flag value. Other values are kept as written: ``=1`` and ``=true`` are one value for a bool
    flag but two for a string flag, and this module does not know XLA's flag types (the key
    also has XLA's own parse: :func:`jaxaot.stages.jaxenv.debug_options_sha256`)."""
    out: dict[str, str] = {}
    for word in words:
        name, eq, value = word.partition("=")
        if name in OUTPUT_ONLY_XLA_FLAGS:
            continue
        out[name] = value if eq else "true"
    return dict(sorted(out.items()))


def libtpu_effective(words: list[str]) -> dict[str, Any]:
    """What of ``LIBTPU_INIT_ARGS`` the key holds: each ``--name=value`` flag's value, a
    repeated flag's values as a list in order, output-only flags left out. Words of any other
    form (``--name`` alone, which libtpu may read with the next word as its value, ``-x``,
    positional words) leave the whole list of words in the key, in order."""
    kept = [w for w in words if flag_name(w) not in OUTPUT_ONLY_XLA_FLAGS]
    if not all(w.startswith("--") and "=" in w and len(flag_name(w)) > 2 for w in kept):
        return {"words": kept}
    values: dict[str, list[str]] = {}
    for word in kept:
        name, _, value = word.partition("=")
        values.setdefault(name, []).append(value)
    return {n: v[0] if len(v) == 1 else v for n, v in sorted(values.items())}


@dataclass(frozen=True)
class ParsedFlags:
    """One variable as its reader sees it."""

    source: FlagSource
    words: list[str]  # in the order the reader applies them
    ignored: str  # text XLA skips (from the first word not starting with '-')
    effective: dict[str, Any]  # what the key holds
    output_only: list[str] = field(default_factory=list)  # words left out of the key

    def to_json(self) -> dict[str, Any]:
        """The manifest's record: the raw value, the file it names, what was read, and what
        the key holds."""
        src = self.source
        out: dict[str, Any] = {"raw": src.raw}
        if src.path is not None:
            out["file"] = src.path
            if src.text is not None:
                out["file_sha256"] = hashlib.sha256(src.text.encode("latin-1")).hexdigest()
        out["words"] = list(self.words)
        if self.ignored.strip():
            out["ignored"] = self.ignored
        out["effective"] = self.effective
        out["not_in_key"] = list(self.output_only)
        out["read_by"] = sorted(READ_BY[src.var])
        return out


def parse(src: FlagSource) -> ParsedFlags:
    """``src`` parsed as its reader parses it (a source with an ``error`` parses as no flags:
    callers refuse it first, see :func:`error_line`)."""
    if src.var == XLA_FLAGS:
        words, ignored = xla_words(src.flag_text if src.error is None else "")
        effective: dict[str, Any] = xla_effective(words)
    else:
        words, ignored = libtpu_words(src.raw), ""
        effective = libtpu_effective(words)
    output_only = [w for w in words if flag_name(w) in OUTPUT_ONLY_XLA_FLAGS]
    return ParsedFlags(src, words, ignored, effective, output_only)


__all__ = [
    "FLAG_ENV_VARS",
    "LIBTPU_INIT_ARGS",
    "OUTPUT_ONLY_XLA_FLAGS",
    "READ_BY",
    "XLA_FLAGS",
    "FlagSource",
    "ParsedFlags",
    "error_line",
    "flag_name",
    "libtpu_effective",
    "libtpu_words",
    "parse",
    "read_source",
    "xla_effective",
    "xla_words",
]
