"""A model node's side of the anonymous overlay: prompt cloves in from proxies (sealed to this node's
key), answers out to the proxies the prompt lists, as S-IDA cloves of padded reply parts, each sealed
under the reply key the user chose for that request and path (and sent under its reply id, also fresh
per request, so nothing in one prompt recurs in another of the same user).

The node answers an overlay prompt exactly as it answers its HTTP API (the same validation, routing,
forwarding and signing), so a prompt cannot be told from a challenge by how it is served, and the
user's program receives the same bytes it would have received over HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from planetserve.node.api.openai import ApiError, Endpoint
from planetserve.node.api.surface import Reply, close_stream
from planetserve.node.overlay import onion, sida
from planetserve.node.overlay.messages import MAX_PROXIES, MessageError, Part, Prompt, open_message
from planetserve.node.overlay.rate import TokenBucket
from planetserve.node.overlay.relay import Send
from planetserve.node.overlay.replay import ReplayWindow
from planetserve.node.overlay.transport import TransportError
from planetserve.node.tasks import stop_tasks

log = logging.getLogger(__name__)

MAX_PART_BYTES = 60 << 10
MAX_ANSWERS = 256
MAX_ANSWERS_PER_PEER = 64
"""Answers under way at once, in all and for the prompts one proxy delivered: past either, a prompt is
refused (busy) before it is answered, so one proxy (a user that is its own) cannot take every slot."""
SEND_TIMEOUT = 10.0
"""The longest one part may take to reach one proxy. A proxy that misses it, or cannot be reached, gets
none of the answer's later parts; once fewer than the prompt's k proxies are left the answer is given
up, since the user could not recover it (a prompt naming unreachable proxies held its slot for hours)."""
PROMPT_MAX_AGE = 120.0
PROMPT_MAX_AHEAD = 30.0
PROMPT_MEMORY = 65_536
PROMPT_MEMORY_PER_PEER = 4_096
"""A prompt is answered only from PROMPT_MAX_AGE before to PROMPT_MAX_AHEAD after this node's clock
(its `sent` is the user's, rounded down to `messages.SENT_STEP`), and once: its request id is remembered
until it leaves that window. The reassembler alone forgets a finished message after 30 s, so a proxy
that kept a prompt's cloves could have the node compute its answer again and again. Past
PROMPT_MEMORY ids within the window, or PROMPT_MEMORY_PER_PEER of one delivering proxy's, prompts are
refused (busy) rather than any id forgotten: one proxy sending cheap prompts (a junk body is a quick
400) filled the whole window in about 85 s, and the node then refused every other prompt."""
BUSY_ANSWERS_PER_S = 8.0
BUSY_BURST = 16
"""A prompt refused as busy (answer slots or the prompt window full, in all or for its proxy) is answered
503 `node_busy`, so that its user's program can retry at once rather than wait out its relay's timeout;
at most this many a second, `BUSY_BURST` at once, and silently past that. Each such answer is a part to
every proxy the prompt names: a flood that keeps the node busy cannot make it send more than these."""

PART_LINGER_SECONDS = 0.02
"""The least time between two parts of one answer: tokens faster than this travel a few to a part, which
halves the relays' CPU per streamed token (docs/benchmarks.md, "The overlay's cost per token")."""

Respond = Callable[[Endpoint, bytes], Awaitable[Reply]]


async def batched(parts: AsyncIterator[bytes], limit: int = MAX_PART_BYTES,
                  linger: float = PART_LINGER_SECONDS) -> AsyncIterator[bytes]:
    """The reply's parts, joined: the first goes at once, and each later one no sooner than `linger`
    seconds after the one before, with whatever else came meanwhile (up to `limit` bytes). Each part
    costs an S-IDA round and n cloves through every relay of n paths, so tokens that come faster than
    `linger` travel a few to a part; slower ones still go one by one as they come."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    async def pump() -> None:
        try:
            async for part in parts:
                await queue.put(part)
        finally:
            await queue.put(None)

    task = asyncio.create_task(pump())
    try:
        done = False
        sent = -float("inf")
        while not done:
            item = await queue.get()
            if item is None:
                break
            if (wait := sent + linger - loop.time()) > 0:
                await asyncio.sleep(wait)
            batch = bytearray(item)
            while len(batch) < limit and not queue.empty():
                more = queue.get_nowait()
                if more is None:
                    done = True
                    break
                batch += more
            yield bytes(batch)
            sent = loop.time()
        await task
    finally:
        task.cancel()


class Undeliverable(Exception):
    """Too few of a prompt's proxies are left for the user to recover its answer."""


class Gateway:
    def __init__(self, me: bytes, secret: bytes, respond: Respond, send: Send,
                 clock: Callable[[], float] = time.time) -> None:
        self.me = me
        self.secret = secret
        self.respond = respond
        self.send = send
        self.reassembler = sida.Reassembler(max_n=MAX_PROXIES)
        self.answered = ReplayWindow(PROMPT_MAX_AGE, PROMPT_MAX_AHEAD, PROMPT_MEMORY, clock=clock)
        """The request ids of the prompts taken for an answer, while within their window."""
        self.tasks: set[asyncio.Task] = set()
        self.busy_answers = TokenBucket(BUSY_ANSWERS_PER_S, BUSY_BURST)
        self.refusals: set[asyncio.Task] = set()
        """Busy answers being sent (at most what `busy_answers` lets through)."""
        self.held: dict[bytes | None, int] = {}
        """Answers under way, by the proxy that delivered their prompt's last clove."""
        self.counters = {"cloves": 0, "bad_cloves": 0, "bad_messages": 0, "prompts": 0, "parts_sent": 0,
                         "busy": 0, "busy_answered": 0, "failed": 0, "replays": 0, "stale": 0,
                         "undeliverable": 0}

    async def on_clove(self, data: bytes, peer: bytes | None = None) -> None:
        """A clove from `peer` (the proxy that delivered it; the reassembler's bounds are per peer)."""
        self.counters["cloves"] += 1
        try:
            message = self.reassembler.add(onion.open_sealed(self.secret, data), peer)
        except (sida.CloveError, onion.OnionError) as exc:
            self.counters["bad_cloves"] += 1
            log.info("clove refused: %s", exc)
            return
        if message is None:
            return
        try:
            prompt = open_message(message)
            if not isinstance(prompt, Prompt) or prompt.node != self.me:
                raise MessageError("not a prompt for this node")
        except MessageError as exc:
            self.counters["bad_messages"] += 1
            log.info("overlay message refused: %s", exc)
            return
        if not self._first_time(prompt, peer):
            return
        if len(self.tasks) >= MAX_ANSWERS or self.held.get(peer, 0) >= MAX_ANSWERS_PER_PEER:
            self._busy(prompt, "as many prompts as it takes at once")
            return
        self.answered.remember(prompt.request_id, prompt.sent, peer)
        self.counters["prompts"] += 1
        task = asyncio.create_task(self._answer(prompt))
        self.tasks.add(task)
        self.held[peer] = self.held.get(peer, 0) + 1
        task.add_done_callback(lambda t: self._done(t, peer))

    def _done(self, task: asyncio.Task, peer: bytes | None) -> None:
        self.tasks.discard(task)
        if (left := self.held.pop(peer) - 1) > 0:
            self.held[peer] = left

    def _first_time(self, prompt: Prompt, peer: bytes | None) -> bool:
        """Whether the prompt is within its window, not answered before, and the window has room for its
        id, in all and for its proxy's (else counted as a replay, busy or stale)."""
        now = self.answered.now()
        self.answered.forget(now)
        if prompt.request_id in self.answered:
            self.counters["replays"] += 1
            log.info("replayed prompt refused")
            return False
        if self.answered.full() or self.answered.held_by(peer) >= PROMPT_MEMORY_PER_PEER:
            self._busy(prompt, "as many prompts as it remembers")
            return False
        if self.answered.outside(prompt.request_id, prompt.sent, now, peer):  # its room checked above
            self.counters["stale"] += 1
            log.info("prompt sent %.0f s from this node's clock refused", prompt.sent - now)
            return False
        return True

    def _busy(self, prompt: Prompt, holding: str) -> None:
        """Answer `prompt` 503 if the busy answers' rate allows (see BUSY_ANSWERS_PER_S)."""
        self.counters["busy"] += 1
        if not self.busy_answers.take():
            return
        self.counters["busy_answered"] += 1
        refusal = ApiError(503, f"This model node is busy: it holds {holding}. Retry, or ask another node.",
                           type="server_error", code="node_busy")
        task = asyncio.create_task(self._answer(prompt, Reply.json(refusal.body(), refusal.status)))
        self.refusals.add(task)
        task.add_done_callback(self.refusals.discard)

    async def _answer(self, prompt: Prompt, reply: Reply | None = None) -> None:
        """Send `reply`, or the node's answer to the prompt, to the proxies it names."""
        try:
            await self._reply(prompt, reply or await self.respond(prompt.endpoint, prompt.body))  # type: ignore[arg-type]
        except Undeliverable as exc:
            self.counters["undeliverable"] += 1
            log.info("answer given up: %s", exc)
        except Exception:  # one broken answer must not go unnoticed, nor stop the others
            self.counters["failed"] += 1
            log.exception("answering an overlay prompt failed")

    async def _reply(self, prompt: Prompt, reply: Reply) -> None:
        live = set(range(len(prompt.reply_to)))
        seq = 0
        try:
            async for data in batched(reply.parts):
                part = Part(prompt.request_id, seq, reply.status, reply.content_type, data, False)
                await self._send(prompt, part, live)
                seq += 1
            last = Part(prompt.request_id, seq, reply.status, reply.content_type, b"", True)
            await self._send(prompt, last, live)
        finally:
            await close_stream(reply.parts)

    async def _send(self, prompt: Prompt, part: Part, live: set[int]) -> None:
        """One part to the proxies in `live`; those it does not reach in time leave `live`."""
        n = len(prompt.reply_to)
        cloves = sida.split_encoded(part.seal(), n, prompt.k)
        sealed = [onion.seal_payload(key, onion.REPLY, onion.Payload("clove", clove))
                  for (_, _, key), clove in zip(prompt.reply_to, cloves, strict=True)]
        targets = sorted(live)
        results = await asyncio.gather(*(self._deliver(prompt.reply_to[i], sealed[i]) for i in targets),
                                       return_exceptions=True)
        for i, result in zip(targets, results, strict=True):
            if isinstance(result, (TransportError, TimeoutError)):
                live.discard(i)
            elif isinstance(result, BaseException):
                raise result
        if len(live) < len(targets):
            log.info("%d of %d proxies unreachable for an answer part", len(targets) - len(live), n)
        if len(live) < prompt.k:
            raise Undeliverable(f"{len(live)} of {n} proxies left, fewer than the answer's k {prompt.k}")
        self.counters["parts_sent"] += 1

    async def _deliver(self, proxy: tuple[bytes, bytes, bytes], data: bytes) -> None:
        key, reply_id, _ = proxy
        async with asyncio.timeout(SEND_TIMEOUT):
            await self.send(key, "reply", [reply_id, data])

    async def close(self) -> None:
        await stop_tasks(self.tasks | self.refusals)
