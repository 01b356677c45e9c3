"""How a request body is read: one pydantic model per dialect's body (`Body`), each field declared with its type and
constraints and the words that say what it takes (`checked`, `tagged`, `one_of`, `neutral`), null in any field
meaning its default. `bad_request` turns pydantic's ValidationError into the project's BadRequest: HTTP 400, the
field named by its whole path (`messages[1].content[0].text`, `options.top_k`) as `param`, the message that path
and what the field takes."""
import json
from typing import Annotated, Any, Dict, Iterable, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, PlainValidator, Tag, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

from exo.api.errors import BadRequest

MAX_INT32 = 2**31 - 1


def invalid(why: str, code: Optional[str] = None, at: str = "", said: str = "") -> PydanticCustomError:
  """A field's fault, raised inside a validator: `why` follows the field's name in the message; `at` names the part
  of the field at fault (`.messages` in chat_template_kwargs), less the tail of it that `why` has `said` in its own
  words; `code` is the error's code."""
  return PydanticCustomError(code or "invalid", why, {"at": at, "said": said})


def _path(loc: Iterable[Any]) -> str:
  """A location as a suffix of a field's name: `.content[0]` (a `tagged` object's <tag> is no part of it)."""
  return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc if not (str(p).startswith("<") and str(p).endswith(">")))


def _own(error: ValidationError, extra: bool) -> Optional[dict]:
  """The first fault raised by `invalid` (a field's own message), or (`extra`) naming a field not taken, if any."""
  return next((e for e in error.errors(include_url=False) if (extra and e["type"] == "extra_forbidden") or "at" in (e.get("ctx") or {})), None)


def bad_request(error: ValidationError) -> BadRequest:
  """The 400 for a body's first fault; a field this server does not know, then one it does not implement, is named
  before any other (as a client most needs to hear that its request asks for what it will not get)."""
  errors = error.errors(include_url=False)
  first = min(errors, key=lambda e: {"extra_forbidden": 0, "unsupported_parameter": 1}.get(e["type"], 2))  # (the first of its kind)
  where, ctx = _path(first["loc"]).lstrip("."), first.get("ctx") or {}
  param = (where + ctx.get("at", "")).lstrip(".")
  if first["type"] == "extra_forbidden":
    return BadRequest(f"Unrecognized request argument supplied: {param}", param=param, code="unsupported_parameter")
  why = first["msg"] if "at" in ctx else f"is not valid: {first['msg']}"  # (pydantic's own words: a fault no type below explains)
  named = param[:len(param) - len(ctx.get("said", ""))]
  message = f"{named}{'' if why[:1] in ':[' else ' '}{why}" if named else why
  return BadRequest(message, param=param or None, code=first["type"] if "at" in ctx and first["type"] != "invalid" else None)


class Body(BaseModel):
  """A request body: the fields a dialect takes, each typed below (null means its default); any other is refused."""
  model_config = ConfigDict(extra="forbid", validate_default=True)

  @classmethod
  def read(cls, body: Any):
    try:
      return cls.model_validate(body)
    except ValidationError as e:
      raise bad_request(e) from None


class Closed(BaseModel):
  """An object's fields, where another key makes the whole object invalid (the object, not the key, is named)."""
  model_config = ConfigDict(extra="forbid", validate_default=True)


def checked(kind: Any, why: str, code: Optional[str] = None, optional: bool = True) -> Any:
  """A field of type `kind` (with its constraints), or null when `optional`; anything else fails saying `why`."""
  def explain(value: Any, handler):
    if value is None and optional:
      return None
    try:
      return handler(value)
    except ValidationError as e:
      own = _own(e, isinstance(kind, type) and issubclass(kind, Body))  # a part's own fault, said of that part; any other is the field's
      if own is None:
        raise invalid(why, code) from None
      ctx = own.get("ctx") or {}
      own_code = None if own["type"] == "invalid" else own["type"]
      raise invalid(own["msg"], own_code, _path(own["loc"]) + ctx.get("at", ""), ctx.get("said", "")) from None
  return Annotated[kind, WrapValidator(explain)]  # (null never reaches `kind`)


def tagged(kinds: Dict[str, Any], why: str, key: str = "type", at: str = ".type") -> Any:
  """An object whose `key` picks its model among `kinds`; one whose `key` is none of them fails saying `why` (of its `at`)."""
  def kind_of(value: Any) -> Optional[str]:
    return f"<{value[key]}>" if isinstance(value, dict) and isinstance(value.get(key), str) and value[key] in kinds else None
  return Annotated[Union[tuple(Annotated[model, Tag(f"<{tag}>")] for tag, model in kinds.items())],
                   Discriminator(kind_of, custom_error_type="invalid", custom_error_message=why, custom_error_context={"at": at, "said": ""})]


def number(low: float, high: float, why: Optional[str] = None) -> Any:
  """A finite JSON number (never a boolean) in [low, high]."""
  return checked(Annotated[float, Field(strict=True, ge=low, le=high, allow_inf_nan=False)], why or f"must be a number between {low:g} and {high:g}")


def integer(low: int, why: str, high: int = MAX_INT32, optional: bool = True) -> Any:
  return checked(Annotated[int, Field(strict=True, ge=low, le=high)], why, optional=optional)


def one_of(values: Iterable[Any], why: str, code: Optional[str] = None, optional: bool = True) -> Any:
  """One of `values` (compared as `_same`: false is not 0), or null when `optional`."""
  values = tuple(values)

  def check(value: Any) -> Any:
    if (value is not None or not optional) and not any(_same(value, v) for v in values):
      raise invalid(why, code)
    return value
  return Annotated[Any, PlainValidator(check)]


def neutral(*values: Any) -> Any:
  """A parameter this server does not implement: taken only with a value that asks for nothing (null is always one)."""
  return one_of(values, f"is not supported by this server (only null or {' or '.join(json.dumps(v) for v in values)})", "unsupported_parameter")


def _same(value: Any, allowed: Any) -> bool:
  """Equal and of the same kind (so `false` is not taken for 0, nor 0 for `false`)."""
  return isinstance(value, bool) == isinstance(allowed, bool) and type(value) in (int, float, bool, dict, str, list) and value == allowed


Switch = checked(Annotated[bool, Field(strict=True)], "must be true or false")  # true, false, or null: not said


def flag(default: bool) -> Any:
  """true or false; null (or left out) is `default`."""
  return Annotated[Switch, AfterValidator(lambda value: default if value is None else value)]


Flag = flag(False)
Text = checked(Annotated[str, Field(strict=True)], "must be a string")
String = checked(Annotated[str, Field(strict=True)], "must be a string", optional=False)
Object = checked(Dict[str, Any], "must be an object")
