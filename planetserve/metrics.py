"""Prometheus metrics: each process exports its own registry over HTTP in Prometheus's text format,
on a loopback address unless its operator names another. Names follow Prometheus's conventions:
`planetserve_<role>_<what>`, counters ending in `_total`, durations in `_seconds`, sizes in `_bytes`;
label values come from small fixed sets only, never from what a peer sends.

The counters tell when a role works (a relay's show when its user sends prompts), so the endpoint
answers only requests addressed to a name it answers to (`browserguard.py`'s Host check): a web page
that re-points its own DNS name at the endpoint cannot read them."""

from __future__ import annotations

import itertools
import socket
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from planetserve.browserguard import BrowserGuard

Wsgi = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def parse_listen(listen: str) -> tuple[str, int]:
    """`host:port` (`:port` means 127.0.0.1; an IPv6 host in brackets); ValueError for anything else."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"metrics address {listen!r} is not host:port")
    return host.removeprefix("[").removesuffix("]") or "127.0.0.1", int(port)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """A scrape every few seconds is no news."""


def host_guarded(app: Wsgi, guard: BrowserGuard) -> Wsgi:
    """`app`, answering 403 to a request addressed to a name `guard` does not answer to."""

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        refusal = guard.host_refusal(environ.get("HTTP_HOST"))
        if refusal is None:
            return app(environ, start_response)
        body = refusal.encode()
        start_response("403 Forbidden", [("Content-Type", "text/plain; charset=utf-8"),
                                         ("Content-Length", str(len(body)))])
        return [body]

    return guarded


def serve(listen: str, registry: CollectorRegistry) -> tuple[int, Callable[[], None]]:
    """Serve `registry` at http://`listen`/metrics on a thread, to requests addressed to a loopback name
    or the host it listens on (any IP address when that is every address); (the bound port, a function
    that stops serving). Port 0 picks a free one."""
    host, port = parse_listen(listen)
    guard = BrowserGuard()
    guard.bind(host)
    server_class = type("Server", (_Server,), {"address_family": _family(host, port)})
    server = make_server(host, port, host_guarded(make_wsgi_app(registry), guard), server_class,
                         _QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return server.server_address[1], stop


def _family(host: str, port: int) -> socket.AddressFamily:
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]


class StatusCollector(Collector):
    """A role's running counts, read when Prometheus scrapes: `counters()` and `gauges()` map a metric's
    name (after `prefix`) to its value and help, from the role's own fixed set of names."""

    def __init__(self, prefix: str, counters: Callable[[], Mapping[str, tuple[float, str]]],
                 gauges: Callable[[], Mapping[str, tuple[float, str]]],
                 more: Callable[[], Iterable[Metric]] = tuple) -> None:
        self._prefix = prefix
        self._counters = counters
        self._gauges = gauges
        self._more = more

    def collect(self) -> Iterator[Metric]:
        for name, (value, text) in sorted(self._counters().items()):
            yield CounterMetricFamily(f"{self._prefix}_{name}", text, value=value)
        for name, (value, text) in sorted(self._gauges().items()):
            yield GaugeMetricFamily(f"{self._prefix}_{name}", text, value=value)
        yield from self._more()


class Histogram:
    """A histogram a role fills as it works and a collector reads when scraped (no global registry)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value

    def family(self, name: str, text: str) -> HistogramMetricFamily:
        cumulative = list(itertools.accumulate(self.counts))
        bounds = [*(repr(float(b)) for b in self.buckets), "+Inf"]
        return HistogramMetricFamily(name, text, buckets=list(zip(bounds, cumulative, strict=True)),
                                     sum_value=self.sum)


def serve_role(listen: str, collector: Collector,
               registry: CollectorRegistry | None = None) -> Callable[[], None]:
    """Serve a role's collector (and `registry`'s other metrics) at `listen` when it is set; the function
    that stops it (a no-op when not serving)."""
    if not listen:
        return lambda: None
    registry = registry or CollectorRegistry()
    registry.register(collector)
    return serve(listen, registry)[1]
