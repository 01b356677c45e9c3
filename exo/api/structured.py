"""`response_format`: an answer that must be JSON (json_object) or JSON a schema allows (json_schema), and the checks
every JSON Schema of a request passes before the request is admitted (tool parameters too): valid JSON Schema, and
within what the grammar engine does. `strict: true` refuses a schema with keywords the engine cannot enforce;
`strict: false` (OpenAI's default) compiles the same grammar but ignores those keywords."""
import json
from dataclasses import dataclass
from typing import Any, Optional

from exo.api.errors import BadRequest
from exo.inference import grammar

MAX_SCHEMA_CHARS = 64 * 1024  # one schema as JSON text; several together must still fit grammar.MAX_GRAMMAR_CHARS


@dataclass(frozen=True)
class ResponseFormat:
  kind: str  # "json_object" or "json_schema"
  schema: dict  # what the answer must match ({"type": "object"} for json_object)
  strict: bool

  def fragment(self) -> str:
    """The grammar fragment (Lark with %json) of an answer in this format."""
    return grammar.json_fragment(self.schema, lenient=not self.strict)


def parse_response_format(body: dict) -> Optional[ResponseFormat]:
  """None for plain text; BadRequest naming response_format for anything malformed or beyond the grammar engine."""
  value = body.get("response_format")
  if value is None:
    return None
  if not isinstance(value, dict) or not isinstance(value.get("type"), str):
    raise BadRequest('response_format must be an object such as {"type": "json_object"}', param="response_format")
  spec = value.get("json_schema")
  if value["type"] == "json_schema" and not isinstance(spec, dict):
    raise BadRequest('response_format.json_schema must be an object: {"name": ..., "schema": {...}, "strict": true}', param="response_format.json_schema")
  return format_of(value["type"], spec, "response_format", "response_format.json_schema")


def format_of(kind: str, spec: Optional[dict], where: str, spec_where: str) -> Optional[ResponseFormat]:
  """The format of type `kind` at `where`; a json_schema's `name`, `schema` and `strict` are in `spec`, at `spec_where`."""
  if kind == "text":
    return None
  if kind == "json_object":
    return ResponseFormat(kind, {"type": "object"}, False)
  if kind != "json_schema":
    raise BadRequest(f'{where}.type must be "text", "json_object" or "json_schema", got {kind!r}', param=f"{where}.type")
  name = spec.get("name")
  if name is not None and (not isinstance(name, str) or not name or len(name) > 64):
    raise BadRequest(f"{spec_where}.name must be a string of 1 to 64 characters", param=f"{spec_where}.name")
  strict = spec.get("strict")
  if strict is not None and not isinstance(strict, bool):
    raise BadRequest(f"{spec_where}.strict must be true or false", param=f"{spec_where}.strict")
  schema = spec.get("schema", {})
  check_schema(schema, f"{spec_where}.schema", bool(strict))
  return ResponseFormat(kind, schema, bool(strict))


def check_schema(schema: Any, where: str, strict: bool) -> None:
  """BadRequest naming `where` unless `schema` is a valid JSON Schema the grammar engine can enforce (all of it when
  `strict`, the keywords it implements otherwise)."""
  if schema is True:
    return
  if not isinstance(schema, dict):
    raise BadRequest(f"{where} must be a JSON Schema object", param=where, code="invalid_schema")
  if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
    raise BadRequest(f"{where} is larger than {MAX_SCHEMA_CHARS:,} characters of JSON", param=where, code="invalid_schema")
  import jsonschema  # (imported here: only requests with a schema need it)
  try:
    jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
  except jsonschema.SchemaError as e:
    path = "".join(f"[{p!r}]" for p in e.absolute_path)
    raise BadRequest(f"{where} is not a valid JSON Schema: {e.message}" + (f" (at {path})" if path else ""), param=where, code="invalid_schema") from None
  if not grammar.available():
    raise BadRequest(f"{where}: this node cannot constrain output (the llguidance package is not installed)", param=where, code="unsupported_schema")
  try:
    grammar.check("start: " + grammar.json_fragment(schema, lenient=not strict))
  except grammar.GrammarError as e:
    hint = "" if not strict else "; with strict false, keywords the engine does not implement are ignored instead"
    raise BadRequest(f"{where} cannot be enforced: {e}{hint}", param=where, code="unsupported_schema") from None
