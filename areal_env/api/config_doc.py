"""Render the configuration reference (markdown) from the dataclasses and their field docstrings.

``python -m areal_env.api.config_doc`` prints it; the README embeds its output between the
``<!-- config-reference -->`` markers and a test keeps the two in sync.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any

from areal_env.api import config as config_module


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings: a string literal right after an annotated assignment."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:], strict=False):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def _type_str(tp: Any) -> str:
    text = tp if isinstance(tp, str) else getattr(tp, "__name__", str(tp))
    return text.replace("typing.", "").replace("|", "\\|")


def _default_str(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(value):
            return "(section)"
    else:
        return "(required)"
    return f"`{value!r}`" if value is not None else "`null`"


def render_reference(cls: type = config_module.ExperimentConfig, prefix: str = "") -> str:
    """Markdown tables, one per section, keys written in dotted form."""
    rows: list[str] = []
    nested: list[tuple[str, type]] = []
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            nested.append((prefix + f.name + ".", type(default)))
            continue
        doc = docs.get(f.name, "").replace("|", "\\|")
        rows.append(f"| `{prefix}{f.name}` | {_type_str(f.type)} | {_default_str(f)} | {doc} |")
    title = prefix.rstrip(".") or "top level"
    out = [f"#### `{title}`\n"]
    cls_doc = (inspect.getdoc(cls) or "").split("\n\n")[0]
    if cls_doc:
        out.append(cls_doc + "\n")
    out += ["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    for sub_prefix, sub_cls in nested:
        out.append(render_reference(sub_cls, sub_prefix))
    for f in dataclasses.fields(cls):  # ``name -> section`` maps: the section of one entry
        args = typing.get_args(typing.get_type_hints(cls).get(f.name))
        if len(args) == 2 and isinstance(args[1], type) and dataclasses.is_dataclass(args[1]):
            out.append(render_reference(args[1], f"{prefix}{f.name}.<name>."))
    return "\n".join(out)


START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def update_file(path: str) -> bool:
    """Replace the text between the markers in ``path``; True when it changed."""
    from pathlib import Path

    p = Path(path)
    text = p.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{START}\n{render_reference()}{END}{tail}"
    if new != text:
        p.write_text(new)
    return new != text


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--update":
        print("updated" if update_file(sys.argv[2]) else "up to date")
    else:
        print(render_reference())
