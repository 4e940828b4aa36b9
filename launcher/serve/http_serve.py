"""The CLI's long-running loopback servers (`metrics serve`, `dashboard`): the --listen address and
--refresh checked, the socket bound with a clear error, served from a thread until Ctrl-C."""

from __future__ import annotations

import contextvars
import errno
import threading
import time
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from lmcore.errors import UserError


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``PORT`` -> (host, port); a clear error otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--listen {text!r}: expected HOST:PORT or PORT, the port 1..65535")
    return host, int(port)


def exposure(host: str, what: str) -> str | None:
    """A warning when ``host`` is not a loopback address: a login node is shared, and beyond it the
    page or the metrics reach whoever reaches the host."""
    import ipaddress
    import socket

    try:
        loopback = all(ipaddress.ip_address(info[4][0]).is_loopback
                       for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
    except (OSError, ValueError):
        loopback = False
    if loopback:
        return None
    return (f"warning: --listen {host}: the {what} is reachable beyond this machine (everything of every run it "
            f"shows); 127.0.0.1 and `ssh -L` keep it to you")


def check_refresh(seconds: float) -> float:
    if not seconds >= 0:
        raise UserError(f"--refresh {seconds}: give the seconds between two readings, 0 or more")
    return seconds


def bind(host: str, port: int, handler: Any, *, what: str) -> ThreadingHTTPServer:
    """The server on ``host:port``, serving from a thread; a port in use or a bad address said."""
    try:
        server = ThreadingHTTPServer((host, port), handler)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise UserError(f"--listen {host}:{port}: the port is in use (another {what}?); choose another "
                            f"with --listen HOST:PORT") from None
        raise UserError(f"--listen {host}:{port}: cannot listen there: {exc.strerror or exc}") from None
    server.daemon_threads = True
    # each request's thread asks the cluster this command asks (`--rest PROFILE`): the caller's
    # context, a copy per request (contextvars: threads start without one)
    asked = contextvars.copy_context()
    serve_one = server.process_request_thread
    server.process_request_thread = (  # type: ignore[method-assign, assignment]
        lambda request, client_address: asked.copy().run(serve_one, request, client_address))
    threading.Thread(target=server.serve_forever, name=f"lmlaunch-{what}", daemon=True).start()
    return server


def serve_until(server: ThreadingHTTPServer, seconds: float | None, *, then: Callable[[], None] = lambda: None) -> None:
    """Until Ctrl-C (or ``seconds``, for tests); then the server stops and ``then`` runs."""
    try:
        deadline = None if seconds is None else time.monotonic() + seconds
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        then()


def bearer_token(path: Path) -> tuple[str, bool]:
    """The exporter's scrape token, kept in ``path`` (Prometheus reads the same file:
    ``authorization: {credentials_file: PATH}``): made (random, mode 0600) when the file does not
    exist; (token, made now). A file others can read, or an empty one, is refused."""
    import secrets
    import stat

    from lmcore.atomic import write_private

    if not path.exists():
        if not path.parent.is_dir():
            raise UserError(f"--token-file {path}: the directory {path.parent} does not exist")
        write_private(path, secrets.token_urlsafe(32) + "\n")
        return path.read_text().strip(), True
    try:
        mode, token = path.stat().st_mode, path.read_text().strip()
    except OSError as exc:
        raise UserError(f"--token-file {path}: cannot read it: {exc.strerror or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UserError(f"--token-file {path}: others on this machine can read it (mode {stat.S_IMODE(mode):o}); "
                        f"`chmod 600 {path}`")
    if not token:
        raise UserError(f"--token-file {path}: empty; delete it and a new token is made at the next start")
    return token, False


def authorized(header: str | None, token: str | None) -> bool:
    """Whether an ``Authorization`` header carries the bearer token (any, when ``token`` is None)."""
    import hmac

    if token is None:
        return True
    given = (header or "").removeprefix("Bearer ").strip() if (header or "").startswith("Bearer ") else ""
    return hmac.compare_digest(given.encode(), token.encode())
