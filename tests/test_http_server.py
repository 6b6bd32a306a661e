"""The small HTTP server of /metrics and /healthz (collector/transport/http.py) over a real
socket: a route that fails answers that request 500 and the server goes on serving."""

from __future__ import annotations

import asyncio
import socket
import urllib.error
import urllib.request

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
