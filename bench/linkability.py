"""Linkability of one user's requests, measured on loopback through real relays and paths (issue 24).

Several users send requests, one at a time, through their own paths over real user relays (TLS, in one
process, as bench/relay_overhead.py does) to a stand-in model node that answers each with a short JSON
document through the real overlay gateway. Two adversaries record what they see:

- the model node: every prompt it opens (its request id and body, and per path the proxy, reply id and
  reply key, and the answer's threshold) and, per clove, the proxy that delivered it and the clove's
  message id;
- a first relay colluding with a proxy: every relay's records as the first relay of a user's path (the
  payloads it took from the user or gave back to it, whose sender it knows) and as a proxy (the
  payloads it opened or sealed at the end of a path, and the cloves and replies it exchanged with the
  node for the request).

For each pair of requests, an adversary links the pair by a field when one value of that field occurs
in both requests. The first relay and the proxy link a request to a user when a run of 31 bytes of
something the proxy handled for the request occurs in something a first relay exchanged with that user
(every 16-byte aligned piece of the one looked up among all 16-byte windows of the other), and a pair
of requests when they link both to one user. The table gives the share of pairs linked among pairs of
one user's requests and among pairs of two users' requests: a field that links one user's pairs more
often than different users' tells the adversary who sent what.

    .venv/bin/python bench/linkability.py [--users 4] [--relays 8] [--requests 6]

The script uses only interfaces that exist before and after the change (issue 24), so the same file
run at an older commit measures the code as it was then.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import secrets
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from planetserve.chain.keys import KeySet
from planetserve.node.api.surface import Reply
from planetserve.node.home import UserConfig
from planetserve.node.overlay import onion, sida
from planetserve.node.overlay.directory import DirectoryView
from planetserve.node.overlay.gateway import Gateway
from planetserve.node.overlay.messages import Prompt
from planetserve.node.overlay.paths import PathSettings
from planetserve.node.overlay.relay import Relay
from planetserve.node.overlay.transport import Peering
from planetserve.node.user import UserRelay
from planetserve.registry.entities import ModelNode, User

WINDOW = 16
"""Bytes per piece in the byte match: a shared run of 2·WINDOW − 1 bytes is always found."""
PATHS = PathSettings(target=5, setup_timeout=10.0, ping_interval=3600.0)
"""Five paths per user as by default, four of them drawn for each request (n = 4), and no pings during
the run."""
MODEL_FIELDS = ("request id", "reply ids", "reply keys", "clove message ids", "body")
"""What a model node sees that is chosen per request (the proxies and the threshold come apart)."""


@dataclass
class Observations:
    """What the adversaries recorded, by request (the index of the request in the run)."""

    users: dict[int, bytes] = field(default_factory=dict)
    """Who sent each request (the ground truth)."""
    fields: dict[int, dict[str, set]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(set)))
    """The model node's view: field -> the values it saw in the request."""
    first: dict[bytes, set[bytes]] = field(default_factory=lambda: defaultdict(set))
    """First relays' view: 16-byte window -> the users it was exchanged with."""
    proxy: dict[int, list[bytes]] = field(default_factory=lambda: defaultdict(list))
    """Proxies' view: the bytes each request's proxies handled."""
    current: int = -1

    def see_prompt(self, prompt: Prompt) -> None:
        seen = self.fields[self.current]
        seen["request id"].add(prompt.request_id)
        seen["body"].add(prompt.body)
        seen["reply ids"].update(r[1] for r in prompt.reply_to)
        seen["reply keys"].update(r[2] for r in prompt.reply_to)
        seen["proxies"].update(r[0] for r in prompt.reply_to)
        seen["proxy set"].add(frozenset(r[0] for r in prompt.reply_to))
        seen["n and k"].add((len(prompt.reply_to), prompt.k))

    def see_clove(self, peer: bytes, message_id: bytes) -> None:
        seen = self.fields[self.current]
        seen["clove message ids"].add(message_id)
        seen["proxies"].add(peer)

    def see_at_first(self, user: bytes, data: bytes) -> None:
        for i in range(len(data) - WINDOW + 1):
            self.first[data[i:i + WINDOW]].add(user)

    def see_at_proxy(self, data: bytes) -> None:
        self.proxy[self.current].append(data)

    def attributed(self, request: int) -> set[bytes]:
        """The users a first relay and a proxy tie this request to by its bytes."""
        found: set[bytes] = set()
        for data in self.proxy.get(request, ()):
            for i in range(0, len(data) - WINDOW + 1, WINDOW):
                found |= self.first.get(data[i:i + WINDOW], set())
        return found


Tally = tuple[int, int]


def pair_shares(users: dict[int, bytes], linked: Callable[[int, int], bool]) -> tuple[Tally, Tally]:
    """(linked, all) among pairs of one user's requests, and among pairs of two users' requests."""
    same, other = [0, 0], [0, 0]
    for a, b in itertools.combinations(sorted(users), 2):
        tally = same if users[a] == users[b] else other
        tally[1] += 1
        tally[0] += linked(a, b)
    return (same[0], same[1]), (other[0], other[1])


def by_fields(obs: Observations, names: Iterable[str]) -> Callable[[int, int], bool]:
    names = tuple(names)
    return lambda a, b: any(obs.fields[a][n] & obs.fields[b][n] for n in names)


def rows(obs: Observations) -> list[tuple[str, str, Tally, Tally]]:
    """(adversary, linked by, same-user pairs, different-user pairs) for every way of linking."""
    table = [("model node", name, *pair_shares(obs.users, by_fields(obs, [name]))) for name in MODEL_FIELDS]
    table.append(("model node", "any of the above", *pair_shares(obs.users, by_fields(obs, MODEL_FIELDS))))
    for name in ("n and k", "proxies", "proxy set"):
        table.append(("model node", name, *pair_shares(obs.users, by_fields(obs, [name]))))
    proxies = {r: obs.fields[r]["proxies"] for r in obs.users}
    table.append(("model node", "3 proxies or more",
                  *pair_shares(obs.users, lambda a, b: len(proxies[a] & proxies[b]) >= 3)))
    attributed = {r: obs.attributed(r) for r in obs.users}
    table.append(("first relay + proxy", "payload bytes",
                  *pair_shares(obs.users, lambda a, b: bool(attributed[a] & attributed[b]))))
    return table


def share(tally: Tally) -> str:
    linked, pairs = tally
    return f"{linked}/{pairs} ({100 * linked / pairs:.1f}%)" if pairs else "-"


def record_relay(relay: Relay, me: bytes, clients: dict[bytes, UserRelay], obs: Observations) -> None:
    """Make `relay` (whose key is `me`) report what it handles as a first relay and as a proxy to `obs`.
    A relay cannot tell a user from a relay before it; the records are those of the hops that are a
    user's first, as an adversary that assumes its predecessor is the user would take them."""
    handle, pass_on = relay.handle, relay._pass_on

    def first_for(peer: bytes, link: Any) -> bool:
        client = clients.get(peer)
        return client is not None and (me, link) in client.paths.paths

    def at_proxy(peer: bytes, link: Any) -> bool:
        hop = relay.forward.get((peer, link)) if type(link) is bytes else None
        return hop is not None and hop.succ is None

    async def handling(peer: bytes, msg_type: str, body: Any) -> None:
        if msg_type == "fwd" and isinstance(body, list) and len(body) == 2:
            if first_for(peer, body[0]):
                obs.see_at_first(peer, body[1])
            if at_proxy(peer, body[0]):
                obs.see_at_proxy(body[1])
        elif msg_type == "reply" and isinstance(body, list) and len(body) == 2:
            obs.see_at_proxy(body[1])
        await handle(peer, msg_type, body)

    async def passing(peer: bytes, msg_type: str, body: Any) -> bool:
        if msg_type == "back":
            if first_for(peer, body[0]):
                obs.see_at_first(peer, body[1])
            if at_proxy(peer, body[0]):
                obs.see_at_proxy(body[1])
        elif msg_type == "clove":
            obs.see_at_proxy(body)
        return await pass_on(peer, msg_type, body)

    relay.handle = handling  # type: ignore[method-assign]
    relay._pass_on = passing  # type: ignore[method-assign]


def record_gateway(gateway: Gateway, obs: Observations) -> None:
    """Make a model node's `gateway` report every clove (its proxy and message id) and every prompt it
    answers to `obs`: the log of a node that tries to link requests."""
    on_clove, reply = gateway.on_clove, gateway._reply

    async def receiving(data: bytes, peer: bytes | None = None) -> None:
        with contextlib.suppress(onion.OnionError, sida.CloveError):
            obs.see_clove(peer or b"", sida.decode(onion.open_sealed(gateway.secret, data)).message_id)
        await on_clove(data, peer)

    async def replying(prompt: Prompt, answer: Reply) -> None:
        obs.see_prompt(prompt)
        await reply(prompt, answer)

    gateway.on_clove = receiving  # type: ignore[method-assign]
    gateway._reply = replying  # type: ignore[method-assign]


class StandInNode:
    """A model node's overlay side: the real gateway, answering every prompt with a short document, and
    recording what it sees."""

    def __init__(self, obs: Observations) -> None:
        self.keys = KeySet.generate()
        self.book: dict[bytes, str] = {}
        self.peering = Peering(self.keys, self._on_peer, lambda _key: True)
        self.gateway = Gateway(self.keys.public, onion.exchange_secret(self.keys.identity), self._respond,
                               self._send)
        record_gateway(self.gateway, obs)
        self.address = ""

    async def start(self) -> None:
        self.address = f"127.0.0.1:{await self.peering.listen('127.0.0.1', 0)}"

    async def _respond(self, _endpoint: str, _body: bytes) -> Reply:
        return Reply.json({"object": "chat.completion", "choices": [{"text": secrets.token_hex(8)}]})

    async def _send(self, peer: bytes, msg_type: str, body: Any) -> None:
        await self.peering.notify(peer, self.book[peer], msg_type, body)

    async def _on_peer(self, peer: bytes, msg_type: str, body: Any) -> None:
        if msg_type == "clove":
            await self.gateway.on_clove(body, peer)

    async def close(self) -> None:
        await self.gateway.close()
        await self.peering.close()


def body(index: int) -> bytes:
    """A request as the user's relay sends it: the same shape for everyone, a session id and seed of
    its own (as the relay gives every request that starts no conversation)."""
    return json.dumps({"model": "echo", "messages": [{"role": "user", "content": f"Question {index}?"}],
                       "max_tokens": 8, "temperature": 0, "seed": secrets.randbits(62),
                       "planetserve": {"session_id": secrets.token_hex(16)}}, separators=(",", ":")).encode()


async def run(users: int, relays: int, requests: int, paths: PathSettings = PATHS) -> Observations:
    obs = Observations()
    node = StandInNode(obs)
    await node.start()
    everyone = [UserRelay(UserConfig(peer="127.0.0.1:0", http="127.0.0.1:0", proxies=PATHS.target),
                          KeySet.generate(), None, settings=paths) for _ in range(users + relays)]
    clients = everyone[:users]
    by_key = {u.keys.public: u for u in clients}
    try:
        for user in everyone:
            await user.start(serve_http=False)
            record_relay(user.relay, user.keys.public, by_key, obs)
        listed = [User(u.keys.public, u.config.address, "bench", 0, 1 << 40) for u in everyone]
        record = ModelNode(node.keys.public, "bench", "echo", node.address, "cpu", 1, "bench", "active", 0)
        view = DirectoryView.of(1, listed, [record])
        node.book = {u.keys.public: u.config.address for u in everyone}
        for user in everyone:
            user.apply_view(view)
        for user in clients:
            assert await user.paths.wait_live(PATHS.target, 30), user.paths.last_error
        order = [u for _ in range(requests) for u in clients]
        for index, user in enumerate(order):
            obs.current = index
            obs.users[index] = user.keys.public
            reply = await user.ask(node.keys.public, "chat", body(index))
            assert reply.status == 200, reply.status
            async for _ in reply.parts:
                pass
            await asyncio.sleep(0.05)  # the answer's last cloves reach every proxy before the next request
    finally:
        for user in everyone:
            await user.close()
        await node.close()
    return obs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--relays", type=int, default=8, help="user relays besides the users themselves")
    parser.add_argument("--requests", type=int, default=6, help="requests per user")
    parser.add_argument("--path-uses", type=int, default=None,
                        help="requests a path carries before it is replaced (default: PathSettings'; "
                             "0 reuses paths until their lifetime, as before per-request paths)")
    args = parser.parse_args()
    paths = PATHS if args.path_uses is None else replace(PATHS, uses=args.path_uses)
    obs = asyncio.run(run(args.users, args.relays, args.requests, paths))
    uses = getattr(paths, "uses", 0)
    print(f"{args.users} users x {args.requests} requests over {args.users + args.relays} relays, "
          f"{paths.target} paths of {paths.length} relays each, n 4, k 3, "
          f"{f'each path used {uses} time(s)' if uses else 'paths reused'}")
    print(f"{'adversary':<20} {'links by':<20} {'same-user pairs':>18} {'different-user pairs':>22}")
    for adversary, name, same, other in rows(obs):
        print(f"{adversary:<20} {name:<20} {share(same):>18} {share(other):>22}")


if __name__ == "__main__":
    main()
