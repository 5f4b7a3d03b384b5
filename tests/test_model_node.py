"""Four model nodes on loopback with the built-in engine over the quick gt: signed answers, forwarding
to the holder of a prefix (the entry node answering for it), overload fallback, session affinity, one
hop, nodes outside the verified list, a peer whose signature does not check, a node that alters
prompts, and bad input from clients and peers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from crosssite import allowed, apost, attacks, check_refusal
from enginefaults import fault
from modelnodes import SHARED, complete, make_node, signed, streamed, view
from waiting import run, until

from planetserve.chain.challenge import response_from_extension, response_valid, served_from_extension
from planetserve.chain.keys import KeySet
from planetserve.node.api.engine_server import Generation
from planetserve.node.behaviours import clickbait
from planetserve.node.model_node import Job, ModelNode
from planetserve.node.overlay.transport import Peering, TransportError
from planetserve.node.routing.balance import LoadReport
from planetserve.registry.epochs import prompt_hash


async def start(nodes: list[ModelNode], members: list[ModelNode] | None = None) -> None:
    """Start the nodes as one group, each having served a request of its own: a node without a latency
    sample of its own serves whatever it receives itself."""
    for node in nodes:
        await node.start()
    group = view(members if members is not None else nodes)
    for node in nodes:
        node.apply_view(group)
    await settle(nodes)
    await asyncio.gather(*(complete(node, "Warm up.", planetserve={"no_forward": True}) for node in nodes))
    await until(lambda: all(node.status()["load"]["latency"] > 0 for node in nodes))


async def stop(nodes: list[ModelNode]) -> None:
    for node in nodes:
        await node.close()
        await node.engine.close()


async def settle(nodes: list[ModelNode], timeout: float = 10.0) -> None:
    """Until every node knows every listed peer's load (the first sync round has happened)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(e.load is not None for n in nodes for e in n.sync.tree.table if e.trusted):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("group did not exchange loads")


async def seed_shared_prefix(holder: ModelNode, entry: ModelNode) -> None:
    """`holder` serves a prompt of the shared prefix itself, and `entry` learns that it holds it, so
    that `entry` forwards the next prompt of that prefix to `holder`."""
    signed((await complete(holder, SHARED + "Seed.", planetserve={"no_forward": True})).json())
    await until(lambda: entry.sync.search(entry.tokenizer(SHARED)["input_ids"]).holders >= {holder.node_id})


@contextlib.asynccontextmanager
async def holder_and_entry(family: Path, holder: type[ModelNode] = ModelNode
                           ) -> AsyncIterator[tuple[ModelNode, ModelNode]]:
    """A running node of class `holder` that holds the shared prefix, and an entry node that knows it
    does, so that the entry forwards the next prompt of that prefix to it; both stopped after."""
    peer, entry = make_node(family, holder), make_node(family)
    await start([peer, entry])
    try:
        await seed_shared_prefix(peer, entry)
        yield peer, entry
    finally:
        await stop([peer, entry])


def test_answers_are_signed_by_the_entry_node(quick_family):
    async def main():
        nodes = [make_node(quick_family) for _ in range(2)]
        await start(nodes)
        try:
            answer = (await complete(nodes[0], "What does the json module do?")).json()
            response = signed(answer)
            assert response.node == nodes[0].keys.public  # whichever node computed it
            assert answer["planetserve"]["served_by"] in {n.node_id for n in nodes}
            assert response.prompt_hash == prompt_hash("What does the json module do?")
            assert response.model_id == "gt" and response.address == nodes[0].config.address
            assert list(response.token_ids) == answer["planetserve"]["token_ids"]
            # any change to what was signed breaks the signature
            tampered = dict(answer["planetserve"], token_ids=[*response.token_ids, 5])
            assert not response_valid(response_from_extension(tampered, answer["choices"][0]["text"]))
            assert not response_valid(response_from_extension(answer["planetserve"], "something else"))
            # chat answers are signed over the prompt the template rendered
            async with httpx.AsyncClient(timeout=60) as client:
                chat = (await client.post(f"{nodes[1].http_url}/v1/chat/completions", json={
                    "model": "gt", "messages": [{"role": "user", "content": "Name a module."}],
                    "max_tokens": 6, "temperature": 0})).json()
            assert response_valid(response_from_extension(chat["planetserve"],
                                                          chat["choices"][0]["message"]["content"]))
        finally:
            await stop(nodes)

    run(main())


def test_streamed_answer_carries_the_signature_on_its_last_chunk(quick_family):
    async def main():
        nodes = [make_node(quick_family)]
        await start(nodes)
        try:
            events = await streamed(nodes[0], "Explain the os module.", 10)
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            assert "planetserve" in chunks[-1] and all("planetserve" not in c for c in chunks[:-1])
            assert response_valid(response_from_extension(chunks[-1]["planetserve"], text))
        finally:
            await stop(nodes)

    run(main())


def test_repeated_prefix_lands_on_the_holder(quick_family):
    async def main():
        nodes = [make_node(quick_family) for _ in range(4)]
        await start(nodes)
        try:
            # the first asker computes it itself, so which node holds the prefix is known
            holder = nodes[0]
            signed((await complete(holder, SHARED + "What is a dict?", planetserve={"no_forward": True})).json())
            await until(lambda: all(
                n.sync.search(n.tokenizer(SHARED + "x")["input_ids"]).holders >= {holder.node_id}
                for n in nodes if n is not holder))
            for entry in (n for n in nodes if n is not holder):
                prompt = SHARED + f"What is a list, asked at {entry.node_id[:6]}?"
                answer = (await complete(entry, prompt)).json()
                # the holder computed it; the entry checked the holder's signature and answers for it
                response = signed(answer)
                assert response.node == entry.keys.public and response.address == entry.config.address
                assert response.prompt_hash == prompt_hash(prompt) and response.model_id == "gt"
                assert answer["planetserve"]["served_by"] == holder.node_id
                served = served_from_extension(answer["planetserve"]["served"], response)
                assert served is not None and served.node == holder.keys.public  # the holder's own signature
                assert answer["planetserve"]["route"] == "hit"
                assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                assert entry.routes.get("hit") == 1
            assert holder.counters["received_forwards"] == 3
        finally:
            await stop(nodes)

    run(main())


@pytest.mark.faults
def test_a_peer_claiming_prefixes_it_does_not_hold_draws_only_a_few_requests(quick_family):
    """A well-formed lie in the cache-state sync: the liar's sync announces prefixes its engine never
    held. Hits sent to it find nothing cached, so after three the entry node stops believing its claims
    (its entries go and requests for the prefixes it still claims are misses); every request is
    answered and signed throughout."""
    async def main():
        entry, liar = nodes = [make_node(quick_family) for _ in range(2)]
        await start(nodes)
        try:
            prefixes = [f"Topic {i} of the ledger. " + SHARED for i in range(6)]
            for prefix in prefixes:
                liar.sync.stored(liar.tokenizer(prefix)["input_ids"])
            await until(lambda: all(
                entry.sync.search(entry.tokenizer(p + "x")["input_ids"]).holders == {liar.node_id}
                for p in prefixes))
            served_by = []
            for prefix in prefixes:
                answer = (await complete(entry, prefix + "What is it?")).json()
                assert signed(answer).node == entry.keys.public
                served_by.append((answer["planetserve"]["route"], answer["planetserve"]["served_by"]))
            assert served_by[:3] == [("hit", liar.node_id)] * 3
            assert all(route != "hit" for route, _ in served_by[3:])
            assert entry.sync.stats.false_claims == 3 and entry.sync.stats.distrusted == 1
            assert entry.sync.tree.entries(liar.node_id) == 0
            assert entry.status()["sync"]["distrusted"] == 1
        finally:
            await stop(nodes)

    run(main())


def test_a_burst_of_a_new_prefix_follows_its_first_forward_while_the_peer_is_busy(quick_family):
    """Two idle peers whose engines are slow (held mid-forward, as a busy GPU holds them), and an entry
    loaded itself: the entry forwards a prompt of a new prefix to one peer (a miss) and marks it as the
    prefix's holder at once, not once the peer answers. Five more prompts of the prefix that come before
    it answered follow it there as hits on the mark (ranked by load they would go to the other, idle
    peer), and each finds the prefix cached, prefilled behind the first. Hits on a mark the entry made
    are no claims of the peer's, so none is held against it (test_cachesync: an engine that prefills a
    batch at once can find them uncached)."""
    async def main():
        entry = make_node(quick_family, capacity=1)
        peers = [make_node(quick_family, capacity=8) for _ in range(2)]
        nodes = [entry, *peers]
        await start(nodes)
        try:
            prefix = "A topic nobody asked about before: the scheduler of the event loop. " + SHARED
            with contextlib.ExitStack() as stack:
                gates = [stack.enter_context(fault(p.engine.model, lambda ids: False)).gate for p in peers]
                for gate in gates:
                    gate.clear()
                busy = asyncio.create_task(complete(entry, "Keep the entry busy.", max_tokens=300,
                                                    ignore_eos=True, planetserve={"no_forward": True}))
                await until(lambda: entry.status()["load"]["queued"] >= 1)
                first = asyncio.create_task(complete(entry, prefix + "Question 0?"))
                await until(lambda: any(entry.sync.tree.speculative(p.node_id) for p in peers))
                holder = next(p for p in peers if entry.sync.tree.speculative(p.node_id))
                rest = [asyncio.create_task(complete(entry, prefix + f"Question {i}?")) for i in range(1, 6)]
                await until(lambda: entry.routes.get("hit", 0) == 5)
                for gate in gates:
                    gate.set()
                answers = [(await task).json() for task in (first, *rest)]
            await busy
            assert entry.routes.get("miss") == 1
            assert all(signed(a).node == entry.keys.public and a["planetserve"]["served_by"] == holder.node_id
                       for a in answers)
            assert all(a["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for a in answers[1:])
            assert entry.sync.stats.false_claims == 0 and entry.sync.stats.distrusted == 0
        finally:
            await stop(nodes)

    run(main())


class UnderReporting(ModelNode):
    """Reports itself idle, instant and large whatever it holds: a well-formed lie in its sync's load."""

    def _set_own_load(self) -> LoadReport:
        report = LoadReport(0.001, 0, 64)
        self.sync.load = report
        self.sync.tree.table.upsert(self.node_id, load=report)
        return report


@pytest.mark.faults
def test_a_peer_understating_its_load_draws_no_more_than_its_share(quick_family):
    """Idle and instant by its own reports, the liar would draw every miss; the entry node counts its own
    requests in flight there and the capacity it registered, so concurrent misses spread over the group,
    and every one is answered and signed."""
    async def main():
        entry, honest = make_node(quick_family), make_node(quick_family)
        liar = make_node(quick_family, cls=UnderReporting)
        nodes = [entry, honest, liar]
        await start(nodes)
        try:
            await until(lambda: entry.sync.tree.table.get(liar.node_id).load == LoadReport(0.001, 0, 64))
            for node in (entry, honest):  # real latencies, so the liar's 1 ms makes it the fastest on paper
                await complete(node, "Warm up.", planetserve={"no_forward": True})
            await until(lambda: all(e.load is not None and e.load.latency > 0.001
                                         for e in entry.sync.tree.table if e.node_id != liar.node_id))
            prompts = [f"Question {i}: what does module number {i} of the library do?" for i in range(6)]
            answers = await asyncio.gather(*(complete(entry, p, max_tokens=24) for p in prompts))
            served_by = [a.json()["planetserve"]["served_by"] for a in answers]
            assert all(signed(a.json()).node == entry.keys.public for a in answers)
            assert 1 <= served_by.count(liar.node_id) <= 3, served_by
            assert len(set(served_by)) >= 2, served_by
            assert entry.status()["forwards"]["inflight"] == {}
            assert liar.node_id in entry.status()["forwards"]["latency"]
        finally:
            await stop(nodes)

    run(main())


def test_overloaded_holder_falls_back_to_the_least_loaded(quick_family):
    async def main():
        nodes = [make_node(quick_family, capacity=1) for _ in range(3)]
        await start(nodes)
        try:
            holder = nodes[0]
            signed((await complete(holder, SHARED + "Seed the cache.", planetserve={"no_forward": True})).json())
            await until(lambda: nodes[1].sync.search(holder.tokenizer(SHARED)["input_ids"]).holders
                             >= {holder.node_id})
            # overload the holder: one running and two waiting long generations (Q = 3 >= 2·C); past
            # the end-of-sequence token, so that how soon the trained model would stop does not matter
            busy = [asyncio.create_task(complete(holder, f"Busy {i}.", max_tokens=300, ignore_eos=True,
                                                 planetserve={"no_forward": True})) for i in range(3)]
            await until(lambda: (e := nodes[1].sync.tree.table.get(holder.node_id)).load is not None
                             and e.load.queued >= 2)
            answer = (await complete(nodes[1], SHARED + "And now?")).json()
            assert signed(answer).node == nodes[1].keys.public
            assert answer["planetserve"]["served_by"] != holder.node_id
            assert nodes[1].routes.get("hit-overloaded") == 1
            await asyncio.gather(*busy)
        finally:
            await stop(nodes)

    run(main())


def test_session_affinity_and_one_hop(quick_family):
    async def main():
        nodes = [make_node(quick_family) for _ in range(3)]
        await start(nodes)
        try:
            session = {"session_id": "conversation-1"}
            first = (await complete(nodes[0], "Hello there.", planetserve=session)).json()
            for _ in range(3):
                again = (await complete(nodes[0], "Hello there. And more?", planetserve=session)).json()
                assert signed(again).node == nodes[0].keys.public
                assert again["planetserve"]["served_by"] == first["planetserve"]["served_by"]
            assert nodes[0].routes.get("affinity") == 3
            # a forwarded request is never forwarded again, whatever the receiving node's view says
            before = nodes[2].routes.get("already-forwarded", 0)  # its warm-up asked no_forward
            hop = (await complete(nodes[2], SHARED, planetserve={"hops": 1})).json()
            assert signed(hop).node == nodes[2].keys.public
            assert hop["planetserve"]["served_by"] == nodes[2].node_id
            assert nodes[2].routes.get("already-forwarded") == before + 1
        finally:
            await stop(nodes)

    run(main())


def test_a_node_outside_the_verified_list_receives_nothing(quick_family):
    async def main():
        listed = [make_node(quick_family) for _ in range(3)]
        outsider = make_node(quick_family)
        await start(listed)
        await outsider.start()
        outsider.apply_view(view([*listed, outsider]))  # it believes itself listed; the others don't
        try:
            for i in range(6):
                signed((await complete(listed[i % 3], SHARED + f"Question {i}?")).json())
            assert outsider.counters["received_forwards"] == 0
            assert all(outsider.node_id not in n.sync.tree.table for n in listed)
            # its connections are refused, so it cannot push cache state or forward into the group
            with pytest.raises(TransportError, match="refused: peer .* is not in the verified list"):
                await outsider.peering.connect(listed[0].keys.public, listed[0].config.address)
            answer = (await complete(outsider, "Anyone there?")).json()
            assert signed(answer).node == outsider.keys.public
        finally:
            await stop([*listed, outsider])

    run(main())


class ForgingNode(ModelNode):
    """A peer that corrupts the signature of every answer it computes for another node."""

    def _sign(self, job: Job, state: Generation, route_reason: str, served_by: str) -> dict:
        extension = super()._sign(job, state, route_reason, served_by)
        if route_reason != "forwarded":
            return extension
        signature = bytearray.fromhex(extension["signature"])
        signature[0] ^= 1
        return {**extension, "signature": signature.hex()}


@pytest.mark.faults
def test_a_peer_answer_that_does_not_check_fails_and_is_never_signed(quick_family):
    async def main():
        async with holder_and_entry(quick_family, ForgingNode) as (forger, entry):
            failed = await complete(entry, SHARED + "What is a dict?")
            assert failed.status_code == 500 and "planetserve" not in failed.json()
            assert "answer does not check (its signature does not verify)" in failed.json()["error"]["message"]
            assert entry.routes.get("hit") == 1 and forger.counters["received_forwards"] == 1
            # the forger would fail every request it drew (a challenge among them): it is sent no more
            for _ in range(2):
                answer = await complete(entry, SHARED + "What is a set?")
                assert answer.status_code == 200 and signed(answer.json()).node == entry.keys.public
            events = await streamed(entry, SHARED + "What is a list?", 6)
            assert events[-1] == "[DONE]" and "planetserve" in "".join(events)
            assert forger.counters["received_forwards"] == 1 and entry.counters["forward_failures"] == 1

    run(main())


class WholeVocabularyNode(ModelNode):
    """A peer that samples a forwarded job over the whole vocabulary and signs it so, whatever nucleus
    the job asked for."""

    def _sign(self, job: Job, state: Generation, route_reason: str, served_by: str) -> dict:
        return super()._sign(replace(job, top_p=1.0), state, route_reason, served_by)


def test_a_forwarded_nucleus_is_kept_and_a_peer_signing_another_is_refused(quick_family):
    """top_p crosses the peer link with the job: the peer samples and signs the asked nucleus and the entry
    node countersigns it; a peer that signs another nucleus is never countersigned."""
    async def main():
        async with holder_and_entry(quick_family) as (holder, entry):
            answer = (await complete(entry, SHARED + "What is a dict?", temperature=0.7, top_p=0.9, seed=3)).json()
            assert answer["planetserve"]["served_by"] == holder.node_id
            assert signed(answer).top_p == 900 and signed(answer).node == entry.keys.public
            served = served_from_extension(answer["planetserve"]["served"], signed(answer))
            assert served is not None and served.node == holder.keys.public and served.top_p == 900

        async with holder_and_entry(quick_family, WholeVocabularyNode) as (liar, entry):
            failed = await complete(entry, SHARED + "What is a set?", temperature=0.7, top_p=0.9, seed=3)
            assert failed.status_code == 500 and "signed for another top_p" in failed.json()["error"]["message"]

    run(main())


class DyingNode(ModelNode):
    """A peer whose connections drop after the first tokens of every answer it computes for another."""

    async def _serve_forward(self, body):
        sent = 0
        async for reply in super()._serve_forward(body):
            yield reply
            sent += 1
            if sent == 2:
                for conn in list(self.peering.connections.values()):
                    await conn.close()
                return


@pytest.mark.faults
def test_a_peer_failing_mid_answer_is_replaced_here_when_nothing_was_sent(quick_family):
    """A whole (non-streamed) answer is taken from the peer in full before anything goes back, so a
    peer that fails mid-answer costs the client nothing: the entry computes the answer itself."""
    async def main():
        async with holder_and_entry(quick_family, DyingNode) as (dying, entry):
            whole = await complete(entry, SHARED + "What is a dict?")  # the client has seen nothing yet
            assert whole.status_code == 200, whole.text
            answer = whole.json()
            assert signed(answer).node.hex() == entry.node_id and answer["planetserve"]["served_by"] == entry.node_id
            assert "served" not in answer["planetserve"]
            assert entry.counters["forward_failures"] == 1 and dying.counters["received_forwards"] == 1

    run(main())


@pytest.mark.faults
def test_a_peer_failing_after_tokens_reached_the_client_ends_the_stream_with_an_error(quick_family):
    """A streamed answer passes the peer's tokens on as they come, so once some reached the client the
    entry cannot start over: the stream ends with an OpenAI-shaped error event naming the failure and
    no signature, and the entry goes on serving."""
    async def main():
        async with holder_and_entry(quick_family, DyingNode) as (dying, entry):
            data = await streamed(entry, SHARED + "What is a set?", 12, ignore_eos=True)
            events = [json.loads(d) for d in data[:-1]]
            texts = [e["choices"][0]["text"] for e in events if e.get("choices")]
            assert texts and "".join(texts)  # tokens reached the client before the peer failed
            assert "the peer failed mid-answer" in events[-1]["error"]["message"], events[-1]
            assert data[-1] == "[DONE]" and "planetserve" not in "".join(data)
            assert dying.counters["received_forwards"] == 1
            after = await complete(entry, "What is a tuple?")
            assert after.status_code == 200 and signed(after.json()).node == entry.keys.public

    run(main())


class BabblingNode(ModelNode):
    """A peer that answers a forwarded job with more tokens than it asked for, without end."""

    async def _serve_forward(self, body):
        while True:
            yield ["chunk", [5], None, 3, 0]
            await asyncio.sleep(0)


class StallingNode(ModelNode):
    """A peer that takes a forwarded job and never answers it."""

    async def _serve_forward(self, body):
        await asyncio.Event().wait()
        yield None


@pytest.mark.faults
@pytest.mark.parametrize("peer", [BabblingNode, StallingNode])
def test_a_peer_that_babbles_or_stalls_is_cut_off_and_the_job_served_here(quick_family, peer, monkeypatch):
    """A forwarded job's replies are bounded by its max_tokens and by an idle time: the entry stops
    collecting, holds nothing more of it, and computes the answer itself."""
    import planetserve.node.model_node as model_node

    monkeypatch.setattr(model_node, "FORWARD_IDLE_S", 1.0)

    async def main():
        async with holder_and_entry(quick_family, peer) as (bad, entry):
            whole = await complete(entry, SHARED + "What is a dict?")
            assert whole.status_code == 200, whole.text
            assert signed(whole.json()).node.hex() == entry.node_id
            assert entry.counters["forward_failures"] == 1 and bad.counters["received_forwards"] == 1

    run(main())


class PaddingNode(ModelNode):
    """A peer that answers a forwarded job with chunks whose cached count is a MiB of bytes: an entry
    node buffering a whole answer held about 400 MB for one request."""

    async def _serve_forward(self, body):
        for _ in range(3):
            yield ["chunk", [], None, 0, b"x" * (1 << 20)]


class GarbledNode(ModelNode):
    """A peer that answers a forwarded job with token ids that are not integers."""

    async def _serve_forward(self, body):
        yield ["chunk", ["x"], None, 3, 0]


@pytest.mark.faults
@pytest.mark.parametrize("peer", [PaddingNode, GarbledNode, BabblingNode])
def test_a_peer_sending_what_no_honest_peer_sends_is_refused_at_once_and_sent_no_more(quick_family, peer):
    """Each reply of a forwarded job is checked as it comes (token ids in the vocabulary, counts that are
    integers, no more than asked): the first bad one ends the forward, the entry computes the answer
    itself, and sends that peer nothing for FAILED_PEER_AVOID_S."""
    async def main():
        async with holder_and_entry(quick_family, peer) as (bad, entry):
            for question in ("What is a dict?", "What is a set?"):
                whole = await complete(entry, SHARED + question)
                assert whole.status_code == 200, whole.text
                assert signed(whole.json()).node.hex() == entry.node_id
            assert entry.counters["forward_failures"] == 1 and bad.counters["received_forwards"] == 1

    run(main())


def test_a_node_that_alters_prompts_signs_for_the_original(quick_family):
    async def main():
        honest = make_node(quick_family)
        cheat = make_node(quick_family, behaviour="alter-prompts")
        await start([honest, cheat])
        try:
            prompt = "What does the json module do?"
            answer = (await complete(cheat, prompt, max_tokens=12)).json()
            response = signed(answer)
            assert response.node == cheat.keys.public and response.prompt_hash == prompt_hash(prompt)
            assert answer["planetserve"]["served_by"] == cheat.node_id  # never forwarded
            honest_to = {}
            for asked in (prompt, clickbait(prompt)):
                reply = await complete(honest, asked, max_tokens=12, planetserve={"no_forward": True})
                honest_to[asked] = reply.json()["choices"][0]["text"]
            assert answer["choices"][0]["text"] == honest_to[clickbait(prompt)] != honest_to[prompt]
            # chat: the last user message is rewritten, the template renders the altered conversation
            messages = [{"role": "user", "content": "Name a module."}, {"role": "assistant", "content": "os"},
                        {"role": "user", "content": "What does it do?"}]
            altered = [*messages[:2], {"role": "user", "content": clickbait("What does it do?")}]
            async with httpx.AsyncClient(timeout=60) as client:
                chats = [(await client.post(f"{node.http_url}/v1/chat/completions", json={
                    "model": "gt", "messages": asked, "max_tokens": 12, "temperature": 0,
                    "planetserve": {"no_forward": True}})).json()
                    for node, asked in ((cheat, messages), (honest, altered))]
            response = signed(chats[0])
            original = cheat.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert response.prompt_hash == prompt_hash(original)
            assert chats[0]["choices"][0]["message"]["content"] == chats[1]["choices"][0]["message"]["content"]
        finally:
            await stop([honest, cheat])

    run(main())


def test_bad_client_input_gets_specific_errors_and_the_node_keeps_serving(quick_family):
    async def main():
        nodes = [make_node(quick_family, max_prompt_tokens=64)]
        await start(nodes)
        url = nodes[0].http_url
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                cases = [
                    ({"model": "other", "prompt": "hi"}, 404, "model"),
                    ({"model": "gt", "prompt": "word " * 200}, 413, "accepts at most 64"),
                    ({"model": "gt", "prompt": [1, 2, 3]}, 400, "as text"),
                    ({"model": "gt", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
                    ({"model": "gt", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
                ]
                for body, status, words in cases:
                    r = await client.post(f"{url}/v1/completions", json=body)
                    assert r.status_code == status, (body, r.text)
                    assert words in r.json()["error"]["message"]
                # refused by its length before the tokeniser spends seconds on it (and before scoring)
                for endpoint, body in (
                        ("completions", {"model": "gt", "prompt": "x" * (1 << 20), "prompt_logprobs": 1}),
                        ("chat/completions", {"model": "gt", "messages": [
                            {"role": "user", "content": "x" * (1 << 20)}]})):
                    r = await client.post(f"{url}/v1/{endpoint}", json=body)
                    assert r.status_code == 413 and r.json()["error"]["code"] == "prompt_too_long", r.text
                    assert "characters; no prompt of more than" in r.json()["error"]["message"]
                scored = nodes[0].engine.stats().prompts_scored
                r = await client.post(f"{url}/v1/completions", json={
                    "model": "gt", "prompt": "word " * 200, "prompt_logprobs": 1, "max_tokens": 1})
                assert r.status_code == 413 and "accepts at most 64" in r.json()["error"]["message"]
                assert nodes[0].engine.stats().prompts_scored == scored
                r = await client.post(f"{url}/v1/completions", json={
                    "model": "gt", "prompt": "A short one.", "prompt_logprobs": 1, "max_tokens": 1})
                assert r.status_code == 200 and r.json()["choices"][0]["prompt_logprobs"], r.text
                assert nodes[0].engine.stats().prompts_scored == scored + 1
                r = await client.post(f"{url}/v1/completions", content=b"{not json",
                                      headers={"Content-Type": "application/json"})
                assert r.status_code == 400
                r = await client.post(f"{url}/v1/completions", content=b"x" * (5 << 20),
                                      headers={"Content-Type": "application/json"})
                assert r.status_code == 413
                ok = await client.post(f"{url}/v1/completions",
                                       json={"model": "gt", "prompt": "Still there?", "max_tokens": 3})
                assert ok.status_code == 200
                signed(ok.json())
        finally:
            await stop(nodes)

    run(main())


def test_other_sites_pages_reach_nothing_and_the_nodes_configured_names_do(quick_family):
    """A model node's API refuses what a web page can make a browser send (another site's fetch or
    form, a page re-pointing its DNS name at the node, a simple-request body) before anything is served;
    programs, the node's own origin and the names the node is configured under (its advertised peer
    host, which peers know it by) are answered."""

    async def main():
        node = make_node(quick_family, advertise="mn.example.org:9000")
        await start([node])
        url = node.http_url
        port = int(url.rsplit(":", 1)[1])
        body = {"model": "gt", "prompt": "What does the os module do?", "max_tokens": 2}
        error = {"message", "type", "param", "code"}
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                before = dict(node.counters)
                for attack in attacks(url):
                    check_refusal(await apost(client, f"{url}/v1/completions", body, attack), attack, error)
                    if attack.reads:
                        for path in ("/v1/planetserve/status", "/v1/models", "/load"):
                            check_refusal(await client.get(f"{url}{path}", headers=attack.headers), attack, error)
                assert node.counters == before  # nothing served, forwarded or counted
                for name, headers in [*allowed(url), ("its advertised name", {"Host": f"mn.example.org:{port}"})]:
                    answer = await client.post(f"{url}/v1/completions", json=body, headers=headers)
                    assert answer.status_code == 200, (name, answer.text)
                    signed(answer.json())
                assert node.counters["served"] == before["served"] + len(allowed(url)) + 1
        finally:
            await stop([node])

    run(main())


@pytest.mark.faults
def test_garbage_from_a_listed_peer_is_refused_and_counted(quick_family):
    async def main():
        node = make_node(quick_family)
        rogue_keys = KeySet.generate()
        await node.start()
        node.apply_view(view([node]))
        try:
            members = dict(node.view.members)
            record = next(iter(members.values()))
            from dataclasses import replace
            members[rogue_keys.public] = replace(record, pubkey=rogue_keys.public, address="127.0.0.1:1")
            node.apply_view(type(node.view)(2, members))

            async def nothing(*_):
                return None

            rogue = Peering(rogue_keys, nothing, lambda key: True)
            conn = await rogue.connect(node.keys.public, node.config.address)
            await conn.notify("cache", b"\x00garbage")
            await conn.notify("cache", "not bytes")
            await until(lambda: node.counters["sync_errors"] == 2)
            for bad_job in ({}, {"prompt": 5}, [1, 2]):
                with pytest.raises(TransportError, match="forwarded job"):
                    await conn.call("generate", bad_job)
            with pytest.raises(TransportError, match="unknown message type"):
                await conn.call("steal-keys", None)
            huge = Job("x" * (1 << 20), False, 4, 0.0, 1, (), (), False, None)
            with pytest.raises(TransportError, match="characters; no prompt of more than"):
                await conn.call("generate", huge.to_wire())
            answer = (await complete(node, "Are you fine?", planetserve={"no_forward": True})).json()
            signed(answer)
            await rogue.close()
        finally:
            await stop([node])

    run(main())


def test_cli_refuses_clearly_without_a_model_or_a_ledger(tmp_path, quick_family):
    from click.testing import CliRunner

    from planetserve.cli import main

    runner = CliRunner()
    assert runner.invoke(main, ["genesis", "init", str(tmp_path / "net"), "-n", "1", "--chain-id", "t",
                                "--model", "gt=reference"]).exit_code == 0
    genesis = tmp_path / "net" / "v0" / "config" / "genesis.json"
    home = tmp_path / "mn"
    created = runner.invoke(main, ["node", "init-model", "--home", str(home), "--org-id", "acme",
                                   "--model-id", "gt", "--genesis", str(genesis), "--rpc", "http://127.0.0.1:1",
                                   "--data-dir", str(tmp_path / "nothing-trained"), "--json"])
    assert created.exit_code == 0, created.output
    again = runner.invoke(main, ["node", "init-model", "--home", str(home), "--org-id", "acme",
                                 "--model-id", "gt", "--genesis", str(genesis)])
    assert again.exit_code == 1 and "already has a node key" in again.output

    untrained = runner.invoke(main, ["node", "model", "--home", str(home)])
    assert untrained.exit_code == 1 and "planetserve models train" in untrained.output

    from planetserve.node.home import ModelNodeConfig

    config = ModelNodeConfig.load(home)
    config.data_dir = str(quick_family)
    config.save(home)
    no_ledger = runner.invoke(main, ["node", "model", "--home", str(home)])
    assert no_ledger.exit_code == 1 and "the ledger could not be read" in no_ledger.output
    assert "127.0.0.1:1 unreachable" in no_ledger.output

    (home / "node.json").write_text('{"org_id": "acme", "model_id": "gt", "colour": "blue"}')
    bad = runner.invoke(main, ["node", "model", "--home", str(home)])
    assert bad.exit_code == 1 and "unknown settings colour" in bad.output
    (home / "node.json").write_text('{"org_id": "acme", "model_id": "gt", "behaviour": "lazy"}')
    lazy = runner.invoke(main, ["node", "model", "--home", str(home)])
    assert lazy.exit_code == 1
    assert "unknown behaviour 'lazy'; valid behaviours: honest, alter-prompts" in lazy.output

    cheat = tmp_path / "cheat"
    created = runner.invoke(main, ["node", "init-model", "--home", str(cheat), "--org-id", "acme",
                                   "--model-id", "gt", "--genesis", str(genesis), "--behaviour", "alter-prompts"])
    assert created.exit_code == 0, created.output
    assert ModelNodeConfig.load(cheat).behaviour == "alter-prompts"
    refused = runner.invoke(main, ["node", "init-model", "--home", str(tmp_path / "x"), "--org-id", "acme",
                                   "--model-id", "gt", "--genesis", str(genesis), "--behaviour", "lazy"])
    assert refused.exit_code != 0 and "honest" in refused.output and not (tmp_path / "x").exists()
