"""A web page that re-points its own DNS name at a role's Prometheus endpoint (DNS rebinding) is
same-origin with it and reads every counter: a user relay's `requests` counter tells the page when its
user sends a prompt, a model node's when it serves. Before, the endpoints answered any Host. Now each
answers only a loopback name, the host it listens on, or (listening on every address) an IP literal;
another site's page that does not rebind is left to the browser, which lets it read nothing (the
endpoint grants no CORS)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest
from crosssite import EVIL, attacks
from prometheus_client import CollectorRegistry, Counter

from planetserve.metrics import serve

SECRET = "planetserve_relay_requests"


@pytest.fixture
def endpoint(request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    """A metrics endpoint listening at `request.param` (host:0), with a relay-like counter; (host, port)."""
    registry = CollectorRegistry()
    Counter(SECRET, "Requests from the local endpoint sent into the overlay", registry=registry).inc(3)
    port, stop = serve(request.param, registry)
    try:
        yield request.param.rpartition(":")[0], port
    finally:
        stop()


def get(port: int, host_header: str | None, **headers: str) -> httpx.Response:
    """GET /metrics from 127.0.0.1:`port` addressed as `host_header` (None: no Host at all)."""
    if host_header is None:
        return _without_host(port)
    return httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Host": host_header, **headers}, timeout=5)


def _without_host(port: int) -> httpx.Response:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        raw = b"".join(iter(lambda: sock.recv(65536), b""))
    head, _, body = raw.partition(b"\r\n\r\n")
    return httpx.Response(int(head.split()[1]), content=body)


@pytest.mark.parametrize("endpoint", ["127.0.0.1:0"], indirect=True)
def test_a_rebinding_page_reads_no_counter(endpoint):
    _, port = endpoint
    for attack in (a for a in attacks(f"http://127.0.0.1:{port}") if a.code == "host_not_allowed"):
        answer = get(port, attack.headers["Host"], **{k: v for k, v in attack.headers.items() if k != "Host"})
        assert answer.status_code == 403, attack.name
        assert SECRET not in answer.text and "not a name this server answers to" in answer.text, attack.name
    assert get(port, None).status_code == 403
    assert SECRET.encode() not in get(port, None).content


@pytest.mark.parametrize("endpoint", ["127.0.0.1:0"], indirect=True)
def test_prometheus_and_people_on_the_machine_still_read_it(endpoint):
    _, port = endpoint
    for name in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
        answer = get(port, name)
        assert answer.status_code == 200 and f"{SECRET}_total 3.0" in answer.text, name


@pytest.mark.parametrize("endpoint", ["127.0.0.1:0"], indirect=True)
def test_another_sites_page_is_granted_no_cors(endpoint):
    """Without rebinding, a page's fetch goes out under the endpoint's own name and passes: what keeps
    the answer from the page is that it carries no Access-Control-Allow-Origin."""
    _, port = endpoint
    answer = get(port, f"127.0.0.1:{port}", Origin=f"http://{EVIL}", **{"Sec-Fetch-Site": "cross-site"})
    assert "access-control-allow-origin" not in answer.headers


@pytest.mark.parametrize("endpoint", ["0.0.0.0:0"], indirect=True)
def test_listening_on_every_address_it_answers_any_ip_but_no_other_name(endpoint):
    _, port = endpoint
    assert get(port, f"192.0.2.7:{port}").status_code == 200  # a scrape by one of the machine's addresses
    assert get(port, f"{EVIL}:{port}").status_code == 403
    assert get(port, f"localhost:{port}").status_code == 200
