"""What a web browser may ask of planetserve's HTTP services: the one aiohttp middleware that a user
relay's OpenAI endpoint, a model node's API and the dashboard put in front of every route, and the Host
check alone, which every role's Prometheus endpoint makes (`metrics.py`: it serves GETs only, whose
answers a cross-site page cannot read unless it rebinds a name).

A page the user opens can make the browser send requests to a service on the user's machine. A
cross-site POST (a form, or `fetch` in no-cors mode) reaches the handler even though the page cannot
read the answer (CSRF); a page whose DNS name the attacker re-points at 127.0.0.1 (DNS rebinding) is
same-origin with the service and reads every answer. Three checks refuse both before any handler runs:

- **Host**: the name the request is addressed to must be one the service answers to: a loopback name
  (localhost, 127.0.0.1, [::1]), the host it is bound to, or a name its owner configured (a model
  node's and a relay's peer and advertised hosts); a service bound to every address (0.0.0.0, ::)
  also takes any IP literal, since it listens on each. A rebinding page's requests carry the
  attacker's name. Refused with 403.
- **Origin** and **Fetch Metadata**: a request that carries Origin must come from the origin it is
  addressed to (scheme, Host name and port), and `Sec-Fetch-Site: cross-site` is refused, except a
  top-level GET navigation (a link the user follows, which lets the page read nothing). Refused
  with 403.
- **Content type**: a POST, PUT or PATCH body must be `application/json`. A page can send that type
  across sites only after a CORS preflight, which these services never grant, so a form or text/plain
  POST cannot reach a handler even from a browser that sends no Origin. Refused with 415.

Programs that are not browsers (the openai SDK, httpx, the verifier daemon, the dashboard's calls to
its relay, curl with `-H 'Content-Type: application/json'`) send no Origin and address a service by the
name they were given, so they pass.

The port of Host is not compared with the listening port: a rebinding page is told apart by its name,
and a browser's Origin is compared with Host port included. A service reached through a forwarded port
(`ssh -L 18080:127.0.0.1:8080`) keeps working that way.

The guard sits beside `metrics.py`, below every role, because the node roles, the dashboard and every
role's metrics endpoint put it in front of what they serve.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ANY_ADDRESS = frozenset({"", "0.0.0.0", "::"})  # noqa: S104 - names to recognise, not to bind
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
JSON_TYPE = "application/json"
DEFAULT_PORTS = {"http": 80, "https": 443}

HOST_NOT_ALLOWED = "host_not_allowed"
CROSS_ORIGIN = "cross_origin"
UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"

_AUTHORITY = re.compile(r"(?P<name>\[[0-9a-f:.]+\]|[a-z0-9_.\-]+)(?::(?P<port>[0-9]{1,5}))?")
_ORIGIN = re.compile(r"(?P<scheme>[a-z][a-z0-9+.\-]*)://(?P<authority>[^/?#@\s]+)")

Refuse = Callable[[int, str, str], web.StreamResponse]
"""(status, code, message) -> the service's error answer."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def refuse_json(status: int, code: str, message: str) -> web.Response:
    """The default error answer: {"error": {"message", "code"}}."""
    body = {"error": {"message": message, "code": code}}
    return web.Response(text=json.dumps(body), status=status, content_type=JSON_TYPE)


def host_name(text: str) -> str:
    """The host of a host:port address or of a bare host, lower-case and without IPv6 brackets."""
    text = text.strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    if text.count(":") > 1:  # a bare IPv6 address
        return text
    return text.rpartition(":")[0] if ":" in text else text


def _authority(text: str) -> tuple[str, int | None] | None:
    """(name, port or None) of a Host header or an Origin's authority; None: not one."""
    match = _AUTHORITY.fullmatch(text.strip().lower())
    if match is None:
        return None
    port = int(match["port"]) if match["port"] is not None else None
    if port is not None and port > 65535:
        return None
    return match["name"].strip("[]"), port


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _shown(value: str) -> str:
    return repr(value[:100])


class BrowserGuard:
    """The checks above, for one service: `names` are the configured host names it answers to besides
    the loopback names; `bind(host)` adds the host it listens on (call it before it serves);
    `middleware` goes first in the aiohttp app's list; `refuse` shapes the error answers."""

    def __init__(self, names: Iterable[str] = (), refuse: Refuse = refuse_json) -> None:
        self.names = set(LOOPBACK_NAMES) | {name for name in map(host_name, names) if name not in ANY_ADDRESS}
        self.any_address = False
        """Bound to every address: any IP literal is a name of this service."""
        self.refuse = refuse

        @web.middleware
        async def browser_guard(request: web.Request, handler: Handler) -> web.StreamResponse:
            refusal = self.check(request)
            return refusal if refusal is not None else await handler(request)

        self.middleware = browser_guard

    def bind(self, host: str) -> None:
        name = host_name(host)
        if name in ANY_ADDRESS:
            self.any_address = True
        else:
            self.names.add(name)

    def answers_to(self, name: str) -> bool:
        return name in self.names or (self.any_address and _is_ip(name))

    def check(self, request: web.Request) -> web.StreamResponse | None:
        """The refusal of `request`, or None when it may reach its handler."""
        return self._host(request) or self._origin(request) or self._content_type(request)

    def host_refusal(self, host: str | None) -> str | None:
        """Why a request addressed to Host `host` (None: it sent none) is refused, or None."""
        if host is None:
            return "The request has no Host header."
        authority = _authority(host)
        if authority is None or not self.answers_to(authority[0]):
            return (f"Host {_shown(host)} is not a name this server answers to; address it as "
                    f"{', '.join(sorted(self._shown_names()))}. Requests under other names are refused (a "
                    "web page re-pointing its own name here, DNS rebinding).")
        return None

    def _host(self, request: web.Request) -> web.StreamResponse | None:
        refusal = self.host_refusal(request.headers.get("Host"))
        return None if refusal is None else self.refuse(403, HOST_NOT_ALLOWED, refusal)

    def _shown_names(self) -> set[str]:
        shown = {f"[{n}]" if ":" in n else n for n in self.names}
        return shown | ({"any IP address"} if self.any_address else set())

    def _origin(self, request: web.Request) -> web.StreamResponse | None:
        origin = request.headers.get("Origin")
        if origin is not None and not self._own_origin(request, origin):
            return self.refuse(403, CROSS_ORIGIN,
                               f"Cross-origin request from Origin {_shown(origin)} refused: this server "
                               "answers its own pages and programs that send no Origin, never another "
                               "site's page.")
        site = request.headers.get("Sec-Fetch-Site", "").strip().lower()
        if site == "cross-site" and not _navigation(request):
            return self.refuse(403, CROSS_ORIGIN,
                               "Cross-site request refused (Sec-Fetch-Site: cross-site): another site's page "
                               "may link here but not send requests.")
        return None

    @staticmethod
    def _own_origin(request: web.Request, origin: str) -> bool:
        """Whether Origin is the origin the request is addressed to: its scheme, Host name and port."""
        match = _ORIGIN.fullmatch(origin.strip().lower())
        host = _authority(request.headers.get("Host", ""))
        if match is None or host is None or match["scheme"] != request.scheme:
            return False
        theirs = _authority(match["authority"])
        default = DEFAULT_PORTS.get(request.scheme)
        return theirs is not None and (theirs[0], theirs[1] or default) == (host[0], host[1] or default)

    def _content_type(self, request: web.Request) -> web.StreamResponse | None:
        if request.method not in BODY_METHODS:
            return None
        given = request.headers.get("Content-Type", "")
        if given.partition(";")[0].strip().lower() != JSON_TYPE:
            return self.refuse(415, UNSUPPORTED_MEDIA_TYPE,
                               f"A {request.method} body must be JSON sent as Content-Type: {JSON_TYPE} (got "
                               f"{_shown(given) if given else 'no Content-Type'}); with curl, add "
                               f"-H 'Content-Type: {JSON_TYPE}'.")
        return None


def _navigation(request: web.Request) -> bool:
    """A top-level GET navigation: following a link to a page (the linking page reads nothing)."""
    return (request.method in ("GET", "HEAD") and request.headers.get("Sec-Fetch-Mode") == "navigate"
            and request.headers.get("Sec-Fetch-Dest", "document") == "document")
