"""Binding: parsed arguments with each position and keyword marked static, traced or donated,
checked against the target's signature the way ``jax.jit`` maps its options."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from jaxaot.config import derived
from jaxaot.config.argspec.dtypes import SIXTY_FOUR_BIT
from jaxaot.config.argspec.grammar import parse_leaf_or_tree
from jaxaot.config.argspec.leaf_types import ArraySpec, Given, Literal
from jaxaot.config.argspec.trees import leaves, map_tree, specs, to_static_value
from jaxaot.errors import ArgSpecError, ConfigError

if TYPE_CHECKING:
    from jaxaot.config.sections import ProgramConfig


class StaticOptions(Protocol):
    """The static-argument options (the stage_out section has them)."""

    @property
    def static_argnums(self) -> Sequence[int]: ...
    @property
    def static_argnames(self) -> Sequence[str]: ...


class DonationOptions(Protocol):
    """The donation options (the lower section has them)."""

    @property
    def donate_argnums(self) -> Sequence[int]: ...
    @property
    def donate_argnames(self) -> Sequence[str]: ...


@dataclass(frozen=True)
class BoundArgs:
    """Parsed arguments, with each position and keyword marked static or traced."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    donate_argnums: tuple[int, ...] = ()
    donate_argnames: tuple[str, ...] = ()
    needs_x64: bool = field(default=False)
    # The static and donation options as given, to mark the same parsed arguments again
    # through the target's signature (:meth:`through`).
    given: Marking | None = field(default=None, compare=False, repr=False)

    def through(self, names_of_positions: Sequence[str] | None) -> BoundArgs:
        """These parsed arguments marked static and donated through the target's parameter
        names, as :func:`bind` marks them with ``names_of_positions`` (nothing parsed again)."""
        if names_of_positions is None or self.given is None:
            return self
        return _mark(self.args, self.kwargs, self.given, names_of_positions)

    def is_static(self, position: int | str) -> bool:
        if isinstance(position, int):
            return position in self.static_argnums
        return position in self.static_argnames

    def traced_args(self) -> list[tuple[str, Any]]:
        """(config path, tree) of every non-static argument, positional first."""
        out = [(f"program.args[{i}]", a) for i, a in enumerate(self.args) if not self.is_static(i)]
        out += [(f"program.kwargs.{k}", v) for k, v in self.kwargs.items() if not self.is_static(k)]
        return out


def _check_traced(tree: Any, where: str, key: str) -> None:
    for path, leaf in leaves(tree, where):
        if isinstance(leaf, Literal) and not isinstance(leaf.value, bool | int | float):
            raise ArgSpecError(
                f"{path}: {leaf.value!r} is a {type(leaf.value).__name__} at a non-static "
                f"position; JAX can only trace arrays and numbers: add it to {key}"
            )


@dataclass(frozen=True)
class Marking:
    """``stage_out.static_argnums/static_argnames`` and ``lower.donate_argnums/donate_argnames``
    as the config gives them."""

    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    donate_argnums: tuple[int, ...] = ()
    donate_argnames: tuple[str, ...] = ()


def bind(
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    static_argnums: Sequence[int] = (),
    static_argnames: Sequence[str] = (),
    donate_argnums: Sequence[int] = (),
    donate_argnames: Sequence[str] = (),
    names_of_positions: Sequence[str] | None = None,
) -> BoundArgs:
    """Parse specs and check static/donated positions against them.

    ``names_of_positions`` (the callable's parameter names, when known) maps the four options
    through the signature as ``jax.jit`` does: a name in ``static_argnames``/``donate_argnames``
    may be passed by position, and a position in ``static_argnums``/``donate_argnums`` may be
    passed by keyword. Without it (before the target is imported) what only the signature can
    resolve is left for the bind that has it (stage_out).
    """
    parsed_args = tuple(parse_leaf_or_tree(a, f"program.args[{i}]") for i, a in enumerate(args))
    parsed_kwargs = {
        str(k): parse_leaf_or_tree(v, f"program.kwargs.{k}") for k, v in kwargs.items()
    }
    given = Marking(
        tuple(static_argnums), tuple(static_argnames), tuple(donate_argnums), tuple(donate_argnames)
    )
    return _mark(parsed_args, parsed_kwargs, given, names_of_positions)


def _mark(
    parsed_args: tuple[Any, ...],
    parsed_kwargs: dict[str, Any],
    given: Marking,
    names_of_positions: Sequence[str] | None,
) -> BoundArgs:
    """Parsed arguments marked static, traced or donated (see :func:`bind`)."""
    static_argnums, static_argnames = given.static_argnums, given.static_argnames
    donate_argnums, donate_argnames = given.donate_argnums, given.donate_argnames
    n = len(parsed_args)
    names = list(names_of_positions or ())
    known = names_of_positions is not None
    s_nums: set[int] = set()
    s_names = set(static_argnames)
    d_nums: set[int] = set()
    d_names = set(donate_argnames)
    # A position past program.args names a parameter passed by keyword (jax.jit maps it
    # through the signature); unknown until the target's signature is.
    unresolved = False
    for key, nums, num_set, name_set in (
        ("stage_out.static_argnums", static_argnums, s_nums, s_names),
        ("lower.donate_argnums", donate_argnums, d_nums, d_names),
    ):
        for i in nums:
            if i < n:
                num_set.add(i)
            elif i < len(names) and names[i] in parsed_kwargs:
                name_set.add(names[i])
            elif not known and parsed_kwargs:
                unresolved = True
            else:
                by_kw = (
                    f"; parameter {i} ({names[i]!r}) is not in program.kwargs either"
                    if i < len(names)
                    else ""
                )
                raise ConfigError(
                    f"{key}: position {i} is out of range; program.args has "
                    f"{n} positional argument(s) (positions 0..{n - 1}){by_kw}"
                )
    for name in static_argnames:
        if name in names and names.index(name) < n:
            s_nums.add(names.index(name))
        elif name not in parsed_kwargs and known and name not in names:
            raise ConfigError(
                f"stage_out.static_argnames: {name!r} is neither a parameter of the target nor "
                f"a key of program.kwargs (parameters: {', '.join(names) or 'none'})"
            )
        elif name not in parsed_kwargs and not known:
            unresolved = True
    for name in donate_argnames:
        if name in names and names.index(name) < n:
            d_nums.add(names.index(name))
        elif name not in parsed_kwargs and known:
            # Neither passed by position nor a program.kwargs key (which may reach **kwargs):
            # jax.jit would donate nothing for it, silently.
            passed = [*names[:n], *parsed_kwargs]
            raise ConfigError(
                f"lower.donate_argnames: {name!r} names no argument passed to the target "
                f"(positional parameters: {', '.join(names) or 'none'}; program.args passes {n} "
                f"positionally; program.kwargs keys: {', '.join(parsed_kwargs) or 'none'}); "
                f"expected one of {', '.join(passed) or 'no names'}, or remove it"
            )
    for i in sorted(s_nums):
        if names and i < len(names):
            s_names.add(names[i])
    for i in sorted(d_nums):
        if names and i < len(names):
            d_names.add(names[i])
    for i in sorted(d_nums):
        if i in s_nums:
            raise ConfigError(
                f"lower.donate_argnums: argument {i} is static (stage_out.static_argnums); only "
                "traced array arguments can be donated"
            )
    for name in d_names:
        if name in s_names:
            raise ConfigError(
                f"lower.donate_argnames: {name!r} is static (stage_out.static_argnames); only "
                "traced array arguments can be donated"
            )
    derived.check_refs(
        [(f"program.args[{i}]", a) for i, a in enumerate(parsed_args)]
        + [(f"program.kwargs.{k}", v) for k, v in parsed_kwargs.items()]
    )
    for i in sorted(s_nums):
        to_static_value(parsed_args[i], f"program.args[{i}]")
    for k in s_names & set(parsed_kwargs):
        to_static_value(parsed_kwargs[k], f"program.kwargs.{k}")
    bound = BoundArgs(
        args=parsed_args,
        kwargs=parsed_kwargs,
        static_argnums=tuple(sorted(s_nums)),
        static_argnames=tuple(sorted(s_names)),
        donate_argnums=tuple(sorted(d_nums)),
        donate_argnames=tuple(sorted(d_names)),
    )
    for path, tree in bound.traced_args():
        if unresolved:  # a value may be static by an option only the signature resolves
            continue
        positional = path.startswith("program.args")
        _check_traced(tree, path, f"stage_out.static_argn{'ums' if positional else 'ames'}")
    needs_x64 = any(
        leaf.dtype in SIXTY_FOUR_BIT for _, tree in bound.traced_args() for _, leaf in specs(tree)
    ) or any(
        isinstance(leaf, Given) and leaf.dtype in SIXTY_FOUR_BIT
        for _, tree in bound.traced_args()
        for _, leaf in leaves(tree)
    )
    return BoundArgs(**{**bound.__dict__, "needs_x64": needs_x64, "given": given})


def concrete_bound(bound: BoundArgs, sizes: Mapping[str, int]) -> BoundArgs:
    """``bound`` with every symbolic dimension evaluated with ``sizes`` (``compile.shapes``)."""
    if not sizes:
        return bound

    def fix(path: str, leaf: Any) -> Any:
        return leaf.concrete(sizes, path) if isinstance(leaf, ArraySpec) else leaf

    args = tuple(map_tree(fix, a, f"program.args[{i}]") for i, a in enumerate(bound.args))
    kwargs = {k: map_tree(fix, v, f"program.kwargs.{k}") for k, v in bound.kwargs.items()}
    return replace(bound, args=args, kwargs=kwargs)


def bind_config(
    program: ProgramConfig,
    stage_out: StaticOptions,
    lower: DonationOptions,
    names_of_positions: Sequence[str] | None = None,
) -> BoundArgs:
    """:func:`bind` with the program section's arguments, stage_out's static options and
    lower's donation options."""
    return bind(
        program.args,
        program.kwargs,
        static_argnums=stage_out.static_argnums,
        static_argnames=stage_out.static_argnames,
        donate_argnums=lower.donate_argnums,
        donate_argnames=lower.donate_argnames,
        names_of_positions=names_of_positions,
    )
