"""What a web page can make the user's browser send to an HTTP service on the user's machine, as
headers on real requests, for the tests of each service's browser guard (`browserguard.py`):
another site's fetch and form posts (CSRF), a page whose DNS name was re-pointed at 127.0.0.1 (DNS
rebinding), and the simple-request bodies a browser sends across sites without asking first; and the
requests that must still pass (programs that send no Origin, the service's own pages)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

EVIL = "evil.example"
JSON_TYPE = "application/json"


@dataclass(frozen=True)
class Attack:
    name: str
    headers: dict[str, str]
    status: int
    code: str
    content_type: str = JSON_TYPE
    reads: bool = field(default=False)
    """Also tried as a GET: an attack that reads answers (rebinding) rather than only sending."""


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None, url
    return port


def attacks(url: str) -> list[Attack]:
    """Requests of other sites' pages to the service at `url` (its base, http://127.0.0.1:PORT...)."""
    port = port_of(url)
    return [
        Attack("another site's fetch", {"Origin": f"http://{EVIL}", "Sec-Fetch-Site": "cross-site",
                                        "Sec-Fetch-Mode": "cors"}, 403, "cross_origin", reads=True),
        Attack("another site's form, Origin only", {"Origin": f"http://{EVIL}"}, 403, "cross_origin",
               content_type="application/x-www-form-urlencoded"),
        Attack("another site's request, Fetch Metadata only", {"Sec-Fetch-Site": "cross-site",
                                                               "Sec-Fetch-Mode": "no-cors"}, 403, "cross_origin"),
        Attack("a page of another local port", {"Origin": f"http://127.0.0.1:{port + 1}",
                                                "Sec-Fetch-Site": "same-site"}, 403, "cross_origin"),
        Attack("a sandboxed page (opaque origin)", {"Origin": "null"}, 403, "cross_origin"),
        Attack("an https page of the same host", {"Origin": f"https://127.0.0.1:{port}"}, 403, "cross_origin"),
        Attack("a rebinding page, same-origin to itself", {
            "Host": f"{EVIL}:{port}", "Origin": f"http://{EVIL}:{port}", "Sec-Fetch-Site": "same-origin"},
            403, "host_not_allowed", reads=True),
        Attack("a rebinding page's plain request", {"Host": f"{EVIL}:{port}"}, 403, "host_not_allowed", reads=True),
        Attack("a rebinding name ending in a loopback one", {"Host": f"localhost.{EVIL}:{port}"}, 403,
               "host_not_allowed", reads=True),
        Attack("a text/plain form from a browser that sends no Origin", {}, 415, "unsupported_media_type",
               content_type="text/plain"),
        Attack("a url-encoded form", {}, 415, "unsupported_media_type",
               content_type="application/x-www-form-urlencoded"),
        Attack("a multipart form", {}, 415, "unsupported_media_type", content_type="multipart/form-data; boundary=x"),
        Attack("a body without a type", {}, 415, "unsupported_media_type", content_type=""),
    ]


def allowed(url: str) -> list[tuple[str, dict[str, str]]]:
    """Requests the service at `url` must still take: a program's (no Origin), its own page's, under
    each loopback name, and JSON with a charset."""
    port = port_of(url)
    own = f"http://127.0.0.1:{port}"
    return [
        ("a program (no Origin)", {}),
        ("its own page", {"Origin": own, "Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors"}),
        ("its own page under localhost", {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"}),
        ("a program naming [::1]", {"Host": f"[::1]:{port}"}),
        ("a program behind a forwarded port", {"Host": f"localhost:{port + 1}"}),
        ("JSON with a charset", {"Content-Type": "application/json; charset=utf-8"}),
    ]


def post(client: httpx.Client, url: str, body: object, attack: Attack) -> httpx.Response:
    headers = dict(attack.headers)
    if attack.content_type:
        headers["Content-Type"] = attack.content_type
    return client.post(url, content=json.dumps(body).encode(), headers=headers)


async def apost(client: httpx.AsyncClient, url: str, body: object, attack: Attack) -> httpx.Response:
    headers = dict(attack.headers)
    if attack.content_type:
        headers["Content-Type"] = attack.content_type
    return await client.post(url, content=json.dumps(body).encode(), headers=headers)


def allowed_post_headers(headers: dict[str, str]) -> dict[str, str]:
    return {"Content-Type": JSON_TYPE, **headers}


def check_refusal(response: httpx.Response, attack: Attack, keys: set[str]) -> dict:
    """The refusal `attack` must get: its status, its code, the service's error shape (`keys`), and a
    message saying what was refused."""
    assert response.status_code == attack.status, (attack.name, response.status_code, response.text)
    assert response.headers["content-type"].startswith(JSON_TYPE), attack.name
    error = response.json()["error"]
    assert set(error) == keys and error["code"] == attack.code, (attack.name, error)
    words = {"host_not_allowed": "Host", "cross_origin": "ross-", "unsupported_media_type": JSON_TYPE}
    assert words[attack.code] in error["message"], (attack.name, error)
    return error
