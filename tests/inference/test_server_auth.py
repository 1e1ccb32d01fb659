"""The generation server's front door (issue 30, item 7): an API key on every route but /health,
read deadlines that cut slow-drip clients, and a cap on open connections."""

import argparse
import select
import socket
import time

import pytest

from megatron.inference.http_guard import API_KEY_ENV, api_key_from
from megatron.inference.server import add_guard_args, limits_from
from tests.helpers.serving import Server, make_checkpoint

pytest.importorskip("httpx", reason="httpx is not installed (pip install -e '.[serve]')")
pytest.importorskip("fastapi", reason="fastapi is not installed (pip install -e '.[serve]')")
pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install -e '.[serve]')")
import httpx  # noqa: E402

KEY = "s3cret-key"
TIMEOUT = 1.0  # --header-timeout and --body-timeout of the server under test, seconds
CAP = 6


def test_the_key_comes_from_the_flag_then_the_environment(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key_from(None) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert api_key_from(None) == "from-env"
    assert api_key_from("from-flag") == "from-flag"
    with pytest.raises(ValueError, match="--api-key is empty"):
        api_key_from(" ")
    p = argparse.ArgumentParser()
    add_guard_args(p)
    assert limits_from(p.parse_args([])).header_timeout == 10
    for bad, flag in (
        (["--header-timeout", "0"], "--header-timeout"),
        (["--body-timeout", "nan"], "--body-timeout"),
        (["--max-connections", "0"], "--max-connections"),
    ):
        with pytest.raises(ValueError, match=flag):
            limits_from(p.parse_args(bad))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("auth"))
    extra = ["--api-key", KEY, "--header-timeout", str(TIMEOUT), "--body-timeout", str(TIMEOUT)]
    srv = Server(ckpt, extra=(*extra, "--max-connections", str(CAP)))
    yield srv
    assert srv.stop() == [0]


def _generate(srv: Server, headers: dict) -> httpx.Response:
    body = {"prompts": ["hello"], "tokens_to_generate": 2, "top_k": 1}
    return httpx.put(f"{srv.url}/api", json=body, headers=headers, timeout=30)


@pytest.mark.slow
def test_every_route_but_health_needs_the_key(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = _generate(server, headers)
        assert r.status_code == 401, r.text
        assert "Authorization: Bearer" in r.json()["error"]
        r = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    good = {"Authorization": f"Bearer {KEY}"}
    assert _generate(server, good).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers=good).status_code == 200


def _read_to_close(sock: socket.socket, limit: float = 5.0) -> bytes:
    """Everything the server sends until it closes (the headers and body of an answer can
    arrive in separate reads on a loaded machine)."""
    sock.settimeout(limit)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def _drip(srv: Server, head: bytes, limit: float = 6 * TIMEOUT) -> tuple[bytes, float]:
    """Send `head`, then one byte every 0.1 s until the server answers or closes; what it sent
    back and the seconds that took. Meanwhile a normal request must be served."""
    sock = socket.create_connection(("127.0.0.1", srv.port))
    start = time.monotonic()
    sock.sendall(head)
    served = False
    try:
        while time.monotonic() - start < limit:
            if not served:
                served = _generate(srv, {"Authorization": f"Bearer {KEY}"}).status_code == 200
            if select.select([sock], [], [], 0.1)[0]:
                return _read_to_close(sock), time.monotonic() - start
            sock.sendall(b"x")
    except (BrokenPipeError, ConnectionResetError):
        return b"", time.monotonic() - start
    finally:
        sock.close()
        assert served, "a normal request was not served during the drip"
    raise AssertionError(f"a dripping client was still connected after {limit} s")


@pytest.mark.slow
def test_a_client_dripping_headers_is_cut_and_others_are_served(server):
    answer, seconds = _drip(server, b"PUT /api HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    assert answer == b"" and seconds < TIMEOUT + 1.5, (answer, seconds)


@pytest.mark.slow
def test_a_client_dripping_the_body_gets_408(server):
    head = (
        f"PUT /api HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    ).encode()
    answer, seconds = _drip(server, head)
    assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer, answer
    assert seconds < TIMEOUT + 1.5, seconds


@pytest.mark.slow
def test_connections_beyond_the_cap_are_refused_at_once(server):
    socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(CAP + 2)]
    try:
        time.sleep(0.3)  # the server has seen them all
        refused = [s for s in socks if select.select([s], [], [], 0)[0]]
        assert len(refused) >= 2, "no connection beyond the cap was refused"
        assert all(s.recv(4096).startswith(b"HTTP/1.1 503") for s in refused)
    finally:
        for s in socks:
            s.close()
    time.sleep(0.3)
    assert httpx.get(f"{server.url}/health").status_code == 200
