"""The schema suite: JSON Schemas of the kinds clients send (nested objects, arrays with bounds, enums, integer and
number ranges, patterns, anyOf, $defs/$ref, nullable, const), each with two prompts. bench/structured.py runs all of
it; tests/test_structured_output.py a few. SUBSET names the ones the tests use."""
from typing import Dict, List, Tuple

S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(required=True, **properties) -> dict:
  """An object schema with these properties, all required unless told otherwise."""
  schema = {"type": "object", "properties": properties}
  if required:
    schema["required"] = list(properties)
  return schema


def short(n: int = 24) -> dict:
  return {"type": "string", "maxLength": n}


SCHEMAS: Dict[str, dict] = {
  # flat objects
  "person": obj(name=short(), age={"type": "integer", "minimum": 0, "maximum": 120}),
  "city": obj(name=short(), country=short(), population={"type": "integer", "minimum": 0}),
  "book": obj(title=short(40), author=short(), year={"type": "integer", "minimum": 1400, "maximum": 2030}),
  "product": obj(name=short(), price={"type": "number", "minimum": 0, "maximum": 10000}, in_stock=B),
  "movie": obj(title=short(40), rating={"type": "number", "minimum": 0, "maximum": 10}),
  "flag": obj(enabled=B),
  "counter": obj(count={"type": "integer", "minimum": -5, "maximum": 5}),
  "point": obj(x=N, y=N),
  "optional_fields": obj(False, name=short(), nickname=short(), age=I),
  "temperature": obj(celsius={"type": "number", "exclusiveMinimum": -274, "maximum": 100}),
  # enums and const
  "color": obj(color={"enum": ["red", "green", "blue"]}),
  "weekday": obj(day={"type": "string", "enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]}),
  "size": obj(size={"enum": ["S", "M", "L", "XL"]}, quantity={"type": "integer", "minimum": 1, "maximum": 9}),
  "version_const": obj(version={"const": 2}, name=short()),
  "kind_const": obj(kind={"const": "event"}, title=short()),
  "mixed_enum": obj(value={"enum": [1, "two", None, True]}),
  "priority": obj(task=short(), priority={"type": "integer", "enum": [1, 2, 3]}),
  # patterns and string formats
  "zip_code": obj(zip={"type": "string", "pattern": "^[0-9]{5}$"}),
  "hex_color": obj(hex={"type": "string", "pattern": "^#[0-9a-f]{6}$"}),
  "phone": obj(phone={"type": "string", "pattern": "^\\+[0-9]{2} [0-9]{3} [0-9]{4}$"}),
  "slug": obj(slug={"type": "string", "pattern": "^[a-z]+(-[a-z]+){0,3}$"}),
  "iso_date": obj(date={"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}),
  "code": obj(code={"type": "string", "minLength": 3, "maxLength": 6, "pattern": "^[A-Z]+$"}),
  # arrays with bounds
  "tags": obj(tags={"type": "array", "items": short(12), "minItems": 1, "maxItems": 4}),
  "scores": obj(scores={"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 2, "maxItems": 5}),
  "exact_pair": obj(pair={"type": "array", "items": N, "minItems": 2, "maxItems": 2}),
  "tuple": obj(row={"type": "array", "prefixItems": [short(), I, B], "items": False}),
  "top_array": {"type": "array", "items": short(16), "minItems": 1, "maxItems": 3},
  "matrix": obj(rows={"type": "array", "maxItems": 3, "items": {"type": "array", "items": I, "minItems": 2, "maxItems": 2}}),
  "empty_allowed": obj(items={"type": "array", "items": I, "maxItems": 3}),
  "colors_list": obj(colors={"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}),
  # nested objects
  "address": obj(name=short(), address=obj(street=short(), city=short(), zip={"type": "string", "pattern": "^[0-9]{5}$"})),
  "order": obj(id={"type": "integer", "minimum": 1}, customer=obj(name=short(), email=short(40)),
               items={"type": "array", "minItems": 1, "maxItems": 3, "items": obj(sku=short(8), qty={"type": "integer", "minimum": 1, "maximum": 10})}),
  "team": obj(name=short(), members={"type": "array", "minItems": 1, "maxItems": 3, "items": obj(name=short(), role={"enum": ["lead", "dev", "qa"]})}),
  "deep": obj(a=obj(b=obj(c=obj(value=I)))),
  "config": obj(server=obj(host=short(), port={"type": "integer", "minimum": 1, "maximum": 65535}), debug=B),
  "recipe": obj(title=short(), ingredients={"type": "array", "maxItems": 4, "items": obj(name=short(16), grams={"type": "integer", "minimum": 1, "maximum": 1000})}),
  # anyOf
  "id_any": obj(id={"anyOf": [{"type": "integer", "minimum": 0}, short(12)]}),
  "shape": obj(shape={"anyOf": [obj(kind={"const": "circle"}, radius={"type": "number", "minimum": 0}),
                                obj(kind={"const": "square"}, side={"type": "number", "minimum": 0})]}),
  "result": {"anyOf": [obj(ok={"const": True}, value=I), obj(ok={"const": False}, error=short())]},
  "contact": obj(contact={"anyOf": [obj(email=short(40)), obj(phone={"type": "string", "pattern": "^[0-9]{10}$"})]}),
  "number_or_list": obj(value={"anyOf": [I, {"type": "array", "items": I, "maxItems": 3}]}),
  # $defs / $ref
  "defs_person": {"$defs": {"person": obj(name=short(), age={"type": "integer", "minimum": 0, "maximum": 120})},
                  "type": "object", "properties": {"author": {"$ref": "#/$defs/person"}, "reviewer": {"$ref": "#/$defs/person"}},
                  "required": ["author", "reviewer"]},
  "defs_enum": {"$defs": {"level": {"enum": ["low", "mid", "high"]}}, "type": "object",
                "properties": {"risk": {"$ref": "#/$defs/level"}, "impact": {"$ref": "#/$defs/level"}}, "required": ["risk", "impact"]},
  "defs_list": {"$defs": {"item": obj(name=short(16), done=B)}, "type": "object",
                "properties": {"todo": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3}}, "required": ["todo"]},
  "defs_tree": {"$defs": {"node": {"type": "object", "properties": {"label": short(8), "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}},
                                   "required": ["label", "children"]}}, "$ref": "#/$defs/node"},
  # nullable
  "nullable_name": obj(name={"type": ["string", "null"], "maxLength": 24}, age={"type": ["integer", "null"], "minimum": 0, "maximum": 120}),
  "nullable_any": obj(note={"anyOf": [short(), {"type": "null"}]}),
  "nullable_nested": obj(manager={"anyOf": [obj(name=short()), {"type": "null"}]}),
  "nullable_list": obj(tags={"anyOf": [{"type": "array", "items": short(10), "maxItems": 3}, {"type": "null"}]}),
  # pydantic-style (titles, descriptions, defaults)
  "pydantic_user": {"title": "User", "type": "object", "properties": {"name": {"title": "Name", "type": "string", "maxLength": 24},
                    "email": {"title": "Email", "type": "string", "maxLength": 40}, "admin": {"title": "Admin", "type": "boolean", "default": False}},
                    "required": ["name", "email"], "additionalProperties": False},
  "event": obj(title=short(), start={"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}, attendees={"type": "integer", "minimum": 1, "maximum": 50}),
}

PROMPTS: Tuple[str, str] = ("Write an example {name} as JSON.", "Fill in this form about a {name} and reply in JSON only.")

# A few schemas covering each kind, for the tests (the bench runs them all).
SUBSET: List[str] = ["person", "color", "version_const", "zip_code", "scores", "order", "shape", "defs_person", "nullable_name", "defs_list"]


def prompt(name: str, which: int) -> str:
  return PROMPTS[which].format(name=name.replace("_", " "))


TOOLS = [{"type": "function", "function": {"name": name, "description": f"Record a {name.replace('_', ' ')}.", "parameters": schema}}
         for name, schema in SCHEMAS.items() if schema.get("type") == "object" and "$ref" not in schema]
