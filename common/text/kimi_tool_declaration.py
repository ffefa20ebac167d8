"""Kimi-K2.5's TypeScript-style tool declarations (the `tools_ts_str` its chat template expects).

K2.5's own tokenizer code turns the OpenAI `tools` list into a TypeScript namespace before the
template runs; the template prefers that text over JSON (docs/design.md section 6,
`assets/kimi_k25/chat_template.jinja`). This is an independent implementation of the same rules,
checked byte for byte against 13 schema -> declaration pairs produced by K2.5's code
(assets/kimi_k25/tool_declaration_fixtures/):

- a function becomes `type NAME = (_: {...}) => any;`, preceded by `// description` lines;
- object fields: required ones first, then optional ones (`name?:`), each group sorted by name,
  joined by ",\\n" and indented two spaces per level; `integer` is written `number`;
- a field's description and its constraints (string: maxLength/minLength/pattern, number:
  maximum/minimum, array: minItems/maxItems, sorted by key) and its default become `//` lines;
- enums become literal unions, `anyOf` and type lists become `|` unions, `$defs` become
  `interface`s, `$ref: "#"` makes the parameters an `interface parameters`;
- unknown scalar types are written as they are (`uuid`), unsupported schemas raise ValueError.
"""
from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger(__name__)

INDENT = "  "
FIELD_SEP = ",\n"
# JSON type -> TypeScript type inside a `"type": [...]` list.
UNION_TYPES = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean",
               "null": "null", "object": "{}", "array": "Array<any>"}
# Which schema keys are shown as a `// key: value` comment, per scalar type.
CONSTRAINT_KEYS = {"string": ("maxLength", "minLength", "pattern"),
                   "number": ("maximum", "minimum"), "integer": ("maximum", "minimum")}
ARRAY_CONSTRAINT_KEYS = ("minItems", "maxItems")


def comment_lines(text: str, indent: str = "") -> str:
    """`// ` before every non-empty line; empty lines stay empty (no trailing newline)."""
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


class Defs:
    """The `$defs` seen while walking one function's parameters, and whether `#` was referenced."""

    def __init__(self):
        self.schemas: dict[str, Any] = {}
        self.self_referenced = False

    def ref_name(self, ref: str) -> str:
        if ref == "#":
            self.self_referenced = True
            return "parameters"
        if ref.startswith("#/$defs/"):
            name = ref.split("/")[-1]
            if name not in self.schemas:
                raise ValueError(f"reference not found: {ref}")
            return name
        raise ValueError(f"unsupported reference format: {ref}")


class Node:
    """One parsed schema: `ts(indent)` is its type text, `doc(indent)` its comment lines."""

    def __init__(self, kind: str, schema: dict, *, description: str = "", constraints=None,
                 **fields):
        self.kind, self.schema = kind, schema
        self.description = description
        self.constraints = constraints or {}
        self.__dict__.update(fields)

    def doc(self, indent: str) -> str:
        lines = []
        if self.description:
            lines.append(comment_lines(self.description, indent))
        if self.constraints:
            # Python's str() of the value (0, 1.5, True), as K2.5's code writes it.
            lines.append(indent + "// " + ", ".join(f"{k}: {v}" for k, v in sorted(self.constraints.items())))
        return "".join(line + "\n" for line in lines)

    def ts(self, indent: str = "") -> str:
        if self.kind == "scalar":
            return "number" if self.type == "integer" else self.type
        if self.kind == "ref":
            return self.name
        if self.kind == "enum":
            return " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in self.values)
        if self.kind == "anyof":
            return " | ".join(t.ts(indent) for t in self.options)
        if self.kind == "union":
            return " | ".join(self.types)
        if self.kind == "array":
            item_doc = self.item.doc(indent + INDENT)
            if not item_doc:
                return f"Array<{self.item.ts(indent)}>"
            return f"Array<\n{item_doc}{indent}{INDENT}{self.item.ts(indent + INDENT)}\n{indent}>"
        assert self.kind == "object", self.kind
        return object_ts(self, indent)


def field_ts(name: str, node: Node, optional: bool, default: Any, indent: str) -> str:
    text = node.doc(indent)
    if default is not None:
        # Numbers and booleans by repr (True, 1.5), anything else as JSON ("a", [1, 2]).
        shown = repr(default) if isinstance(default, (int, float, bool)) else json.dumps(default, ensure_ascii=False)
        text += f"{indent}// Default: {shown}\n"
    return text + f"{indent}{name}{'?' if optional else ''}: {node.ts(indent)}"


def object_ts(node: Node, indent: str) -> str:
    required = sorted((f for f in node.fields if not f[2]), key=lambda f: f[0])
    optional = sorted((f for f in node.fields if f[2]), key=lambda f: f[0])
    parts = [field_ts(name, sub, opt, default, indent + INDENT)
             for name, sub, opt, default in required + optional]
    extra = node.additional
    if extra is not None:
        if extra is True:
            extra_ts = "any"
        elif extra is False:
            extra_ts = "never"
        elif isinstance(extra, Node):
            extra_ts = extra.ts(indent + INDENT)
        else:
            raise ValueError(f"unknown additionalProperties: {extra!r}")
        parts.append(f"{indent}{INDENT}[k: string]: {extra_ts}")
    if not parts:
        return "{}"
    return "{\n" + FIELD_SEP.join(parts) + "\n" + indent + "}"


def parse_object(schema: dict, defs: Defs) -> Node:
    node = Node("object", schema, description=schema.get("description", "") if schema else "",
                fields=[], additional=None)
    if not schema:
        return node
    if "$defs" in schema:
        # Registered before the properties are parsed, so `$ref`s below resolve.
        defs.schemas.update(schema["$defs"] or {})
    extra = schema.get("additionalProperties")
    node.additional = parse(extra, defs) if isinstance(extra, dict) else extra
    if "properties" not in schema:
        return node
    required = set(schema.get("required", []))
    for name, prop in schema["properties"].items():
        default = prop.get("default") if isinstance(prop, dict) else None
        node.fields.append((name, parse(prop, defs), name not in required, default))
    return node


def check_enum(schema: dict) -> None:
    """Enum values must agree with a declared type (K2.5 refuses such schemas; JSON is used then)."""
    typ = schema.get("type")
    if typ is None:
        return
    if isinstance(typ, list):
        if len(typ) == 2 and "null" in typ:
            typ = typ[0] if typ[0] != "null" else typ[1]
        elif len(typ) == 1:
            typ = typ[0]
        else:
            raise ValueError(f"enum type {typ} is not supported")
    expected = {"string": str, "number": (int, float), "integer": int, "boolean": bool}.get(typ)
    for value in schema["enum"]:
        if value is not None and expected is not None and not isinstance(value, expected):
            raise ValueError(f"enum value {value!r} is not a {typ}")


def parse(schema: Any, defs: Defs) -> Node:
    """Schema -> Node, trying `$ref`, `anyOf`, `enum`, `type` in that order (K2.5's precedence)."""
    if isinstance(schema, bool):
        if not schema:
            log.warning("boolean schema false is not supported, written as null")
        return Node("scalar", {}, type="any" if schema else "null")
    desc = schema.get("description", "")
    if "$ref" in schema:
        return Node("ref", schema, description=desc, name=defs.ref_name(schema["$ref"]))
    if "anyOf" in schema:
        return Node("anyof", schema, description=desc, options=[parse(s, defs) for s in schema["anyOf"]])
    if "enum" in schema:
        check_enum(schema)
        return Node("enum", schema, description=desc, values=schema["enum"])
    if "type" in schema:
        typ = schema["type"]
        if isinstance(typ, list):
            unknown = [t for t in typ if t not in UNION_TYPES]
            if unknown:
                raise ValueError(f"unsupported types in type list: {unknown}")
            return Node("union", schema, description=desc, types=[UNION_TYPES[t] for t in typ])
        if typ == "object":
            return parse_object(schema, defs)
        if typ == "array":
            item = parse(schema["items"], defs) if schema.get("items") else Node("scalar", {}, type="any")
            return Node("array", schema, description=desc, item=item,
                        constraints={k: v for k, v in schema.items() if k in ARRAY_CONSTRAINT_KEYS})
        keys = CONSTRAINT_KEYS.get(typ, ())
        return Node("scalar", schema, description=desc, type=typ,
                    constraints={k: v for k, v in schema.items() if k in keys})
    if schema == {}:
        return Node("scalar", {}, type="any")
    raise ValueError(f"invalid JSON schema: {schema!r}")


def function_to_typescript(function: dict) -> str:
    """One OpenAI function definition -> its interfaces, description comment and `type` line."""
    defs = Defs()
    params = parse_object(function.get("parameters") or {}, defs)
    blocks = []
    if defs.self_referenced:
        # `$ref: "#"` points at the parameters object itself: it needs a name. Fields keep
        # their declared order here (K2.5 does not sort this interface).
        body = FIELD_SEP.join(field_ts(n, t, o, d, INDENT) for n, t, o, d in params.fields)
        blocks.append("interface parameters {" + (f"\n{body}\n" if body else "") + "}")
    for name, schema in dict(defs.schemas).items():
        desc = schema.get("description", "") if isinstance(schema, dict) else ""
        head = comment_lines(desc) + "\n" if desc else ""
        blocks.append(f"{head}interface {name} {parse(schema, defs).ts()}")
    name = function.get("name", "function")
    signature = "parameters" if defs.self_referenced else params.ts()
    description = function.get("description")
    parts = ["\n".join(blocks), comment_lines(description) if description else "",
             f"type {name} = (_: {signature}) => any;"]
    return "\n".join(p for p in parts if p)


def encode_tools_to_typescript(tools: list[dict] | None) -> str:
    """The `tools_ts_str` for an OpenAI `tools` list; "" when it holds no function tools.

    Raises ValueError (or KeyError/TypeError on malformed input) for schemas K2.5 cannot write;
    K2.5's tokenizer then falls back to the template's JSON rendering.
    """
    functions = [function_to_typescript(tool["function"]) for tool in tools or []
                 if tool.get("type") == "function" and tool.get("function")]
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"
