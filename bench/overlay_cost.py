"""The anonymous overlay's cost: the same streamed completions asked of a model node directly (its HTTP
API) and through a user relay's OpenAI endpoint (the prompt as n S-IDA cloves over n paths of three
relays, every answer part back as cloves through the proxies the prompt named), interleaved one by
one so both see the same machine.

Every role runs in its own process, as on its own machine: the model node, each relay that carries the
client's paths, and the client's own user relay (whose OpenAI endpoint the program asks, over loopback
HTTP as a user's program does). Prompts are fresh random text (no prefix-cache hit in either mode), and
every request generates exactly `--tokens` tokens.

- TTFT: from sending the request to the first token's chunk.
- per token: (last token's arrival - first token's) / (tokens - 1), the streaming rate a user sees.
- the model's own per-token time is the direct request's.
Target (issue 26): through the overlay at most +10 ms of TTFT and +0.5 ms per streamed token, or 5% of
the model's own per-token time where that is larger.

With `--loops asyncio,uvloop` every role's process runs on each event loop in turn: one whole set of
processes per loop, all running at once, their requests interleaved round by round (the order rotating)
so each loop sees the same machine. The CLI runs the overlay's roles on uvloop.

    .venv/bin/python bench/overlay_cost.py [--data-dir DIR] [--shape 0.5b] [--tokens 32] [--rounds 30]
        [--loops asyncio,uvloop]

DIR holds a trained gt (for instance localnet/build after `make localnet`; by default the models' own
data directory); with `--shape` the node serves a random-weight model of that published shape with
gt's tokenizer instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import describe  # noqa: E402
from bench.processes import Processes  # noqa: E402
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


LOOPS = {"asyncio": asyncio.run, "uvloop": uvloop.run}


def serve_node(pipe: Connection, loop: str, args: argparse.Namespace, users: list[tuple[bytes, str]]) -> None:
    """The model node's process: serve until the parent says stop."""
    LOOPS[loop](_serve_node(pipe, args, users))


async def _serve_node(pipe: Connection, args: argparse.Namespace, users: list[tuple[bytes, str]]) -> None:
    import torch

    from bench.forwarding_real import own_engine
    from planetserve.node.model_node import ModelNode
    from planetserve.node.routing.group import GroupView

    torch.set_num_threads(args.threads)
    http, peer = free_ports(2)
    config = ModelNodeConfig(org_id="bench", model_id="gt", model="gt", data_dir=args.data_dir,
                             http=f"127.0.0.1:{http}", peer=f"127.0.0.1:{peer}", capacity=4,
                             max_prompt_tokens=4096)
    engine, tokenizer, vocab, stop = await own_engine(config, args.shape or None)
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


def serve_relay(pipe: Connection, loop: str, path_uses: int, client: bool) -> None:
    """A relay's process: report its key and address, take the directory, relay until told to stop. The
    client's relay also serves its OpenAI endpoint, and reports it once its paths are live."""
    LOOPS[loop](_serve_relay(pipe, path_uses, client))


async def _serve_relay(pipe: Connection, path_uses: int, client: bool) -> None:
    relay = UserRelay(user_config(path_uses), KeySet.generate(), None)
    await relay.start(serve_http=client)
    pipe.send((relay.keys.public, relay.config.address))
    relay.apply_view(await asyncio.to_thread(pipe.recv))
    if client:
        relay.start_paths()
        live = await relay.paths.wait_live(relay.config.n, 30)
        pipe.send(relay.http_url if live else SystemExit(f"no paths: {relay.paths.last_error}"))
    await asyncio.to_thread(pipe.recv)
    await relay.close()


@dataclass(frozen=True)
class Setup:
    """One loop's set of processes, ready: where to ask, and whose CPU to count."""

    urls: dict[str, str]
    node_pid: int
    client_pid: int
    relay_pids: list[int]

    def cpu(self) -> tuple[float, float, float]:
        """CPU ms so far of the node, the client's relay and the relays together."""
        return cpu_ms(self.node_pid), cpu_ms(self.client_pid), sum(map(cpu_ms, self.relay_pids))


async def start_setup(processes: Processes, loop: str, args: argparse.Namespace) -> Setup:
    client, client_pipe = processes.start(serve_relay, loop, args.path_uses, True)
    relays = [processes.start(serve_relay, loop, args.path_uses, False) for _ in range(args.relays)]
    everyone = [(client, client_pipe), *relays]
    listed = [await processes.answer(process, pipe, f"relay ({loop})") for process, pipe in everyone]
    node, node_pipe = processes.start(serve_node, loop, args, listed)
    key, address, node_url = await processes.answer(node, node_pipe, f"model node ({loop})")  # type: ignore[misc]
    view = directory(listed, node_record(key, address))  # type: ignore[arg-type]
    for _, pipe in everyone:
        pipe.send(view)
    client_url = await processes.answer(client, client_pipe, f"client's relay ({loop})")
    if isinstance(client_url, SystemExit):
        raise client_url
    return Setup({"direct": node_url, "overlay": client_url}, node.pid, client.pid,  # type: ignore[arg-type]
                 [process.pid for process, _ in relays])


async def measure(args: argparse.Namespace) -> dict[str, dict[str, list[Timing]]]:
    """Per loop and mode, the timings of the measured requests."""
    processes = Processes()
    try:
        setups = {loop: await start_setup(processes, loop, args) for loop in args.loops}
        rng = random.Random(args.seed)
        timings: dict[str, dict[str, list[Timing]]] = {loop: {"direct": [], "overlay": []} for loop in setups}
        runs = [(loop, mode) for loop in setups for mode in ("direct", "overlay")]
        async with httpx.AsyncClient(timeout=600) as http:
            for round_ in range(args.rounds + args.warmup):
                shift = round_ % len(runs)
                for loop, mode in runs[shift:] + runs[:shift]:
                    setup = setups[loop]
                    before = setup.cpu()
                    text = prompt(rng, args.prompt_words)
                    ttft, per_token = await stream(http, setup.urls[mode], text, args.tokens)
                    node, client, relays = (now - was for now, was in zip(setup.cpu(), before, strict=True))
                    timing = Timing(ttft, per_token, node_cpu_ms=node, client_cpu_ms=client,
                                    relays_cpu_ms=relays)
                    if round_ >= args.warmup:
                        timings[loop][mode].append(timing)
                print(f"\r  {round_ + 1}/{args.rounds + args.warmup} rounds", end="", file=sys.stderr,
                      flush=True)
        print(file=sys.stderr)
        return timings
    finally:
        await processes.stop()


def summarize(args: argparse.Namespace, timings: dict[str, list[Timing]]) -> dict[str, dict[str, float]]:
    """Per mode: TTFT and per-token medians, CPU per token means; and the overlay's excess as "overlay +"."""
    def row(ts: list[Timing]) -> dict[str, float]:
        return {"ttft_ms": statistics.median(t.ttft_ms for t in ts),
                "token_ms": statistics.median(t.per_token_ms for t in ts),
                **{f"{part}_cpu_per_token_ms":
                   statistics.fmean(getattr(t, f"{part}_cpu_ms") for t in ts) / args.tokens
                   for part in ("node", "client", "relays")}}

    rows = {mode: row(ts) for mode, ts in timings.items()}
    rows["overlay +"] = {k: rows["overlay"][k] - rows["direct"][k] for k in rows["direct"]}
    return rows


def report(args: argparse.Namespace, summaries: dict[str, dict[str, dict[str, float]]]) -> None:
    print(f"\n{'':18} {'TTFT ms':>9} {'per token ms':>13}   CPU ms per token: {'node':>6} {'client':>7} "
          f"{'relays':>7}   (medians of {args.rounds} interleaved requests of {args.tokens} tokens; "
          f"CPU: means)")
    for loop, rows in summaries.items():
        for mode, r in rows.items():
            sign = "+" if mode == "overlay +" else ""
            print(f"{loop:7} {mode:10} {r['ttft_ms']:{sign}9.2f} {r['token_ms']:{sign}13.3f}   {'':18}"
                  f"{r['node_cpu_per_token_ms']:{sign}6.3f} {r['client_cpu_per_token_ms']:{sign}7.3f} "
                  f"{r['relays_cpu_per_token_ms']:{sign}7.3f}")
    for loop, rows in summaries.items():
        direct, over = rows["direct"], rows["overlay +"]
        token_target = max(TOKEN_TARGET_MS, TOKEN_TARGET_SHARE * direct["token_ms"])
        ttft_met = "met" if over["ttft_ms"] <= TTFT_TARGET_MS else "not met"
        token_met = "met" if over["token_ms"] <= token_target else "not met"
        print(f"{loop}: TTFT {over['ttft_ms']:+.2f} ms (target <= +{TTFT_TARGET_MS:g}: {ttft_met}); "
              f"per token {over['token_ms']:+.3f} ms (target <= +{token_target:.2f}, the larger of "
              f"{TOKEN_TARGET_MS:g} ms and {TOKEN_TARGET_SHARE:.0%} of the model's "
              f"{direct['token_ms']:.2f} ms: {token_met})")
    (base, first), *others = summaries.items()
    for loop, rows in others:
        was, now = first["overlay"]["relays_cpu_per_token_ms"], rows["overlay"]["relays_cpu_per_token_ms"]
        print(f"{loop} against {base}: the overlay's TTFT excess {first['overlay +']['ttft_ms']:.2f} -> "
              f"{rows['overlay +']['ttft_ms']:.2f} ms; the relays' CPU per token {was:.3f} -> {now:.3f} ms "
              f"({was / now:.2f}x less)")


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
    parser.add_argument("--loops", default="uvloop",
                        help=f"the event loops every process runs on, comma-separated, each a whole set "
                             f"of processes, the first the baseline ({', '.join(LOOPS)}; default uvloop, as "
                             f"the CLI runs them)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.tokens < 2:
        parser.error("--tokens must be at least 2")
    args.loops = args.loops.split(",")
    if any(loop not in LOOPS for loop in args.loops) or len(set(args.loops)) < len(args.loops):
        parser.error(f"--loops: each of {', '.join(LOOPS)} at most once, comma-separated, not {args.loops}")
    served = f"a random-weight {args.shape} shape" if args.shape else "gt"
    print(f"machine: {describe()}")
    print(f"model node ({served}), {args.relays} relays and the client's relay in processes of their own, "
          f"loopback TLS; event loops: {', '.join(args.loops)}")
    timings = asyncio.run(measure(args))
    summaries = {loop: summarize(args, ts) for loop, ts in timings.items()}
    report(args, summaries)
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
