"""A minimal HTTP/1.0 server on the event loop for GET endpoints (metrics, health probes).

One request per connection; a route is an async function of the request's Accept header that
answers (status, content type, body). Anything but GET is 405, an unknown path 404 (a query
string is not part of the path: Prometheus sends a scrape config's `params` as one), a request
line or header line longer than the stream's 64 KiB limit 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping

log = logging.getLogger(__name__)

Answer = tuple[str, str, bytes]  # "200 OK", content type, body
Route = Callable[[str], Awaitable[Answer]]
TEXT = "text/plain; charset=utf-8"
_MAX_HEADERS = 100


class ListenError(Exception):
    """A listener could not start: "<port> on <host>: <why>", for a one-line error."""


def _listen_error(host: str, port: int, exc: OSError) -> ListenError:
    if isinstance(exc, socket.gaierror):
        # A resolver error's errno is an EAI_* code, negative: os.strerror() has no text for
        # it ("Unknown error -2"), the exception's own is the resolver's.
        why = exc.strerror or str(exc)
    else:
        # asyncio words its own strerror; the errno's text is the short one.
        why = os.strerror(exc.errno) if exc.errno else str(exc)
    return ListenError(f"{port} on {host}: {why}")


def try_listen(host: str, port: int) -> None:
    """Bind `host`:`port` as `HttpServer.start` will (every address the name resolves to,
    SO_REUSEADDR), and let go at once: a command checks its listener so, before it makes any
    folder, so that a refused run leaves none behind. Raises ListenError. Port 0 (any free
    one) is not tried."""
    if port == 0:
        return
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in found:
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:
                continue  # a family this host lacks (IPv6 off): asyncio skips it too
            with sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
    except OSError as exc:
        raise _listen_error(host, port, exc) from None


class HttpServer:
    def __init__(self, host: str, port: int, routes: Mapping[str, Route]) -> None:
        self.host = host
        self.port = port
        self._routes = dict(routes)
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        """Listen; the actual port (for port 0). Raises ListenError when the address is
        unusable (in use, not an address of this host, a name that does not resolve)."""
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port)
        except OSError as exc:
            raise _listen_error(self.host, self.port, exc) from None
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _request(self, reader: asyncio.StreamReader) -> tuple[str, str, str]:
        """(method, path, Accept header) of one request. Raises ValueError for a line longer
        than the reader's limit (asyncio's readline does)."""
        parts = (await reader.readline()).decode("latin-1").split()
        accept = ""
        for _ in range(_MAX_HEADERS):
            line = (await reader.readline()).decode("latin-1")
            if line in ("\r\n", "\n", ""):
                break
            name, _, value = line.partition(":")
            if name.strip().lower() == "accept":
                accept = value.strip()
        target = parts[1] if len(parts) >= 2 else ""
        return (parts[0] if parts else ""), urllib.parse.urlsplit(target).path, accept

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                method, path, accept = await asyncio.wait_for(self._request(reader), timeout=5)
            except ValueError as exc:
                # Anyone who reaches the port can send one: the client's fault, not a failure
                # of ours worth a traceback in the log.
                log.debug("HTTP request refused: %s", exc)
                writer.write(b"HTTP/1.0 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
                return
            route = self._routes.get(path)
            if method != "GET":
                status, content_type, body = "405 Method Not Allowed", TEXT, b"GET only\n"
            elif route is None:
                known = " or ".join(sorted(self._routes))
                status, content_type, body = "404 Not Found", TEXT, f"try {known}\n".encode()
            else:
                status, content_type, body = await route(accept)
            writer.write(
                f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError) as exc:
            log.debug("HTTP request dropped: %s", exc)
        except Exception:  # a route's failure is that request's, never the server's
            log.exception("HTTP request failed")
            with contextlib.suppress(ConnectionError):
                writer.write(b"HTTP/1.0 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
        finally:
            writer.close()
