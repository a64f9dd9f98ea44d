"""The server's limits, on loopback with raw sockets: connections that never send a request are closed after the
head timeout, connections past the cap are closed at once, and a body is refused from its Content-Length before it
is read, capped while streamed, and timed out when it does not arrive. Every loop is bounded."""

from __future__ import annotations

import socket
import time

import pytest

from dspo.agent.endpoint.scheduler import Scheduler
from dspo.agent.endpoint.server import MAX_BODY_BYTES, EndpointServer

PATH = "/r/round/e/episode/v1/chat/completions"


@pytest.fixture
def server():
    server = EndpointServer(Scheduler(), lambda round_id, key: 0, max_connections=16, header_timeout_s=0.5)
    server.body_timeout_s = 0.5
    yield server
    server.close()


def connect(server: EndpointServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.settimeout(5)
    return sock


def is_closed(sock: socket.socket) -> bool:
    sock.settimeout(0.05)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:  # reset by the server
        return True


def head(server: EndpointServer, extra: str) -> bytes:
    return (
        f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {server.api_key}\r\n"
        f"Content-Type: application/json\r\n{extra}\r\n"
    ).encode()


def response(sock: socket.socket) -> str:
    sock.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data and len(data) < 65536:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace")


def test_idle_connections_are_closed_and_the_cap_holds(server):
    socks = [connect(server) for _ in range(40)]
    try:
        time.sleep(0.2)
        assert server.refused_connections >= 40 - 16  # past the cap: closed as they came
        assert sum(not is_closed(s) for s in socks) <= 16
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(is_closed(s) for s in socks):
            time.sleep(0.1)
        assert all(is_closed(s) for s in socks)  # no request head within header_timeout_s=0.5
    finally:
        for sock in socks:
            sock.close()
    with connect(server) as sock:  # the server still answers
        sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.api_key}\r\n\r\n".encode())
        assert response(sock).startswith("HTTP/1.1 200")


def test_an_oversized_body_is_refused_before_it_is_read(server):
    with connect(server) as sock:
        sock.sendall(head(server, f"Content-Length: {MAX_BODY_BYTES + 1}\r\n"))  # and no body at all
        answer = response(sock)
    assert answer.startswith("HTTP/1.1 413")


def test_a_chunked_body_is_capped_while_it_streams(server):
    server.body_timeout_s = 30
    chunk = b"x" * (1024 * 1024)
    with connect(server) as sock:
        sock.sendall(head(server, "Transfer-Encoding: chunked\r\n"))
        try:
            for _ in range(MAX_BODY_BYTES // len(chunk) + 2):
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        except OSError:  # the server answered and closed while we were still sending
            pass
        answer = response(sock)
    assert answer.startswith("HTTP/1.1 413")


def test_a_body_that_does_not_arrive_times_out(server):
    with connect(server) as sock:
        sock.sendall(head(server, "Content-Length: 100\r\n") + b'{"messages": ')
        tic = time.monotonic()
        answer = response(sock)
    assert answer.startswith("HTTP/1.1 408") and time.monotonic() - tic < 3
