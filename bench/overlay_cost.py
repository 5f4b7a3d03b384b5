"""The anonymous overlay's cost: the same streamed completions asked of a model node directly (its HTTP
API) and through a user relay's OpenAI endpoint (the prompt as n S-IDA cloves over n paths of three
relays, every answer part back as cloves through the proxies the prompt named), interleaved one by
one so both see the same machine.

Every role runs in its own process, as on its own machine: the model node, each relay that carries the
client's paths, and the client's own user relay (here, with the program that asks). Prompts are fresh random
text (no prefix-cache hit in either mode), and every request generates exactly `--tokens` tokens.

- TTFT: from sending the request to the first token's chunk.
- per token: (last token's arrival - first token's) / (tokens - 1), the streaming rate a user sees.
- the model's own per-token time is the direct request's.
Target (issue 26): through the overlay at most +10 ms of TTFT and +0.5 ms per streamed token, or 5% of
the model's own per-token time where that is larger.

    .venv/bin/python bench/overlay_cost.py [--data-dir DIR] [--shape 0.5b] [--tokens 32] [--rounds 30]

DIR holds a trained gt (for instance localnet/build after `make localnet`; by default the models' own
data directory); with `--shape` the node serves a random-weight model of that published shape with
gt's tokenizer instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planetserve.chain.keys import KeySet  # noqa: E402
from planetserve.genesis.network import free_ports  # noqa: E402
from planetserve.node.home import ModelNodeConfig, UserConfig  # noqa: E402
from planetserve.node.overlay.directory import DirectoryView  # noqa: E402
from planetserve.node.user import UserRelay  # noqa: E402
from planetserve.registry.entities import ModelNode as NodeRecord  # noqa: E402
from planetserve.registry.entities import User  # noqa: E402

TTFT_TARGET_MS = 10.0
TOKEN_TARGET_MS = 0.5
TOKEN_TARGET_SHARE = 0.05
WORDS = ("the", "of", "model", "node", "relay", "path", "token", "cache", "user", "proxy", "ledger",
         "answer", "prompt", "stream", "clove", "key", "list", "block", "share", "time")


@dataclass(frozen=True)
class Timing:
    ttft_ms: float
    per_token_ms: float
    node_cpu_ms: float
    """CPU the model node's process spent on the request (all its threads)."""
    client_cpu_ms: float
    """CPU this process spent: the program asking, and for the overlay the client's user relay."""
    relays_cpu_ms: float
    """CPU the relay processes spent, all together."""


def cpu_ms(pid: int) -> float:
    """A process's user + system CPU time so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) * 1e3 / os.sysconf("SC_CLK_TCK")


def node_record(key: bytes, address: str) -> NodeRecord:
    return NodeRecord(key, "bench", "gt", address, "cpu", 4, "global", "active", 1)


def directory(users: list[tuple[bytes, str]], node: NodeRecord) -> DirectoryView:
    """The verified lists every role is given: the users (key, address) and the one model node."""
    return DirectoryView.of(1, [User(key, address, "global", 0, 1 << 40) for key, address in users], [node])


def serve_node(pipe: Connection, args: argparse.Namespace, users: list[tuple[bytes, str]]) -> None:
    """The model node's process: serve until the parent says stop."""
    asyncio.run(_serve_node(pipe, args, users))


async def _serve_node(pipe: Connection, args: argparse.Namespace, users: list[tuple[bytes, str]]) -> None:
    import torch

    from bench.forwarding_real import shaped_engine, shaped_model
    from planetserve.node.model_node import ModelNode
    from planetserve.node.routing.group import GroupView
    from planetserve.node.runner import builtin_engine

    torch.set_num_threads(args.threads)
    http, peer = free_ports(2)
    config = ModelNodeConfig(org_id="bench", model_id="gt", model="gt", data_dir=args.data_dir,
                             http=f"127.0.0.1:{http}", peer=f"127.0.0.1:{peer}", capacity=4,
                             max_prompt_tokens=4096)
    engine, tokenizer, vocab, stop = builtin_engine(config)
    if args.shape:
        await engine.close()
        engine, _, vocab, _ = shaped_engine(config, shaped_model(args.shape, tokenizer), tokenizer)
    node = ModelNode(config, KeySet.generate(), engine, tokenizer, vocab_size=vocab, eos_ids=stop, group=None)
    await node.start()
    me = node_record(node.keys.public, config.peer)
    node.apply_view(GroupView(1, {me.pubkey: me}))
    node.apply_users(directory(users, me))
    pipe.send((node.keys.public, config.peer, node.http_url))
    await asyncio.to_thread(pipe.recv)
    await node.close()
    await engine.close()


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def stream(client: httpx.AsyncClient, url: str, text: str, tokens: int) -> tuple[float, float]:
    """TTFT and per-token time (ms) of one streamed completion of exactly `tokens` tokens."""
    body = {"model": "gt", "prompt": text, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    arrivals = []
    sent = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"{url}: {response.status_code} {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                arrivals.append(time.perf_counter())
    if len(arrivals) != tokens:
        raise SystemExit(f"{url}: {len(arrivals)} token chunks streamed, {tokens} asked for")
    return (arrivals[0] - sent) * 1e3, (arrivals[-1] - arrivals[0]) * 1e3 / (tokens - 1)


def user_config(path_uses: int) -> UserConfig:
    return UserConfig(http="127.0.0.1:0", peer="127.0.0.1:0", response_timeout=120.0, path_uses=path_uses)


def serve_relay(pipe: Connection, path_uses: int) -> None:
    """A relay's process: report its key and address, take the directory, relay until told to stop."""
    asyncio.run(_serve_relay(pipe, path_uses))


async def _serve_relay(pipe: Connection, path_uses: int) -> None:
    relay = UserRelay(user_config(path_uses), KeySet.generate(), None)
    await relay.start(serve_http=False)
    pipe.send((relay.keys.public, relay.config.address))
    relay.apply_view(await asyncio.to_thread(pipe.recv))
    await asyncio.to_thread(pipe.recv)
    await relay.close()


class Processes:
    """The other roles' processes, each started with a pipe to talk to it."""

    def __init__(self) -> None:
        self.context = multiprocessing.get_context("spawn")
        self.started: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []

    def start(self, target: object, *args: object) -> tuple[multiprocessing.process.BaseProcess, Connection]:
        parent, child = self.context.Pipe()
        process = self.context.Process(target=target, args=(child, *args), daemon=True)
        process.start()
        self.started.append((process, parent))
        return process, parent

    @staticmethod
    async def answer(process: multiprocessing.process.BaseProcess, pipe: Connection, what: str) -> object:
        deadline = time.monotonic() + 300
        while not await asyncio.to_thread(pipe.poll, 0.5):
            if not process.is_alive() or time.monotonic() > deadline:
                raise SystemExit(f"the {what} did not start (its error is above)")
        return pipe.recv()

    async def stop(self) -> None:
        for process, pipe in self.started:
            if process.is_alive():
                pipe.send("stop")
        for process, _ in self.started:
            await asyncio.to_thread(process.join, 60)


async def measure(args: argparse.Namespace) -> dict[str, list[Timing]]:
    client = UserRelay(user_config(args.path_uses), KeySet.generate(), None)
    await client.start()
    processes = Processes()
    try:
        relays = [processes.start(serve_relay, args.path_uses) for _ in range(args.relays)]
        listed = [(client.keys.public, client.config.address)]
        for process, pipe in relays:
            listed.append(await processes.answer(process, pipe, "relay"))  # type: ignore[arg-type]
        node, node_pipe = processes.start(serve_node, args, listed)
        key, address, node_url = await processes.answer(node, node_pipe, "model node")  # type: ignore[misc]
        view = directory(listed, node_record(key, address))
        client.apply_view(view)
        for _, pipe in relays:
            pipe.send(view)
        client.start_paths()
        if not await client.paths.wait_live(client.config.n, 30):
            raise SystemExit(f"no paths: {client.paths.last_error}")
        rng = random.Random(args.seed)
        timings: dict[str, list[Timing]] = {"direct": [], "overlay": []}
        urls = {"direct": node_url, "overlay": client.http_url}
        relay_pids = [process.pid for process, _ in relays]
        async with httpx.AsyncClient(timeout=600) as http:
            for round_ in range(args.rounds + args.warmup):
                order = ["direct", "overlay"] if round_ % 2 == 0 else ["overlay", "direct"]
                for mode in order:
                    before = (cpu_ms(node.pid), time.process_time(), sum(map(cpu_ms, relay_pids)))
                    text = prompt(rng, args.prompt_words)
                    ttft, per_token = await stream(http, urls[mode], text, args.tokens)
                    timing = Timing(ttft, per_token, node_cpu_ms=cpu_ms(node.pid) - before[0],
                                    client_cpu_ms=(time.process_time() - before[1]) * 1e3,
                                    relays_cpu_ms=sum(map(cpu_ms, relay_pids)) - before[2])
                    if round_ >= args.warmup:
                        timings[mode].append(timing)
                print(f"\r  {round_ + 1}/{args.rounds + args.warmup} rounds", end="", file=sys.stderr,
                      flush=True)
        print(file=sys.stderr)
        return timings
    finally:
        await processes.stop()
        await client.close()


def report(args: argparse.Namespace, timings: dict[str, list[Timing]]) -> dict[str, float]:
    def row(ts: list[Timing]) -> dict[str, float]:
        return {"ttft_ms": statistics.median(t.ttft_ms for t in ts),
                "token_ms": statistics.median(t.per_token_ms for t in ts),
                **{f"{part}_cpu_per_token_ms":
                   statistics.fmean(getattr(t, f"{part}_cpu_ms") for t in ts) / args.tokens
                   for part in ("node", "client", "relays")}}

    rows = {mode: row(ts) for mode, ts in timings.items()}
    direct, overlay = rows["direct"], rows["overlay"]
    print(f"\n{'':10} {'TTFT ms':>9} {'per token ms':>13}   CPU ms per token: {'node':>6} {'client':>7} "
          f"{'relays':>7}   (medians of {args.rounds} interleaved requests of {args.tokens} tokens; "
          f"CPU: means)")
    for mode, r in rows.items():
        print(f"{mode:10} {r['ttft_ms']:9.2f} {r['token_ms']:13.3f}   {'':18}"
              f"{r['node_cpu_per_token_ms']:6.3f} {r['client_cpu_per_token_ms']:7.3f} "
              f"{r['relays_cpu_per_token_ms']:7.3f}")
    over = {k: overlay[k] - direct[k] for k in direct}
    print(f"{'overlay +':10} {over['ttft_ms']:+9.2f} {over['token_ms']:+13.3f}   {'':18}"
          f"{over['node_cpu_per_token_ms']:+6.3f} {over['client_cpu_per_token_ms']:+7.3f} "
          f"{over['relays_cpu_per_token_ms']:+7.3f}   ({overlay['ttft_ms'] / direct['ttft_ms']:.2f}x TTFT, "
          f"{overlay['token_ms'] / direct['token_ms']:.2f}x per token)")
    token_target = max(TOKEN_TARGET_MS, TOKEN_TARGET_SHARE * direct["token_ms"])
    ttft_met = over["ttft_ms"] <= TTFT_TARGET_MS
    print(f"target: TTFT <= +{TTFT_TARGET_MS:g} ms: {'met' if ttft_met else 'not met'}; "
          f"per token <= +{token_target:.2f} ms (the larger of {TOKEN_TARGET_MS:g} ms and "
          f"{TOKEN_TARGET_SHARE:.0%} of the model's {direct['token_ms']:.2f} ms): "
          f"{'met' if over['token_ms'] <= token_target else 'not met'}")
    return {f"{mode}_{k}": v for mode, r in rows.items() for k, v in r.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="",
                        help="a directory holding a trained gt (default: the models' own data directory)")
    parser.add_argument("--shape", help="serve a random-weight model of this shape (0.5b, 1b, ...)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--prompt-words", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=30, help="requests per mode (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--relays", type=int, default=6, help="user relays besides the client's")
    parser.add_argument("--path-uses", type=int, default=UserConfig.path_uses,
                        help="requests per path before it is replaced (the user's setting; 0: never)")
    parser.add_argument("--threads", type=int, default=1, help="the model node's torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.tokens < 2:
        parser.error("--tokens must be at least 2")
    served = f"a random-weight {args.shape} shape" if args.shape else "gt"
    print(f"model node ({served}), {args.relays} relays and the client in processes of their own, "
          f"loopback TLS")
    timings = asyncio.run(measure(args))
    summary = report(args, timings)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
