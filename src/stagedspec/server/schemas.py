"""Request bodies of the OpenAI-compatible endpoints: parsed and checked by hand.

Why by hand rather than with pydantic models: the error a client gets must be
the OpenAI shape (`{"error": {"message", "type", "param", "code"}}`, status
400) naming the one field that is wrong.  A few explicit checks say that
more plainly than overriding a validation framework's own 422 errors.

Why no field is ignored: a client that sends `tools`, `presence_penalty: 1` or a
misspelt `max_token` and gets a plain completion back cannot tell that its
request was not honoured.  So every field is either honoured, accepted
because at the value sent it cannot change the output (`n: 1`,
`presence_penalty: 0`, `user`), or refused with "<field> is not supported"
(as OpenAI's own API refuses arguments it does not recognise).  `null`
counts as leaving a field out, everywhere.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from stagedspec.constraints.grammar import GrammarSpec
from stagedspec.errors import StagedSpecError, first_line
from stagedspec.speculation import SIZE_FIELDS

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1
# Deepest nesting of arrays and objects a body may have.  A request needs 4 (messages[i].content[j]); the cap
# is checked on the raw bytes before parsing, because Python's parser recurses once per level and a body of
# 100k brackets would end in RecursionError.
MAX_JSON_DEPTH = 64
ROLES = ("system", "developer", "user", "assistant")  # `developer` is OpenAI's newer name for `system`


@dataclass
class APIError(Exception):
    """A client-visible failure: its HTTP status and the OpenAI error object."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


@dataclass
class SpeculationRequest:
    """The `speculation` extension object; None fields keep the server's defaults."""

    method: str | None = None
    draft: str | None = None
    sizes: dict[str, int] = field(default_factory=dict)  # the sizes named, by `speculation.SIZE_FIELDS` names


@dataclass
class GenerationRequest:
    """What `/v1/completions` and `/v1/chat/completions` both reduce to."""

    chat: bool
    model: str | None
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0  # the OpenAI default
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    speculation: SpeculationRequest = field(default_factory=SpeculationRequest)
    logit_bias: dict[str, Any] = field(default_factory=dict)  # as sent; token ids are checked against the model
    grammar: GrammarSpec | None = None  # from `response_format` (chat): json_object or json_schema


# A JSON string (escapes and all, closing quote optional so that an unterminated one cannot make the scan
# backtrack) or one bracket: what the depth scan reads.  Brackets inside strings are text, not nesting.
_DEPTH_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.DOTALL)
_OPENERS = frozenset(b"[{")


def nesting_depth_exceeds(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the raw body nests arrays/objects deeper than `limit`, read without parsing it."""
    if raw.count(b"[") + raw.count(b"{") <= limit:  # the usual body: too few brackets to be that deep
        return False
    depth = 0
    for match in _DEPTH_TOKENS.finditer(raw):
        first = match.group()[0]
        if first in _OPENERS:
            depth += 1
            if depth > limit:
                return True
        elif first != 0x22:  # a closing bracket ('"' starts a string)
            depth -= 1
    return False


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or 400: bad JSON, nesting past `MAX_JSON_DEPTH`, a lone surrogate."""
    if nesting_depth_exceeds(raw):
        raise bad(f"the request body nests arrays/objects more than {MAX_JSON_DEPTH} levels deep")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, an integer of over 4300 digits
        raise bad(f"the request body is not valid JSON: {first_line(e)}") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    where = _lone_surrogate(body, "")
    if where is not None:
        raise bad(f"{where} is not valid Unicode: it holds a lone surrogate (an unpaired \\ud800-\\udfff escape)",
                  where)
    return body


def _valid_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate: JSON's \\ud800 escapes decode to one, and neither the
    tokenizer nor a UTF-8 response can carry it."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def field_name(path: str, key: str) -> str:
    """`path.key` for error messages and `param`; an odd key (spaces, escapes, long) is quoted, ASCII only."""
    shown = key if _PLAIN_NAME.fullmatch(key) else json.dumps(key[:64])
    return f"{path}.{shown}" if path else shown


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (or key) in `value` that holds a lone surrogate, if any."""
    if isinstance(value, str):
        return None if _valid_unicode(value) else (path or "the request body")
    if isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, (str, list, dict)):
                found = _lone_surrogate(item, f"{path}[{i}]")
                if found is not None:
                    return found
    elif isinstance(value, dict):
        for key, item in value.items():
            name = field_name(path, key)
            if not _valid_unicode(key):
                return name
            found = _lone_surrogate(item, name)
            if found is not None:
                return found
    return None


# ---------------------------------------------------------------- which fields a request may carry
# Honoured: they change what is generated, and the server does what they say.
_HONOURED = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                       "stream_options", "speculation", "logit_bias"})
HONOURED_FIELDS = {False: _HONOURED | {"prompt"},
                   True: _HONOURED | {"messages", "max_completion_tokens", "response_format"}}

# Accepted at these values only, because there they ask for nothing this server does not do ("null" too).
NEUTRAL_FIELDS: dict[bool, dict[str, tuple[Any, ...]]] = {
    False: {"n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",), "logprobs": (False,),
            "presence_penalty": (0,), "frequency_penalty": (0,)},
    True: {"n": (1,), "logprobs": (False,), "top_logprobs": (0,), "presence_penalty": (0,),
           "frequency_penalty": (0,), "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
           "modalities": (["text"],), "store": (False,), "service_tier": ("auto", "default")},
}

# Accepted with any value of their type: they label or route a request and never change its output.
INERT_FIELDS: dict[bool, dict[str, type]] = {
    False: {"user": str},
    True: {"user": str, "metadata": dict, "parallel_tool_calls": bool, "prompt_cache_key": str,
           "safety_identifier": str},
}

# The same, inside a message: what the `openai` client's `message.model_dump()` carries when a reply is sent back.
MESSAGE_NEUTRAL: dict[str, tuple[Any, ...]] = {"tool_calls": ([],), "annotations": ([],)}
STREAM_OPTIONS = {"include_usage": bool, "include_obfuscation": bool}  # obfuscation pads chunks; none is added
SPECULATION_FIELDS = ("method", "draft") + SIZE_FIELDS


_TYPE_NAMES = {str: "string", dict: "JSON object", bool: "boolean"}


def shown(value: Any, limit: int = 60) -> str:
    """A client's value as it goes into an error message: JSON, ASCII, cut short (it may be a megabyte)."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality that keeps booleans apart from numbers (in Python, False == 0 and True == 1)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return isinstance(value, bool) and isinstance(neutral, bool) and value == neutral
    if isinstance(value, (int, float)) and isinstance(neutral, (int, float)):
        return value == neutral
    if isinstance(value, list) and isinstance(neutral, list):
        return len(value) == len(neutral) and all(_same(a, b) for a, b in zip(value, neutral))
    if isinstance(value, dict) and isinstance(neutral, dict):
        return value.keys() == neutral.keys() and all(_same(value[k], neutral[k]) for k in value)
    return type(value) is type(neutral) and value == neutral


def not_supported(name: str, accepted: tuple[Any, ...] = ()) -> APIError:
    """400 "<field> is not supported", saying which values would be accepted, if any."""
    hint = (f" (accepted: {' or '.join(json.dumps(v) for v in accepted)}, or leaving it out)" if accepted else "")
    return bad(f"{name} is not supported{hint}", name)


def _check_fields(body: dict[str, Any], chat: bool) -> None:
    """Refuse every field that is neither honoured, neutral at its value, nor inert (in the body's order)."""
    honoured, neutral, inert = HONOURED_FIELDS[chat], NEUTRAL_FIELDS[chat], INERT_FIELDS[chat]
    for key, value in body.items():
        if key in honoured or value is None:
            continue
        name = field_name("", key)
        if key == "n":
            if not _same(value, 1):
                raise bad(f"n must be 1: this server returns one choice per request (got {shown(value)})",
                          "n")
        elif key in neutral:
            if not any(_same(value, v) for v in neutral[key]):
                raise not_supported(name, neutral[key])
        elif key in inert:
            if not isinstance(value, inert[key]):
                raise bad(f"{name} must be a {_TYPE_NAMES[inert[key]]}", name)
        else:
            raise not_supported(name)


def _check_object_fields(obj: dict[str, Any], path: str, allowed: Any,
                         neutral: dict[str, tuple[Any, ...]] | None = None) -> None:
    """Refuse keys of a nested object (`stream_options`, `speculation`, a message) that it does not take."""
    for key, value in obj.items():
        if key in allowed or value is None:
            continue
        name = field_name(path, key)
        accepted = (neutral or {}).get(key, ())
        if not any(_same(value, v) for v in accepted):
            raise not_supported(name, accepted)


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"'{name}' must be a number, got {type(value).__name__}", name)
    if not math.isfinite(value):
        raise bad(f"'{name}' must be a finite number, got {value}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, path: str = "") -> int | None:
    """`body[name]` as an int (None if absent); errors name the field by its full path."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        full = f"{path}.{name}" if path else name
        raise bad(f"'{full}' must be an integer, got {shown(value)}", full)
    return value


def _flag(body: dict[str, Any], name: str, path: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        full = f"{path}.{name}" if path else name
        raise bad(f"'{full}' must be true or false, got {shown(value)}", full)
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise bad("'stop' strings must not be empty", "stop")
    return list(stops)


def _speculation(body: dict[str, Any]) -> SpeculationRequest:
    return parse_speculation(body.get("speculation"))


def parse_speculation(value: Any) -> SpeculationRequest:
    """A request's `speculation` object (None: absent) as a `SpeculationRequest`, or a 400 naming the field."""
    if value is None:
        return SpeculationRequest()
    if not isinstance(value, dict):
        raise bad(f"'speculation' must be an object with optional method, draft and sizes "
                  f"({', '.join(SIZE_FIELDS)})", "speculation")
    _check_object_fields(value, "speculation", SPECULATION_FIELDS)
    method, draft = value.get("method"), value.get("draft")
    for name, v in (("method", method), ("draft", draft)):
        if v is not None and not isinstance(v, str):
            raise bad(f"'speculation.{name}' must be a string", f"speculation.{name}")
    sizes = {}
    for name in SIZE_FIELDS:
        size = _integer(value, name, "speculation")
        if size is not None and size < 1:
            raise bad(f"'speculation.{name}' must be >= 1, got {size}", f"speculation.{name}")
        if size is not None:
            sizes[name] = size
    return SpeculationRequest(method=method, draft=draft, sizes=sizes)


RESPONSE_FORMATS = ("text", "json_object", "json_schema")
JSON_SCHEMA_FIELDS = {"name": str, "description": str, "strict": bool, "schema": (dict, bool)}


def _logit_bias(body: dict[str, Any]) -> dict[str, Any]:
    """`logit_bias` as sent (an object); its keys and values are checked against the model's vocabulary later
    (`stagedspec.constraints.parse_logit_bias`), where the vocabulary is known."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("'logit_bias' must be an object mapping token ids to biases in [-100, 100]", "logit_bias")
    return value


def _response_format(body: dict[str, Any]) -> GrammarSpec | None:
    """`response_format` -> the grammar it asks for: None for text, any JSON object, or a JSON schema."""
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMATS:
        raise bad(f"'response_format' must be an object with 'type' one of {', '.join(RESPONSE_FORMATS)}",
                  "response_format")
    kind = value["type"]
    _check_object_fields(value, "response_format", ("type", "json_schema") if kind == "json_schema" else ("type",))
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("'response_format.json_schema' must be an object with a 'schema'", "response_format.json_schema")
    _check_object_fields(spec, "response_format.json_schema", tuple(JSON_SCHEMA_FIELDS))
    for key, kinds in JSON_SCHEMA_FIELDS.items():
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            raise bad(f"'response_format.json_schema.{key}' has the wrong type", f"response_format.json_schema.{key}")
    if spec.get("schema") is None:
        raise bad("'response_format.json_schema.schema' is required", "response_format.json_schema.schema")
    try:
        return GrammarSpec.json_schema(spec["schema"])
    except StagedSpecError as e:
        raise bad(str(e), "response_format.json_schema.schema") from None


def _stream_options(body: dict[str, Any]) -> bool:
    """`stream_options.include_usage` (the other option OpenAI has, `include_obfuscation`, changes no text)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    _check_object_fields(options, "stream_options", STREAM_OPTIONS)
    _flag(options, "include_obfuscation", "stream_options")
    return _flag(options, "include_usage", "stream_options")


def _prompt(body: dict[str, Any]) -> str | list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise bad("'prompt' is required", "prompt")
    value = body["prompt"]
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        if not value:
            raise bad("'prompt' must not be empty", "prompt")
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    raise bad("'prompt' must be a non-empty string or a list of token ids (one prompt per request)", "prompt")


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad(f"'messages[{i}].content' must be a string or a list of text parts", f"messages[{i}].content")


def _role(message: dict[str, Any], i: int) -> str:
    """The role the chat template sees: one of `ROLES` (`developer` rendered as `system`), else 400."""
    role = message["role"]
    if role not in ROLES:
        why = ": this server does not run tools" if role in ("tool", "function") else ""
        raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {shown(role)}{why}",
                  f"messages[{i}].role")
    return "system" if role == "developer" else role


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    value = body.get("messages")
    if value is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(value, list) or not value:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"'messages[{i}]' must be an object with a string 'role'", f"messages[{i}]")
        role = _role(m, i)
        _check_object_fields(m, f"messages[{i}]", ("role", "content"), MESSAGE_NEUTRAL)
        out.append({"role": role, "content": _content(m.get("content", ""), i)})
    return out


def _max_tokens(body: dict[str, Any], chat: bool) -> int | None:
    name = "max_tokens" if body.get("max_tokens") is not None or chat is False else "max_completion_tokens"
    value = _integer(body, name)
    if value is not None and value < 1:
        raise bad(f"'{name}' must be >= 1, got {value}", name)
    return value


def parse_generation(body: dict[str, Any], chat: bool) -> GenerationRequest:
    """Check a completions (`chat=False`) or chat-completions body: every field is honoured, accepted
    because it cannot change the output, or refused (`_check_fields`)."""
    _check_fields(body, chat)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    req = GenerationRequest(chat=chat, model=model)
    if chat:
        req.messages = _messages(body)
    else:
        req.prompt = _prompt(body)
    req.max_tokens = _max_tokens(body, chat)
    req.temperature = _number(body, "temperature", 1.0)
    if req.temperature < 0:
        raise bad(f"'temperature' must be >= 0, got {req.temperature}", "temperature")
    req.top_p = _number(body, "top_p", 1.0)
    if not 0 < req.top_p <= 1:
        raise bad(f"'top_p' must be in (0, 1], got {req.top_p}", "top_p")
    top_k = _integer(body, "top_k")
    if top_k is not None and top_k < 0:
        raise bad(f"'top_k' must be >= 0 (0 disables it), got {top_k}", "top_k")
    req.top_k = top_k or 0
    req.seed = _integer(body, "seed")
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise bad(f"'seed' must be in [0, 2**63 - 1], got {req.seed}", "seed")
    req.stop = _stop(body)
    req.stream = _flag(body, "stream")
    req.include_usage = _stream_options(body)
    req.speculation = _speculation(body)
    req.logit_bias = _logit_bias(body)
    if chat:
        req.grammar = _response_format(body)
    return req
