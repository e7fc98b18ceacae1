"""Request bodies of the OpenAI-compatible endpoints: parsed and checked by hand.

Why by hand rather than with pydantic models: the error a client gets must be
the OpenAI shape (`{"error": {"message", "type", "param", "code"}}`, status
400) naming the one field that is wrong, and unknown fields must be ignored,
not rejected.  A few explicit checks say that more plainly than overriding a
validation framework's own 422 errors.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1


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
    tree_budget: int | None = None


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


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"'{name}' must be a number, got {type(value).__name__}", name)
    if not math.isfinite(value):
        raise bad(f"'{name}' must be a finite number, got {value}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer, got {json.dumps(value)}", name)
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false, got {json.dumps(value)}", name)
    return value


def _unsupported(body: dict[str, Any]) -> None:
    """Fields the server knows but does not implement: refused rather than silently ignored."""
    n = _integer(body, "n")
    if n is not None and n != 1:
        raise bad("'n' > 1 is not supported: send one request per completion", "n")
    best_of = _integer(body, "best_of")
    if best_of is not None and best_of != 1:
        raise bad("'best_of' is not supported", "best_of")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise bad("'logprobs' is not supported", "logprobs")
    if body.get("echo") not in (None, False):
        raise bad("'echo' is not supported", "echo")
    if body.get("suffix") not in (None, ""):
        raise bad("'suffix' is not supported", "suffix")


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
    value = body.get("speculation")
    if value is None:
        return SpeculationRequest()
    if not isinstance(value, dict):
        raise bad("'speculation' must be an object with optional method, draft and tree_budget", "speculation")
    method, draft = value.get("method"), value.get("draft")
    for name, v in (("method", method), ("draft", draft)):
        if v is not None and not isinstance(v, str):
            raise bad(f"'speculation.{name}' must be a string", f"speculation.{name}")
    budget = _integer(value, "tree_budget")
    if budget is not None and budget < 1:
        raise bad(f"'speculation.tree_budget' must be >= 1, got {budget}", "speculation.tree_budget")
    return SpeculationRequest(method=method, draft=draft, tree_budget=budget)


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
        out.append({"role": m["role"], "content": _content(m.get("content", ""), i)})
    return out


def parse_generation(body: dict[str, Any], chat: bool) -> GenerationRequest:
    """Check a completions (`chat=False`) or chat-completions body; unknown fields are ignored."""
    _unsupported(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    req = GenerationRequest(chat=chat, model=model)
    if chat:
        req.messages = _messages(body)
    else:
        req.prompt = _prompt(body)
    name = "max_tokens" if body.get("max_tokens") is not None or chat is False else "max_completion_tokens"
    req.max_tokens = _integer(body, name)
    if req.max_tokens is not None and req.max_tokens < 1:
        raise bad(f"'{name}' must be >= 1, got {req.max_tokens}", name)
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
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        req.include_usage = _flag(options, "include_usage")
    req.speculation = _speculation(body)
    return req
