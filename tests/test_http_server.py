"""The small HTTP server of /metrics and /healthz (collector/transport/http.py) over a real
socket: a route that fails answers that request 500 and the server goes on serving."""

from __future__ import annotations

import asyncio
import socket
import urllib.error
import urllib.request
from typing import Any

import pytest

from collector.transport.http import TEXT, HttpServer, ListenError


def test_a_failing_route_is_a_500_and_the_server_goes_on() -> None:
    async def broken(accept: str) -> tuple[str, str, bytes]:
        raise UnicodeEncodeError("utf-8", "\udcff", 0, 1, "surrogates not allowed")

    async def fine(accept: str) -> tuple[str, str, bytes]:
        return "200 OK", TEXT, b"ok\n"

    def get(port: int, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    async def run() -> list[tuple[int, bytes]]:
        server = HttpServer("127.0.0.1", 0, {"/metrics": broken, "/healthz": fine})
        port = await server.start()
        try:
            return [
                await asyncio.to_thread(get, port, "/metrics"),
                await asyncio.to_thread(get, port, "/healthz"),
            ]
        finally:
            await server.stop()

    assert asyncio.run(run()) == [(500, b""), (200, b"ok\n")]


def test_a_name_that_does_not_resolve_is_said_in_the_resolvers_words() -> None:
    """A resolver error's errno is a negative EAI_* code: os.strerror() made it "Unknown error
    -2" (`collect --metrics-bind-address`, `aggregate --health-bind-address`)."""
    host = "nosuchhost.invalid"
    try:
        socket.getaddrinfo(host, 0)
    except socket.gaierror as exc:
        why = exc.strerror
    else:
        pytest.skip(f"{host} resolves here")

    async def start() -> None:
        await HttpServer(host, 0, {}).start()

    with pytest.raises(ListenError) as raised:
        asyncio.run(start())
    assert str(raised.value) == f"0 on {host}: {why}"
    assert "Unknown error" not in why


def _exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_a_query_string_is_not_part_of_the_path() -> None:
    """Prometheus sends a scrape config's `params` as a query string: it was a 404."""

    async def fine(accept: str) -> tuple[str, str, bytes]:
        return "200 OK", TEXT, b"ok\n"

    async def run() -> list[bytes]:
        server = HttpServer("127.0.0.1", 0, {"/metrics": fine})
        port = await server.start()
        try:
            return [
                await asyncio.to_thread(_exchange, port, f"GET {target} HTTP/1.1\r\n\r\n".encode())
                for target in ("/metrics?format=prometheus", "http://x/metrics?a=1", "/nope?x")
            ]
        finally:
            await server.stop()

    answers = [a.split(b"\r\n", 1)[0] for a in asyncio.run(run())]
    assert answers == [b"HTTP/1.0 200 OK", b"HTTP/1.0 200 OK", b"HTTP/1.0 404 Not Found"]


def test_a_line_over_the_limit_is_a_400_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A request or header line over asyncio's 64 KiB was a 500 and an ERROR with a
    traceback in the log, for anyone who can reach the port to repeat."""

    async def fine(accept: str) -> tuple[str, str, bytes]:
        return "200 OK", TEXT, b"ok\n"

    long_header = b"GET /metrics HTTP/1.1\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n"
    long_target = b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n"

    async def run() -> list[bytes]:
        server = HttpServer("127.0.0.1", 0, {"/metrics": fine})
        port = await server.start()
        try:
            out = [await asyncio.to_thread(_exchange, port, r) for r in (long_header, long_target)]
            out.append(await asyncio.to_thread(_exchange, port, b"GET /metrics HTTP/1.1\r\n\r\n"))
            return out
        finally:
            await server.stop()

    with caplog.at_level("DEBUG", logger="collector.transport.http"):
        answers = asyncio.run(run())
    assert [a.split(b"\r\n", 1)[0] for a in answers] == [
        b"HTTP/1.0 400 Bad Request",
        b"HTTP/1.0 400 Bad Request",
        b"HTTP/1.0 200 OK",
    ]
    assert [r.levelname for r in caplog.records if r.levelname != "DEBUG"] == []


def test_the_listener_check_skips_an_address_family_the_host_lacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node booted with IPv6 off: `localhost` resolves to 127.0.0.1 and ::1, and a socket of
    AF_INET6 cannot be made. The server (asyncio) skips that family and listens; the check
    refused the address, so `--metrics-bind-address localhost` exited 2 on such nodes."""
    import errno

    from collector.transport import http

    real = socket.socket

    def no_ipv6(family: int = socket.AF_INET, *args: Any, **kwargs: Any) -> socket.socket:
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real(family, *args, **kwargs)

    both = [
        (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0)),
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0)),
    ]
    with real() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(http.socket, "socket", no_ipv6)
    monkeypatch.setattr(
        http.socket,
        "getaddrinfo",
        lambda *a, **k: [(*x[:4], (x[4][0], port, *x[4][2:])) for x in both],
    )
    http.try_listen("localhost", port)  # no ListenError
    with real() as taken:  # and the family it has is still tried
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(http.ListenError, match="Address already in use"):
            http.try_listen("localhost", port)
