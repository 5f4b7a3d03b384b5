"""A proxy's per-request reply ids (relay.py): each prompt clove registers a fresh one; they are bounded
per path (the path's own least recently used goes), per previous-hop peer and in all (refused before
anything is stored), forgotten when idle or with their path, and answers under a forgotten one go
nowhere (unit: one Relay, its sends recorded)."""

from __future__ import annotations

import secrets
import time

from waiting import run

from planetserve.node.overlay import onion
from planetserve.node.overlay.directory import Knocks
from planetserve.node.overlay.relay import MAX_REPLIES_PER_PATH, REPLY_IDLE_SECONDS, Hop, Relay

NODE = b"n" * 32
ROTATED = b"r" * 32
STRANGER = b"s" * 32
PEERS = (b"a" * 32, b"b" * 32)


def proxy(**bounds: int) -> tuple[Relay, list[tuple[bytes, str, object]]]:
    sent: list[tuple[bytes, str, object]] = []

    async def send(peer: bytes, msg_type: str, body: object) -> None:
        sent.append((peer, msg_type, body))

    return Relay(bytes(32), send, is_user=lambda k: k in PEERS, is_node=lambda k: k == NODE, **bounds), sent


def path_to(relay: Relay, peer: bytes) -> Hop:
    hop = Hop(peer, secrets.token_bytes(onion.ID_SIZE), None, None, secrets.token_bytes(onion.KEY_SIZE))
    relay._store(hop)
    return hop


async def clove(relay: Relay, hop: Hop, reply_id: bytes | None = None, destination: bytes = NODE) -> bytes:
    """A prompt clove for `destination` on `hop`'s path under a fresh reply id (or `reply_id`); the id it
    used."""
    reply_id = reply_id or secrets.token_bytes(onion.ID_SIZE)
    sealed = onion.seal_forward(hop.key, (), onion.Payload(destination, b"clove", reply_id))
    await relay.handle(hop.pred, "fwd", [hop.in_id, sealed])
    return reply_id


def test_a_path_holds_its_most_recent_reply_ids_and_answers_come_back_under_them():
    async def main():
        relay, sent = proxy()
        hop = path_to(relay, PEERS[0])
        ids = [await clove(relay, hop) for _ in range(MAX_REPLIES_PER_PATH + 44)]
        assert relay.counters["to_nodes"] == len(ids) and sum(t == "clove" for _, t, _ in sent) == len(ids)
        assert list(hop.replies) == ids[44:] and set(relay.replies) == set(ids[44:])
        assert relay.replies_by_peer == {PEERS[0]: MAX_REPLIES_PER_PATH}
        await relay.handle(NODE, "reply", [ids[-1], b"answer"])
        peer, kind, (link, sealed) = sent[-1]
        assert (peer, kind, link) == (PEERS[0], "back", hop.in_id)
        assert onion.open_backward(hop.key, (), sealed) == onion.Payload("clove", b"answer", ids[-1])
        await relay.handle(NODE, "reply", [ids[0], b"answer"])  # replaced by a newer one of its path
        assert relay.counters["unknown_path"] == 1 and len(sent) == len(ids) + 1
        other = path_to(relay, PEERS[1])
        await clove(relay, other, ids[-1])  # another path cannot take over a live reply id
        assert relay.replies[ids[-1]] is hop and not other.replies

    run(main())


def test_a_peer_at_its_bound_is_refused_before_anything_is_stored_and_others_are_not():
    async def main():
        relay, sent = proxy(max_replies_per_peer=300, max_replies=400)
        paths = [path_to(relay, PEERS[0]) for _ in range(2)]
        for _ in range(200):
            for hop in paths:
                await clove(relay, hop)
        assert relay.replies_by_peer[PEERS[0]] == 300 and relay.counters["refused_replies"] == 100
        assert relay.counters["to_nodes"] == 300 == sum(t == "clove" for _, t, _ in sent)
        honest = path_to(relay, PEERS[1])
        for _ in range(150):
            await clove(relay, honest)
        assert len(honest.replies) == 100 and len(relay.replies) == 400  # then the whole table is full
        assert relay.counters["refused_replies"] == 150

    run(main())


def test_idle_reply_ids_are_forgotten_and_so_are_those_of_a_path_torn_down():
    async def main():
        relay, _ = proxy()
        idle, busy = path_to(relay, PEERS[0]), path_to(relay, PEERS[1])
        await clove(relay, idle)
        await clove(relay, busy)
        later = time.monotonic() + REPLY_IDLE_SECONDS + 1
        busy.replies[await clove(relay, busy)] = later  # used again just now, as `later` sees it
        relay.expire(now=later)
        assert not idle.replies and len(busy.replies) == 1 and len(relay.replies) == 1
        assert relay.replies_by_peer == {PEERS[1]: 1} and len(relay.forward) == 2  # the paths stay
        await relay.handle(PEERS[1], "down", [busy.in_id])
        assert not relay.replies and not relay.replies_by_peer

    run(main())


def test_a_clove_for_a_key_the_proxys_list_lacks_reads_the_list_again_and_else_says_unreachable():
    """A model node's new key (registered or rotated to since the proxy's last read) is delivered to
    once the lists are read again; a key the ledger does not hold comes back "unreachable" at once, with
    no read of the lists (`Knocks` looked it up alone), so the user's request fails now instead of at
    its timeout."""
    async def main():
        registered = {NODE}
        reads = []

        async def refresh() -> None:
            reads.append(True)
            registered.add(ROTATED)

        sent: list[tuple[bytes, str, object]] = []

        async def send(peer: bytes, msg_type: str, body: object) -> None:
            sent.append((peer, msg_type, body))

        knocks = Knocks(lambda key: key == ROTATED, refresh)  # the ledger holds the rotated key
        relay = Relay(bytes(32), send, is_user=lambda k: k in PEERS, is_node=lambda k: k in registered,
                      knock=knocks)
        hop = path_to(relay, PEERS[0])
        await clove(relay, hop, destination=ROTATED)
        assert reads == [True] and sent[-1][:2] == (ROTATED, "clove") and relay.counters["to_nodes"] == 1
        await clove(relay, hop, destination=STRANGER)
        peer, kind, (link, sealed) = sent[-1]
        assert (peer, kind, link) == (PEERS[0], "back", hop.in_id)
        assert onion.open_backward(hop.key, (), sealed).first == "unreachable"
        assert relay.counters["refused"] == 1 and relay.counters["to_nodes"] == 1
        assert len(relay.replies) == 1  # the refused clove's reply id was never stored
        assert reads == [True] and knocks.counts["lookups"] == 2

    run(main())
