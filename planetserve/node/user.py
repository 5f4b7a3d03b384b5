"""The user relay: relays other users' paths, keeps its own proxies, and serves a local
OpenAI-compatible endpoint whose requests travel to model nodes anonymously.

A request from the user's program is checked here (the same parser the model nodes use), sent to a
trusted model node of the requested model (or to the registered node its `planetserve.node` names,
trusted or not: how the committee challenges a given node) as n S-IDA cloves over n of our live paths,
and answered in reply parts that come back as cloves through the proxies the prompt listed. What the
program receives is exactly what the model node's own API would have sent, streaming included; overlay
failures become OpenAI-shaped errors with specific codes (`too_few_paths`, `timeout`, `model_not_found`,
`node_not_found`, `node_model_mismatch`, `answer_too_large`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import re
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from planetserve.chain.challenge import ANSWERED_BY
from planetserve.chain.keys import KeySet
from planetserve.node.api.openai import (
    ApiError,
    ApiLimits,
    ApiRequest,
    ChatMessage,
    Endpoint,
    PlanetServeOptions,
    bad_request,
    canonical_body,
    check_model,
    models_body,
    parse_json_body,
    parse_request_body,
)
from planetserve.node.api.surface import EVENT_STREAM, ApiServer, Reply, single_part
from planetserve.node.engine.wire import SSE_DONE, sse
from planetserve.node.home import UserConfig
from planetserve.node.overlay import onion, sida
from planetserve.node.overlay.directory import Directory, DirectoryView, Knocks, OnDemand, registered
from planetserve.node.overlay.messages import (
    MAX_MESSAGE,
    MAX_PROXIES,
    MessageError,
    Part,
    Prompt,
    open_message,
    sent_now,
)
from planetserve.node.overlay.paths import Path, PathManager, PathSettings
from planetserve.node.overlay.relay import Relay
from planetserve.node.overlay.transport import Peering, TransportError
from planetserve.node.sessions import Sessions, conversation_key, new_session_id, remembered, session_key
from planetserve.node.tasks import stop_tasks
from planetserve.registry.epochs import SEED_BITS, to_seed

log = logging.getLogger(__name__)

MAX_TRACKED_MESSAGES = 4096
DROP_GRACE_SECONDS = 1.0
NODE_AVOID_SECONDS = 60.0
NODE_ATTEMPTS = 3
"""Times one request is sent, each over paths to proxies none of its earlier sends used, while more than
n - k of the proxies of each send say that the node cannot be reached (`UserRelay._node_unreachable`).
A proxy's "unreachable" is its word alone, and colluding proxies said it of every node but theirs: two
of a request's four failed it and had the node avoided for NODE_AVOID_SECONDS (about 31% of requests
with 4 of 14 relays colluding). Each refused send takes at least n - k + 1 of the colluders out of the
request's later draws, so L of them can refuse at most L / (n - k + 1) sends: 3 sends outlast 4 colluders
among 14 relays, and where a fraction f of a large list colludes, a send is refused with a probability
of about 6f² (0.33 at f = 0.29) and all three with about its cube (0.036). The node itself is avoided
only when every proxy of one send says it cannot be reached and no send was answered: an honest proxy
says so only when that is true, so a node that is down is still avoided after one send, and colluders
must hold all n proxies of a send (about f⁴, 0.007 at f = 0.29) to have an honest node avoided."""
USER_LIMITS = ApiLimits(max_body_bytes=MAX_MESSAGE - (64 << 10))
NODE_KEY = re.compile(r"[0-9a-fA-F]{64}")
MAX_PARTS_AHEAD = 64
"""Reply parts kept beyond the next one expected (parts overtake each other on different paths)."""
INF = float("inf")
MAX_ANSWER_BYTES = 16 << 20
"""The most of one answer a model node can send: more is refused, streamed or not."""
BY_RELAY, BY_NODE = {ANSWERED_BY: "relay"}, {ANSWERED_BY: "node"}
"""Whose words an answer is, as the relay's HTTP answers say (`challenge.ANSWERED_BY`)."""


def too_few_paths(live: int, needed: int, detail: str = "") -> ApiError:
    return ApiError(503, f"Only {live} anonymous path(s) survive{detail}; {needed} are needed. New paths are "
                    f"being built; retry shortly.", type="server_error", code="too_few_paths")


def node_unreachable(node: bytes, seconds: float, sends: int = 1) -> ApiError:
    """`seconds`: how long the node is avoided now (0: not, as only some proxies of each of the request's
    `sends` said that it cannot be reached)."""
    then = (f"it is avoided for {seconds:g} s, so a retry goes to another node." if seconds else
            f"asked over {sends} set(s) of different proxies, not all said so, so it is not avoided.")
    return ApiError(502, f"The model node {node.hex()[:16]} cannot be reached by enough of our proxies; "
                    f"{then}", type="server_error", code="node_unreachable")


def timed_out(seconds: float) -> ApiError:
    return ApiError(504, f"No answer from the model node within {seconds:g} seconds.", type="server_error",
                    code="timeout")


def node_not_found(key: bytes) -> ApiError:
    return ApiError(404, f"No active registered model node has the key {key.hex()}.", type="not_found_error",
                    code="node_not_found", param="planetserve.node")


def answer_too_large() -> ApiError:
    return ApiError(502, f"The model node's answer exceeds {MAX_ANSWER_BYTES} bytes.", type="server_error",
                    code="answer_too_large")


@dataclass(eq=False)
class Exchange:
    """One request in flight: the paths it used and the answer's parts as they arrive."""

    request_id: bytes
    node: bytes
    paths: tuple[Path, ...]
    k: int
    reply_keys: dict[bytes, bytes] = field(default_factory=dict, repr=False)
    """Reply id -> reply key, one pair per path, fresh for this request: nothing a model node sees in
    one request recurs in another."""
    parts: dict[int, Part] = field(default_factory=dict)
    unreachable: set[Path] = field(default_factory=set)
    """Paths whose proxy said that the node cannot be reached."""
    refused: bool = False
    """More than n - k of them did: the node cannot have the prompt, or answer over k proxies."""
    asking: Asking | None = None
    """The request this is one send of."""
    next_seq: int = 0
    held: int = 0
    """Bytes of the parts kept, not yet read."""
    consumed: int = 0
    """Bytes of the answer read so far."""
    messages: int = 0
    delivered: Counter = field(default_factory=Counter)
    failure: ApiError | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, part: Part) -> None:
        """Keep a part of the answer; one far ahead of the next expected is dropped, and one that would
        take what is read and kept past MAX_ANSWER_BYTES fails the answer, so a node cannot make us hold
        an unbounded answer out of order (64 parts of 4 MiB ahead of a part it never sent were kept)."""
        if not self.next_seq <= part.seq < self.next_seq + MAX_PARTS_AHEAD:
            return
        replaced = self.parts.get(part.seq)
        held = self.held + len(part.data) - (len(replaced.data) if replaced is not None else 0)
        if self.consumed + held > MAX_ANSWER_BYTES:
            self.fail(answer_too_large())
            return
        self.held = held
        self.parts[part.seq] = part
        self.changed.set()

    @property
    def begun(self) -> bool:
        """An answer part arrived: the node had the prompt."""
        return self.messages > 0 or self.next_seq > 0

    def fail(self, error: ApiError) -> None:
        if self.failure is None:
            self.failure = error
            self.changed.set()

    def check_paths(self) -> None:
        live = sum(p.carrying for p in self.paths)
        if live < self.k:
            self.fail(too_few_paths(live, self.k, f" of the {len(self.paths)} this request used"))

    async def next_part(self, timeout: float) -> Part:
        """The next part in order, within `timeout` seconds however many other parts arrive."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self.next_seq in self.parts:
                self.next_seq += 1
                part = self.parts.pop(self.next_seq - 1)
                self.held -= len(part.data)
                return part
            if self.failure is not None:
                raise self.failure
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), max(deadline - loop.time(), 0.0))
            except TimeoutError:
                raise timed_out(timeout) from None

    async def data(self, first: Part, timeout: float) -> AsyncIterator[bytes]:
        """The answer's bytes part by part, from `first` to the last; ApiError when it cannot finish
        or grows past MAX_ANSWER_BYTES."""
        part = first
        while True:
            self.consumed += len(part.data)
            if self.consumed > MAX_ANSWER_BYTES:
                raise answer_too_large()
            yield part.data
            if part.last:
                return
            part = await self.next_part(timeout)


@dataclass(eq=False)
class Asking:
    """One request, sent up to NODE_ATTEMPTS times."""

    node: bytes
    attempts: list[Exchange] = field(default_factory=list)
    verdict: ApiError | None = None
    """Set once every proxy of one send said the node cannot be reached: it is avoided."""

    @property
    def proxies(self) -> set[bytes]:
        return {p.proxy for e in self.attempts for p in e.paths}


class UserRelay:
    def __init__(self, config: UserConfig, keys: KeySet, directory: Directory | None, *,
                 settings: PathSettings | None = None, rng: random.Random | None = None) -> None:
        self.config = config
        self.keys = keys
        self.view = DirectoryView(0)
        self.refresh_directory: OnDemand | None = None
        self.knocks: Knocks | None = None
        if directory is not None:
            self.refresh_directory = OnDemand(directory.refresh, self.apply_view)
            self.knocks = Knocks(partial(registered, directory.ledger, nodes=True), self.refresh_directory)
        self.peering = Peering(keys, self._on_peer, self._authorized, on_close=self._peer_closed,
                               knock=self.knocks)
        self.paths = PathManager(keys.public, self._send, lambda: sorted(self.view.users),
                                 settings=settings or path_settings(config), rng=rng)
        self.paths.on_clove = self._on_clove
        self.paths.on_unreachable = self._node_unreachable
        self.paths.on_death.append(self._path_died)
        self.paths.in_use = lambda path: any(path in e.paths for e in self.exchanges.values())
        self.relay = Relay(onion.exchange_secret(keys.identity), self._send,
                           is_user=lambda key: key in self.view.users,
                           is_node=lambda key: self.view.node(key) is not None,
                           knock=self.knocks, owner=self.paths)
        self.reassembler = sida.Reassembler(max_n=MAX_PROXIES)
        self.exchanges: dict[bytes, Exchange] = {}
        self.reply_keys: dict[bytes, bytes] = {}
        """The reply ids of requests in flight (and for a grace period after), with their keys."""
        self.paths.reply_key = self.reply_keys.get
        self.arrivals: OrderedDict[bytes, list[Path]] = OrderedDict()
        """Per answer message still being reassembled: the paths its cloves came by."""
        self.answered: OrderedDict[bytes, Exchange] = OrderedDict()
        self.sessions = Sessions()
        self.seed_key = secrets.token_bytes(32)
        """Keys the seeds programs choose (`relayed_seed`): this relay's alone, for its lifetime."""
        self.avoided_nodes: dict[bytes, float] = {}
        self.counters = {"requests": 0, "answered": 0, "failed": 0, "bad_cloves": 0, "dropping_paths": 0,
                         "resent": 0}
        self.surface = ApiServer(self, max_body_bytes=USER_LIMITS.max_body_bytes,
                                 documents={"/v1/planetserve/status": self.status},
                                 hosts=(config.peer, config.advertise))
        self.http_url = ""
        self.peer_port = 0
        self._tasks: set[asyncio.Task] = set()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self, *, serve_http: bool = True) -> None:
        host, _, port = self.config.peer.rpartition(":")
        self.peer_port = await self.peering.listen(host, int(port))
        if int(port) == 0:  # the address we register and others dial is the port we got
            self.config = replace(self.config, peer=f"{host}:{self.peer_port}")
        if self.refresh_directory is not None:
            await self.refresh_directory()
            self.spawn(self._directory_loop(self.refresh_directory))
        self.spawn(self._expiry_loop())  # relaying for others needs it too
        if serve_http:
            http_host, _, http_port = self.config.http.rpartition(":")
            self.http_url = await self.surface.start(http_host, int(http_port))

    def start_paths(self) -> None:
        """Keep proxies from now on (a relay that only relays for others never calls this)."""
        self.spawn(self.paths.maintain())

    async def close(self) -> None:
        await self.paths.close_all()
        await stop_tasks(self._tasks)
        await self.surface.close()
        await self.peering.close()

    def spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def apply_view(self, view: DirectoryView) -> None:
        if view.height >= self.view.height:
            self.view = view

    async def _directory_loop(self, refresh: OnDemand) -> None:
        while True:
            await asyncio.sleep(self.config.list_interval)
            await refresh()

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(60)
            self.relay.expire()
            self.reassembler.expire()

    # -- peers ---------------------------------------------------------------------------------------

    def _authorized(self, key: bytes) -> bool:
        return key in self.view.users or self.view.node(key) is not None

    async def _send(self, peer: bytes, msg_type: str, body: Any) -> None:
        address = self.view.address(peer)
        if address is None:
            raise TransportError(f"{peer.hex()[:16]} is neither a listed user nor a registered model node")
        await self.peering.notify(peer, address, msg_type, body)

    async def _on_peer(self, peer: bytes, msg_type: str, body: Any) -> None:
        await self.relay.handle(peer, msg_type, body)

    def _peer_closed(self, peer: bytes) -> None:
        self.paths.peer_closed(peer)
        self.spawn(self.relay.peer_closed(peer))

    def _path_died(self, _path: Path) -> None:
        """Requests that used the path may now have too few; the path is replaced. When a relay of it
        ended it, the PathManager has already reserved its rebuild over the same relays (`paths._lost`),
        which this fill counts: a relay that tears down our paths does not get them drawn again."""
        for exchange in self.exchanges.values():
            exchange.check_paths()
        self.spawn(self.paths.fill())

    # -- answers coming back ---------------------------------------------------------------------------

    def _on_clove(self, path: Path, data: bytes) -> None:
        try:
            clove = sida.decode(data)
        except sida.CloveError:  # sealed by the node under our reply key: the node sent garbage
            self.counters["bad_cloves"] += 1
            return
        mid = clove.message_id
        if (late := self.answered.get(mid)) is not None:
            late.delivered[path] += 1
            return
        self.arrivals.setdefault(mid, []).append(path)
        while len(self.arrivals) > MAX_TRACKED_MESSAGES:
            self.arrivals.popitem(last=False)
        try:
            message = self.reassembler.add(clove)
        except sida.CloveError:
            self.counters["bad_cloves"] += 1
            return
        if message is None:
            return
        try:
            part = open_message(message)
        except MessageError:
            self.counters["bad_cloves"] += 1
            return
        exchange = self.exchanges.get(part.request_id) if isinstance(part, Part) else None
        arrivals = self.arrivals.pop(mid, [])
        if exchange is None:
            return
        self.answered[mid] = exchange
        while len(self.answered) > MAX_TRACKED_MESSAGES:
            self.answered.popitem(last=False)
        exchange.messages += 1
        exchange.delivered.update(arrivals)
        exchange.add(part)

    def _node_unreachable(self, path: Path, node: bytes) -> None:
        """A path's proxy says it could not reach the node. That is the proxy's word (only the proxy can
        say it: the answer is sealed under the path key), and a proxy that wants our requests to go to
        another node says it falsely. So it weighs against this send of the request only: once more than
        n - k of its proxies said so, the node cannot have the prompt or answer over k proxies, and the
        request is sent again over paths to proxies it has not used (`ask`, NODE_ATTEMPTS). The node is
        avoided only when every proxy of one send said so, which an honest proxy does only when it is
        true; a request refused on every send fails without the node being avoided. The path itself is
        neither retired nor are its relays avoided: the claim says nothing about the path, an honest
        proxy makes it when a node is down, and replacing the path would be a fresh draw any proxy could
        ask for (as "down" was, `paths._lost`)."""
        for exchange in list(self.exchanges.values()):
            if (exchange.node != node or path not in exchange.paths or path in exchange.unreachable
                    or exchange.begun):
                continue
            exchange.unreachable.add(path)
            sends = exchange.asking.attempts if exchange.asking is not None else [exchange]
            if len(exchange.unreachable) == len(exchange.paths) and not any(s.begun for s in sends):
                self.avoided_nodes[node] = time.monotonic() + NODE_AVOID_SECONDS
                verdict = node_unreachable(node, NODE_AVOID_SECONDS)
                if exchange.asking is not None:
                    exchange.asking.verdict = verdict
                for send in sends:
                    send.fail(verdict)
            elif len(exchange.paths) - len(exchange.unreachable) < exchange.k and not exchange.refused:
                exchange.refused = True
                exchange.fail(node_unreachable(node, 0, len(sends)))

    def _penalize_dropping(self, path: Path) -> None:
        self.counters["dropping_paths"] += 1
        self.spawn(self.paths.penalize(path, "dropped cloves"))

    async def _check_drops(self, exchange: Exchange) -> None:
        """After the answer and a grace period: a path that carried fewer than half of the answer's
        messages (and did not fail on its own meanwhile) is dropping them."""
        await asyncio.sleep(DROP_GRACE_SECONDS)
        for reply_id in exchange.reply_keys:
            self.reply_keys.pop(reply_id, None)
        if exchange.messages < 2:
            return
        for path in exchange.paths:
            if path.state != "dead" and 2 * exchange.delivered[path] < exchange.messages:
                self._penalize_dropping(path)

    # -- asking ------------------------------------------------------------------------------------------

    async def ask(self, node: bytes, endpoint: Endpoint, body: bytes) -> Reply:
        """Send one API request to `node` through the overlay; the Reply streams its answer. A request
        that more than n - k of its proxies say cannot reach the node is sent again over paths to other
        proxies (`_first_part`)."""
        asking = Asking(node)
        try:
            first = await self._first_part(asking, endpoint, body)
            exchange = asking.attempts[-1]
            self.paths.replenish()
            for earlier in asking.attempts[:-1]:
                self._finish(earlier, False, counted=False)
            if first.content_type == EVENT_STREAM:
                return Reply(first.status, first.content_type, self._stream(exchange, first), BY_NODE)
            body = b"".join([data async for data in exchange.data(first, self.config.response_timeout)])
        except BaseException:
            self.paths.replenish()
            for attempt in asking.attempts:
                self._finish(attempt, False, counted=attempt is asking.attempts[-1])
            raise
        self._finish(exchange, True)
        return Reply(first.status, first.content_type, single_part(body), BY_NODE)

    async def _first_part(self, asking: Asking, endpoint: Endpoint, body: bytes) -> Part:
        """Send the request, and again (NODE_ATTEMPTS in all) over paths to proxies that no earlier send
        used while more than n - k of a send's proxies say the node cannot be reached; the first part of
        the answer. The earlier sends stay in `exchanges` until then, so that a send all of whose proxies
        say so has the node avoided and ends the request (`_node_unreachable`)."""
        for attempt in range(NODE_ATTEMPTS):
            if attempt == 0:
                chosen = await self._request_paths()
            else:
                refusal = asking.attempts[-1].failure
                chosen = await self._paths_avoiding(asking.proxies)
                if asking.verdict is not None:
                    raise asking.verdict
                if len(chosen) < self.config.k:  # no other proxies to ask
                    raise refusal  # type: ignore[misc]
                self.counters["resent"] += 1
            exchange = await self._launch(asking, endpoint, body, chosen)
            try:
                return await exchange.next_part(self.config.response_timeout)
            except ApiError:
                if asking.verdict is not None:
                    raise asking.verdict from None
                if not exchange.refused or attempt == NODE_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    async def _request_paths(self) -> tuple[Path, ...]:
        """n of the live paths, chosen at random."""
        n, k = self.config.n, self.config.k
        want = min(n, self.paths.settings.target)
        live = self.paths.live()
        if len(live) < want:
            # A request right after another may find its predecessor's paths retired and their
            # replacements still being built: it waits for them, since one sent over fewer paths would
            # stand out by its (n, k) and lose the slack of a lost path. Fewer go only where the
            # network cannot give more within the setup time, and never fewer than k.
            await self.paths.wait_live(want, self.paths.settings.setup_timeout)
            live = self.paths.live()
            if len(live) < k:
                raise too_few_paths(len(live), k, f" (last error: {self.paths.last_error})"
                                    if self.paths.last_error else "")
        return tuple(secrets.SystemRandom().sample(live, min(n, len(live))))

    async def _paths_avoiding(self, proxies: set[bytes]) -> tuple[Path, ...]:
        """n live paths to distinct proxies none of `proxies`, chosen at random, building what is missing
        within the setup time; fewer if the list cannot give them."""
        want = min(self.config.n, self.paths.settings.target)
        deadline = time.monotonic() + self.paths.settings.setup_timeout
        while True:
            live = self.paths.live()
            ends, fresh = set(proxies), []
            for path in secrets.SystemRandom().sample(live, len(live)):
                if path.proxy not in ends:
                    ends.add(path.proxy)
                    fresh.append(path)
            if len(fresh) >= want or time.monotonic() >= deadline:
                return tuple(fresh[:want])
            built = await asyncio.gather(*(self.paths.build(proxies=ends) for _ in range(want - len(fresh))))
            if not any(built):
                await asyncio.sleep(0.2)

    async def _launch(self, asking: Asking, endpoint: Endpoint, body: bytes,
                      chosen: tuple[Path, ...]) -> Exchange:
        """Send the prompt to `asking.node` over `chosen`, each path naming a fresh reply id and key; the
        exchange its answer will come to."""
        k, node = self.config.k, asking.node
        request_id = secrets.token_bytes(16)
        threshold = min(k, len(chosen))
        replies = [(secrets.token_bytes(onion.ID_SIZE), secrets.token_bytes(onion.KEY_SIZE)) for _ in chosen]
        prompt = Prompt(request_id, node, endpoint, body,
                        tuple((p.proxy, *reply) for p, reply in zip(chosen, replies, strict=True)), threshold,
                        sent_now())
        cloves = sida.split_encoded(prompt.seal(), len(chosen), threshold)
        exchange = Exchange(request_id, node, chosen, threshold, dict(replies), asking=asking)
        if not asking.attempts:
            self.counters["requests"] += 1
        asking.attempts.append(exchange)
        self.exchanges[request_id] = exchange
        self.paths.use(chosen)
        self.reply_keys.update(exchange.reply_keys)
        payloads = [p.seal(node, onion.seal_to(node, c), reply_id)
                    for p, c, (reply_id, _) in zip(chosen, cloves, replies, strict=True)]
        sent = await asyncio.gather(*(self._send(p.first, "fwd", [p.link, data])
                                      for p, data in zip(chosen, payloads, strict=True)),
                                    return_exceptions=True)
        for path, result in zip(chosen, sent, strict=True):
            if result is not None:
                self.spawn(self.paths.lose(path, f"the prompt could not be sent: {result}"))
        delivered = sum(r is None for r in sent)
        if delivered < exchange.k:
            raise too_few_paths(delivered, exchange.k, " the prompt could be sent on")
        return exchange

    async def _stream(self, exchange: Exchange, first: Part) -> AsyncIterator[bytes]:
        ok = False
        try:
            async for data in exchange.data(first, self.config.response_timeout):
                if data:
                    yield data
            ok = True
        except ApiError as exc:
            yield sse(exc.body())
            yield SSE_DONE
        finally:
            self._finish(exchange, ok)

    def _finish(self, exchange: Exchange, ok: bool, counted: bool = True) -> None:
        """The exchange is over; `counted` false for a send of a request that was sent again."""
        if self.exchanges.pop(exchange.request_id, None) is None:
            return
        if counted:
            self.counters["answered" if ok else "failed"] += 1
        self.spawn(self._check_drops(exchange))

    def trusted_model(self, request: ApiRequest) -> str:
        """The model a request names, which some trusted node must serve."""
        models = sorted(self.view.models())
        if not models:
            raise ApiError(503, "No trusted model node is listed on the ledger yet.", type="server_error",
                           code="no_model_nodes")
        try:
            return check_model(request, models)
        except ApiError as exc:
            raise ApiError(exc.status, f"{exc} No trusted model node serves it; served models: "
                           f"{', '.join(models)}.", type=exc.type, code=exc.code, param="model") from None

    def named_node(self, key: bytes, request: ApiRequest) -> bytes:
        """The node a request names, trusted or not: it must be registered, active, and serve the model
        the request asks for."""
        node = self.view.node(key)
        if node is None:
            raise node_not_found(key)
        if request.model is not None and request.model != node.model_id:
            raise bad_request(f"The model node {key.hex()[:16]} serves `{node.model_id}`, not "
                              f"`{request.model[:200]}`.", "model", code="node_model_mismatch")
        return key

    def choose_node(self, request: ApiRequest, model: str) -> tuple[bytes, str]:
        """A trusted node of the model, and the session id to give it: every request of a conversation
        goes to the same entry node under the same random session id, so the group serves it where its
        KV cache is; any other request gets a fresh one (so a session id says nothing of who sent it)."""
        known = self.sessions.get(session_key(request))
        if known is not None and known[0] in self.view.nodes:
            return known
        nodes = self.view.models().get(model, [])
        now = time.monotonic()
        reachable = [n for n in nodes if self.avoided_nodes.get(n.pubkey, 0.0) <= now]
        chosen = secrets.choice(reachable or nodes).pubkey
        return chosen, self._start_session(request, chosen)

    def named_session(self, request: ApiRequest, node: bytes) -> str:
        """The session id for a request to a node it names: its conversation's, when that was with this
        node, else a new one (so a challenge's follow-up arrives like a user's)."""
        known = self.sessions.get(session_key(request))
        if known is not None and known[0] == node:
            return known[1]
        return self._start_session(request, node)

    def _start_session(self, request: ApiRequest, node: bytes) -> str:
        session = new_session_id()
        self.sessions.keep(session_key(request), node, session)
        return session

    def _continued(self, request: ApiRequest, node: bytes, session: str, reply: Reply) -> Reply:
        """`reply`, recording as it passes the conversation its answer continues (`sessions.py`): the
        program's next turn goes to the same node under the same session id."""
        if reply.status != 200 or request.endpoint != "chat" or request.planetserve.session_id:
            return reply

        def delivered(text: str) -> None:
            answered = (*request.messages, ChatMessage("assistant", text))
            self.sessions.keep(conversation_key(request.model, answered), node, session)

        return replace(reply, parts=remembered(reply.parts, reply.streamed, delivered))

    # -- the local OpenAI-compatible endpoint (answers for `surface`) ------------------------------------

    def health(self) -> tuple[int, dict[str, Any] | None]:
        live = len(self.paths.live())
        ok = live >= self.config.k
        return 200 if ok else 503, {"ok": ok, "live_paths": live}

    def models(self) -> dict[str, Any]:
        """The models of the trusted list, without `max_model_len`: the ledger does not record a model's
        context length, and the nodes serving one may differ in it (each node's /v1/models says its own)."""
        return models_body(sorted(self.view.models()), max_model_len=None)

    async def respond(self, endpoint: Endpoint, raw: bytes) -> Reply:
        """A request of the user's program, answered through the overlay by the node it names or one
        chosen for it; an overlay failure is an OpenAI-shaped error. What travels is the request
        re-encoded canonically under this relay's session id, with the model it resolved to, and
        nothing else the program wrote (`canonical_body`)."""
        try:
            body = parse_json_body(raw, USER_LIMITS)
            named, request = taken_request(endpoint, body, self.seed_key)
            if named is not None:  # exactly that node, whatever the conversation's was; no avoidance
                node = self.named_node(named, request)
                model, session = self.view.node(node).model_id, self.named_session(request, node)
            else:
                model = self.trusted_model(request)
                node, session = self.choose_node(request, model)
            reply = await self.ask(node, endpoint, relayed_body(request, model, session))
            return self._continued(request, node, session, reply)
        except ApiError as exc:
            return Reply.json(exc.body(), exc.status, BY_RELAY)

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        live = self.paths.live()
        return {
            "user": self.keys.public.hex(), "address": self.config.address,
            "directory_height": self.view.height,
            "users": len(self.view.users), "model_nodes": len(self.view.nodes),
            "registered_nodes": len(self.view.registered),
            "paths": [{"proxy": p.proxy.hex(), "age": round(now - p.created, 1), "misses": p.misses,
                       "replaced_in": round(max(p.expires - now, 0.0), 1) if p.expires != INF else None,
                       "listed": p.listed}
                      for p in live],
            "distinct_proxies": len({p.proxy for p in live}),
            "rotations": self.paths.counters["rotated"],
            "relayed_paths": len(self.relay.forward), "counters": dict(self.counters),
            "path_counters": dict(self.paths.counters), "relay_counters": dict(self.relay.counters),
            "last_path_error": self.paths.last_error,
        }


def path_settings(config: UserConfig) -> PathSettings:
    """The paths a relay keeps, from its configuration: N = max(proxies, n), pinged every
    `ping_interval`, replaced after `path_uses` requests or about `path_lifetime`; a replaced path stays
    open for answers as long as a request waits for its next part."""
    return PathSettings(target=max(config.proxies, config.n), ping_interval=config.ping_interval,
                        lifetime=config.path_lifetime, retire_grace=config.response_timeout,
                        uses=config.path_uses)


def relayed_body(request: ApiRequest, model: str, session_id: str) -> bytes:
    """What leaves the relay for a program's request: the request in its canonical encoding, naming the
    model it resolved to and carrying the relay's session id as its only extension."""
    options = PlanetServeOptions(session_id=session_id)
    return canonical_body(replace(request, model=model, planetserve=options))


def taken_request(endpoint: Endpoint, body: dict[str, Any], seed_key: bytes
                  ) -> tuple[bytes | None, ApiRequest]:
    """A program's request as this relay sends it on, and the node it names (if any): the relay's own
    fields taken out and the seed it travels with set (`relayed_seed`)."""
    named, exact = _named_node(body), _exact_seed(body)
    request = parse_request_body(endpoint, body, USER_LIMITS)
    return named, replace(request, seed=relayed_seed(request, seed_key) if exact is None else exact)


def relayed_seed(request: ApiRequest, key: bytes) -> int:
    """The seed a request travels with: a fresh uniform one when the program sent none, else the
    program's keyed by this relay (`key`) together with what the request asks, so that a program's rerun
    of a request with its seed is reproduced while no seed a node sees repeats across different
    requests or looks chosen (a program's 42 on every request would tell it from a challenge)."""
    if request.seed is None:
        return secrets.randbits(SEED_BITS)
    asked = canonical_body(replace(request, seed=None, planetserve=PlanetServeOptions()))
    digest = hashlib.blake2b(to_seed(request.seed).to_bytes(8, "big") + asked, key=key, digest_size=8)
    return int.from_bytes(digest.digest(), "big") >> (64 - SEED_BITS)


def _relay_field(body: dict[str, Any], name: str, valid: Callable[[Any], bool], must: str) -> Any:
    """The relay-only field `planetserve.<name>`, taken out of the body so that it never travels on; None
    when absent, a 400 saying what it `must` be when `valid` refuses it."""
    options = body.get("planetserve")
    if not isinstance(options, dict) or name not in options:
        return None
    value = options.pop(name)
    if not valid(value):
        raise bad_request(f"`planetserve.{name}` must be {must}.", f"planetserve.{name}")
    return value


def _named_node(body: dict[str, Any]) -> bytes | None:
    """The model node's key `planetserve.node` names: exactly that node answers."""
    key = _relay_field(body, "node", lambda k: isinstance(k, str) and bool(NODE_KEY.fullmatch(k)),
                       "a model node's key as 64 hex digits")
    return None if key is None else bytes.fromhex(key)


def _exact_seed(body: dict[str, Any]) -> int | None:
    """The seed `planetserve.seed` asks this relay to send unchanged: a committee member's challenge must
    reach the node with the seed its commitment binds."""
    return _relay_field(body, "seed", lambda s: type(s) is int and 0 <= s < 1 << SEED_BITS,
                        f"an integer in [0, 2**{SEED_BITS})")
