"""A lying RPC endpoint: a real HTTP forwarder that rewrites CometBFT's JSON-RPC answers."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

Rewrite = Callable[[str, dict[str, Any], dict[str, Any]], "dict[str, Any] | bytes | None"]
Intercept = Callable[[str, dict[str, Any]], "dict[str, Any] | None"]


class TamperProxy:
    """Forwards JSON-RPC POSTs to `upstream`, passing each answer through `rewrite`; a request that
    `intercept` answers (its JSON-RPC `result`) is not forwarded at all."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.rewrite: Rewrite | None = None
        self.intercept: Intercept | None = None
        self.http = httpx.Client(timeout=5.0)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = json.loads(body)
                params = req.get("params") or {}
                made = None if proxy.intercept is None else proxy.intercept(req["method"], params)
                if made is not None:
                    answer = {"jsonrpc": "2.0", "id": req.get("id"), "result": made}
                else:
                    answer = proxy.http.post(
                        proxy.upstream, content=body, headers={"Content-Type": "application/json"}
                    ).json()
                out: Any = answer
                if proxy.rewrite is not None:
                    out = proxy.rewrite(req["method"], params, answer)
                    out = answer if out is None else out
                data = out if isinstance(out, bytes) else json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.http.close()
