"""A user's own onion paths and proxies: building them, keeping N of them live, noticing dead or
misbehaving ones, and replacing them with paths over other relays.

A path is live once its proxy's acknowledgement token (sealed in the proxy's onion layer, so no relay
can forge it) comes back. Paths die when a relay reports them down (a neighbour disappeared), when
pings go unanswered or come back altered, or when the messaging layer sees the path drop or corrupt
cloves; the relays of a misbehaving path are avoided for a while, since the user cannot tell which of
them misbehaved without learning more about the path than it should.

Paths are also replaced while they work (rotation): each after a lifetime drawn around
`PathSettings.lifetime`, and each that was built from a markedly shorter user list than the one now
verified, so a path chosen while few users were listed (the first minutes of a network, when several
paths had to share relays and proxies) does not stay on them. One path is replaced at a time and never
by dropping below the target: the replacement is built first, then the old path stops taking new
requests (`retiring`) and is torn down once the answers it carries are in (or after `retire_grace`).

A path is used up after `PathSettings.uses` requests (one by default): it retires at once, and the
paths that replace it are built while its answer comes back, so the next request finds fresh ones.

A path lost to a relay is not a new draw. Any relay of a path can end it at will and for free: it
sends "down" toward us, or (our first relay) closes its connection. Were the path then replaced by one
over freshly drawn relays, colluding relays could tear down every path of ours they sit on without
also holding its first relay and proxy, and keep those that they do: the paths that survive would be
theirs far more often than a fair draw (a review measured 7.5% -> 28% of paths with colluding first
relay and proxy, 15 users of which 4 colluded). So a live path that is lost (`_lost`) is built again
over the same relays (fresh link ids and keys, the same remaining uses and lifetime): tearing it down
gains its relays nothing but the same path back. A relay that really left makes that rebuild fail at
once (its neighbour cannot reach it and answers "down"), which is a failed setup, and a failed setup's
relays are avoided for `failed_setup_avoid_seconds`; so is a route lost again within that time of its
rebuild, and then a fresh route is drawn. Every way a relay can force a fresh draw (failing a setup,
ending a rebuilt path, dropping pings or cloves) thus costs it its own place in our draws, exactly as
much as it costs each other relay of the path: the blame is shared equally by every relay of the path,
once per event, because we cannot tell which of them caused it. While colluders are fewer than a third
of the listed relays, each event takes a larger share of colluders than of honest relays out of what
we draw from, so the colluders that keep ending our paths soon draw none of them (measured with 4 of 14
relays colluding and ending every path they do not fully watch: 0-10% of paths with colluding first
relay and proxy, against 6.6% for a fair draw and 34-37% before). How much may be avoided at once is
bounded (`_shunned`), so that colluders above a third cannot have the honest relays avoided wholesale.

Alternatives we did not take: a per-relay count of abnormal deaths with a threshold above one lets
colluders keep their own counts below it while concentrating them on an honest relay that shares
their paths (each of C colluders ends t - 1 paths through it), which is then avoided and they are not.
A ration of fresh draws in place of failed paths (past it, a place stays empty until the next request)
bounds the steering whatever the share of colluders, but turned the same attack on 15 users into a
denial of service for every request until the ration's window ended; shared blame keeps requests
answered. Where colluders are more than a third of the list no blame helps: the paths that survive
are still chosen by them (measured with 6 of 12 relays: 70% of paths before, 80-94% now, against 25%
for a fair draw).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import logging
import random
import secrets
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from planetserve.node.overlay import onion
from planetserve.node.overlay.relay import Send
from planetserve.node.overlay.routes import PATH_LENGTH, NotEnoughRelays, choose_routes
from planetserve.node.overlay.transport import TransportError

log = logging.getLogger(__name__)

_SYSTEM = secrets.SystemRandom()


@dataclass(frozen=True)
class PathSettings:
    target: int = 5
    """N: live paths (proxies) to keep; at least n."""
    length: int = PATH_LENGTH
    """Relays per path, the last being the proxy (the paper's l = 3)."""
    setup_timeout: float = 5.0
    ping_interval: float = 10.0
    ping_timeout: float = 5.0
    misses_allowed: int = 1
    """Consecutive unanswered pings a path survives."""
    avoid_seconds: float = 600.0
    """How long relays of a path that dropped or corrupted traffic are avoided."""
    avoided_share: float = 0.5
    """The most of the other listed relays left out of new paths for failing or misbehaving at once
    (`PathManager._shunned`)."""
    failed_setup_avoid_seconds: float = 60.0
    """How long relays of a path whose setup failed are avoided; also those of a path lost again (torn
    down by a relay, or its first relay's connection closed) within this time of being rebuilt over the
    same relays after a loss (`PathManager._lost`)."""
    lifetime: float = 600.0
    """Seconds a path serves before it is replaced by one over freshly chosen relays (0: never). A path
    that lives long lets its proxy (and a colluding first relay) collect every request of the user that
    it carries, and keeps the user on relays chosen from whatever list was verified when it was built;
    ten minutes bounds that to a few dozen requests per path at interactive rates, while rebuilding
    costs only 3 public-key operations per relay per path, about one setup every two minutes per user
    at N = 5."""
    lifetime_jitter: float = 0.25
    """Each path's lifetime is drawn uniformly from lifetime·[1 − jitter, 1 + jitter], so paths built
    together are not all replaced together (and their replacement times do not mark them as one
    user's)."""
    list_growth: float = 0.25
    """A path built while the user list held L users is rebuilt once it holds more than L·(1 + this)
    users (and at least one more): a small list forced relays and proxies to repeat across paths, a
    grown one lets them spread; the fraction keeps a large network's steady joins from rotating paths
    at every refresh."""
    retire_grace: float = 120.0
    """How long a replaced path stays open for the answers still coming back over it."""
    uses: int = 1
    """Requests a path carries before it is replaced (0: no limit, rotation by lifetime alone). A model
    node sees the proxies that deliver a request's cloves and that its prompt names for the answer; a
    path that carried an earlier request would name the same proxy again, so two requests of one user
    would share proxies far more often than two users' requests do (3 or more in 224 of 224 pairs against
    12 of 1,792 in bench/linkability.py with paths reused). At 1, every request goes out over paths nobody
    used before, built over freshly drawn relays while the previous requests were answered (1 of 224
    against 20 of 1,792)."""


@dataclass(eq=False)
class Path:
    link: bytes
    """Id of the link from us to the first relay: how that relay and we name this path."""
    route: tuple[bytes, ...]
    token: bytes
    key: bytes = field(repr=False)
    """The path key: seals what we and the proxy exchange."""
    hop_keys: tuple[bytes, ...] = field(default=(), repr=False)
    """The hop keys of the relays before the proxy, first relay first: each re-encrypts the payloads."""
    created: float = field(default_factory=time.monotonic)
    listed: int = 0
    """Users in the verified list the path's relays were chosen from."""
    expires: float = float("inf")
    """When (monotonic) the path is due to be replaced."""
    state: str = "building"
    """building, live, retiring (replaced: carries the answers still in flight, takes no new request),
    then gone from the manager: spent once retired, dead when it failed."""
    penalized: bool = False
    suspect: bool = False
    """A relay of it was found misbehaving on another path while it was being built."""
    misses: int = 0
    uses: int = 0
    """Requests sent over it."""
    ready: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def first(self) -> bytes:
        return self.route[0]

    @property
    def proxy(self) -> bytes:
        return self.route[-1]

    @property
    def live(self) -> bool:
        return self.state == "live"

    @property
    def carrying(self) -> bool:
        """Answers over it still arrive: live, or retiring after its replacement went live."""
        return self.state in ("live", "retiring")

    def seal(self, destination: bytes, data: bytes, reply_id: bytes = b"") -> bytes:
        """A payload only our proxy can open, as our first relay receives it: data for the model node
        `destination` (empty: a ping), to be answered under `reply_id`. Every relay of the path receives
        it at this length (`onion.seal_forward`)."""
        return onion.seal_forward(self.key, self.hop_keys, onion.Payload(destination, data, reply_id))

    def open(self, wrapped: bytes) -> onion.Payload:
        """A payload from our proxy, as our first relay passed it on; OnionError if anyone altered it."""
        return onion.open_backward(self.key, self.hop_keys, wrapped)


CloveSink = Callable[[Path, bytes], None]
ReplyKeys = Callable[[bytes], bytes | None]
UnreachableSink = Callable[[Path, bytes], None]


class PathManager:
    """Implements the relay's PathOwner for paths that start here."""

    def __init__(self, me: bytes, send: Send, users: Callable[[], Sequence[bytes]], *,
                 settings: PathSettings | None = None, rng: random.Random | None = None) -> None:
        self.me = me
        self.send = send
        self.users = users
        self.settings = settings or PathSettings()
        self.rng = rng
        self.paths: dict[tuple[bytes, bytes], Path] = {}
        self.avoided: dict[bytes, float] = {}
        self.on_clove: CloveSink = lambda _path, _data: None
        self.reply_key: ReplyKeys = lambda _reply_id: None
        """The key an answer clove under a reply id of ours is sealed with (None: not, or no longer,
        awaited)."""
        self.on_unreachable: UnreachableSink = lambda _path, _node: None
        self.on_death: list[Callable[[Path], None]] = []
        self.in_use: Callable[[Path], bool] = lambda _path: False
        """Whether a request in flight still waits for answers over the path (retiring waits for it)."""
        self._pings: dict[bytes, tuple[bytes, asyncio.Future]] = {}
        self._filling = asyncio.Lock()
        self._rebuilt: dict[tuple[bytes, ...], float] = {}
        """Routes rebuilt after a loss, with when (monotonic): one lost again within
        `failed_setup_avoid_seconds` is treated as a failed setup."""
        self.counters = {"built": 0, "setup_failures": 0, "died": 0, "penalized": 0, "pings_failed": 0,
                         "altered": 0, "rotated": 0, "rotation_failures": 0, "used_up": 0,
                         "lost": 0, "rebuilt": 0, "lost_again": 0}
        self._tasks: set[asyncio.Task] = set()
        self.last_error: str | None = None

    def live(self) -> list[Path]:
        return [p for p in self.paths.values() if p.live]

    # -- building ------------------------------------------------------------------------------------

    def _shunned(self, users: Sequence[bytes]) -> tuple[set[bytes], set[bytes]]:
        """Relays a new path leaves out (those avoided for failing or misbehaving) and relays it uses only
        as a last resort (also those carrying our other paths). Retiring paths count for neither: a used
        path's replacements are chosen as if it were gone, so that the proxies of one request say nothing
        about those of the next, not even by avoiding them.

        At most `avoided_share` of the other listed relays are left out, and never so many that fewer
        than a path's length remain; past either bound, those whose avoidance ends soonest (blamed
        longest ago, or for less) are let back first, so the relays that failed us last stay out. Before,
        past the second bound every avoided relay was let back at once: colluders that kept ending our
        paths soon had the whole list avoided, and then avoiding meant nothing. The first bound is for
        lists where colluders are more than a third: a blamed path holds one colluder and two honest
        relays, so there each blame leaves a list with a larger share of colluders (with 6 of 12 relays
        colluding and no bound, every path ended up over colluders alone); bounded, blame raises their
        share f of what we draw from to at most (f - share / 3) / (1 - share), and lowers it when f is
        below a third."""
        now = time.monotonic()
        self.avoided = {k: until for k, until in self.avoided.items() if until > now}
        busy = {r for p in self.paths.values() if p.state != "retiring" for r in p.route}
        others = {u for u in users if u != self.me}
        held = sorted((until, relay) for relay, until in self.avoided.items() if relay in others)
        room = min(int(len(others) * self.settings.avoided_share), len(others) - self.settings.length)
        bad = {relay for _, relay in held[max(len(held) - max(room, 0), 0):]}
        return bad, set(self.avoided) | busy

    def _lifetime(self) -> float:
        settings = self.settings
        if settings.lifetime <= 0:
            return float("inf")
        spread = settings.lifetime * min(max(settings.lifetime_jitter, 0.0), 1.0)
        return (self.rng or _SYSTEM).uniform(settings.lifetime - spread, settings.lifetime + spread)

    async def build(self, replacing: Path | None = None, *, proxies: Collection[bytes] = ()) -> Path | None:
        """One new path, or None if its setup failed (its relays are then avoided for a while). Its
        proxy ends none of our other paths whenever the list allows (`replacing`'s only as a last resort),
        nor is one of `proxies` (those a request was sent to before, when it is sent again) but as a last
        resort."""
        users = self.users()
        ends = {p.proxy for p in self.paths.values() if p is not replacing and p.state != "retiring"}
        left_out, last_resort = self._shunned(users)
        try:
            (route,) = choose_routes(users, 1, length=self.settings.length, exclude={self.me} | left_out,
                                     avoid=last_resort, proxies=ends | set(proxies), rng=self.rng)
        except NotEnoughRelays as exc:
            self.last_error = str(exc)
            return None
        return await self._set_up(self._reserve(route, len(users)))

    def _reserve(self, route: tuple[bytes, ...], listed: int) -> Path:
        """A path over `route`, in the table at once (before any await: concurrent builds avoid its
        relays, and `fill` counts it)."""
        path = Path(secrets.token_bytes(onion.ID_SIZE), route, secrets.token_bytes(onion.TOKEN_SIZE),
                    secrets.token_bytes(onion.KEY_SIZE), listed=listed)
        self.paths[(path.first, path.link)] = path
        return path

    async def _set_up(self, path: Path) -> Path | None:
        """Send a reserved path's setup and wait for its proxy's token: the live path, or None if the
        setup failed (its relays are then avoided for `failed_setup_avoid_seconds`)."""
        route = path.route
        links = [path.link, *(secrets.token_bytes(onion.ID_SIZE) for _ in route[1:])]
        layers = [onion.relay_layer(links[i + 1], route[i + 1]) for i in range(len(route) - 1)]
        layers.append(onion.proxy_layer(path.token, path.key))
        try:
            packet, hop_keys = await asyncio.to_thread(onion.build, route, layers)
            path.hop_keys = hop_keys[:-1]
            await self.send(path.first, "setup", [path.link, packet])
            await asyncio.wait_for(asyncio.shield(path.ready), self.settings.setup_timeout)
        except (TransportError, TimeoutError, onion.OnionError, asyncio.CancelledError) as exc:
            self.paths.pop((path.first, path.link), None)
            self.counters["setup_failures"] += 1
            self.last_error = f"path setup failed: {exc or type(exc).__name__}"
            self._avoid(route, self.settings.failed_setup_avoid_seconds)
            if path.state == "building":
                await self._send_down(path)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return None
        self.counters["built"] += 1
        if path.expires == float("inf"):  # a rebuilt path keeps the lifetime of the one it replaces
            path.expires = time.monotonic() + self._lifetime()
        if path.suspect:  # a relay of it misbehaved on another path while it was built
            self._retire(path)
            return None
        return path

    async def fill(self) -> int:
        """Build paths until `target` are live (one round; failures are retried next round)."""
        async with self._filling:
            missing = self.settings.target - sum(p.state in ("building", "live") for p in self.paths.values())
            if missing <= 0:
                return 0
            built = await asyncio.gather(*(self.build() for _ in range(missing)))
            return sum(p is not None for p in built)

    async def wait_live(self, count: int, timeout: float) -> bool:
        """Fill until `count` paths are live or the time is up."""
        deadline = time.monotonic() + timeout
        while len(self.live()) < count:
            if time.monotonic() > deadline:
                return False
            if await self.fill() == 0:
                await asyncio.sleep(0.2)
        return True

    async def maintain(self) -> None:
        """Forever: ping every live path, replace the dead, rotate one that is due."""
        while True:
            try:
                await self.fill()
                await asyncio.gather(*(self.ping(p) for p in self.live()))
                if (due := self.due()) is not None:
                    await self.rotate(due)
            except Exception:  # one round's failure must not end the user's paths for good
                log.exception("a round of path maintenance failed")
            await asyncio.sleep(self.settings.ping_interval)

    # -- rotating ------------------------------------------------------------------------------------

    def stale(self, path: Path, listed: int) -> bool:
        """Built from a list that has since grown to `listed` users, by more than `list_growth`."""
        return listed > path.listed and listed > path.listed * (1 + self.settings.list_growth)

    def due(self) -> Path | None:
        """The live path to replace next, if any (only while all `target` are live): the one longest
        past its lifetime, else one built from a list since grown, those sharing a proxy first."""
        live = self.live()
        if len(live) < self.settings.target:
            return None
        now = time.monotonic()
        expired = [p for p in live if p.expires <= now]
        if expired:
            return min(expired, key=lambda p: p.expires)
        listed = len(self.users())
        stale = [p for p in live if self.stale(p, listed)]
        if not stale:
            return None
        ends = collections.Counter(p.proxy for p in live)
        return min(stale, key=lambda p: (ends[p.proxy] == 1, p.created))

    async def rotate(self, old: Path) -> bool:
        """Replace `old`: build its successor first; once that is live, `old` takes no new requests and
        is torn down when the answers it carries are in. False when the new path could not be built
        (`old` serves on and is tried again next round)."""
        new = await self.build(replacing=old)
        if new is None:
            self.counters["rotation_failures"] += 1
            return False
        if old.state == "live":
            self.counters["rotated"] += 1
            self._retire(old)
        return True

    def use(self, paths: Sequence[Path]) -> None:
        """A request goes out over `paths`: each that reaches its `uses` retires (its answer still comes
        back over it). Its replacement is built when the request calls `replenish`, once its answer has
        begun, so that building (three key agreements per relay) does not delay the prompt on its way;
        a request that finds too few paths meanwhile builds them itself (`wait_live`)."""
        limit = self.settings.uses
        for path in paths:
            path.uses += 1
            if limit and path.uses >= limit and path.live:
                self.counters["used_up"] += 1
                self._retire(path, replace=False)

    def replenish(self) -> None:
        """Build the paths that retired ones left missing, now rather than at the next maintenance round."""
        self.spawn(self.fill())

    def _retire(self, path: Path, replace: bool = True) -> None:
        """The path takes no new request; it is torn down once its answers are in, and replaced now
        (unless `replace` is false: then at `replenish`)."""
        path.state = "retiring"
        self.spawn(self._tear_down_when_done(path))
        if replace:
            self.replenish()

    async def _tear_down_when_done(self, path: Path) -> None:
        deadline = time.monotonic() + self.settings.retire_grace
        while path.state == "retiring" and self.in_use(path) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if path.state == "retiring":
            await self.drop(path, "replaced", ended="spent")

    async def ping(self, path: Path) -> bool:
        """Ask the proxy to echo a random value back; a miss or an altered echo counts against it."""
        nonce = secrets.token_bytes(16)
        waiter = asyncio.get_running_loop().create_future()
        self._pings[path.link] = (nonce, waiter)
        try:
            await self.send(path.first, "fwd", [path.link, path.seal(b"", nonce)])
            ok = await asyncio.wait_for(waiter, self.settings.ping_timeout)
        except (TransportError, TimeoutError):
            ok = False
        finally:
            self._pings.pop(path.link, None)
        if ok:
            path.misses = 0
            return True
        self.counters["pings_failed"] += 1
        path.misses += 1
        if path.misses > self.settings.misses_allowed:
            await self.penalize(path, "unanswered or altered pings")
        return False

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- losing paths --------------------------------------------------------------------------------

    def _avoid(self, route: Sequence[bytes], seconds: float) -> None:
        until = time.monotonic() + seconds
        for relay in route:
            self.avoided[relay] = max(self.avoided.get(relay, 0.0), until)

    def _die(self, path: Path, reason: str, ended: str = "dead") -> bool:
        if self.paths.pop((path.first, path.link), None) is None:
            return False
        was_live, was_carrying = path.live, path.carrying
        path.state = ended
        if not path.ready.done():
            path.ready.set_exception(TransportError(reason))
            path.ready.exception()
        if was_live:
            self.counters["died"] += 1
        if was_carrying:
            log.info("path via proxy %s died: %s", path.proxy.hex()[:16], reason)
            for listener in self.on_death:
                listener(path)
        return True

    async def _send_down(self, path: Path) -> None:
        """Tell the path's relays to forget it (they would after an idle while anyway)."""
        with contextlib.suppress(TransportError):
            await self.send(path.first, "down", [path.link])

    def _lost(self, path: Path, reason: str) -> bool:
        """A relay of the path ended it ("down"), or our connection to its first relay closed: events
        any relay of the path can cause at will, so they must not give it a new draw. A live path lost
        so is built again over the same relays at once (`_rebuild_lost`); a path still being built has
        failed its setup (its relays are avoided for a while, `_set_up`); a retiring one was replaced
        already."""
        was_live = path.live
        if not self._die(path, reason):
            return False
        if was_live:
            self.counters["lost"] += 1
            self._rebuild_lost(path)
        return True

    def _rebuild_lost(self, lost: Path) -> None:
        """Reserve a path over `lost`'s relays now (so that the `fill` its death set off draws none
        in its place), with the uses and lifetime it had left, and set it up. Not when its route is
        no longer usable (a relay left the list or is avoided, or misbehaved on another path): then
        `fill` draws a fresh one. A route lost again within `failed_setup_avoid_seconds` of its rebuild
        is treated as a failed setup: all its relays are avoided for that long, the one that keeps
        ending it with them, and `fill` draws a fresh route."""
        now = time.monotonic()
        window = self.settings.failed_setup_avoid_seconds
        self._rebuilt = {r: t for r, t in self._rebuilt.items() if now - t < window}
        route = lost.route
        if route in self._rebuilt:
            del self._rebuilt[route]
            self.counters["lost_again"] += 1
            self._avoid(route, window)
            return
        users = self.users()
        left_out, _ = self._shunned(users)
        if lost.suspect or not set(route) <= set(users) - {self.me} or set(route) & left_out:
            return
        if sum(p.state in ("building", "live") for p in self.paths.values()) >= self.settings.target:
            return
        path = self._reserve(route, lost.listed)
        path.uses, path.expires = lost.uses, lost.expires
        self._rebuilt[route] = now
        self.counters["rebuilt"] += 1
        self.spawn(self._rebuild(path))

    async def _rebuild(self, path: Path) -> None:
        if await self._set_up(path) is None:  # its relays are avoided now: draw another route at once
            await self.fill()

    async def lose(self, path: Path, reason: str) -> None:
        """Our first relay could not be reached to carry something over the path: as `_lost` (it is
        that relay's doing as much as a closed connection is), and tell the path's relays."""
        if self._lost(path, reason):
            await self._send_down(path)

    async def drop(self, path: Path, reason: str, ended: str = "dead") -> None:
        """The path was replaced (`ended` "spent"), or we are closing: tear it down. (A path whose first
        relay cannot be reached is lost, `lose`.)"""
        if self._die(path, reason, ended):
            await self._send_down(path)

    async def penalize(self, path: Path, reason: str) -> None:
        """The path dropped or corrupted traffic: tear it down and avoid its relays, also when it was
        already spent (a used-up path's drops show only once its answer is in)."""
        if path.penalized:
            return
        path.penalized = True
        self.counters["penalized"] += 1
        self._avoid(path.route, self.settings.avoid_seconds)
        self._retire_through(path.route)
        if self._die(path, reason):
            await self._send_down(path)

    def _retire_through(self, relays: Sequence[bytes]) -> None:
        """Paths over any of `relays` take no new request: built before those relays were avoided (a used
        path's replacements are built while its answer is still coming back), they are replaced over
        others, and the answers they carry still come in."""
        suspect = set(relays)
        for other in [p for p in self.paths.values() if suspect & set(p.route)]:
            other.suspect = True
            if other.live:
                self._retire(other)

    async def close_all(self) -> None:
        for path in list(self.paths.values()):
            await self.drop(path, "closing")

    # -- PathOwner -----------------------------------------------------------------------------------

    def deliver(self, peer: bytes, link: bytes, sealed: bytes) -> bool:
        path = self.paths.get((peer, link))
        if path is None:
            return False
        try:
            payload = path.open(sealed)
        except onion.OnionError:
            self.counters["altered"] += 1
            self.spawn(self.penalize(path, "a relay altered its traffic"))
            return True
        kind, data = payload.first, payload.data
        if kind == "ready":
            if path.state == "building" and hmac.compare_digest(data, path.token):
                path.state = "live"
                path.ready.set_result(path)
        elif kind == "pong":
            pending = self._pings.get(link)
            if pending is not None and not pending[1].done():
                pending[1].set_result(hmac.compare_digest(pending[0], data))
        elif kind == "unreachable":
            self.on_unreachable(path, data)
        elif path.carrying and (reply_key := self.reply_key(payload.reply_id)) is not None:
            try:
                clove = onion.open_payload(reply_key, onion.REPLY, data).data
            except onion.OnionError:
                self.counters["altered"] += 1
                self.spawn(self.penalize(path, "its proxy altered an answer clove"))
                return True
            self.on_clove(path, clove)
        return True

    def path_down(self, peer: bytes, link: bytes) -> bool:
        path = self.paths.get((peer, link))
        return path is not None and self._lost(path, "a relay reported the path down")

    def peer_closed(self, peer: bytes) -> None:
        for path in [p for p in self.paths.values() if p.first == peer]:
            self._lost(path, "the first relay went away")
