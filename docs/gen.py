"""``python -m docs.gen``: the reference, written from the one definition of each thing.

Each table lies in a page between ``gen:`` markers (``docs.blocks``) and is made from
the code that defines it, nothing else:

- ``http-api``, ``schemas``: the routes and bodies of the OpenAPI schema the app
  serves at ``/openapi.json`` (``pinfeed_server.main.create_app``);
- ``cli``: typer's command tree (``pinfeed_server.cli.app``);
- ``settings``: the fields of ``pinfeed_server.settings.Settings``;
- ``metrics``: the families ``GET /metrics`` declares (``api.routes.metrics.families``);
- ``loader-fields``, ``loader-patch``: ``LoaderCreate`` (``engine.config.LoaderFields``)
  and ``LoaderPatch``, with which of them are torch DataLoader's own arguments;
- ``dataset-kinds``: every kind of ``pinfeed_server.datasets.KINDS`` and its params;
- ``errors``: the exception tree of ``pinfeed.errors`` (slug, HTTP status, data plane).

``python -m docs.gen`` rewrites every block; ``--check`` changes nothing and exits 1
naming each page whose blocks differ from what the code makes (tests/docs/test_reference.py
runs that check). The output depends on the code alone, never on the machine: a default
computed at start-up (half the RAM, the CPUs) is shown as such, not as this machine's
value. A new table is a function ``(args) -> markdown`` in ``RENDERERS`` and a marker in
a page.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

from docs import blocks

MARKER = blocks.marker("gen")
JsonSchema = dict[str, Any]


# --- cells ------------------------------------------------------------------------------


def cell(text: str) -> str:
    """Prose in a table cell: one line, no HTML (``<run_dir>`` stays text), no column
    break; backticks keep their code."""
    text = " ".join(text.split())
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def code(value: object) -> str:
    return f"`{value}`"


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def first_paragraph(doc: str | None) -> str:
    return inspect.cleandoc(doc or "").split("\n\n")[0]


# --- JSON schemas (pydantic models, the OpenAPI components) -------------------------------

TYPES = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "null": "null"}


def type_of(prop: JsonSchema, link: Callable[[str], str]) -> str:
    """A property's type, as a reader writes it: ``int | null``, ``list[str]``, a
    schema's name linked."""
    if "$ref" in prop:
        return link(prop["$ref"].rsplit("/", 1)[1])
    for key in ("anyOf", "oneOf"):
        if key in prop:
            return " \\| ".join(type_of(p, link) for p in prop[key])
    if "allOf" in prop and len(prop["allOf"]) == 1:
        return type_of(prop["allOf"][0], link)
    if "const" in prop:
        return code(json.dumps(prop["const"]))
    if "enum" in prop:
        return " \\| ".join(code(json.dumps(v)) for v in prop["enum"])
    kind = prop.get("type")
    if kind == "array":
        items = prop.get("items")
        return f"list[{type_of(items, link)}]" if items else "list"
    if kind == "object":
        values = prop.get("additionalProperties")
        return f"dict[str, {type_of(values, link)}]" if isinstance(values, dict) else "object"
    if prop.get("format") == "path":
        return "path"
    if isinstance(kind, list):
        return " \\| ".join(TYPES.get(k, k) for k in kind)
    return TYPES.get(kind, kind or "any")


BOUNDS = (
    ("minimum", ">="),
    ("exclusiveMinimum", ">"),
    ("maximum", "<="),
    ("exclusiveMaximum", "<"),
    ("minLength", "length >="),
    ("maxLength", "length <="),
    ("minItems", "items >="),
    ("maxItems", "items <="),
)


def bounds(prop: JsonSchema) -> str:
    """What a value may be besides its type: its bounds and pattern."""
    parts: list[str] = []
    for alt in [prop, *prop.get("anyOf", [])]:
        parts += [f"{op} {_num(alt[key])}" for key, op in BOUNDS if key in alt]
        if "pattern" in alt:
            parts.append(code(alt["pattern"]))
    return ", ".join(parts)


def _num(x: float) -> str:
    if isinstance(x, int) and x >= 1 << 20 and (x & (x - 1)) == 0:
        return f"2^{x.bit_length() - 1}"  # 1 << 40 reads better than 1099511627776
    return str(x)


def schema_rows(
    schema: JsonSchema,
    link: Callable[[str], str],
    default: Callable[[str, JsonSchema], str] | None = None,
) -> list[list[str]]:
    """One row per property: name, type, default (or required), allowed, meaning."""
    required = set(schema.get("required", []))
    rows = []
    for name, prop in schema.get("properties", {}).items():
        if name in required:
            dflt = "required"
        elif "default" in prop:
            dflt = code(json.dumps(prop["default"]))
        else:
            dflt = default(name, prop) if default else "—"
        rows.append(
            [
                code(name),
                type_of(prop, link),
                dflt,
                bounds(prop),
                cell(prop.get("description", "")),
            ]
        )
    return rows


FIELD_HEAD = ["Field", "Type", "Default", "Allowed", "Meaning"]


# --- the HTTP API -----------------------------------------------------------------------


@cache
def openapi() -> JsonSchema:
    """The schema the app serves, as with PINFEED_TOKEN set (mutating routes say 401)."""
    from pinfeed_server.main import create_app
    from pinfeed_server.settings import Settings

    schema: JsonSchema = create_app(Settings(token="x" * 16)).openapi()
    return schema


def _schema_link(name: str) -> str:
    return f"[`{name}`](#{name.lower()})"


def _kind_link(name: str) -> str:
    """A schema named on another page: the HTTP reference's section."""
    return f"[`{name}`](http-api.md#{name.lower()})"


def http_api(args: list[str]) -> str:
    """Every route: method, path, what it does, its success and its problems."""
    rows = []
    for path, item in openapi()["paths"].items():
        for method, op in item.items():
            codes = sorted(op["responses"])
            ok = [c for c in codes if c < "400"]
            problems = [f"[{c}](errors.md)" for c in codes if c >= "400"]
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            what = first_paragraph(op.get("description"))
            if body:
                what += f" Body: {type_of(body['schema'], _schema_link)}."
            rows.append([method.upper(), code(path), cell(what), " ".join(ok), " ".join(problems)])
    return table(["Method", "Path", "What", "Success", "Problems"], rows)


def schemas(args: list[str]) -> str:
    """Every body the API takes or answers, a section each, in name order."""
    out = []
    for name, schema in sorted(openapi()["components"]["schemas"].items()):
        out.append(f"### {name}\n")
        if schema.get("description"):
            out.append(cell(first_paragraph(schema["description"])) + "\n")
        if "properties" in schema:
            out.append(table(FIELD_HEAD, schema_rows(schema, _schema_link)) + "\n")
        elif "oneOf" in schema or "anyOf" in schema:
            out.append(f"One of: {type_of(schema, _schema_link)}.\n")
    return "\n".join(out)


# --- the loader's fields, the dataset kinds -----------------------------------------------


def _torch_dataloader_args() -> set[str]:
    from torch.utils.data import DataLoader

    return set(inspect.signature(DataLoader).parameters)


def loader_fields(args: list[str]) -> str:
    """``POST /v1/loaders``: every field, and whether it is torch DataLoader's own."""
    schema = openapi()["components"]["schemas"]["LoaderCreate"]
    torch_args = _torch_dataloader_args()
    rows = schema_rows(schema, _kind_link)
    for row, name in zip(rows, schema["properties"], strict=True):
        row.insert(1, "yes" if name in torch_args else "")
    return table(["Field", "DataLoader's", *FIELD_HEAD[1:]], rows)


def loader_patch(args: list[str]) -> str:
    """``PATCH /v1/loaders/{name}``: the fields that change live."""
    schema = openapi()["components"]["schemas"]["LoaderPatch"]
    return table(FIELD_HEAD, schema_rows(schema, _kind_link))


def dataset_kinds(args: list[str]) -> str:
    """Every kind ``POST /v1/datasets`` takes: its summary and its ``params``."""
    from pinfeed_server.datasets import KINDS

    out = []
    for name, kind in KINDS.items():
        out.append(f"### `{name}`\n")
        out.append(cell(first_paragraph(kind.doc) or kind.summary) + "\n")
        schema = kind.params.model_json_schema()
        out.append(table(FIELD_HEAD, schema_rows(schema, _kind_link)) + "\n")
    return "\n".join(out)


# --- settings ---------------------------------------------------------------------------

EMPTY = {list: "[]", dict: "{}"}


def settings(args: list[str]) -> str:
    """Every setting of ``pinfeed serve``: its environment variable, type, default."""
    from pinfeed_server.settings import Settings

    def computed(name: str, prop: JsonSchema) -> str:
        factory = Settings.model_fields[name].default_factory
        return code(EMPTY[factory]) if factory in EMPTY else "computed at start-up"

    schema = Settings.model_json_schema()
    rows = schema_rows(schema, code, computed)
    for row, prop in zip(rows, schema["properties"].values(), strict=True):
        row[0] = code("PINFEED_" + row[0].strip("`").upper())
        if "default" in prop:  # as the variable is written: unset, or its text
            value = prop["default"]
            row[2] = "unset" if value is None else code(_env_text(value))
    return table(["Environment", *FIELD_HEAD[1:]], rows)


def _env_text(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return value if isinstance(value, str) else json.dumps(value)


# --- metrics ----------------------------------------------------------------------------


def metrics(args: list[str]) -> str:
    """Every pinfeed family of ``GET /metrics``: type, labels, meaning."""
    from pinfeed_server.api.prometheus import families

    rows = [
        [code(f.metric), f.kind, ", ".join(code(x) for x in f.labels), cell(f.help)]
        for f in families()
    ]
    return table(["Metric", "Type", "Labels", "Meaning"], rows)


# --- the CLI ----------------------------------------------------------------------------


def _commands(cmd: Any, path: str) -> Iterator[tuple[str, Any]]:
    yield path, cmd
    for name, sub in (getattr(cmd, "commands", None) or {}).items():
        yield from _commands(sub, f"{path} {name}")


def _param(p: Any) -> list[str]:
    if p.param_type_name == "argument":
        name = code(p.name.upper())
    else:
        name = " / ".join(code(o) for o in [*p.opts, *p.secondary_opts])
    default = "" if p.default in (None, False, ()) or p.required else code(p.default)
    return [name, code(p.envvar) if p.envvar else "", default, cell(p.help or "")]


def cli(args: list[str]) -> str:
    """Every command of ``pinfeed``: its usage, what it does, its arguments and options."""
    import typer

    from pinfeed_server.cli import app

    out = []
    for path, cmd in _commands(typer.main.get_command(app), "pinfeed"):
        params = [p for p in cmd.params if p.name not in ("install_completion", "show_completion")]
        if getattr(cmd, "commands", None) and path != "pinfeed":
            continue  # a group: its commands have sections of their own
        args_ = [p.name.upper() for p in params if p.param_type_name == "argument"]
        opts = " [OPTIONS]" if any(p.param_type_name == "option" for p in params) else ""
        if path == "pinfeed":
            args_, opts = ["COMMAND"], ""
        out.append(f"### `{path}`\n")
        out.append(f"```text\n{' '.join([path, *args_])}{opts}\n```\n")
        out.append(cell(inspect.cleandoc(cmd.help or "").split("\n\n")[0]) + "\n")
        if params and path != "pinfeed":
            out.append(
                table(["Argument", "Environment", "Default", "What"], list(map(_param, params)))
                + "\n"
            )
    return "\n".join(out)


# --- errors -----------------------------------------------------------------------------


def errors(args: list[str]) -> str:
    """Every class of ``pinfeed.errors``: its ``type`` slug, HTTP status, whether the data
    plane sends it (and closes the connection after it), when it happens, its members."""
    from pinfeed.errors import ERRORS, ProblemError

    rows = []
    for cls in ERRORS:
        if not cls.__doc__:
            raise ValueError(f"pinfeed.errors.{cls.__name__} has no docstring: say when it happens")
        status = (
            str(cls.status) if issubclass(cls, ProblemError) and cls is not ProblemError else ""
        )
        plane = {None: "", True: "yes, closes", False: "yes"}[cls.fatal]
        bases = ", ".join(b.__name__ for b in cls.__bases__ if b is not Exception)
        members = [code(n) for n, v in vars(cls).items() if isinstance(v, property)]
        rows.append(
            [
                code(cls.slug),
                status,
                plane,
                f"`{cls.__name__}` ({bases})" if bases else code(cls.__name__),
                cell(first_paragraph(cls.__doc__)),
                ", ".join(members),
            ]
        )
    return table(["`type` slug", "HTTP", "Data plane", "Class (bases)", "When", "Members"], rows)


# --- the pages --------------------------------------------------------------------------

RENDERERS: dict[str, Callable[[list[str]], str]] = {
    "http-api": http_api,
    "schemas": schemas,
    "loader-fields": loader_fields,
    "loader-patch": loader_patch,
    "dataset-kinds": dataset_kinds,
    "settings": settings,
    "metrics": metrics,
    "cli": cli,
    "errors": errors,
}


def render(text: str) -> str:
    def one(name: str, args: list[str]) -> str:
        if name not in RENDERERS:
            raise KeyError(f"unknown generated block {name!r}; one of {sorted(RENDERERS)}")
        return RENDERERS[name](args)

    return blocks.fill(text, MARKER, one)


def check() -> list[str]:
    """One line per page whose generated blocks differ from what the code makes."""
    return [
        f"{path.relative_to(blocks.REPO)}: the reference differs from the code"
        for path in blocks.pages()
        if render(text := path.read_text()) != text
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m docs.gen", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 on a difference")
    args = ap.parse_args(argv)
    if args.check:
        problems = check()
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("run `make docs-gen` (python -m docs.gen) and commit the pages", file=sys.stderr)
        return 1 if problems else 0
    for path in blocks.pages():
        text = path.read_text()
        new = render(text)
        if new != text:
            path.write_text(new)
            print(f"updated {path.relative_to(blocks.REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
