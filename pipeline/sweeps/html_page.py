"""The parts of jaxaot's HTML report pages: one self-contained document (CSS and script inline,
images as ``data:`` URIs), escaped text, sortable tables, stacked bars and relative links.

A page makes no request of its own: its Content-Security-Policy allows images from ``data:``
URIs only, inline styles, and exactly the one script below (by its sha256), so a name that
reaches a page (a program, an override, an error) can only ever be text, even where a page
shows it unescaped by mistake. Links are relative to the page's folder; a browser opens them
(navigation is no request of the page).
"""

from __future__ import annotations

import base64
import hashlib
import html
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from jaxaot.util.humanize import human_bytes

# Click a column head of a table.sortable: its rows by that column, ascending, then descending.
# A cell's data-sort (a raw number) is its key, else its text; numbers compare as numbers,
# text in natural order (f32[64,256] before f32[1024,256]); empty cells (no key, or "-") stay
# last in either direction.
SCRIPT = """
(function () {
  function key(row, col) {
    var cell = row.cells[col];
    if (!cell) return "";
    var raw = cell.getAttribute("data-sort");
    if (raw !== null) return raw;
    var text = cell.textContent.trim();
    return text === "-" ? "" : text;
  }
  function numeric(text) {
    return text !== "" && isFinite(Number(text));
  }
  function compare(a, b) {
    if (numeric(a) && numeric(b)) return Number(a) - Number(b);
    return a.localeCompare(b, undefined, {numeric: true, sensitivity: "base"});
  }
  function sortBy(table, col, th) {
    var up = th.getAttribute("aria-sort") !== "ascending";
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (other) {
      other.removeAttribute("aria-sort");
    });
    th.setAttribute("aria-sort", up ? "ascending" : "descending");
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (x, y) {
      var a = key(x, col), b = key(y, col);
      if (a === "" || b === "") return (a === "") - (b === "");
      return up ? compare(a, b) : compare(b, a);
    });
    rows.forEach(function (row) { body.appendChild(row); });
  }
  document.querySelectorAll("table.sortable").forEach(function (table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, col) {
      th.tabIndex = 0;
      th.addEventListener("click", function () { sortBy(table, col, th); });
      th.addEventListener("keydown", function (event) {
        if (event.key === "Enter" || event.key === " ") {
          event.preventDefault();
          sortBy(table, col, th);
        }
      });
    });
  });
})();
"""

STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1f2328;
  margin: 0; padding: 1.2em 2em 3em; background: #fff; }
h1 { font-size: 1.5em; margin: 0.2em 0 0.4em; }
h2 { font-size: 1.2em; margin: 1.6em 0 0.5em; padding-bottom: 0.2em; border-bottom: 1px solid #d0d7de; }
code, pre, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12.5px; }
pre { background: #f6f8fa; padding: 0.6em 0.8em; overflow-x: auto; border-radius: 4px; }
.scroll { overflow: auto; max-height: 85vh; }
table { border-collapse: collapse; margin: 0.4em 0; }
th, td { border: 1px solid #d0d7de; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f6f8fa; white-space: nowrap; position: sticky; top: 0; z-index: 1; }
td.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
#jobs td { white-space: nowrap; }
#jobs td.wrap { white-space: normal; min-width: 24em; }
td.clip { max-width: 22em; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
table.sortable th { cursor: pointer; user-select: none; }
table.sortable th::after { content: " \\2195"; color: #8c959f; }
table.sortable th[aria-sort=ascending]::after { content: " \\25B2"; color: #1f2328; }
table.sortable th[aria-sort=descending]::after { content: " \\25BC"; color: #1f2328; }
tr.failed td, tr.incomplete td, tr.interrupted td { background: #fff0f0; }
tr.does_not_fit td { background: #fff8e6; }
.status { font-weight: 600; }
.status.ok { color: #1a7f37; }
.status.failed, .status.incomplete, .status.interrupted { color: #cf222e; }
.status.does_not_fit { color: #9a6700; }
.badge { display: inline-block; padding: 0 5px; margin-left: 4px; border-radius: 8px;
  background: #ddf4ff; color: #0969da; font-size: 11px; font-weight: 600; }
.error { color: #cf222e; white-space: pre-wrap; }
.note { color: #59636e; }
.facts th { position: static; }
.bar { display: flex; height: 14px; min-width: 2px; background: #eaeef2; border-radius: 2px;
  overflow: hidden; }
.bar span { display: block; height: 100%; }
.legend span { display: inline-block; margin-right: 1em; }
.legend i { display: inline-block; width: 10px; height: 10px; margin-right: 4px; vertical-align: -1px; }
figure { display: inline-block; margin: 0 1em 1em 0; vertical-align: top; max-width: 100%;
  overflow-x: auto; }
figure img { border: 1px solid #d0d7de; }
figcaption { font-size: 12px; color: #59636e; }
.graph img { max-width: 100%; height: auto; border: 1px solid #d0d7de; background: #fff; }
details { margin: 0.2em 0; }
summary { cursor: pointer; }
ul.files { columns: 2; column-gap: 2em; margin: 0.3em 0; }
"""

COLORS = ("#4C72B0", "#55A868", "#C44E52", "#8172B2", "#CCB974", "#64B5CD", "#DD8452", "#937860")
_EMPHASIS = re.compile(r"\*\*(.+?)\*\*")
_CODE = re.compile(r"`([^`]+)`")


def esc(text: object) -> str:
    """Text as HTML (attribute-safe: quotes escaped too)."""
    return html.escape(str(text), quote=True)


def href(rel: str | Path) -> str:
    """A relative link (``compile/optimized.hlo.txt``), percent-encoded and escaped."""
    return esc(quote(Path(rel).as_posix()))


def link(rel: str | Path, text: object | None = None) -> str:
    return f'<a href="{href(rel)}">{esc(rel if text is None else text)}</a>'


def inline_markdown(text: str) -> str:
    """One line of the Markdown report as HTML: escaped, then its ``code`` and **bold**."""
    out = esc(text)
    out = _CODE.sub(lambda m: f"<code>{m[1]}</code>", out)
    return _EMPHASIS.sub(lambda m: f"<strong>{m[1]}</strong>", out)


def _md_cells(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [c.strip().replace("\\|", "|") for c in cells]


def markdown_block(lines: Sequence[str]) -> str:
    """The Markdown the sweep report writes in its sections (headings, pipe tables, list items,
    paragraphs) as HTML; anything else is a paragraph of escaped text."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("#"):
            level = min(len(line) - len(line.lstrip("#")), 4)
            out.append(f"<h{level}>{inline_markdown(line.lstrip('#').strip())}</h{level}>")
            i += 1
        elif line.startswith("|"):
            block = []
            while i < len(lines) and lines[i].startswith("|"):
                block.append(lines[i])
                i += 1
            rows = [_md_cells(b) for b in block if not re.fullmatch(r"\|(-+\|)+", b.strip())]
            head, body = rows[0], rows[1:]
            out.append(
                '<div class="scroll"><table class="sortable"><thead><tr>'
                + "".join(f"<th>{inline_markdown(c)}</th>" for c in head)
                + "</tr></thead><tbody>"
                + "".join(
                    "<tr>" + "".join(f"<td>{inline_markdown(c)}</td>" for c in r) + "</tr>"
                    for r in body
                )
                + "</tbody></table></div>"
            )
        elif line.startswith("- "):
            items = []
            while i < len(lines) and lines[i].startswith("- "):
                items.append(f"<li>{inline_markdown(lines[i][2:])}</li>")
                i += 1
            out.append("<ul>" + "".join(items) + "</ul>")
        else:
            out.append(f"<p>{inline_markdown(line)}</p>")
            i += 1
    return "\n".join(out)


def data_uri(path: Path, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


@dataclass(frozen=True)
class Cell:
    """A table cell: its text (escaped when shown) or ready HTML, and the raw number it sorts
    by (None: by its text)."""

    text: object = ""
    sort: float | int | str | None = None
    html: str | None = None
    numeric: bool = False
    wrap: bool = False  # a long text (an error): wrapped, not one line
    clip: bool = False  # a long text shown on one line, cut; whole in its tooltip

    def render(self) -> str:
        flags = (("num", self.numeric), ("wrap", self.wrap), ("clip", self.clip))
        classes = " ".join(c for c, on in flags if on)
        attrs = f' class="{classes}"' if classes else ""
        if self.clip:
            attrs += f' title="{esc(self.text)}"'
        missing = self.html is None and str(self.text) in ("", "-")
        if self.sort is not None or self.numeric or missing:  # no figure ("-", "n/a"): last
            attrs += f' data-sort="{esc("" if self.sort is None else self.sort)}"'
        inner = self.html if self.html is not None else esc(self.text)
        return f"<td{attrs}>{inner}</td>"


def table(
    heads: Sequence[tuple[str, str]],
    rows: Iterable[tuple[str, Sequence[Cell]]],
    *,
    sortable: bool = True,
    table_id: str | None = None,
) -> str:
    """A table: ``heads`` as (text, tooltip); ``rows`` as (row class, cells)."""
    ident = f' id="{esc(table_id)}"' if table_id else ""
    cls = ' class="sortable"' if sortable else ""
    head = "".join(
        f'<th title="{esc(tip)}">{esc(text)}</th>' if tip else f"<th>{esc(text)}</th>"
        for text, tip in heads
    )
    body = "".join(
        (f'<tr class="{esc(rc)}">' if rc else "<tr>") + "".join(c.render() for c in cells) + "</tr>"
        for rc, cells in rows
    )
    return (
        f'<div class="scroll"><table{ident}{cls}><thead><tr>{head}</tr></thead>'
        f"<tbody>{body}</tbody></table></div>"
    )


def stacked_bar(parts: Sequence[tuple[str, float]], scale: float, width_px: int = 420) -> str:
    """A horizontal bar of ``parts`` (label, bytes), ``scale`` bytes to its full width."""
    total = sum(max(v, 0) for _, v in parts)
    outer = max(total / scale, 0.005) if scale > 0 else 0.0
    spans = "".join(
        f'<span style="width:{100 * v / total:.3f}%;background:{COLORS[i % len(COLORS)]}" '
        f'title="{esc(label)}: {esc(human_bytes(v))}"></span>'
        for i, (label, v) in enumerate(parts)
        if v > 0 and total > 0
    )
    return f'<div class="bar" style="width:{outer * width_px:.1f}px">{spans}</div>'


def legend(labels: Sequence[str]) -> str:
    return (
        '<p class="legend">'
        + "".join(
            f'<span><i style="background:{COLORS[i % len(COLORS)]}"></i>{esc(label)}</span>'
            for i, label in enumerate(labels)
        )
        + "</p>"
    )


def document(title: str, body: str) -> str:
    """The whole page: ``body`` under a head with the styles, the policy and the script."""
    digest = base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode("ascii")
    policy = (
        "default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
        f"script-src 'sha256-{digest}'; base-uri 'none'; form-action 'none'"
    )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{esc(policy)}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        '<meta name="generator" content="jaxaot-report">\n'
        '<link rel="icon" href="data:,">\n'
        f"<title>{esc(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n{body}\n"
        f"<script>{SCRIPT}</script>\n</body>\n</html>\n"
    )


__all__ = [
    "COLORS",
    "SCRIPT",
    "STYLE",
    "Cell",
    "data_uri",
    "document",
    "esc",
    "href",
    "inline_markdown",
    "legend",
    "link",
    "markdown_block",
    "stacked_bar",
    "table",
]
