"""Prometheus metrics: each process exports its own registry over HTTP in Prometheus's text format,
on a loopback address unless its operator names another. Names follow Prometheus's conventions:
`planetserve_<role>_<what>`, counters ending in `_total`, durations in `_seconds`, sizes in `_bytes`;
label values come from small fixed sets only, never from what a peer sends."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, start_http_server


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
