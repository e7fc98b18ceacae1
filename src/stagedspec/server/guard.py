"""Who may talk to the server: the `Host` header and browser origins, checked before any route runs.

Why a server bound to 127.0.0.1 needs this: a web page the user opens can
make the browser send requests to 127.0.0.1.  Without a check, a page on
any site could (a) point its own host name at 127.0.0.1 once the page has
loaded (DNS rebinding) and then read the server's answers as same-origin,
or (b) fire "simple" cross-origin POSTs (`text/plain` bodies need no CORS
preflight) that run generations.  So:

- the `Host` header must name this server: a loopback name, the bound
  address, or a host the operator listed (`--allowed-host`); a rebound
  page's requests carry the attacker's host name and are refused (400);
- a request carrying an `Origin` header (browsers send one; the `openai`
  client, curl and `bench-serve` do not) is refused (403) unless the
  operator listed that origin (`--allow-origin`), in which case it gets
  CORS headers and preflight `OPTIONS` requests are answered;
- POST bodies must be `application/json` (checked by the routes: 415),
  which a browser cannot send cross-origin without a preflight.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
WILDCARD_BINDS = ("0.0.0.0", "::", "")
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type"
CORS_MAX_AGE = "600"
_HEADER_LIST = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*")
_PORT = re.compile(r"[0-9]{1,5}")


def host_name(header: str) -> str | None:
    """The host of a `Host` header value, lower-cased, without port, brackets or trailing dot; None if malformed.

    `127.0.0.1:8000` -> `127.0.0.1`, `[::1]:8000` -> `::1`, `LocalHost.` -> `localhost`."""
    text = header.strip().lower()
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            return None
        name, rest = text[1:end], text[end + 1:]
        if rest and not (rest.startswith(":") and _PORT.fullmatch(rest[1:])):
            return None
        return name or None
    name, colon, port = text.partition(":")
    if colon and not _PORT.fullmatch(port):
        return None
    name = name.rstrip(".")
    return name or None


def normalise_host(value: str) -> str:
    """An `--allowed-host` / `--host` value as `host_name` would read it in a header (a port is dropped)."""
    if ":" in value and not value.startswith("[") and value.count(":") > 1:
        return value.lower()  # a bare IPv6 address such as ::1
    return host_name(value) or value.lower()


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine (a name other than localhost counts as not)."""
    name = normalise_host(host)
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def startup_warning(host: str, api_key: str | None) -> str | None:
    """The one line `serve` prints when it listens beyond this machine with no API key, else None."""
    if api_key or is_loopback(host):
        return None
    return (f"stagedspec serve: warning: listening on {host} without --api-key: anyone who can reach this port "
            "can run the model (set --api-key, or bind 127.0.0.1)")


@dataclass(frozen=True)
class AccessPolicy:
    """Which `Host` headers and browser origins the server answers (see the module docstring for why)."""

    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()

    @classmethod
    def build(cls, bind_host: str = "127.0.0.1", allowed_hosts: Iterable[str] = (),
              allowed_origins: Iterable[str] = ()) -> "AccessPolicy":
        return cls(bind_host, tuple(normalise_host(h) for h in allowed_hosts if h.strip()),
                   tuple(o.strip().rstrip("/").lower() for o in allowed_origins if o.strip()))

    def host_allowed(self, header: str | None) -> bool:
        """Whether a request's `Host` header names this server.

        Loopback names, the bound address and listed hosts pass, with any port.  Bound to all interfaces
        (0.0.0.0 or ::), any IP address passes too: a rebinding attack always arrives under a host *name*,
        so an address typed by a client on the network is no such attack."""
        if "*" in self.allowed_hosts:
            return True
        if header is None:
            return False
        name = host_name(header)
        if name is None:
            return False
        if name in LOOPBACK_NAMES or name in self.allowed_hosts or name == normalise_host(self.bind_host):
            return True
        return self.bind_host.strip() in WILDCARD_BINDS and is_ip_literal(name)

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin.strip().rstrip("/").lower() in self.allowed_origins


def _error(status: int, message: str, code: str) -> tuple[int, bytes]:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    return status, json.dumps(body).encode()


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class AccessGuard:
    """ASGI middleware applying an `AccessPolicy` to every HTTP request, and CORS to allowed origins."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = _header(scope, b"host")
        if not self.policy.host_allowed(host):
            shown = json.dumps((host or "")[:100])
            await _reply(send, *_error(400, f"the Host header {shown} does not name this server (start it with "
                                            "--allowed-host NAME to accept that name)", "invalid_host"))
            return
        origin = _header(scope, b"origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        if not self.policy.origin_allowed(origin):
            shown = json.dumps(origin[:100])
            await _reply(send, *_error(403, f"requests from the web origin {shown} are refused (start the server "
                                            "with --allow-origin ORIGIN to accept them)", "origin_not_allowed"))
            return
        if scope["method"] == "OPTIONS" and _header(scope, b"access-control-request-method") is not None:
            await _reply(send, 204, b"", self._preflight_headers(scope, origin))
            return
        await self.app(scope, receive, self._with_cors(send, origin))

    def _preflight_headers(self, scope: Scope, origin: str) -> list[tuple[bytes, bytes]]:
        asked = _header(scope, b"access-control-request-headers")
        allow = asked.strip() if asked and _HEADER_LIST.fullmatch(asked.strip()) else CORS_HEADERS
        return [*_cors_headers(origin), (b"access-control-allow-methods", CORS_METHODS.encode()),
                (b"access-control-allow-headers", allow.encode("latin-1")),
                (b"access-control-max-age", CORS_MAX_AGE.encode())]

    @staticmethod
    def _with_cors(send: Send, origin: str) -> Send:
        async def send_with_cors(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_cors_headers(origin)]}
            await send(message)
        return send_with_cors


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    """The request's own origin, echoed even under `--allow-origin '*'`, with `Vary: Origin` so that a cache
    never hands one origin's answer to another."""
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


async def _reply(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    head = [*(headers or [])]
    if body:
        head += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    else:
        head.append((b"content-length", b"0"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})
