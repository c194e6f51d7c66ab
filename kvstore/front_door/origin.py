"""Cross-origin protection: what keeps a web page in a browser on the same host from using the store.

- Data routes take a body only in their own content type (or with the X-KVStore-Wire header), which a
  browser cannot send cross-origin without a CORS preflight; the server grants no CORS (it never sends
  Access-Control-Allow-*), so the preflight fails and the request is never sent (`kvstore.server.body`).
- Without a token, a page could still point a DNS name of its own at 127.0.0.1 (DNS rebinding) and be
  "same-origin" with the server. So without a token every request must name in `Host` an IP address,
  `localhost`, or a name listed in `allowed_hosts` (`*` turns the check off); and an `Origin`, which
  only browsers send, must be the server itself, a loopback address, `localhost` or an allowed name.
  With a token the browser has nothing to send: no check is needed.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from aiohttp import web

from kvstore.errors import Forbidden


def _hostname(authority: str) -> str:
    """The host of `host[:port]` / `[v6]:port`, lowercased, without a trailing dot."""
    if authority.startswith("["):
        host = authority[1 : authority.find("]")] if "]" in authority else authority
    else:
        host = authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority
    return host.rstrip(".").lower()


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HostCheck:
    """Refuses (403) a request whose Host or Origin names a host that is not allowed."""

    SERVER_HINT = "connect by IP address or localhost, list the name in allowed_hosts, or set a token"

    def __init__(self, allowed_hosts: Iterable[str], bind_host: str = "", hint: str = SERVER_HINT) -> None:
        self.hint = hint  # what the refused client may do instead
        names = {_hostname(h) for h in allowed_hosts if h}
        if bind_host and not _is_ip(bind_host):
            names.add(_hostname(bind_host))
        self.any = "*" in names
        self.names = frozenset(names - {"*"})

    def allowed(self, host: str) -> bool:
        return (
            self.any
            or host in self.names
            or host == "localhost"
            or host.endswith(".localhost")
            or _is_ip(host)
        )

    def check(self, request: web.BaseRequest) -> None:
        problem = self.problem(request)
        if problem is not None:
            raise Forbidden(problem)

    def problem(self, request: web.BaseRequest) -> str | None:
        """Why `request` is refused (its Host or Origin), None when it is not. kvstore-server and
        kvstore-engine's servers (serve, router, proxy: kvstore.engine.server_middleware) share it."""
        if self.any:
            return None
        host = request.headers.get("Host")
        if host is not None and not self.allowed(_hostname(host)):
            return f"Host {host!r:.80} is not allowed (DNS rebinding protection); {self.hint}"
        origin = request.headers.get("Origin")  # only browsers send it ("null" from sandboxes, files)
        if origin is not None:
            name = _hostname(urlsplit(origin).netloc)
            same_site = host is not None and name == _hostname(host)  # the dashboard's own requests
            if not (same_site or self.any or name in self.names or name == "localhost" or _is_loopback(name)):
                return f"cross-origin request from {origin!r:.80} refused"
        return None
