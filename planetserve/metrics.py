"""Prometheus metrics: each process exports its own registry over HTTP in Prometheus's text format,
on a loopback address unless its operator names another. Names follow Prometheus's conventions:
`planetserve_<role>_<what>`, counters ending in `_total`, durations in `_seconds`, sizes in `_bytes`;
label values come from small fixed sets only, never from what a peer sends."""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector


def parse_listen(listen: str) -> tuple[str, int]:
    """`host:port` (`:port` means 127.0.0.1); ValueError for anything else."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"metrics address {listen!r} is not host:port")
    return host or "127.0.0.1", int(port)


def serve(listen: str, registry: CollectorRegistry) -> tuple[int, Callable[[], None]]:
    """Serve `registry` at http://`listen`/metrics on a thread; (the bound port, a function that stops
    serving). Port 0 picks a free one."""
    host, port = parse_listen(listen)
    server, thread = start_http_server(port, addr=host, registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return server.server_address[1], stop


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
