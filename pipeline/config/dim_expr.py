"""Symbolic dimension expressions (shape polymorphism), parsed and evaluated without JAX.

The grammar is the one ``jax.export.symbolic_shape`` reads (jax 0.10, ``shape_poly._Parser``)::

    expr   := ['+' | '-'] term (('+' | '-') term)*
    term   := factor ['^' INT] ('*' factor ['^' INT])*
    factor := NAME | ['-'] INT | OP '(' expr ',' expr ')'      OP: floordiv, mod, max, min

A NAME is a dimension variable (``b``, ``seq_len``); an INT is written in digits (``1_000``
too). JAX has no grouping parentheses: ``(b+1)*2`` is refused there, so it is here. Checking
up front lets a typo (``f32[b+]``, ``f32[1e3]``) be refused with the argument's config path
before JAX is imported, instead of as JAX's parser text at trace time.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

OPERATIONS = ("floordiv", "mod", "max", "min")
GRAMMAR = (
    "an integer, or an expression of dimension variables and integers with + - *, ^<integer>, "
    "floordiv(a, b), mod(a, b), max(a, b), min(a, b) (e.g. b, 2*b + 1, floordiv(b, 2))"
)

_TOKEN = re.compile(
    r"\s*(?:(?P<num>[0-9][A-Za-z0-9_.]*)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<op>[-+*^(),])"
    r"|(?P<bad>\S))"
)
_INT = re.compile(r"[0-9]+(?:_[0-9]+)*")
# An AST node: ("int", n) | ("var", name) | (op, left, right) for + - * ^ and the OPERATIONS.
Node = tuple[Any, ...]


class DimSyntaxError(ValueError):
    """A dimension that is not an expression of the grammar; the message says why."""


@dataclass(frozen=True)
class _Tok:
    kind: str  # num, name, op, end
    text: str
    start: int  # its offset in the dimension's text


def _tokens(text: str) -> list[_Tok]:
    out: list[_Tok] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:  # only trailing blanks are left
            break
        pos = m.end()
        kind = m.lastgroup
        assert kind is not None
        word = m.group(kind)
        if kind == "bad":
            raise DimSyntaxError(f"{word!r} is not allowed in a dimension")
        if kind == "num" and not _INT.fullmatch(word):
            if re.fullmatch(r"0[xXoObB][0-9A-Fa-f_]*", word):
                raise DimSyntaxError(f"{word!r} is not an integer: write sizes in decimal digits")
            if re.fullmatch(r"[0-9]+(\.[0-9]*)?([eE][0-9]*)?|[0-9]*\.[0-9]+.*", word):
                raise DimSyntaxError(f"{word!r} is not an integer: write sizes in digits (1000)")
            if re.fullmatch(r"[0-9]+[A-Za-z_][A-Za-z0-9_]*", word):
                digits = re.match(r"[0-9]+", word)
                assert digits is not None
                n = digits.group(0)
                raise DimSyntaxError(f"{word!r}: write a product with * ({n}*{word[len(n) :]})")
            raise DimSyntaxError(f"{word!r} is not an integer")
        out.append(_Tok(kind, word, m.start(kind)))
    out.append(_Tok("end", "", len(text)))
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.toks = _tokens(text)
        self.i = 0

    @property
    def tok(self) -> _Tok:
        return self.toks[self.i]

    def take(self, text: str) -> None:
        if self.tok.text != text or self.tok.kind == "end":
            raise DimSyntaxError(f"{text!r} is missing {self._at()}")
        self.i += 1

    def _at(self) -> str:
        return "at the end" if self.tok.kind == "end" else f"before {self.tok.text!r}"

    def expr(self) -> Node:
        negate = False
        if self.tok.text in "+-" and self.tok.kind == "op":
            negate = self.tok.text == "-"
            self.i += 1
        acc = self.term()
        if negate:
            acc = ("*", ("int", -1), acc)
        while self.tok.kind == "op" and self.tok.text in "+-":
            op = self.tok.text
            self.i += 1
            acc = (op, acc, self.term())
        return acc

    def term(self) -> Node:
        acc = self.power()
        while self.tok.kind == "op" and self.tok.text == "*":
            self.i += 1
            acc = ("*", acc, self.power())
        return acc

    def power(self) -> Node:
        base = self.factor()
        if self.tok.kind == "op" and self.tok.text == "^":
            self.i += 1
            if self.tok.kind != "num":
                raise DimSyntaxError(f"an integer power is missing after '^' ({self._at()})")
            base = ("^", base, ("int", int(self.tok.text)))
            self.i += 1
        return base

    def factor(self) -> Node:
        tok = self.tok
        if tok.kind == "name":
            self.i += 1
            if tok.text in OPERATIONS:
                self.take("(")
                left = self.expr()
                self.take(",")
                right = self.expr()
                self.take(")")
                return (tok.text, left, right)
            if tok.text == "_":
                raise DimSyntaxError("'_' is not a dimension variable name")
            return ("var", tok.text)
        sign = 1
        if tok.kind == "op" and tok.text == "-":
            self.i += 1
            sign = -1
        if self.tok.kind == "num":
            value = int(self.tok.text)
            self.i += 1
            return ("int", sign * value)
        if self.tok.kind == "op" and self.tok.text == "*":
            raise DimSyntaxError("write a power with ^ (b^2), not **")
        if self.tok.kind == "op" and self.tok.text == "(":
            raise DimSyntaxError(
                "JAX's dimension expressions have no grouping parentheses (expand them: "
                "2*b + 2, not (b+1)*2)"
            )
        raise DimSyntaxError(f"a variable or an integer is missing {self._at()}")


def parse(text: str) -> Node:
    """The expression ``text`` (one dimension) as a tree, or :class:`DimSyntaxError`."""
    if not text.strip():
        raise DimSyntaxError("the dimension is empty")
    p = _Parser(text)
    node = p.expr()
    if p.tok.kind != "end":
        raise DimSyntaxError(f"unexpected {p.tok.text!r} after {text[: p.tok.start].strip()!r}")
    return node


def variables(node: Node) -> list[str]:
    """The dimension variables of an expression, in order of first appearance."""
    if node[0] == "var":
        return [node[1]]
    if node[0] == "int":
        return []
    out: list[str] = []
    for child in node[1:]:
        out += [v for v in variables(child) if v not in out]
    return out


def evaluate(node: Node, sizes: Mapping[str, int]) -> int:
    """The value of an expression given every variable's size (floor division and modulo as
    Python's, as JAX evaluates them)."""
    kind = node[0]
    if kind == "int":
        return int(node[1])
    if kind == "var":
        return int(sizes[node[1]])
    a, b = evaluate(node[1], sizes), evaluate(node[2], sizes)
    if kind == "+":
        return a + b
    if kind == "-":
        return a - b
    if kind == "*":
        return a * b
    if kind == "^":
        return int(a**b)
    if kind == "max":
        return max(a, b)
    if kind == "min":
        return min(a, b)
    if b == 0:
        raise ZeroDivisionError(f"{kind}(..., 0)")
    return a // b if kind == "floordiv" else a % b


def split_dims(text: str) -> list[str]:
    """The dimensions of ``f32[<text>]``: split at the commas outside ``floordiv(..., ...)``."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return out


__all__ = [
    "GRAMMAR",
    "OPERATIONS",
    "DimSyntaxError",
    "evaluate",
    "parse",
    "split_dims",
    "variables",
]
