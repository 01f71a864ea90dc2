"""An executable's calling convention, and the one rule for whether a stored one may serve a run.

Two programs can lower to one module and still be different executables: which arguments jax
pruned as unused, and the input/output pytrees, are part of how the executable is called and
not of the module text (``x * 2`` of the first or of the second argument). The
compile key covers the :class:`Convention` of what is compiled, and every executable loaded
from the store or a checkpoint is checked with :func:`mismatch` before it is called.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from jaxaot.compat import jax as compat_jax
from jaxaot.stages.lower import Lowered


@dataclass(frozen=True)
class Convention:
    """How an executable is called, beyond its module: what ``jax.stages.Compiled`` uses at
    every call to turn the caller's pytrees into the executable's arguments and back.

    ``kept`` lists the flat inputs the executable takes (jax prunes unused ones, so two
    programs with one module can read different arguments); ``None`` in ``kept`` or
    ``donated`` of an *expected* convention means "not known here, not checked".
    """

    in_tree: str
    out_tree: str
    in_avals: tuple[str, ...]  # every flat input, pruned ones too: dtype[shape]
    out_avals: tuple[str, ...]
    kept: tuple[int, ...] | None
    donated: tuple[int, ...] | None

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _aval(x: Any) -> str:
    return f"{x.dtype}[{','.join(map(str, x.shape))}]"


def kept_inputs(stage: Any) -> tuple[int, ...] | None:
    """The flat inputs a ``jax.stages.Lowered`` or ``Compiled`` keeps, None if it does not say.

    jax 0.10 has no public API for it: a Lowered has it in its compile arguments, a Compiled
    (also a deserialized one) on its executable; ``Exported.module_kept_var_idx`` is the same
    list (tests/test_store_identity.py checks that the three agree).
    """
    kept = compat_jax.kept_var_idx(stage)
    return tuple(sorted(int(i) for i in kept)) if kept is not None else None


def convention_of(stage: Any) -> Convention:
    """The calling convention of a ``jax.stages.Lowered`` or ``jax.stages.Compiled``."""
    import jax

    ins = jax.tree_util.tree_leaves(stage.args_info)
    outs = jax.tree_util.tree_leaves(compat_jax.out_info(stage))
    return Convention(
        in_tree=str(stage.in_tree),
        out_tree=str(stage.out_tree),
        in_avals=tuple(_aval(a) for a in ins),
        out_avals=tuple(_aval(o) for o in outs),
        kept=kept_inputs(stage),
        donated=tuple(i for i, a in enumerate(ins) if getattr(a, "donated", False)),
    )


def export_conventions(lowered: Lowered) -> tuple[Convention, ...]:
    """The conventions an executable compiled from ``lowered`` may have, read from its export
    alone (a resumed run has no program): compiled from the program's own lowering it keeps
    the export's kept inputs; compiled from the export (``jax.jit(exported.call)``) it keeps
    every input, the export prunes inside. An export does not record donation."""
    exp = lowered.export()
    base = Convention(
        in_tree=str(exp.in_tree),
        out_tree=str(exp.out_tree),
        in_avals=tuple(_aval(a) for a in exp.in_avals),
        out_avals=tuple(_aval(a) for a in exp.out_avals),
        kept=tuple(sorted(int(i) for i in exp.module_kept_var_idx)),
        donated=None,
    )
    return base, replace(base, kept=tuple(range(len(exp.in_avals))))


def mismatch(found: Convention, expected: Sequence[Convention]) -> str | None:
    """Why an executable with convention ``found`` must not serve a run that expects one of
    ``expected``; None when it may. The one compatibility rule of store hits and resumes."""
    reasons = []
    for want in expected:
        diffs = [
            f"{f.name} {getattr(found, f.name)!r}, expected {getattr(want, f.name)!r}"
            for f in fields(Convention)
            if getattr(want, f.name) is not None and getattr(found, f.name) != getattr(want, f.name)
        ]
        if not diffs:
            return None
        reasons.append(diffs[0])
    return "its calling convention differs: " + (" | ".join(reasons) or "nothing expected")


__all__ = [
    "Convention",
    "convention_of",
    "export_conventions",
    "kept_inputs",
    "mismatch",
]
