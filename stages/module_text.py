"""The lowered module's texts, its identity hash and its large constants.

A program that closes over a big array (weights in a global, a table built with numpy) gets
it embedded as a dense literal: printed in full, a 51 MB constant is 100 MB of StableHLO and
170 MB of HLO text, and hashing that text costs seconds. So the texts are printed the way
MLIR's and XLA's printers can, with large constants elided (``dense_resource<__elided__>``,
``constant({...})``), and the module's identity is not taken from any text: it is the sha256
of the module's MLIR bytecode with locations stripped and the module renamed, which holds
every constant's every byte. Two programs that differ only in a captured constant's values
therefore never share a compile key, however the texts print.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass
from typing import Any

from jaxaot.compat import jax as compat_jax
from jaxaot.util.canonical import canonical_stablehlo
from jaxaot.util.fsio import sha256_bytes

# Constants at least this big are named in the one-line warning (1 MiB).
WARN_BYTES = 1 << 20
ELIDED = "__elided__"


@dataclass(frozen=True)
class LargeConstant:
    """A constant literal the lowering embedded: its type and where the program used it."""

    type: str  # "tensor<3584x3584xf32>"
    nbytes: int
    where: str  # "captured.py:31 (project)" or "" when the location says nothing useful

    def describe(self) -> str:
        at = f" used at {self.where}" if self.where else ""
        return f"{self.type} ({self.nbytes / 1e6:.1f} MB){at}"


def stablehlo_text(lowered: Any, elide_over: int | None, debug: bool = False) -> str:
    """The StableHLO text, constants of more than ``elide_over`` elements elided (None: all
    kept), as ``Lowered.as_text(debug_info=debug)`` prints it."""
    if elide_over is None:
        return str(lowered.as_text(debug_info=debug))
    module = lowered.compiler_ir("stablehlo")
    return str(
        module.operation.get_asm(large_elements_limit=int(elide_over), enable_debug_info=debug)
    )


class _HashingSink(io.RawIOBase):
    """A write-only file that keeps only the sha256 of what is written to it."""

    def __init__(self) -> None:
        super().__init__()
        self._hash = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._hash.update(data)
        return memoryview(data).nbytes

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _stripped_digest(module: Any) -> str:
    """sha256 of ``module``'s bytecode with locations stripped and the module renamed."""
    ir, passmanager = compat_jax.mlir_ir()
    with module.context:
        # A clone shares the (uniqued) constant storage: cheap however big the constants.
        op = module.operation.clone()
        try:
            passmanager.PassManager.parse("builtin.module(strip-debuginfo)").run(op)
            op.attributes["sym_name"] = ir.StringAttr.get("main_module")
            sink = _HashingSink()
            op.write_bytecode(sink)  # hashed as it is written: no copy of the constants
        finally:
            op.erase()
    return sink.hexdigest()


def module_digest(lowered: Any) -> str:
    """sha256 of the module's bytecode without locations or module name: what is compiled.

    Location info varies with source paths and line numbers (and with where jaxaot was called
    from: the traced stack runs up to the caller) and the module name carries a per-process
    counter; neither changes the program, so neither changes the digest (the same rule as the
    canonical text, and as JAX's own compilation cache). Falls back to the canonical full text.
    """
    try:
        return _stripped_digest(lowered.compiler_ir("stablehlo"))
    except Exception:  # an MLIR binding without these APIs: hash the whole canonical text
        return sha256_bytes(canonical_stablehlo(str(lowered.as_text())).encode())


def export_digest(exported: Any) -> str:
    """What a ``jax.export.Exported`` compiles to, by :func:`module_digest`'s rule: the sha256
    of its serialization with the module left out, and of its module without locations or
    name. Every other field (shardings, avals, platforms, calling convention, effects, ...)
    is hashed as serialized. Falls back to the serialization's very bytes (locations and all:
    a call from elsewhere is then a store miss, never a wrong hit)."""
    from dataclasses import replace

    rest = bytes(replace(exported, mlir_module_serialized=b"").serialize())
    try:
        module = _stripped_digest(compat_jax.export_module(exported))
    except Exception:
        return sha256_bytes(bytes(exported.serialize()))
    return sha256_bytes(f"{sha256_bytes(rest)} {module}".encode())


def _where(location: Any) -> str:
    """``file.py:LINE (function)`` from an MLIR location's text, best effort."""
    import re

    text = str(location)
    found = re.findall(r'"([^"]+\.py)":(\d+)', text)
    if not found:
        return ""
    path, line = found[0]  # innermost frame first: the user's line, not the caller's
    return f"{path.rsplit('/', 1)[-1]}:{line}"


def _used_at(op: Any) -> str:
    """Where the program first uses a constant: the constant op's own location is wherever the
    lowering was called from (a closed-over value has no line of its own)."""
    try:
        for use in op.result.uses:
            where = _where(use.owner.location)
            if where:
                return where
    except Exception:  # an MLIR binding without use lists
        pass
    return ""


def large_constants(lowered: Any, over_elements: int) -> list[LargeConstant]:
    """The constant ops with more than ``over_elements`` elements (splats excluded), in order.

    Read from each op's result type and its elided printed form, never from its ``value``
    attribute: the MLIR bindings cannot hand a complex dense attribute to Python (jaxlib
    0.10 raises TypeError by name and aborts the process by index; older ones abort), and one
    constant that cannot be read must not hide the others."""
    ir, _ = compat_jax.mlir_ir()
    module = lowered.compiler_ir("stablehlo")
    found: list[LargeConstant] = []

    def visit(op: Any) -> Any:
        if op.name == "stablehlo.constant":
            try:
                big = _large_constant(ir, op, over_elements)
            except Exception:  # advice only: skip what this binding cannot read
                big = None
            if big is not None:
                found.append(big)
        return ir.WalkResult.ADVANCE

    try:
        with module.context:
            module.operation.walk(visit)
    except Exception:  # the warning is advice: an MLIR binding without these APIs gives none
        return found
    return found


def element_bytes(ir: Any, element_type: Any) -> int:
    """Bytes of one element of an MLIR element type: a complex number is two of its parts
    (``complex<f32>``: 8), sub-byte types round up to 1; a type without a width counts 4."""
    if isinstance(element_type, ir.ComplexType):
        return 2 * element_bytes(ir, element_type.element_type)
    width = getattr(element_type, "width", None)  # integer and float types have one
    return max(1, int(width) // 8) if width is not None else 4


def _large_constant(ir: Any, op: Any, over_elements: int) -> LargeConstant | None:
    result_type = op.results[0].type
    shaped = ir.ShapedType(result_type)
    count = math.prod(shaped.shape) if shaped.has_static_shape else 0
    if count <= over_elements:
        return None
    # A splat prints as its one value (dense<1.0>, dense<(1.0,2.0)>) whatever the limit; a
    # large one elided (dense_resource<__elided__>, or older MLIR's opaque/hex forms).
    text = op.get_asm(large_elements_limit=1)
    value = text.split("stablehlo.constant", 1)[-1].strip()
    if value.startswith("dense<") and value[len("dense<") : len("dense<") + 1] not in '["':
        return None
    nbytes = count * element_bytes(ir, shaped.element_type)
    return LargeConstant(str(result_type), nbytes, _used_at(op))


def warning(constants: list[LargeConstant]) -> str | None:
    """One line naming the captured constants of at least :data:`WARN_BYTES`, or None."""
    big = [c for c in constants if c.nbytes >= WARN_BYTES]
    if not big:
        return None
    total = sum(c.nbytes for c in big)
    shown = "; ".join(c.describe() for c in big[:3]) + ("; ..." if len(big) > 3 else "")
    return (
        f"the program captures {len(big)} large constant(s), {total / 1e6:.1f} MB in all: "
        f"{shown}; they are embedded in the module, the export and the executable (texts elide "
        "them): pass large arrays as arguments instead of closing over them"
    )


def hlo_text(lowered: Any, keep_large: bool, debug: bool = False) -> tuple[str, Any]:
    """The HLO text (as ``as_text(dialect="hlo")`` prints it) and the HLO module, built once.

    ``keep_large=False`` prints constants of more than a few elements as ``{...}`` (XLA's
    printer has one fixed threshold), so callers pass it only when StableHLO elided some.
    """
    module = compat_jax.hlo_module(lowered)
    # debug: op names and source locations, as as_text(debug_info=True)
    return compat_jax.hlo_module_to_text(module, debug=debug, keep_large=keep_large), module


def cost_analysis(lowered: Any, hlo_module: Any | None) -> dict[str, float] | None:
    """``Lowered.cost_analysis()``, from an HLO module already built when there is one (the
    public call converts the module to HLO again: a second copy of every constant)."""
    cost: Any = None
    try:
        if hlo_module is not None:
            cost = compat_jax.hlo_module_cost_analysis(
                compat_jax.lowering_backend(lowered), hlo_module
            )
    except Exception:
        cost = None
    if cost is None:
        try:
            cost = lowered.cost_analysis()
        except Exception:
            return None
    if isinstance(cost, list | tuple):  # older JAX returned one dict per device
        cost = cost[0] if cost else None
    return {str(k): float(v) for k, v in cost.items()} if cost else None


def trailer(module_sha256: str, elide_over: int, comment: str) -> str:
    """The last line of a text whose constants were elided: the module's digest, so a text
    diff (snapshot verify) still sees a change in an elided constant's values."""
    return (
        f"{comment} jaxaot: constants over {elide_over} elements elided "
        f"(lower.elide_constants_over=null keeps them); module {module_sha256}\n"
    )


__all__ = [
    "ELIDED",
    "WARN_BYTES",
    "LargeConstant",
    "cost_analysis",
    "hlo_text",
    "large_constants",
    "module_digest",
    "stablehlo_text",
    "trailer",
    "warning",
]
