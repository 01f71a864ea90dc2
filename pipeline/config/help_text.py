"""The config-group part of ``jaxaot --help``, rendered from ``conf/`` itself so it cannot drift.

Hydra's ``$APP_CONFIG_GROUPS`` lists the ``base_*`` schema entries as if they were choices and
``$CONFIG`` dumps the whole composed config (the transformer's parameter tree alone is ~150
lines). ``conf/config.yaml``'s help template uses ``${jaxaot_help:groups}`` and
``${jaxaot_help:keys}`` instead: one line per group (its description from the defaults list's
comment, its options, the default marked ``*``) and the top-level keys with their comments.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

RESOLVER = "jaxaot_help"
WIDTH = 100
_DEFAULTS_LINE = re.compile(r"^\s+- (?P<group>[\w/]+): (?P<default>\S+)\s+# (?P<doc>.*)$")
_TOP_KEY = re.compile(r"^(?P<key>\w+): (?P<value>.*?)\s+# (?P<doc>.*)$")


def _conf_dir() -> Path:
    import jaxaot.conf as conf

    return Path(conf.__file__).parent


def _options(group: str) -> list[str]:
    folder = _conf_dir() / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def groups_text() -> str:
    """``program  what to compile: attention, axpy, ..., transformer*`` for every group."""
    lines = (_conf_dir() / "config.yaml").read_text().splitlines()
    rows = []
    for line in lines:
        m = _DEFAULTS_LINE.match(line)
        if not m or m["group"].startswith("base_") or m["group"] == "_self_":
            continue
        group, default = m["group"], m["default"]
        doc = m["doc"].split(": conf/", 1)[0].split(" (conf/", 1)[0]
        opts = [o + ("*" if o == default else "") for o in _options(group)]
        rows.append((group, doc, opts))
    width = max(len(g) for g, _, _ in rows) + 2
    out = []
    for group, doc, opts in rows:
        text = f"{doc}: {', '.join(opts)}" if opts else doc
        wrapped = textwrap.wrap(text, WIDTH - width) or [""]
        out.append(f"{group:<{width}}{wrapped[0]}")
        out += [" " * width + w for w in wrapped[1:]]
    return "\n".join(out)


def keys_text() -> str:
    """The top-level keys of ``conf/config.yaml`` with their default and comment."""
    out = []
    for line in (_conf_dir() / "config.yaml").read_text().splitlines():
        if line.startswith("hydra:"):
            break
        m = _TOP_KEY.match(line)
        if m and m["key"] != "defaults":
            out.append(f"{m['key'] + '=' + m['value']:<24}{m['doc']}")
    return "\n".join(out)


def _resolve(part: str) -> str:
    return {"groups": groups_text, "keys": keys_text}[part]()


def register_resolver() -> None:
    """Register ``${jaxaot_help:groups|keys}`` (idempotent), used by ``hydra.help.template``."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, _resolve)


__all__ = ["groups_text", "keys_text", "register_resolver"]
