"""The anonymous overlay's cost to a streamed answer: TTFT and per-token latency of the same requests
sent through a user relay's endpoint (n S-IDA cloves over anonymous paths of three relays, the answer
back as cloves through the proxies) and sent to the model node's own API, interleaved.

Everything runs on loopback with real TLS links: a real model node (the built-in engine) in this
process with the client, and the user relays (the client's own, which serves the endpoint, and the
relays its paths cross) in a process of their own, as they run on other machines; with
`--in-process` they share the node's event loop and GIL instead (tests/overlaynet.py's layout), so
the relays' work on every part of an answer competes with the engine's thread. Each round sends one
request each way, alternating which goes first; every request has a prompt of its own (no prefix-cache
hits) and streams `--tokens` tokens (`ignore_eos`).

- TTFT: from sending the request to the first streamed token.
- per token: (last token - first token) / (tokens - 1), the streaming rate the client sees.
- total: from sending to the end of the stream (the connection's last byte).
- the overlay's cost: the median over rounds of the overlay request's figure minus the direct one's.

Target (issue 26): the overlay adds at most 10 ms of TTFT and at most max(0.5 ms, 5% of the model's
own per-token time) per streamed token.

    .venv/bin/python bench/overlay_cost.py [--rounds 30] [--tokens 32] [--data-dir DIR]
        [--shape 0.5b] [--relays 12] [--in-process]

`--shape` serves a random-weight Llama with a published model's depth and width (engine/profile.py's
SHAPES) over gt's tokenizer and vocabulary instead of the trained gt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planetserve.chain.keys import KeySet  # noqa: E402
from planetserve.genesis.network import free_ports  # noqa: E402
from planetserve.models import load  # noqa: E402
from planetserve.node.engine.builtin import BuiltinEngine  # noqa: E402
from planetserve.node.home import ModelNodeConfig, UserConfig  # noqa: E402
from planetserve.node.model_node import ModelNode  # noqa: E402
from planetserve.node.overlay.directory import DirectoryView  # noqa: E402
from planetserve.node.overlay.paths import PathSettings  # noqa: E402
from planetserve.node.routing.group import GroupView  # noqa: E402
from planetserve.node.user import UserRelay  # noqa: E402
from planetserve.registry.entities import ModelNode as NodeRecord  # noqa: E402
from planetserve.registry.entities import User  # noqa: E402

MODES = ("direct", "overlay")
TTFT_TARGET_MS = 10.0
TOKEN_TARGET_MS = 0.5
TOKEN_TARGET_SHARE = 0.05
WORDS = ("the", "committee", "keeps", "a", "ledger", "of", "every", "node", "and", "each", "node", "answers",
         "questions")


@dataclass(frozen=True)
class Sample:
    ttft: float
    per_token: float
    total: float


def build_engine(args: argparse.Namespace) -> tuple[BuiltinEngine, object, tuple[int, ...]]:
    loaded = load("gt", data_dir=args.data_dir or None)
    model = loaded.model
    if args.shape:
        from transformers import LlamaConfig, LlamaForCausalLM

        from planetserve.node.engine.profile import SHAPES

        dims = SHAPES[args.shape]
        config = LlamaConfig(vocab_size=model.config.vocab_size, hidden_size=dims.hidden,
                             intermediate_size=dims.ffn, num_hidden_layers=dims.layers,
                             num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads,
                             max_position_embeddings=model.config.max_position_embeddings,
                             attn_implementation="sdpa")
        model = LlamaForCausalLM(config).eval()
    engine = BuiltinEngine(model, "gt", max_batch=4, cache_capacity_tokens=8192)
    return engine, loaded.tokenizer, tuple(loaded.stop_token_ids)


def user_relays(count: int) -> list[UserRelay]:
    settings = PathSettings(target=4, setup_timeout=10.0, ping_interval=30.0)
    config = UserConfig(http="127.0.0.1:0", peer="127.0.0.1:0", proxies=4, response_timeout=60.0)
    return [UserRelay(config, KeySet.generate(), None, settings=settings) for _ in range(count)]


async def start_relays(users: list[UserRelay], record: NodeRecord) -> DirectoryView:
    """Start `users` (the first serves the endpoint and keeps 4 paths) toward the node of `record`."""
    for user in users:
        await user.start(serve_http=user is users[0])
    view = DirectoryView.of(2, [User(u.keys.public, u.config.address, "global", 0, 1 << 40) for u in users],
                            [record])
    for user in users:
        user.apply_view(view)
    users[0].start_paths()
    if not await users[0].paths.wait_live(4, 30):
        raise SystemExit(f"the relay built too few paths: {users[0].paths.last_error}")
    return view


def relay_process(conn: Connection, count: int, record: NodeRecord) -> None:
    """The relays in a process of their own: they report their keys, addresses and the endpoint's URL,
    then relay until told to stop."""

    async def serve() -> None:
        users = user_relays(count)
        view = await start_relays(users, record)
        conn.send((view.height, [(u.keys.public, u.config.address) for u in users], users[0].http_url))
        await asyncio.to_thread(conn.recv)
        for user in users:
            await user.close()

    asyncio.run(serve())


async def start(args: argparse.Namespace) -> tuple[ModelNode, str, Callable[[], Awaitable[None]]]:
    """The model node, and the relays' endpoint URL, with what closes them."""
    engine, tokenizer, stop = await asyncio.to_thread(build_engine, args)
    http, peer = free_ports(2)
    config = ModelNodeConfig(org_id="bench", model_id="gt", http=f"127.0.0.1:{http}",
                             peer=f"127.0.0.1:{peer}", capacity=4, max_prompt_tokens=1024, cache_tokens=8192)
    node = ModelNode(config, KeySet.generate(), engine, tokenizer, vocab_size=engine.vocab_size, eos_ids=stop,
                     group=None)
    await node.start()
    record = NodeRecord(node.keys.public, "bench", "gt", config.address, "cpu", 4, "global", "active", 1)
    node.apply_view(GroupView(1, {node.keys.public: record}))
    if args.in_process:
        users = user_relays(args.relays + 1)
        node.apply_users(await start_relays(users, record))
        url = users[0].http_url

        async def close() -> None:
            for user in users:
                await user.close()
    else:
        ours, theirs = multiprocessing.get_context("spawn").Pipe()
        process = multiprocessing.get_context("spawn").Process(
            target=relay_process, args=(theirs, args.relays + 1, record), daemon=True)
        process.start()
        height, listed, url = await asyncio.to_thread(ours.recv)
        node.apply_users(DirectoryView.of(height, [User(key, address, "global", 0, 1 << 40)
                                                   for key, address in listed], [record]))

        async def close() -> None:
            ours.send("stop")
            await asyncio.to_thread(process.join, 30)

    async def close_all() -> None:
        await close()
        await node.close()
        await node.engine.close()

    return node, url, close_all


async def ask(http: httpx.AsyncClient, url: str, prompt: str, tokens: int) -> Sample:
    body = {"model": "gt", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    times: list[float] = []
    sent = time.perf_counter()
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"{url}: {response.status_code} {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                times += [time.perf_counter()] * len(chunk["choices"][0].get("token_ids") or ())
    done = time.perf_counter()
    if len(times) != tokens:
        raise SystemExit(f"{url}: {len(times)} tokens streamed, {tokens} asked")
    return Sample((times[0] - sent) * 1e3, (times[-1] - times[0]) * 1e3 / (tokens - 1), (done - sent) * 1e3)


async def run(args: argparse.Namespace) -> dict[str, list[Sample]]:
    node, overlay_url, close = await start(args)
    urls = {"direct": node.http_url, "overlay": overlay_url}
    samples: dict[str, list[Sample]] = {mode: [] for mode in MODES}
    try:
        async with httpx.AsyncClient(timeout=120) as http:
            for i in range(args.warmup + args.rounds):
                order = MODES if i % 2 == 0 else MODES[::-1]
                for mode in order:
                    words = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(40))
                    prompt = f"Request {i} {mode}: {words}"
                    sample = await ask(http, urls[mode], prompt, args.tokens)
                    if i >= args.warmup:
                        samples[mode].append(sample)
        counters = node.gateway.counters
        print(f"answer parts per overlay request: {counters['parts_sent'] / counters['prompts']:.1f}")
    finally:
        await close()
    return samples


def report(args: argparse.Namespace, samples: dict[str, list[Sample]]) -> None:
    fields = ("ttft", "per_token", "total")
    med = {mode: {f: statistics.median(getattr(s, f) for s in samples[mode]) for f in fields}
           for mode in MODES}
    # Each round's two requests ran back to back: their difference is the overlay's cost under the same
    # load, so the cost is the median of those differences (other work on the machine cancels out).
    cost = {f: statistics.median(getattr(o, f) - getattr(d, f)
                                 for d, o in zip(samples["direct"], samples["overlay"], strict=True))
            for f in fields}
    model = f"random-weight {args.shape} shape" if args.shape else "gt"
    where = "in the model node's process" if args.in_process else "in a process of their own"
    print(f"{model}, {args.tokens} tokens, {args.rounds} rounds interleaved, {args.relays} relays {where} "
          f"(n 4, k 3, paths of 3), loopback TLS; medians in ms\n")
    print(f"{'':10} {'TTFT':>8} {'per token':>10} {'total':>8}")
    for mode in MODES:
        m = med[mode]
        print(f"{mode:10} {m['ttft']:8.2f} {m['per_token']:10.3f} {m['total']:8.2f}")
    print(f"{'overlay +':10} {cost['ttft']:+8.2f} {cost['per_token']:+10.3f} {cost['total']:+8.2f}"
          "   (median of each round's difference)")
    d, o = med["direct"], med["overlay"]
    print(f"{'ratio':10} {o['ttft'] / d['ttft']:8.2f}x {o['per_token'] / d['per_token']:9.2f}x "
          f"{o['total'] / d['total']:7.2f}x")
    token_target = max(TOKEN_TARGET_MS, TOKEN_TARGET_SHARE * d["per_token"])
    ttft_ok = cost["ttft"] <= TTFT_TARGET_MS
    token_ok = cost["per_token"] <= token_target
    print(f"\ntarget TTFT +{TTFT_TARGET_MS:g} ms: {'holds' if ttft_ok else 'missed'}; "
          f"per token +{token_target:.3f} ms (max of {TOKEN_TARGET_MS:g} ms and "
          f"{TOKEN_TARGET_SHARE:.0%} of {d['per_token']:.3f}): {'holds' if token_ok else 'missed'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--relays", type=int, default=12, help="relays besides the client's own")
    parser.add_argument("--data-dir", default="",
                        help="where the trained family is (default $PLANETSERVE_DATA)")
    parser.add_argument("--shape", default="", help="a random-weight model of this shape (0.5b, 1b, ...)")
    parser.add_argument("--in-process", action="store_true",
                        help="the relays in the model node's process (its event loop and GIL) too")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    report(args, asyncio.run(run(args)))


if __name__ == "__main__":
    main()
