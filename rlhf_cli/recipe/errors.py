"""Validation errors as one line each: `file:line: field: message`, with the `--set` that
caused it named."""

from __future__ import annotations

import re

import yaml
from pydantic import (
    ValidationError,
)


def _yaml_line(root: yaml.Node | None, loc: tuple[str | int, ...]) -> int | None:
    """1-based line of the deepest YAML node that exists along `loc`."""
    node, line = root, None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            pair = next(((k, v) for k, v in node.value if k.value == str(key)), None)
            if pair is None:
                return line
            line, node = pair[0].start_mark.line + 1, pair[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def printable(text: str) -> str:
    """Keys and messages may carry newlines or control characters: one line per problem."""
    return text if text.isprintable() else repr(text)


def format_errors(
    err: ValidationError,
    source: str,
    root: yaml.Node | None,
    overridden: dict[str, str] | None = None,
) -> list[str]:
    problems: list[str] = []
    seen: dict[str, int] = {}
    for e in err.errors():
        # Union members appear in `loc` as type tags such as `list[str]` or `literal['x']`; they
        # are not fields, so they stay out of the dotted path (an unknown key, last, stays in).
        unknown_key = len(e["loc"]) - 1 if e["type"] == "extra_forbidden" else None
        loc = tuple(
            p
            for i, p in enumerate(e["loc"])
            if isinstance(p, int) or "[" not in p or i == unknown_key
        )
        msg = e["msg"].removeprefix("Value error, ")
        named = re.match(r"^(\w+): (.*)$", msg, re.S)
        if named and e["type"] == "value_error":
            loc, msg = loc + (named.group(1),), named.group(2)
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; `rlhf validate` lists every field)"
        dotted = ".".join(printable(str(p)) for p in loc) or "(top level)"
        msg = printable(msg)
        line = _yaml_line(root, loc)
        where = f"{source}:{line}" if line else source
        for key, arg in (overridden or {}).items():
            if dotted == key or dotted.startswith(key + "."):
                where = f"--set {printable(arg)}"
        if dotted in seen:  # one line per field: the alternatives of a union are joined
            problems[seen[dotted]] += f", or {msg[0].lower()}{msg[1:]}"
            continue
        seen[dotted] = len(problems)
        problems.append(f"{where}: {dotted}: {msg}")
    return problems
