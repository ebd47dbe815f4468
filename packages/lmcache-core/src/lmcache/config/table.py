# SPDX-License-Identifier: Apache-2.0
"""The README's configuration table, generated from :class:`lmcache.config.LMCacheConfig`.

Each row is one dataclass field: its key, its ``LMCACHE_<KEY>`` environment variable, its type,
its default (written as YAML) and its attribute docstring (the string literal right below the
field in the class source). The README holds the table between :data:`BEGIN_MARKER` and
:data:`END_MARKER`; a unit test compares it with :func:`markdown_table`.

Rewrite the README's table after changing a field::

    python -m lmcache.config.table --write README.md

``--check README.md`` exits 1 when the table is out of date; no argument prints the table.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import re
import sys
import textwrap
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmcache.config import ENV_PREFIX, LMCacheConfig

__all__ = [
    "BEGIN_MARKER",
    "END_MARKER",
    "REGENERATE_COMMAND",
    "ConfigRow",
    "config_rows",
    "markdown_table",
    "replace_table",
]

REGENERATE_COMMAND = "python -m lmcache.config.table --write README.md"
"""The command that rewrites the README's table (run from the repository root)."""

BEGIN_MARKER = f"<!-- config-table:begin (generated: {REGENERATE_COMMAND}) -->"
"""The comment line above the generated table."""

END_MARKER = "<!-- config-table:end -->"
"""The comment line below the generated table."""

_HEADER = "| Key | Environment variable | Type | Default | Meaning |\n|---|---|---|---|---|"


@dataclasses.dataclass(frozen=True)
class ConfigRow:
    """One config key as the table shows it."""

    key: str
    env: str
    type: str
    default: str
    doc: str


def config_rows() -> list[ConfigRow]:
    """One row per field of :class:`LMCacheConfig`, in declaration order.

    Raises:
        ValueError: A field has no attribute docstring.
    """
    docs = _attribute_docstrings(LMCacheConfig)
    hints = typing.get_type_hints(LMCacheConfig)
    rows = []
    for field in dataclasses.fields(LMCacheConfig):
        if field.name not in docs:
            raise ValueError(
                f"LMCacheConfig field {field.name!r} has no docstring: expected a string literal "
                f"on the line after it, found none. Add one; it becomes the README's 'Meaning'."
            )
        rows.append(
            ConfigRow(
                key=field.name,
                env=ENV_PREFIX + field.name.upper(),
                type=_type_name(hints[field.name]),
                default=_yaml_default(field),
                doc=_markdown(docs[field.name]),
            )
        )
    return rows


def markdown_table() -> str:
    """The configuration table as Markdown, without the markers and without a final newline."""
    lines = [_HEADER]
    for row in config_rows():
        cells = (f"`{row.key}`", f"`{row.env}`", row.type, f"`{row.default}`", row.doc)
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


def replace_table(text: str, table: str | None = None) -> str:
    """``text`` with the lines between the markers replaced by ``table`` (default: the current one).

    Raises:
        ValueError: The markers are missing, repeated or out of order.
    """
    begin, end = text.count(BEGIN_MARKER), text.count(END_MARKER)
    if begin != 1 or end != 1 or text.index(BEGIN_MARKER) > text.index(END_MARKER):
        raise ValueError(
            f"expected one line {BEGIN_MARKER!r} followed later by one line {END_MARKER!r}; "
            f"found {begin} and {end}. Put both markers where the table belongs."
        )
    head, rest = text.split(BEGIN_MARKER, 1)
    _, tail = rest.split(END_MARKER, 1)
    body = markdown_table() if table is None else table
    return f"{head}{BEGIN_MARKER}\n{body}\n{END_MARKER}{tail}"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table, or rewrite (``--write``) or check (``--check``) a Markdown file's table."""
    parser = argparse.ArgumentParser(
        prog="python -m lmcache.config.table", description=(__doc__ or "").split("\n", 1)[0]
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="FILE", help="rewrite FILE's table in place")
    group.add_argument("--check", metavar="FILE", help="exit 1 if FILE's table is out of date")
    args = parser.parse_args(argv)
    if args.write is None and args.check is None:
        print(markdown_table())
        return 0
    path = Path(args.write or args.check)
    text = path.read_text(encoding="utf-8")
    try:
        updated = replace_table(text)
    except ValueError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 2
    if args.check is not None:
        if updated != text:
            print(f"{path}: the config table is out of date; run: {REGENERATE_COMMAND}")
            return 1
        return 0
    if updated != text:
        path.write_text(updated, encoding="utf-8")
        print(f"{path}: config table rewritten")
    return 0


def _attribute_docstrings(cls: type) -> dict[str, str]:
    """``{field: docstring}`` from the string literals that follow annotated fields in ``cls``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef)).body
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _type_name(tp: Any) -> str:
    if isinstance(tp, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return str(getattr(tp, "__name__", tp))


def _yaml_default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def _markdown(doc: str) -> str:
    """A reST docstring as one Markdown line: roles and ````literals```` become `code`."""
    text = " ".join(doc.split())
    text = _ROLE.sub(r"`\1`", text)
    return text.replace("``", "`")


if __name__ == "__main__":
    sys.exit(main())
