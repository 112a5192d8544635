"""The config reference of the docs site, rendered from the deployment's pydantic models.

An mkdocs hook (named in mkdocs.yml): every page holding the marker below gets it replaced,
at build time, by one table per config section with each key's name, type, default and
description. It reads the models themselves (services.deployment.deployment_model()), so a
key added to any section is in the next build without anyone editing a page.
"""

from __future__ import annotations

import enum
import html
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

MARKER = "<!-- config-reference -->"
ROOT = Path(__file__).resolve().parent.parent


def render_type(annotation: Any) -> str:
    """A field's type as a reader of a TOML file thinks of it: `int`, `str | null`,
    `"a" | "b"` for a Literal, `list[str]`."""
    if annotation is None or annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) if isinstance(a, str) else str(a) for a in args)
    if origin is typing.Annotated:
        return render_type(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(render_type(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(render_type(a) for a in args)}]" if args else name
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(json.dumps(m.value) for m in annotation)
    if isinstance(annotation, type):
        return {"Path": "path", "NoneType": "null"}.get(annotation.__name__,
                                                          annotation.__name__)
    return str(annotation).replace("typing.", "")


def render_default(field: FieldInfo) -> str:
    """The default as it would be written in TOML; `required` when there is none."""
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "unset"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return json.dumps(value, default=str)


def _code_cell(text: str) -> str:
    """Text shown as code in a table cell (a pipe inside a code span splits no cell)."""
    return "`" + " ".join(text.split()) + "`"


def _text_cell(text: str) -> str:
    """Prose in a table cell: outside its code spans HTML-escaped, with pipes escaped."""
    parts = " ".join(text.split()).split("`")
    return "`".join(part if i % 2 else html.escape(part, quote=False).replace("|", "\\|")
                    for i, part in enumerate(parts))


def _models_of(annotation: Any) -> list[type[BaseModel]]:
    """The config models a field holds: one for a sub-section, several for a union of them
    (e.g. the sandbox provider, chosen by its `type`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if models and len(models) == len([a for a in args if a is not type(None)]):
            return models
    return []


def _variant_label(model: type[BaseModel]) -> str:
    type_field = model.model_fields.get("type")
    if type_field is not None and type_field.default is not PydanticUndefined:
        return f"`type = {json.dumps(type_field.default)}`"
    return model.__name__


def render_section(model: type[BaseModel], path: str, level: int = 2,
                   variant: str = "") -> list[str]:
    """One heading and table for `model` at dotted `path`, then its sub-sections."""
    heading = f"{'#' * min(level, 6)} `[{path}]`" + (f" ({variant})" if variant else "")
    lines = [heading, ""]
    doc = (model.__doc__ or "").strip()
    if doc and not doc.startswith(model.__name__ + "("):
        lines += [" ".join(doc.split()), ""]
    rows: list[str] = []
    nested: list[tuple[str, list[type[BaseModel]]]] = []
    for name, field in model.model_fields.items():
        sub_models = _models_of(field.annotation)
        if sub_models:
            nested.append((name, sub_models))
            continue
        cells = [f"`{name}`", _code_cell(render_type(field.annotation)),
                 _code_cell(render_default(field)), _text_cell(field.description or "")]
        rows.append("| " + " | ".join(cells) + " |")
    if rows:
        lines += ["| key | type | default | description |", "|---|---|---|---|", *rows, ""]
    for name, sub_models in nested:
        for sub in sub_models:
            label = _variant_label(sub) if len(sub_models) > 1 else ""
            lines += render_section(sub, f"{path}.{name}", level + 1, label)
    return lines


def render_reference(deployment: type[BaseModel]) -> str:
    """Every section of a deployment model, in the order of the file."""
    lines: list[str] = []
    for name, field in deployment.model_fields.items():
        for model in _models_of(field.annotation):
            lines += render_section(model, name)
    return "\n".join(lines)


def deployment_reference() -> str:
    """The reference of this checkout's deployment config."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from services.deployment import deployment_model

    return render_reference(deployment_model())


def on_page_markdown(markdown: str, **_: Any) -> str:
    """mkdocs hook: fill the marker of any page with the generated reference."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, deployment_reference())
