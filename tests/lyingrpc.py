"""A lying RPC endpoint: a real HTTP server on loopback that answers each JSON-RPC call as a test
scripts it, for tests of what clients do with answers no CometBFT sends."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Answer = Callable[[BaseHTTPRequestHandler], None]


def json_answer(result: object) -> Answer:
    """A JSON-RPC answer carrying `result`."""
    return _body({"jsonrpc": "2.0", "id": 1, "result": result})


def json_error(message: str) -> Answer:
    """A JSON-RPC error answer saying `message`."""
    return _body({"jsonrpc": "2.0", "id": 1, "error": {"code": -32603, "message": message, "data": ""}})


def _body(document: object) -> Answer:
    def write(handler: BaseHTTPRequestHandler) -> None:
        body = json.dumps(document).encode()
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    return write


@dataclass
class Script:
    """What the endpoint answers: `by_method[method]` for a method it names, `answers[0]` otherwise."""

    url: str = ""
    answers: list[Answer] = field(default_factory=list)
    by_method: dict[str, Answer] = field(default_factory=dict)

    def answer(self, method: str) -> Answer:
        return self.by_method.get(method) or self.answers[0]


@contextmanager
def lying_endpoint() -> Iterator[Script]:
    script = Script()

    class Lying(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                method = str(json.loads(body).get("method", ""))
            except (ValueError, AttributeError):
                method = ""
            script.answer(method)(self)

        def log_message(self, *args: object) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Lying)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    script.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield script
    finally:
        server.shutdown()
        server.server_close()
