"""Colluding relays that tear down a user's paths to steer them onto themselves (docs/threat-model.md,
"Steers a user's paths onto colluders by tearing down the others"). Any relay of a path can end it for
free: it sends "down" [link id] toward the user, or, as its first relay, closes its connection. When the
user replaced such a path by one over freshly drawn relays, colluders that tore down every path they sat
on without holding both its first relay and its proxy kept only the paths they fully watch: a review
measured 7.5% -> 28.3% of paths with a colluding first relay and proxy (15 users, 4 colluding), every
request still answered. Now a live path lost so is built again over the same relays, and a route lost
again soon after is avoided as a failed setup is, its colluder with it; at most half the list is
avoided at once, those blamed last staying out (`node/overlay/paths.py`).

The adversary here is stronger than a real one: it is told each path's whole route and its own hop on
it the moment the user has the path live, so it never tears down a path it should keep and never
misses one it should not, whatever the relays could learn of their positions. It runs on a live
in-process overlay (tests/overlaynet.py: real TLS between every relay, a real model node)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from overlaynet import chat, make_user, start_overlay
from waiting import run, until

from planetserve.node.overlay.paths import Path
from planetserve.node.overlay.relay import Hop, Relay
from planetserve.node.user import UserRelay

USERS = 15
"""The client and 14 relays."""
COLLUDERS = 4
REQUESTS = 30
GAP_S = 0.5
"""Between two requests: time for the used paths' replacements to be built and torn down."""
FAIR_SHARE = (COLLUDERS / (USERS - 1)) * ((COLLUDERS - 1) / (USERS - 2))
"""The share of paths with a colluding first relay and proxy that a fair draw gives: 4/14 · 3/13 ≈ 6.6%
(the review measured 5.8% and 7.5% without the attack)."""
BOUND = 0.15
"""The most the share may reach under the attack: about 2.3 times the fair share, and less than half what
the attack reached before the change (34-37%). With 120 paths drawn fairly, 18 or more compromised ones
(mean 7.9, standard deviation about 2.7) has a probability below 10^-3; under the attack the change
measured 0-10%."""


class TearingRelay(Relay):
    """A colluding relay: ends a path through it on command, as an honest relay ends one whose neighbour
    left ("down" both ways), so the user cannot tell the difference."""

    async def tear_down(self, hop: Hop) -> bool:
        if self.forward.get((hop.pred, hop.in_id)) is not hop:
            return False
        self._drop(hop)
        await self._pass_on(hop.pred, "down", [hop.in_id])
        if hop.succ is not None:
            await self._pass_on(hop.succ, "down", [hop.out_id])
        return True


def colluding(user: UserRelay) -> UserRelay:
    old = user.relay
    user.relay = TearingRelay(old.secret, old.send, is_user=old.is_user, is_node=old.is_node, owner=old.owner)
    return user


@dataclass
class Steering:
    """The colluders' rule: tear down every live path of the client that holds one of them but does not
    end at one of them with another of them as its first relay; keep the rest. With `once`, each route is
    torn down only the first time (a colluder that will not pay for its rerolls)."""

    users: dict[bytes, UserRelay]
    client: UserRelay
    colluders: set[bytes]
    on: bool = False
    once: bool = False
    torn: int = 0
    seen: set[tuple[bytes, ...]] = field(default_factory=set)
    tasks: set[asyncio.Task] = field(default_factory=set)

    def compromised(self, route: tuple[bytes, ...]) -> bool:
        return route[0] in self.colluders and route[-1] in self.colluders

    def hops(self, path: Path) -> list[Hop]:
        """The path's hop at each of its relays, followed from the client's link id."""
        hops, pred, link = [], self.client.keys.public, path.link
        for relay in path.route:
            hop = self.users[relay].relay.forward.get((pred, link))
            if hop is None:
                return []
            hops.append(hop)
            pred, link = relay, hop.out_id
        return hops

    def live(self, path: Path) -> None:
        route = path.route
        if not self.on or self.compromised(route) or not self.colluders & set(route):
            return
        if self.once and route in self.seen:
            return
        self.seen.add(route)
        hops = self.hops(path)
        if not hops:
            return
        position = next(i for i, relay in enumerate(route) if relay in self.colluders)
        task = asyncio.get_running_loop().create_task(self._tear(route[position], hops[position]))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _tear(self, relay: bytes, hop: Hop) -> None:
        if await self.users[relay].relay.tear_down(hop):
            self.torn += 1


def watch(client: UserRelay, steering: Steering) -> list[list[tuple[bytes, ...]]]:
    """Tell the adversary each path the client has live, and record the routes each request goes out
    over."""
    manager = client.paths
    deliver, use = manager.deliver, manager.use
    used: list[list[tuple[bytes, ...]]] = []

    def delivered(peer: bytes, link: bytes, sealed: bytes) -> bool:
        path = manager.paths.get((peer, link))
        was_live = path is not None and path.live
        handled = deliver(peer, link, sealed)
        if path is not None and path.live and not was_live:
            steering.live(path)
        return handled

    def using(paths) -> None:  # type: ignore[no-untyped-def]
        used.append([p.route for p in paths])
        use(paths)

    manager.deliver, manager.use = delivered, using  # type: ignore[method-assign]
    return used


async def steered_overlay(data, colluders: int = COLLUDERS):  # type: ignore[no-untyped-def]
    users = [make_user() for _ in range(USERS)]
    for user in users[1:1 + colluders]:
        colluding(user)
    net = await start_overlay(data, users, 1)
    keys = {u.keys.public for u in users[1:1 + colluders]}
    steering = Steering({u.keys.public: u for u in users}, net.client, keys)
    return net, steering, watch(net.client, steering)


async def phase(net, used, requests: int) -> list[list[tuple[bytes, ...]]]:  # type: ignore[no-untyped-def]
    """Send `requests` requests, each answered; the routes of the paths that each went out over."""
    start = len(used)
    for i in range(requests):
        answer = await chat(net.client, f"Question {i}: what does os do?", max_tokens=2)
        assert answer.status_code == 200, answer.text
        await asyncio.sleep(GAP_S)
    return used[start:]


def shares(requests: list[list[tuple[bytes, ...]]], colluders: set[bytes]) -> tuple[float, int]:
    """(share of paths with a colluding first relay and proxy, requests with at least one such path)."""
    routes = [r for request in requests for r in request]
    bad = [r for r in routes if r[0] in colluders and r[-1] in colluders]
    hit = sum(any(r[0] in colluders and r[-1] in colluders for r in request) for request in requests)
    return len(bad) / len(routes), hit


@pytest.mark.parametrize("once", [False, True], ids=["every-time", "once-per-route"])
def test_colluders_tearing_down_paths_do_not_steer_them_onto_themselves(quick_family, once):
    """4 of 14 relays tear down every path of the client they sit on without holding both its first
    relay and its proxy, every time (rebuilt routes included) or only the first time they see a route:
    the share of the paths the client's requests went out over that have a colluding first relay and
    proxy stays within BOUND (it reached 34-37% before the change, against a fair 6.6%), and every
    request is answered. Tearing a route down every time costs the colluders their place in the client's
    draws; tearing it down once gives it back unchanged."""
    async def main():
        net, steering, used = await steered_overlay(quick_family)
        steering.once = once
        try:
            baseline = await phase(net, used, REQUESTS)
            steering.on = True
            await phase(net, used, 3)  # paths built before the switch are spent
            attacked = await phase(net, used, REQUESTS)
            before, before_hit = shares(baseline, steering.colluders)
            share, hit = shares(attacked, steering.colluders)
            counters = net.client.paths.counters
            print(f"without the attack {before:.1%} of paths ({before_hit}/{REQUESTS} requests), with it "
                  f"{share:.1%} ({hit}/{REQUESTS}); torn down {steering.torn}; counters {counters}")
            assert steering.torn > 0, "the adversary never acted"
            assert share <= BOUND, f"{share:.1%} of paths with a colluding first relay and proxy"
            if once:  # a route torn down once is rebuilt as it was: nothing is avoided for it
                assert counters["rebuilt"] > 0 and counters["lost_again"] == 0
            else:  # the colluders' rerolls cost them their place
                assert counters["lost_again"] > 0
        finally:
            await net.close()

    run(main(), timeout=300)


def test_a_single_tear_down_gives_the_same_relays_back_and_a_second_avoids_them_all(quick_family):
    """A colluder that tears down a live path gets it rebuilt over the same relays, and no relay is
    avoided (a relay that restarts or whose connection broke costs nothing more). The same route torn down
    again soon after is treated as a failed setup: all three of its relays, the colluder among them, are
    avoided for `failed_setup_avoid_seconds`, and a route over other relays takes its place."""
    async def main():
        net, steering, _ = await steered_overlay(quick_family, colluders=USERS - 1)
        try:
            client = net.client
            path = client.paths.live()[0]
            route, middle = path.route, path.route[1]
            relay = net.user(middle).relay
            assert await relay.tear_down(steering.hops(path)[1])
            await until(lambda: not path.live and any(p.route == route for p in client.paths.live()))
            assert not client.paths.avoided
            assert client.paths.counters["rebuilt"] == 1
            again = next(p for p in client.paths.live() if p.route == route)
            assert again.link != path.link and again.key != path.key  # fresh link ids and keys
            assert await relay.tear_down(steering.hops(again)[1])
            await until(lambda: not again.live and len(client.paths.live()) >= client.paths.settings.target)
            assert set(route) <= set(client.paths.avoided)
            assert client.paths.counters["lost_again"] == 1
            assert all(not set(route) & set(p.route) for p in client.paths.live())
            assert (await chat(client, "Still there?")).status_code == 200
        finally:
            await net.close()

    run(main())


def test_a_path_whose_relay_really_left_is_replaced_at_once_over_others(quick_family):
    """Honest churn still costs little: a relay in the middle of a live path leaves; its neighbours
    report the path down, the rebuild over the same relays fails at once (the first relay cannot reach
    it), and a path over other relays is live within a few seconds, the gone relay avoided."""
    async def main():
        net, _, _ = await steered_overlay(quick_family, colluders=0)
        try:
            client = net.client
            path = client.paths.live()[0]
            gone = path.route[1]
            started = asyncio.get_running_loop().time()
            await net.user(gone).close()
            net.users = [u for u in net.users if u.keys.public != gone]
            await until(lambda: not path.live and len(client.paths.live()) >= client.paths.settings.target
                        and all(gone not in p.route for p in client.paths.live()), timeout=10)
            took = asyncio.get_running_loop().time() - started
            assert took < 5, f"replaced after {took:.1f} s"
            assert gone in client.paths.avoided
            assert (await chat(client, "After churn?")).status_code == 200
        finally:
            await net.close()

    run(main())
