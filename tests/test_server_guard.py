"""Safe on loopback, in process: the Host check (DNS rebinding), browser origins and CORS, JSON-only bodies,
the warning when listening beyond this machine without a key, and the CLI flags that configure them."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("fastapi")

from _server import free_port, local_client, tiny_engine, tiny_model_folder  # noqa: E402
from stagedspec.server.app import create_app  # noqa: E402
from stagedspec.server.guard import AccessPolicy, host_name, is_loopback, startup_warning  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine(tmp_path_factory.mktemp("guard"))


@pytest.fixture(scope="module")
def client(engine):
    with local_client(create_app(engine, log=lambda s: None)) as c:
        yield c


def error_of(r, status: int, code: str) -> str:  # noqa: ANN001
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code and err["message"]
    return err["message"]


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:8000", "localhost", "LOCALHOST:1", "localhost.",
                                  "[::1]", "[::1]:8000"])
def test_loopback_hosts_are_answered(client, host):
    assert client.get("/health", headers={"Host": host}).status_code == 200
    assert client.post("/v1/completions", json=BODY, headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "10.0.0.5",
                                  "127.0.0.1:abc", "[::1", "[::1]x", "localhost:8000:1", ""])
def test_other_hosts_are_refused(client, host):
    """A DNS-rebound page's requests carry its own host name: refused on every path, /health included."""
    for r in (client.get("/health", headers={"Host": host}), client.get("/metrics", headers={"Host": host}),
              client.post("/v1/completions", json=BODY, headers={"Host": host})):
        assert "does not name this server" in error_of(r, 400, "invalid_host")


def test_host_policy():
    assert host_name("[::1]:80") == "::1" and host_name("Example.COM.:8080") == "example.com"
    assert host_name("a:b") is None and host_name("[::1]:") is None
    loop = AccessPolicy.build()
    assert not loop.host_allowed(None) and not loop.host_allowed("192.168.1.9")
    bound = AccessPolicy.build("10.1.2.3", ["Models.Lan:8000", "api.example"])
    assert all(bound.host_allowed(h) for h in ("10.1.2.3:8000", "models.lan", "API.example:443", "localhost"))
    assert not bound.host_allowed("10.1.2.4") and not bound.host_allowed("other.lan")
    wild = AccessPolicy.build("0.0.0.0")  # any address a network client typed passes; names still do not
    assert wild.host_allowed("192.168.1.9:8000") and wild.host_allowed("[fe80::1]")
    assert not wild.host_allowed("rebound.example")
    assert AccessPolicy.build("::").host_allowed("10.0.0.1")
    anything = AccessPolicy.build(allowed_hosts=["*"])
    assert anything.host_allowed("whatever.example") and anything.host_allowed(None)


def test_allowed_host_flag_value_reaches_the_app(engine):
    with local_client(create_app(engine, log=lambda s: None, allowed_hosts=["models.lan"])) as c:
        assert c.get("/health", headers={"Host": "models.lan:8000"}).status_code == 200
        assert c.get("/health", headers={"Host": "other.lan"}).status_code == 400


def test_requests_from_web_pages_are_refused(client):
    origin = {"Origin": "https://evil.example"}
    for r in (client.post("/v1/completions", json=BODY, headers=origin), client.get("/v1/models", headers=origin),
              client.get("/health", headers=origin),
              client.options("/v1/completions", headers={**origin, "Access-Control-Request-Method": "POST"})):
        assert "https://evil.example" in error_of(r, 403, "origin_not_allowed")
        assert "access-control-allow-origin" not in r.headers
    assert client.post("/v1/completions", json=BODY).status_code == 200  # no Origin: not a browser page


def test_listed_origin_gets_cors_and_preflight(engine):
    app = create_app(engine, log=lambda s: None, allowed_origins=["http://localhost:3000/"])
    with local_client(app) as c:
        origin = "http://localhost:3000"
        pre = c.options("/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
        assert pre.status_code == 204 and pre.content == b""
        assert pre.headers["access-control-allow-origin"] == origin and "Origin" in pre.headers["vary"]
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert pre.headers["access-control-allow-headers"] == "authorization, content-type, x-stainless-os"
        r = c.post("/v1/completions", json=BODY, headers={"Origin": origin})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        streamed = c.post("/v1/completions", json={**BODY, "stream": True}, headers={"Origin": origin})
        assert streamed.status_code == 200 and streamed.headers["access-control-allow-origin"] == origin
        refused = c.post("/v1/completions", json={**BODY, "n": 2}, headers={"Origin": origin})
        assert refused.status_code == 400 and refused.headers["access-control-allow-origin"] == origin
        assert c.post("/v1/completions", json=BODY, headers={"Origin": "http://localhost:3001"}).status_code == 403


def test_any_origin_with_star(engine):
    with local_client(create_app(engine, log=lambda s: None, allowed_origins=["*"])) as c:
        for origin in ("https://a.example", "null"):
            r = c.get("/v1/models", headers={"Origin": origin})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx", "json"])
def test_post_bodies_must_be_json(client, content_type):
    """A browser sends text/plain and form bodies cross-origin without a preflight: such POSTs get 415."""
    headers = {"Content-Type": content_type} if content_type else {}
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = client.post(path, content=b'{"model": "tiny", "prompt": "Hello", "max_tokens": 2}', headers=headers)
        assert "Content-Type: application/json" in error_of(r, 415, "unsupported_media_type")


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON"])
def test_json_content_types_are_accepted(client, content_type):
    import json

    r = client.post("/v1/completions", content=json.dumps(BODY), headers={"Content-Type": content_type})
    assert r.status_code == 200, r.text


def test_startup_warning_beyond_loopback_without_a_key():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert startup_warning(host, None) is None and is_loopback(host)
    for host in ("0.0.0.0", "::", "192.168.1.5", "myhost.lan"):
        line = startup_warning(host, None)
        assert line and "\n" not in line and "--api-key" in line and host in line
        assert startup_warning(host, "s3cret") is None


def held_port() -> socket.socket:
    """A socket listening on 127.0.0.1: binding the same port on 0.0.0.0 then fails, so `serve` stops
    with its one-line error before it listens anywhere."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_serve_prints_the_warning_when_binding_beyond_loopback(tmp_path, capsys):
    from stagedspec.cli import main

    folder = str(tiny_model_folder(tmp_path))
    capsys.readouterr()  # saving the tiny model prints progress
    with held_port() as s:
        port = str(s.getsockname()[1])
        args = ["serve", "--oracle", folder, "--quant", "none", "--dtype", "fp32", "--port", port]
        assert main([*args, "--host", "0.0.0.0"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 2 and "warning: listening on 0.0.0.0 without --api-key" in err[0]
        assert "cannot listen" in err[1]
        assert main([*args, "--host", "0.0.0.0", "--api-key", "k"]) == 2
        assert "warning" not in capsys.readouterr().err
        assert main([*args, "--host", "127.0.0.1"]) == 2
        assert "warning" not in capsys.readouterr().err


def test_serve_flags_reach_the_app(tmp_path, monkeypatch):
    import uvicorn

    import stagedspec.server.app as app_module
    from stagedspec.cli import main

    seen = {}
    real = app_module.create_app

    def capture(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        seen.update(kw)
        return real(*args, **kw)

    monkeypatch.setattr(app_module, "create_app", capture)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)  # nothing listens; the loader never starts
    folder = str(tiny_model_folder(tmp_path))
    assert main(["serve", "--oracle", folder, "--quant", "none", "--port", str(free_port()),
                 "--allowed-host", "models.lan", "--allowed-host", "api.example",
                 "--allow-origin", "http://localhost:3000", "--allow-origin", "*"]) == 0
    assert seen["host"] == "127.0.0.1" and list(seen["allowed_hosts"]) == ["models.lan", "api.example"]
    assert list(seen["allowed_origins"]) == ["http://localhost:3000", "*"]
