"""The model node: serves its model through the OpenAI-compatible API, forwards each request at most
once within its group by the HR-tree and the load-balance factor (Algorithm 2), keeps the group's
cache state in sync, and signs every answer it returns with its registered key, a peer's included once
the peer's own signature checks (the node a client addressed answers for what it returns).

Peer protocol (over `transport`), between members of the group:
  "cache"     one-way, bytes: a cachesync message (deltas, snapshots, snapshot requests, loads)
  "generate"  request, a forwarded prompt: replies are ["chunk", ids, finish, prompt_tokens,
              cached_tokens] and a last ["signed", extension]; the forwarded node never forwards again.
and from listed users (proxies of the anonymous overlay, see `gateway`):
  "clove"     one-way, bytes: one clove of a prompt; answers go back as "reply" messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from planetserve.chain.challenge import (
    ResponseFormatError,
    response_extension,
    response_from_extension,
    response_valid,
    served_extension,
    sign_response,
)
from planetserve.chain.keys import KeySet
from planetserve.metrics import Histogram
from planetserve.node.api.engine_server import EngineServer, Generation, Production
from planetserve.node.api.openai import (
    ApiError,
    ApiLimits,
    ApiRequest,
    PlanetServeOptions,
    bad_request,
    build_generation,
    check_prompt_tokens,
    prompt_text,
    render_prompt,
    tokenize_prompt,
    too_large,
)
from planetserve.node.behaviours import ALTER_PROMPTS, clickbait
from planetserve.node.engine.base import (
    CacheEvent,
    Engine,
    EngineError,
    GenerationRequest,
    TokenChunk,
    Tokenizer,
)
from planetserve.node.engine.kvevents import PrefixMirror
from planetserve.node.home import ModelNodeConfig
from planetserve.node.metrics import TTFT_BUCKETS
from planetserve.node.overlay.directory import Directory, DirectoryView, Knocks, OnDemand, registered
from planetserve.node.overlay.gateway import Gateway
from planetserve.node.overlay.onion import exchange_secret
from planetserve.node.overlay.transport import Peering, RemoteError, TransportError
from planetserve.node.pipeline.assignment import StageRole
from planetserve.node.routing.balance import (
    BalancePolicy,
    Decision,
    LatencyEWMA,
    LoadReport,
    Reason,
    checked,
    route,
)
from planetserve.node.routing.cachesync import CacheSync, SyncConfig, SyncError
from planetserve.node.routing.group import EMPTY, Group, GroupView
from planetserve.node.routing.hrtree import SearchResult
from planetserve.node.tasks import stop_tasks
from planetserve.registry.epochs import SEED_LIMIT, milli, prompt_hash

log = logging.getLogger(__name__)

MAX_SESSIONS = 10_000
MAX_FORWARD_STOP = 16
MAX_FORWARD_PROMPT_CHARS = 1 << 20
FORWARD_IDLE_S = 120.0
"""A peer serving a forwarded job that sends nothing for this long has failed (it is served here)."""
LOGPROBS_HERE = "logprobs"
"""The route of a request that asks for log-probabilities: always served by the node it reached."""


async def _replay(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


FINISH_REASONS = frozenset({"stop", "length"})
FAILED_PEER_AVOID_S = 300.0
"""How long a peer whose answer did not check (a signature that fails, none at all, a malformed reply) is
sent no forwards: it failed the request that reached it, and would fail every other (a challenge among
them) while it drew them."""


class PeerMisbehaved(TransportError):
    """A peer's reply to a forwarded job is not what `_serve_forward` sends."""


def _checked_reply(reply: Any, vocab_size: int) -> Any:
    """A peer's reply as `_serve_forward` sends it, field by field: a chunk of token ids in the
    vocabulary with its finish reason and counts, or the signed extension. Anything else, or a field of
    another type or size, is PeerMisbehaved: a peer padding a field held 400 MB of an entry node's
    memory for one buffered answer."""
    if isinstance(reply, list) and len(reply) == 5 and reply[0] == "chunk":
        _, ids, finish, prompt_tokens, cached = reply
        if (isinstance(ids, list) and all(type(t) is int and 0 <= t < vocab_size for t in ids)
                and (finish is None or finish in FINISH_REASONS)
                and all(type(n) is int and n >= 0 for n in (prompt_tokens, cached))):
            return reply
    elif isinstance(reply, list) and len(reply) == 2 and reply[0] == "signed" and isinstance(reply[1], dict):
        return reply
    raise PeerMisbehaved("the peer sent a malformed reply")


async def _bounded(replies: AsyncIterator[Any], max_tokens: int, idle: float,
                   vocab_size: int) -> AsyncIterator[Any]:
    """A forwarded job's replies, each checked (`_checked_reply`), ended with TransportError once the
    peer sends more tokens, or more replies, than the job asks for, or nothing for `idle` seconds: a peer
    in the group must not hold our memory or one of our answers without end."""
    tokens = 0
    for count in itertools.count(1):
        try:
            reply = await asyncio.wait_for(anext(replies), idle)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise TransportError(f"the peer sent nothing for {idle:g} s") from None
        if count > max_tokens + 2:  # a chunk per token, an empty last chunk, the signature
            raise PeerMisbehaved(f"the peer sent more than {max_tokens + 2} replies")
        reply = _checked_reply(reply, vocab_size)
        if reply[0] == "chunk":
            tokens += len(reply[1])
            if tokens > max_tokens:
                raise PeerMisbehaved(f"the peer sent more than the {max_tokens} tokens asked for")
        yield reply


def clickbait_request(request: ApiRequest) -> ApiRequest:
    """The request an alter-prompts node answers: a completion's text prompt, or a chat's last user
    message (its last message when no user spoke), wrapped by `clickbait`; the chat template then
    renders the altered conversation as it would any other."""
    if request.endpoint == "completions":
        if not isinstance(request.prompt, str):
            raise ValueError("only text prompts can be rewritten")
        return replace(request, prompt=clickbait(request.prompt))
    messages = list(request.messages)
    index = max((i for i, m in enumerate(messages) if m.role == "user"), default=len(messages) - 1)
    messages[index] = replace(messages[index], content=clickbait(messages[index].content))
    return replace(request, messages=tuple(messages))


def group_hash_key(model_id: str) -> bytes:
    """The HR-tree hash key of a model's group: every member derives the same one, nothing else
    needs distributing, and another model's group hashes differently."""
    return hashlib.sha256(b"planetserve/hrtree-key/v1\x00" + model_id.encode()).digest()


@dataclass(frozen=True)
class Job:
    """A request as it crosses the peer link: the text (answers are signed over it) and how to
    generate, nothing of the original HTTP request."""

    prompt: str
    special: bool
    max_tokens: int
    temperature: float
    seed: int
    """The protocol's unsigned seed (planetserve.sampling), drawn by the API when the request had none."""
    stop: tuple[str, ...]
    stop_ids: tuple[int, ...]
    ignore_eos: bool
    session_id: str | None
    top_p: float = 1.0

    def to_wire(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "special": self.special, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "seed": self.seed, "stop": list(self.stop),
                "stop_ids": list(self.stop_ids), "ignore_eos": self.ignore_eos, "session_id": self.session_id,
                "top_p": self.top_p}

    @classmethod
    def from_wire(cls, body: Any) -> Job:
        """A peer's job, checked field by field (a group member can still send garbage)."""
        if not isinstance(body, dict) or set(body) != set(cls.__dataclass_fields__):
            raise bad_request("forwarded job has the wrong fields")
        fields = {
            "prompt": str, "special": bool, "max_tokens": int, "temperature": (int, float),
            "top_p": (int, float), "stop": list, "stop_ids": list, "ignore_eos": bool,
        }
        for name, kind in fields.items():
            if not isinstance(body[name], kind) or (kind is int and isinstance(body[name], bool)):
                raise bad_request(f"forwarded job field {name!r} has the wrong type")
        if len(body["prompt"]) > MAX_FORWARD_PROMPT_CHARS or len(body["stop"]) > MAX_FORWARD_STOP:
            raise too_large("forwarded job is too large")
        if not all(isinstance(s, str) and 0 < len(s) <= 256 for s in body["stop"]):
            raise bad_request("forwarded job stop strings are malformed")
        if not all(type(t) is int and t >= 0 for t in body["stop_ids"]) or len(body["stop_ids"]) > 128:
            raise bad_request("forwarded job stop ids are malformed")
        if type(body["seed"]) is not int or not 0 <= body["seed"] < SEED_LIMIT:
            raise bad_request("forwarded job seed is malformed")
        if body["session_id"] is not None and not isinstance(body["session_id"], str):
            raise bad_request("forwarded job session id is malformed")
        if not 0 <= body["temperature"] <= 2:
            raise bad_request("forwarded job temperature is out of range")
        if isinstance(body["top_p"], bool) or not 0 <= body["top_p"] <= 1:
            raise bad_request("forwarded job top_p is out of range")
        return cls(body["prompt"], body["special"], body["max_tokens"], float(body["temperature"]),
                   body["seed"], tuple(body["stop"]), tuple(body["stop_ids"]), body["ignore_eos"],
                   body["session_id"], float(body["top_p"]))

    def api_request(self) -> ApiRequest:
        return ApiRequest("completions", None, prompt=self.prompt, max_tokens=self.max_tokens,
                          temperature=self.temperature, seed=self.seed, top_p=self.top_p, stop=self.stop,
                          stop_token_ids=self.stop_ids, ignore_eos=self.ignore_eos,
                          planetserve=PlanetServeOptions(session_id=self.session_id, hops=1))


INFLIGHT_TTL = 300.0
"""Seconds after which a forward whose stream was never read to its end stops counting as in flight."""


class Forwards:
    """This node's forwards to each peer: those in flight (Q as we see it) and how long the finished ones
    took (L as we see it), which a peer's own load reports cannot understate (`balance.checked`)."""

    def __init__(self) -> None:
        self._open: dict[str, dict[int, float]] = {}
        self._latency: dict[str, LatencyEWMA] = {}
        self._tokens = itertools.count()
        self._failed: dict[str, float] = {}
        """Peers whose answer did not check, until when they are sent nothing."""

    def start(self, peer_id: str, now: float) -> int:
        token = next(self._tokens)
        self._open.setdefault(peer_id, {})[token] = now
        return token

    def end(self, peer_id: str, token: int, answered_at: float | None = None) -> None:
        """Idempotent; `answered_at` (a whole answer came back) adds the forward's duration to L."""
        started = self._open.get(peer_id, {}).pop(token, None)
        if not self._open.get(peer_id, True):
            del self._open[peer_id]
        if started is not None and answered_at is not None:
            self._latency.setdefault(peer_id, LatencyEWMA()).observe(max(0.0, answered_at - started))

    def inflight(self, now: float) -> dict[str, int]:
        return {peer: count for peer, opened in self._open.items()
                if (count := sum(now - t < INFLIGHT_TTL for t in opened.values()))}

    def latency(self) -> dict[str, float]:
        return {peer: ewma.value for peer, ewma in self._latency.items() if ewma.value is not None}

    def fail(self, peer_id: str, now: float) -> None:
        self._failed[peer_id] = now + FAILED_PEER_AVOID_S

    def avoided(self, now: float) -> set[str]:
        for peer in [p for p, until in self._failed.items() if until <= now]:
            del self._failed[peer]
        return set(self._failed)


class ModelNodeServer(EngineServer):
    """The HTTP side of a model node: EngineServer's API, with routing and signing plugged in."""

    def __init__(self, node: ModelNode, limits: ApiLimits) -> None:
        super().__init__(node.engine, node.tokenizer, model_name=node.config.model_id, limits=limits,
                         vocab_size=node.vocab_size, eos_token_ids=node.eos_ids,
                         documents={"/v1/planetserve/status": node.status},
                         hosts=(node.config.peer, node.config.advertise),
                         max_prompt_tokens=node.config.max_prompt_tokens)
        self.node = node

    async def produce(self, request: ApiRequest, prompt_ids: Sequence[int],
                      generation: GenerationRequest) -> Production:
        text, special = prompt_text(request, self.tokenizer)
        job = Job(text, special, generation.max_tokens, generation.temperature, generation.seed,
                  request.stop, request.stop_token_ids, request.ignore_eos, request.planetserve.session_id,
                  generation.top_p)
        if self.node.config.behaviour == ALTER_PROMPTS:
            return self.node.alter_prompt(job, request)
        return await self.node.produce(job, tuple(prompt_ids), generation, request.planetserve,
                                       whole=not request.stream)


class ModelNode:
    """One model node process's state and loops (see the module docstring for the peer protocol)."""

    def __init__(self, config: ModelNodeConfig, keys: KeySet, engine: Engine, tokenizer: Tokenizer, *,
                 vocab_size: int, eos_ids: Sequence[int], group: Group | None,
                 users: Directory | None = None, limits: ApiLimits | None = None,
                 policy: BalancePolicy | None = None, stage: StageRole | None = None) -> None:
        self.config = config
        self.stage = stage
        self.keys = keys
        self.node_id = keys.public.hex()
        self.engine = engine
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.group = group
        self.policy = policy or BalancePolicy()
        self.sync = CacheSync(
            self.node_id, group_hash_key(config.model_id), hash_bits=config.hash_bits,
            min_depth=config.match_depth,
            config=SyncConfig(batch_interval=config.delta_interval, snapshot_interval=config.sync_interval,
                              load_interval=config.load_interval))
        self.mirror = PrefixMirror()
        self.latency = LatencyEWMA()
        self.forwards = Forwards()
        self.sessions: OrderedDict[str, str] = OrderedDict()
        self.view = EMPTY
        self.users = users
        self.users_view = DirectoryView(0)
        self.refresh_lists = OnDemand(self._lists, self._apply_lists)
        ledger = group.ledger if group is not None else users.ledger if users is not None else None
        self.knocks = (Knocks(partial(registered, ledger, nodes=True), self.refresh_lists)
                       if ledger is not None else None)
        self.peering = Peering(keys, self._on_peer, self._authorized, knock=self.knocks)
        self.http = ModelNodeServer(self, limits or ApiLimits())
        self.gateway = Gateway(keys.public, exchange_secret(keys.identity), self.http.respond,
                               self._send_to_user)
        self.counters = {"served": 0, "forwarded": 0, "received_forwards": 0, "forward_failures": 0,
                         "sync_errors": 0, "tokens": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0,
                         "cache_hits": 0}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.routes: dict[str, int] = {}
        self.http_url = ""
        self.peer_port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._set_own_load()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine.on_cache_events(self._cache_events_from_engine)
        host, _, port = self.config.peer.rpartition(":")
        self.peer_port = await self.peering.listen(host, int(port))
        http_host, _, http_port = self.config.http.rpartition(":")
        self.http_url = await self.http.start(http_host, int(http_port))
        self._tasks = [asyncio.create_task(loop()) for loop in (self._sync_loop, self._group_loop)]

    async def close(self) -> None:
        await stop_tasks(self._tasks)
        await self.gateway.close()
        await self.http.close()
        await self.peering.close()

    # -- group and cache state -----------------------------------------------------------------------

    def _authorized(self, key: bytes) -> bool:
        return (key in self.view.members or key in self.users_view.users
                or (self.stage is not None and key in self.stage.peers))

    async def _group_loop(self) -> None:
        while True:
            await self.refresh_lists()
            await asyncio.sleep(self.config.list_interval)

    def _lists(self) -> tuple[GroupView | None, DirectoryView | None]:
        """Both verified lists (blocking): a key that knocks is a new group member or a new user."""
        return (self.group.refresh() if self.group is not None else None,
                self.users.refresh() if self.users is not None else None)

    def _apply_lists(self, lists: tuple[GroupView | None, DirectoryView | None]) -> None:
        group, users = lists
        if group is not None:
            self.apply_view(group)
        if users is not None:
            self.apply_users(users)

    def apply_users(self, view: DirectoryView) -> None:
        """The verified user list: the proxies that may bring prompts and receive answers."""
        if view.height >= self.users_view.height:
            self.users_view = view

    async def _send_to_user(self, peer: bytes, msg_type: str, body: Any) -> None:
        user = self.users_view.users.get(peer)
        if user is None:
            raise TransportError(f"{peer.hex()[:16]} is not a listed user")
        await self.peering.notify(peer, user.address, msg_type, body)

    def apply_view(self, view: GroupView) -> None:
        """Members become peers (trusted: the list holds only trusted nodes); delisted ones go."""
        self.view = view
        now = time.monotonic()
        current = {k.hex() for k in view.members} - {self.node_id}
        for entry in self.sync.peers():
            if entry.node_id not in current:
                self.sync.remove_peer(entry.node_id)
                conn = self.peering.connections.get(bytes.fromhex(entry.node_id))
                if conn is not None:
                    self._tasks.append(asyncio.get_running_loop().create_task(conn.close()))
        for key, node in view.members.items():
            if key != self.keys.public:
                self.sync.add_peer(key.hex(), now=now, address=node.address, trusted=True)
        self.sync.describe_self(address=self.config.address, trusted=self.keys.public in view.members)

    def _cache_events_from_engine(self, events: list[CacheEvent]) -> None:
        """Engine thread → event loop: the sync state is only touched from the loop."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._apply_cache_events, events)

    def _apply_cache_events(self, events: list[CacheEvent]) -> None:
        for change in self.mirror.apply(events):
            if not change.token_ids:
                self.sync.cleared()
            elif change.added:
                self.sync.stored(change.token_ids)
            else:
                self.sync.removed(change.token_ids)

    def _set_own_load(self) -> LoadReport:
        load = self.engine.load()
        report = LoadReport(self.latency.value or 0.0, load.running + load.queued, max(1, load.capacity))
        self.sync.report_load(report)
        return report

    async def _sync_loop(self) -> None:
        interval = min(self.config.delta_interval, self.config.load_interval)
        while True:
            self._set_own_load()
            for message in self.sync.poll(time.monotonic()):
                await self._broadcast(message)
            await asyncio.sleep(interval)

    async def _broadcast(self, message: bytes) -> None:
        for entry in self.sync.peers():
            if not entry.address:
                continue
            try:
                await self.peering.notify(bytes.fromhex(entry.node_id), entry.address, "cache", message)
            except TransportError as exc:
                log.debug("cache sync to %s failed: %s", entry.node_id[:16], exc)

    # -- peer messages -------------------------------------------------------------------------------

    async def _on_peer(self, peer: bytes, msg_type: str, body: Any) -> Any:
        if msg_type == "clove" and peer in self.users_view.users and isinstance(body, bytes):
            return await self.gateway.on_clove(body, peer)
        if self.stage is not None and msg_type == self.stage.msg_type and peer in self.stage.peers:
            return await self.stage.handler(peer, msg_type, body)
        if peer not in self.view.members:
            raise ValueError(f"{msg_type!r} from a key outside the group")
        if msg_type == "cache":
            return await self._on_cache_message(peer, body)
        if msg_type == "generate":
            self.counters["received_forwards"] += 1
            return self._serve_forward(body)
        raise ValueError(f"unknown message type {msg_type!r}")

    async def _on_cache_message(self, peer: bytes, body: Any) -> None:
        if not isinstance(body, bytes):
            self.counters["sync_errors"] += 1
            return
        try:
            result = self.sync.receive(peer.hex(), body, time.monotonic())
        except SyncError as exc:
            self.counters["sync_errors"] += 1
            log.info("cache message from %s refused: %s", peer.hex()[:16], exc)
            return
        if result.reply is not None:
            conn = self.peering.connections.get(peer)
            if conn is not None:
                with contextlib.suppress(TransportError):
                    await conn.notify("cache", result.reply)

    async def _serve_forward(self, body: Any) -> AsyncIterator[list]:
        """A peer's forwarded job, served here (never forwarded again)."""
        job = Job.from_wire(body)
        request = job.api_request()
        prompt_ids = tokenize_prompt(job.prompt, job.special, self.tokenizer, self.http.max_prompt_chars)
        generation = self._generation(request, prompt_ids)
        production = self._local(job, prompt_ids, generation, "forwarded")
        state = Generation(request, prompt_ids, self.tokenizer)
        first = True
        async for chunk in production.chunks:
            state.step(chunk, first)
            first = False
            yield ["chunk", list(chunk.token_ids), chunk.finish_reason, chunk.prompt_tokens,
                   chunk.cached_tokens]
            if state.finish_reason is not None:
                break
        if state.finish_reason is None:
            raise EngineError("the engine stream ended early")
        yield ["signed", await production.finish(state)]

    # -- serving -------------------------------------------------------------------------------------

    def _generation(self, request: ApiRequest, prompt_ids: tuple[int, ...]) -> GenerationRequest:
        check_prompt_tokens(prompt_ids, self.config.max_prompt_tokens)
        return build_generation(request, prompt_ids, max_model_len=self.engine.max_model_len,
                                vocab_size=self.vocab_size, eos_token_ids=self.eos_ids)

    def decide(self, result: SearchResult, options: PlanetServeOptions) -> Decision:
        """Algorithm 2 at this node for a prompt the HR-tree matched as `result`, with session affinity
        and the one-hop rule."""
        affinity = self.sessions.get(options.session_id) if options.session_id else None
        now = time.monotonic()
        avoided = self.forwards.avoided(now)
        candidates = checked([c for c in self.sync.nodes() if c.node_id not in avoided], self.node_id,
                             inflight=self.forwards.inflight(now), latency=self.forwards.latency(),
                             capacity={k.hex(): n.capacity for k, n in self.view.members.items()})
        return route(self.node_id, candidates, holders=result.holders if result.matched else (),
                     forwarded=options.hops > 0 or options.no_forward, affinity=affinity,
                     policy=self.policy)

    async def produce(self, job: Job, prompt_ids: tuple[int, ...], generation: GenerationRequest,
                      options: PlanetServeOptions, *, whole: bool = False) -> Production:
        """Where the request is computed (Algorithm 2). `whole`: the answer goes back in one piece, so a
        forwarded one is taken from the peer in full before anything is returned, and a peer failing
        mid-answer means the request is served here.

        A request asking for `logprobs` is served here, never forwarded: a peer's signature covers the
        tokens and text it returns, not their log-probabilities, so the entry node returns only
        log-probabilities it computed itself (and a `Job` carries none across the peer link)."""
        self.sync.observe(prompt_ids)
        if generation.logprobs is not None:
            self._remember(job.session_id, self.node_id)
            self.routes[LOGPROBS_HERE] = self.routes.get(LOGPROBS_HERE, 0) + 1
            return self._local(job, prompt_ids, generation, LOGPROBS_HERE)
        result = self.sync.search(prompt_ids)
        decision = self.decide(result, options)
        self.routes[decision.reason.value] = self.routes.get(decision.reason.value, 0) + 1
        if decision.forward:
            address = self.sync.address(decision.target)
            if address:
                hit = decision.reason == Reason.HIT
                claimed = self.sync.claimed_tokens(decision.target, prompt_ids) if hit else 0
                if decision.reason in (Reason.MISS, Reason.HIT_OVERLOADED):
                    # marked now, not once the peer answers: requests of this prefix that come while the
                    # peer queues or prefills this one follow it there (a failed forward's mark expires)
                    self.sync.forwarded(decision.target, prompt_ids, time.monotonic())
                try:
                    production = await self._remote(decision.target, address, job,
                                                    decision.reason.value, whole, claimed)
                except (TransportError, ApiError) as exc:
                    self.counters["forward_failures"] += 1
                    log.info("forward to %s failed, serving here: %s", decision.target[:16], exc)
                else:
                    self._remember(job.session_id, decision.target)
                    self.counters["forwarded"] += 1
                    return production
        self._remember(job.session_id, self.node_id)
        return self._local(job, prompt_ids, generation, decision.reason.value)

    def _remember(self, session_id: str | None, node_id: str) -> None:
        if session_id is None:
            return
        self.sessions[session_id] = node_id
        self.sessions.move_to_end(session_id)
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)

    def alter_prompt(self, job: Job, request: ApiRequest) -> Production:
        """Fault injection (behaviour alter-prompts): generate from a clickbait rewrite of the request,
        sign for the original prompt (job.prompt). Served here, never forwarded: a peer would answer
        the original."""
        asked = clickbait_request(request)
        prompt_ids = render_prompt(asked, self.tokenizer, self.http.max_prompt_chars)
        generation = self._generation(asked, prompt_ids)
        self.routes[ALTER_PROMPTS] = self.routes.get(ALTER_PROMPTS, 0) + 1
        return self._local(job, prompt_ids, generation, Reason.NO_CANDIDATES.value)  # as a cheat would claim

    def _local(self, job: Job, prompt_ids: tuple[int, ...], generation: GenerationRequest,
               route_reason: str) -> Production:
        started = time.monotonic()
        self.counters["served"] += 1

        async def finish(state: Generation) -> dict[str, Any]:
            self.latency.observe(time.monotonic() - started)
            return self._sign(job, state, route_reason, self.node_id)

        return Production(self._counted(self.engine.generate(generation), started), finish)

    async def _counted(self, chunks: AsyncIterator[TokenChunk], started: float) -> AsyncIterator[TokenChunk]:
        """The engine's stream, its first token timed and its tokens counted (`metrics`); closed with it,
        so that a reader who stops early stops the engine's work at once."""
        first = True
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if first:
                    first = False
                    self.ttft.observe(time.monotonic() - started)
                    self.counters["prompt_tokens"] += chunk.prompt_tokens
                    self.counters["cached_prompt_tokens"] += chunk.cached_tokens
                    self.counters["cache_hits"] += chunk.cached_tokens > 0
                self.counters["tokens"] += len(chunk.token_ids)
                yield chunk

    def _sign(self, job: Job, state: Generation, route_reason: str, served_by: str) -> dict[str, Any]:
        """The answer's `planetserve` extension: our signature over it, why it went where it went, and
        which node computed it (`route` and `served_by` are not signed)."""
        signed = sign_response(self.keys, job.prompt, state.token_ids, state.text, self.config.model_id,
                               int(time.time()), self.config.address, milli(job.temperature), job.seed,
                               milli(job.top_p))
        return {**response_extension(signed), "route": route_reason, "served_by": served_by}

    def _countersign(self, peer_id: str, job: Job, state: Generation, extension: Any,
                     route_reason: str) -> dict[str, Any]:
        """A peer's answer, signed by us once the peer's own signature checks: the node the client
        addressed answers for what it returns, and never vouches for what its peer did not sign."""
        try:
            theirs = response_from_extension(extension, state.text)
        except ResponseFormatError as exc:
            raise EngineError(f"peer {peer_id[:16]} sent a malformed signed answer: {exc}") from exc
        checks = (("signed by another key", theirs.node.hex() == peer_id),
                  ("signed for another prompt", theirs.prompt_hash == prompt_hash(job.prompt)),
                  ("signed for another model", theirs.model_id == self.config.model_id),
                  ("signed for another temperature", theirs.temperature == milli(job.temperature)),
                  ("signed for another seed", theirs.seed == job.seed),
                  ("signed for another top_p", theirs.top_p == milli(job.top_p)),
                  ("signed other token ids than it streamed", list(theirs.token_ids) == state.token_ids),
                  ("its signature does not verify", response_valid(theirs)))
        failed = [problem for problem, ok in checks if not ok]
        if failed:
            log.warning("peer %s sent an answer that does not check: %s", peer_id[:16], "; ".join(failed))
            raise EngineError(f"peer {peer_id[:16]}'s answer does not check ({'; '.join(failed)}), "
                              f"so this node does not sign it")
        return {**self._sign(job, state, route_reason, peer_id), "served": served_extension(theirs)}

    async def _remote(self, peer_id: str, address: str, job: Job, route_reason: str,
                      whole: bool, claimed: int = 0) -> Production:
        """Open the stream at the peer and wait for its first chunk (with `whole`, for all of it), so
        that a peer that cannot serve is noticed before anything is sent to the client (and the
        request is served here instead). `claimed`: the prompt tokens the peer claimed to hold, when
        it was picked as a hit; what it found cached is checked against them once it answered. The
        forward counts as in flight there until its stream ends (Forwards)."""
        token = self.forwards.start(peer_id, time.monotonic())
        try:
            conn = await self.peering.connect(bytes.fromhex(peer_id), address)
            replies = _bounded(conn.request("generate", job.to_wire()), job.max_tokens, FORWARD_IDLE_S,
                               self.vocab_size)
            first = await anext(replies)
            if whole:
                replies = _replay([reply async for reply in replies])
        except BaseException as exc:
            self.forwards.end(peer_id, token)
            if isinstance(exc, PeerMisbehaved):
                self.forwards.fail(peer_id, time.monotonic())
            if isinstance(exc, StopAsyncIteration):
                raise TransportError("the peer ended the stream without an answer") from None
            if isinstance(exc, RemoteError):
                raise TransportError(f"the peer refused or failed: {exc}") from exc
            raise
        signed: dict[str, Any] = {}
        found = [0]
        """The most prompt tokens the peer reported cached (an engine may report them on any chunk)."""

        async def chunks() -> AsyncIterator[TokenChunk]:
            reply = first
            try:
                while True:  # each reply was checked as it came (`_checked_reply`)
                    if reply[0] == "signed":
                        signed.update(reply[1])
                        return
                    _, ids, finish, prompt_tokens, cached = reply
                    found[0] = max(found[0], cached)
                    yield TokenChunk(tuple(ids), finish, prompt_tokens, cached)
                    try:
                        reply = await anext(replies)
                    except StopAsyncIteration:
                        return
                    except TransportError as exc:
                        self._failed_peer(peer_id)
                        raise EngineError(f"the peer failed mid-answer: {exc}") from exc
            finally:
                self.forwards.end(peer_id, token, time.monotonic() if signed else None)

        stream = chunks()

        async def finish(state: Generation) -> dict[str, Any]:
            try:
                async for _extra in stream:  # drain to the signature, which follows the last chunk
                    raise EngineError("the peer sent tokens after the end of its answer")
                if not signed:
                    raise EngineError("the peer's answer carries no signature")
                if claimed:
                    self._check_claim(peer_id, claimed, found[0])
                return self._countersign(peer_id, job, state, signed, route_reason)
            except EngineError:
                self._failed_peer(peer_id)
                raise

        return Production(stream, finish)

    def _failed_peer(self, peer_id: str) -> None:
        self.counters["forward_failures"] += 1
        self.forwards.fail(peer_id, time.monotonic())
        log.warning("peer %s failed an answer; it is sent no forwards for %.0f s", peer_id[:16],
                    FAILED_PEER_AVOID_S)

    def _check_claim(self, peer_id: str, claimed: int, cached: int) -> None:
        now = time.monotonic()
        before = self.sync.distrusts(peer_id, now)
        if self.sync.check_claim(peer_id, claimed, cached, now) and not before:
            log.warning("peer %s claimed prefixes it did not hold (last: %d of %d tokens cached); its "
                        "claims are ignored for %.0f s", peer_id[:16], cached, claimed,
                        self.sync.config.claim_distrust)

    # -- introspection -------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        load = self._set_own_load()
        return {
            "node": self.node_id, "model_id": self.config.model_id, "address": self.config.address,
            "group_height": self.view.height, "group": sorted(k.hex() for k in self.view.members),
            "trusted": self.keys.public in self.view.members,
            "load": {"latency": load.latency, "queued": load.queued, "capacity": load.capacity,
                     "lb_factor": load.lb_factor},
            **self.sync.status(), "counters": dict(self.counters),
            "routes": dict(self.routes),
            "forwards": {"inflight": self.forwards.inflight(time.monotonic()),
                         "latency": self.forwards.latency()},
            "sync": dict(vars(self.sync.stats)), "overlay": dict(self.gateway.counters),
            "stage": list(self.stage.layers) if self.stage is not None else None,
        }

