"""Relay overhead per hop and session (path) establishment on loopback, with TLS and without, side by
side in one process; and what the client spends preparing one prompt.

- "TLS": user relays as they run (`UserRelay`, the real TLS 1.3 transport).
- "plain TCP": the same relay and path code (`Relay`, `PathManager`, onion setup, sealed payloads)
  over plain TCP with the same length-prefixed msgpack frames: the baseline that isolates TLS's share.
A stand-in model node echoes every clove back through the proxy it came from, so a round trip crosses
the path twice. Per-hop overhead = (RTT over 3 relays - RTT over 1 relay) / 4 (two extra relays each
way). Session establishment = building one path: onion packet, setup through every relay, the proxy's
sealed acknowledgement back.

The paper's appendix A10 measured 168.9 ms session establishment and 92.9 ms in-session latency across
four US regions: wide-area latency dominates those; on loopback only the software's share remains, so
the comparison is with and without TLS, not with the paper.

Prompt preparation: S-IDA alone (the paper's 0.273 ms, section 5.2) against everything the client does
for one prompt: S-IDA, each clove sealed to the model node's key (one X25519 each) and under its path
key.

    .venv/bin/python bench/relay_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from planetserve.chain.keys import KeySet
from planetserve.node.home import UserConfig
from planetserve.node.overlay import onion, sida
from planetserve.node.overlay.directory import DirectoryView
from planetserve.node.overlay.paths import Path, PathManager, PathSettings
from planetserve.node.overlay.relay import Relay
from planetserve.node.overlay.transport import Peering, TransportError, read_frame, write_frame
from planetserve.node.user import UserRelay
from planetserve.registry.entities import ModelNode, User

TOOLUSE_BYTES = 7206 * 4
SIZES = {"64 B": 64, "ToolUse clove 9,716 B": 9716, "256 KiB clove 87,489 B": 87489}
PAPER_PREPARE_MS = 0.273
ROW = "{:<10} {:<36} {:>4} {:>8} {:>8}"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class PlainNode:
    """One participant over plain TCP: frames are [sender key, type, body]."""

    def __init__(self, keys: KeySet, handler: Callable[[bytes, str, Any], Awaitable[None]]) -> None:
        self.keys = keys
        self.handler = handler
        self.port = 0
        self.book: dict[bytes, int] = {}
        self.links: dict[bytes, asyncio.StreamWriter] = {}
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                sender, msg_type, body = await read_frame(reader)
                asyncio.get_running_loop().create_task(self.handler(sender, msg_type, body))
        except (TransportError, ConnectionError, asyncio.CancelledError):
            writer.close()

    async def send(self, peer: bytes, msg_type: str, body: Any) -> None:
        writer = self.links.get(peer)
        if writer is None:
            _, writer = await asyncio.open_connection("127.0.0.1", self.book[peer])
            self.links[peer] = writer
        await write_frame(writer, [self.keys.public, msg_type, body])

    async def close(self) -> None:
        for writer in self.links.values():
            writer.close()
        if self.server is not None:
            self.server.close()


def echo_reply(data: bytes) -> tuple[bytes, bytes]:
    """The stand-in model node's answer: the payload back, sealed under the reply key it names."""
    reply_id, reply_key, payload = data[:16], data[16:48], data[48:]
    return reply_id, onion.seal_payload(reply_key, onion.REPLY, onion.Payload("clove", payload))


class Harness:
    """A client, relays and an echoing node; `rtt` and `setup` measure through the client's paths."""

    def __init__(self, relays: int) -> None:
        self.relay_count = relays
        self.echo_keys = KeySet.generate()
        self.replies: dict[bytes, asyncio.Future] = {}
        self.reply_keys: dict[bytes, bytes] = {}
        """Each round trip's own reply id and key, as a user's request has."""
        self.paths: PathManager

    def arrived(self, path: Path, clove: bytes) -> None:
        waiter = self.replies.pop(clove[:16], None)
        if waiter is not None and not waiter.done():
            waiter.set_result(time.perf_counter())

    async def rtt(self, path: Path, size: int) -> float:
        nonce = os.urandom(16)
        waiter = asyncio.get_running_loop().create_future()
        self.replies[nonce] = waiter
        reply_id, reply_key = os.urandom(16), os.urandom(32)
        self.reply_keys[reply_id] = reply_key
        data = reply_id + reply_key + nonce + os.urandom(max(0, size - 16))
        start = time.perf_counter()
        sealed = path.seal(self.echo_keys.public, data, reply_id)
        await self.paths.send(path.first, "fwd", [path.link, sealed])
        try:
            return (await asyncio.wait_for(waiter, 10) - start) * 1e3
        finally:
            del self.reply_keys[reply_id]


class TlsHarness(Harness):
    async def start(self) -> None:
        self.users = [
            UserRelay(UserConfig(peer="127.0.0.1:0", http="127.0.0.1:0"), KeySet.generate(), None)
            for _ in range(self.relay_count + 1)
        ]
        self.echo = Peering(self.echo_keys, self._echo, lambda _key: True)
        port = await self.echo.listen("127.0.0.1", 0)
        for user in self.users:
            await user.start(serve_http=False)
        view = DirectoryView.of(
            1,
            [User(u.keys.public, u.config.address, "bench", 0, 1 << 40) for u in self.users],
            [
                ModelNode(
                    self.echo_keys.public,
                    "bench",
                    "echo",
                    f"127.0.0.1:{port}",
                    "cpu",
                    1,
                    "bench",
                    "active",
                    0,
                )
            ],
        )
        for user in self.users:
            user.apply_view(view)
        self.paths = self.users[0].paths
        self.paths.on_clove = self.arrived
        self.paths.reply_key = self.reply_keys.get

    async def _echo(self, peer: bytes, msg_type: str, body: Any) -> None:
        await self.echo.connections[peer].notify("reply", list(echo_reply(body)))

    async def close(self) -> None:
        for user in self.users:
            await user.close()
        await self.echo.close()


class PlainHarness(Harness):
    async def start(self) -> None:
        keys = [KeySet.generate() for _ in range(self.relay_count + 1)]
        users = {k.public for k in keys}
        self.nodes: list[PlainNode] = []
        self.relays: list[Relay] = []
        for i, key in enumerate(keys):
            node = PlainNode(key, self._dispatch(i))
            self.nodes.append(node)
            owner = PathManager(key.public, node.send, lambda: sorted(users)) if i == 0 else None
            if owner is not None:
                self.paths = owner
                owner.on_clove = self.arrived
                owner.reply_key = self.reply_keys.get
            self.relays.append(
                Relay(
                    onion.exchange_secret(key.identity),
                    node.send,
                    is_user=users.__contains__,
                    is_node=lambda k: k == self.echo_keys.public,
                    owner=owner,
                )
            )
        self.echo = PlainNode(self.echo_keys, self._echo)
        for node in [*self.nodes, self.echo]:
            await node.start()
        book = {n.keys.public: n.port for n in [*self.nodes, self.echo]}
        for node in [*self.nodes, self.echo]:
            node.book = book

    def _dispatch(self, index: int) -> Callable[[bytes, str, Any], Awaitable[None]]:
        async def handle(sender: bytes, msg_type: str, body: Any) -> None:
            await self.relays[index].handle(sender, msg_type, body)

        return handle

    async def _echo(self, sender: bytes, msg_type: str, body: Any) -> None:
        await self.echo.send(sender, "reply", list(echo_reply(body)))

    async def close(self) -> None:
        for node in [*self.nodes, self.echo]:
            await node.close()


async def measure(kind: str, harness: Harness, setups: int, rounds: int) -> tuple[list[str], dict]:
    await harness.start()
    rows, medians = [], {}
    try:
        for length in (3, 1):  # the first path of length 3 also opens its TLS links (cold)
            harness.paths.settings = PathSettings(length=length, setup_timeout=10)
            times = []
            for _ in range(setups):
                start = time.perf_counter()
                path = await harness.paths.build()
                assert path is not None, harness.paths.last_error
                times.append((time.perf_counter() - start) * 1e3)
            if length == 3:
                rows.append(ROW.format(kind, "session establishment, cold links", "3", f"{times[0]:.3f}", ""))
                rows.append(
                    ROW.format(
                        kind,
                        "session establishment, warm links",
                        "3",
                        f"{statistics.median(times):.3f}",
                        f"{pct(times, 0.99):.3f}",
                    )
                )
                medians[("setup", 3)] = statistics.median(times)
            for label, size in SIZES.items():
                rtts = [await harness.rtt(path, size) for _ in range(rounds)]
                medians[(label, length)] = statistics.median(rtts)
                rows.append(
                    ROW.format(
                        kind,
                        f"round trip {label}",
                        str(length),
                        f"{statistics.median(rtts):.3f}",
                        f"{pct(rtts, 0.99):.3f}",
                    )
                )
        for label in SIZES:
            per_hop = (medians[(label, 3)] - medians[(label, 1)]) / 4
            medians[("hop", label)] = per_hop
            rows.append(ROW.format(kind, f"per hop {label}", "", f"{per_hop:.3f}", ""))
    finally:
        await harness.close()
    return rows, medians


def prepare_prompt(message: bytes, node: bytes, path_key: bytes, hop_keys: list[bytes]) -> list[bytes]:
    """Everything the client does to one prompt before sending: per clove, sealing to the node, under
    the path key with a fresh reply id, and one layer per relay before the proxy."""
    payloads = [onion.Payload(node, onion.seal_to(node, sida.encode(c)), os.urandom(16))
                for c in sida.split(message)]
    return [onion.seal_forward(path_key, hop_keys, p) for p in payloads]


def preparation(iterations: int) -> list[str]:
    node = KeySet.generate().public
    key = os.urandom(32)
    hop_keys = [os.urandom(32) for _ in range(2)]
    message = os.urandom(TOOLUSE_BYTES)
    sida_only, full = [], []
    for i in range(iterations + 50):
        t0 = time.perf_counter()
        [sida.encode(c) for c in sida.split(message)]
        t1 = time.perf_counter()
        prepare_prompt(message, node, key, hop_keys)
        t2 = time.perf_counter()
        if i >= 50:
            sida_only.append((t1 - t0) * 1e3)
            full.append((t2 - t1) * 1e3)
    rows = []
    for label, values in (("S-IDA only", sida_only), ("S-IDA + sealing", full)):
        mean = statistics.fmean(values)
        rows.append(
            f"{label:<16} {mean:>8.4f} {statistics.median(values):>8.4f} {pct(values, 0.99):>8.4f}"
            f"   paper {PAPER_PREPARE_MS} ms: {PAPER_PREPARE_MS / mean:.1f}x faster"
        )
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--relays", type=int, default=8)
    args = parser.parse_args()
    setups, rounds, iterations = (20, 30, 200) if args.quick else (200, 300, 2000)
    print(
        f"loopback, {args.relays} relays, {setups} path setups and {rounds} round trips per row "
        f"(median and P99 in ms)\n"
    )
    print(ROW.format("transport", "measure", "hops", "median", "P99"))
    tls_rows, tls = await measure("TLS", TlsHarness(args.relays), setups, rounds)
    plain_rows, plain = await measure("plain TCP", PlainHarness(args.relays), setups, rounds)
    print("\n".join(tls_rows + plain_rows))
    print(f"\nsession establishment: TLS / plain = {tls[('setup', 3)] / plain[('setup', 3)]:.2f}x")
    for label in SIZES:
        print(f"per hop, {label}: TLS {tls[('hop', label)]:.3f} ms, plain {plain[('hop', label)]:.3f} ms")
    print(f"\nclient preparation of one ToolUse prompt ({TOOLUSE_BYTES:,} B, n 4, k 3), ms:")
    print(f"{'':<16} {'mean':>8} {'P50':>8} {'P99':>8}")
    print("\n".join(preparation(iterations)))


if __name__ == "__main__":
    asyncio.run(main())
