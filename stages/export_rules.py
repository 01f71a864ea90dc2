"""What ``jax.export`` accepts, as JAX decides it: platform names (an open set, with near-miss
warnings and aliases), the safety checks a config may disable, and donation across platforms.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from jaxaot.compat import jax as compat_jax
from jaxaot.errors import ConfigError, one_line

if TYPE_CHECKING:
    import jax


def check_platforms(platforms: tuple[str, ...]) -> tuple[tuple[str, ...], list[str]]:
    """``lower.platforms`` as JAX lowers for them, and a warning for each near-miss of a name
    JAX knows.

    JAX's set of platforms is open (jax 0.10.2: ``lower`` and ``jax.export`` take any name,
    "users can add platforms"; an unknown one is lowered with the default rules only), so a
    name such as ``other`` is exported as given; one close to a known name (``tpuu``, ``CPU``)
    is probably a typo: exported too, with a warning. An alias (``gpu``) is the GPU platform
    present, as JAX's ``canonicalize_platform`` says; with none present it is an error, as in
    JAX. Compiling for a platform the lowering lacks is compile's to refuse (check_platform).

    Reading an alias starts JAX's backends: JAX's ``canonicalize_platform`` (jax 0.10.2) asks
    which of the alias's platforms has a backend, which initializes every backend present,
    plugins included, even in a run that stops after lower (``stop_after=lower``); names
    other than aliases initialize none."""
    import difflib

    aliases, known, canonicalize = compat_jax.platform_rules()  # cuda -> gpu, ...
    out: list[str] = []
    notes: list[str] = []
    for p in platforms:
        if p in aliases.values():
            meant = sorted(k for k, v in aliases.items() if v == p)
            try:
                out.append(canonicalize(p))
            except RuntimeError as exc:
                raise ConfigError(
                    f"lower.platforms: {p!r} ({p} is an alias of {', '.join(meant)}) names the "
                    f"{p} platform present, and JAX has none here ({one_line(exc)}); expected "
                    f"one of {', '.join(meant)} (e.g. lower.platforms=[{meant[0]}])"
                ) from None
            continue
        out.append(p)
        if p in known:
            continue
        close = difflib.get_close_matches(p.lower(), known, n=1, cutoff=0.75)
        if close:
            notes.append(
                f"lower.platforms: {p!r} is no platform this JAX knows (did you mean "
                f"{close[0]!r}?); JAX lowers for it with its default rules only, and a compile "
                f"here refuses it unless lower.disabled_checks=[platform]"
            )
    return tuple(out), notes


def safety_checks(names: list[str] | tuple[str, ...]) -> list[jax.export.DisabledSafetyCheck]:
    """``lower.disabled_checks`` as ``jax.export.DisabledSafetyCheck`` (spellings checked by
    :func:`check`)."""
    from jax.export import DisabledSafetyCheck

    return [
        DisabledSafetyCheck.platform()
        if name == "platform"
        else DisabledSafetyCheck.custom_call(name.removeprefix("custom_call:"))
        for name in names
    ]


def check_disabled(names: Any) -> None:
    for name in names:
        target = name.removeprefix("custom_call:") if isinstance(name, str) else ""
        if name == "platform" or (name != target and target.strip() == target and target):
            continue
        raise ConfigError(
            f"lower.disabled_checks: expected 'platform' or 'custom_call:<target>' (the "
            f"jax.export.DisabledSafetyCheck spellings), found {name!r}; e.g. "
            "lower.disabled_checks=[platform] or '[custom_call:lapack_sgesvd_ffi]'"
        )


_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @([\w.$-]+)\(")


def custom_call_hint(exc: Exception) -> str:
    """How to export anyway when jax.export refused custom calls it does not know stable."""
    text = str(exc)
    if "custom calls whose targets have no compatibility guarantees" not in text:
        return ""
    targets = list(dict.fromkeys(_CUSTOM_CALL.findall(text)))
    if not targets:
        return ""
    listed = ", ".join(f"custom_call:{t}" for t in targets)
    return f"; to export it anyway (no stability guarantee), lower.disabled_checks='[{listed}]'"


def donating(platforms: tuple[str, ...]) -> bool:
    """Whether one of ``platforms`` implements donation (JAX's rule)."""
    supported = compat_jax.platforms_with_donation()
    try:
        return any(p in supported for p in platforms)
    except TypeError as exc:
        raise compat_jax.jax_internal(
            "jax._src.interpreters.mlir._platforms_with_donation",
            "record which arguments are donated",
            exc,
        ) from None


def donation_keys(low: Any) -> str:
    """The ``lower`` donation options set (``low``: the lower section), for a message."""
    keys = [
        f"lower.{k}={list(getattr(low, k))}"
        for k in ("donate_argnums", "donate_argnames")
        if getattr(low, k)
    ]
    return " and ".join(keys) or "donation"


__all__ = [
    "check_disabled",
    "check_platforms",
    "custom_call_hint",
    "donating",
    "donation_keys",
    "safety_checks",
]
