"""`planetserve node`: run the overlay's roles (a model node serving a model to the network; a user relay
that carries others' traffic and gives its user's programs an anonymous OpenAI-compatible endpoint)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click
import uvloop

from planetserve.chain.keys import KeyFileError, KeySet
from planetserve.cli import (
    check_genesis,
    console,
    emit_json,
    fail,
    log_level_option,
    max_age_option,
    metrics_option,
    rpc_option,
    setup_logging,
    witness_option,
)
from planetserve.node.behaviours import BEHAVIOURS, HONEST
from planetserve.node.home import ENGINE_SAMPLING

if TYPE_CHECKING:
    from planetserve.node.home import HomeConfig

HOME_HELP = "The node's home directory (configuration node.json and key file node_keys.json)."


@click.group("node")
def group() -> None:
    """Run overlay nodes.

    \b
    A model node, step by step:
      planetserve models train                        # the small model family (once)
      planetserve node init-model --home mn1 --org-id acme --model-id gt --genesis genesis.json
      planetserve node model --home mn1 --org-keys acme.json   # registers itself, then serves
    \b
    A user relay (any OpenAI client can then use http://127.0.0.1:8080/v1 anonymously):
      planetserve node init-user --home me --genesis genesis.json --peer 0.0.0.0:9100 \\
          --advertise my.host:9100
      planetserve node user --home me
    \b
    A pipeline stage (one layer range of a model too large for one node):
      planetserve node stage --model gt --layers 0:1 --keys stage.json --allow <coordinator key>
    """


@group.command("init-model")
@click.option("--home", required=True, type=click.Path(file_okay=False, path_type=Path), help=HOME_HELP)
@click.option("--org-id", required=True, help="The organisation that registers and answers for the node.")
@click.option("--model-id", required=True, help="The model id registered on the ledger (the node's group).")
@click.option("--model", default="gt", show_default=True,
              help="What the built-in engine loads: a family name (see `planetserve models list`) or a "
                   "Hugging Face checkpoint directory.")
@click.option("--genesis", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Genesis file the ledger is verified against.")
@rpc_option
@witness_option()
@max_age_option()
@metrics_option()
@click.option("--http", "http_addr", default="127.0.0.1:8000", show_default=True,
              help="host:port of the OpenAI-compatible API.")
@click.option("--peer", default="127.0.0.1:9000", show_default=True, help="host:port of the TLS peer port.")
@click.option("--advertise", default="", help="Peer address registered on the ledger (default: --peer).")
@click.option("--capacity", default=4, show_default=True, type=click.IntRange(1, 1024),
              help="Sequences decoded concurrently (also registered).")
@click.option("--prefill-chunk", default=512, show_default=True, type=click.IntRange(1),
              help="Prompt tokens the built-in engine prefills per step: a long prompt then delays running "
                   "requests by one chunk's time per step instead of its whole prefill.")
@click.option("--kv-budget-tokens", default=0, show_default=True, type=click.IntRange(0),
              help="KV positions the built-in engine may reserve (prompt + max_tokens per request); 0 sizes "
                   "it from the GPU's free memory. Requests beyond it wait; past a full queue they get 503.")
@click.option("--hardware", default="cpu", show_default=True, help="Hardware class, registered.")
@click.option("--memory-mib", default=0, show_default=True, type=click.IntRange(0),
              help="Memory offered for the model (MiB), registered. Less than a sized model needs makes this "
                   "node a pipeline stage that serves the layers a deployment assigns it.")
@click.option("--gflops", default=0, show_default=True, type=click.IntRange(0),
              help="Compute throughput (GFLOP/s), registered; pipelines place layers by it.")
@click.option("--region", default="global", show_default=True, help="Where it runs (registered).")
@click.option("--engine-url", default="", help="Use an OpenAI-compatible server (e.g. `vllm serve`) instead "
                                                "of the built-in engine.")
@click.option("--kv-events", default="",
              help="That server's KV-event ZMQ endpoint (vLLM --kv-events-config).")
@click.option("--kv-events-replay", default="",
              help="That server's KV-event replay endpoint (replay_endpoint in vLLM --kv-events-config): "
                   "missed events are asked for there instead of forgetting the mirrored cache.")
@click.option("--engine-sampling", default="server", show_default=True, type=click.Choice(ENGINE_SAMPLING),
              help="How that server samples: vllm-processor for `vllm serve` with planetserve's logits "
                   "processor (sampled answers verify); server leaves sampling to the server.")
@click.option("--data-dir", default="", help="Where the model family is cached (default: PLANETSERVE_DATA "
                                             "or ~/.cache/planetserve).")
@click.option("--node-keys", "--keys", "node_keys",
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Use this key file (copied into the home) instead of a fresh key: a node already "
                   "registered under it.")
@click.option("--behaviour", default=HONEST, show_default=True, type=click.Choice(BEHAVIOURS),
              help="Fault injection for testnets only: alter-prompts answers a clickbait rewrite of each "
                   "prompt but signs for the original, which the committee must catch.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def init_model(home: Path, genesis: Path, http_addr: str, node_keys: Path | None, as_json: bool,
               **settings: object) -> None:
    """Create a model node's home: configuration and a node key (never overwritten)."""
    from planetserve.node.home import ModelNodeConfig

    config = ModelNodeConfig(genesis=str(check_genesis(genesis).resolve()), http=http_addr,
                             **settings)  # type: ignore[arg-type]
    _create_home(home, config, node_keys, as_json, role="model node", key_name="node",
                 extra={"model_id": config.model_id, "address": config.address},
                 run=f"planetserve node model --home {home} --org-keys <organisation key file>")


def _create_home(home: Path, config: HomeConfig, key_file: Path | None, as_json: bool, *, role: str,
                 key_name: str, extra: dict[str, str], run: str) -> None:
    """Write a role's home (with the given key file's key, or a fresh one) and say how to run it."""
    from planetserve.node.home import HomeError, init_home

    try:
        keys = init_home(home, config, KeySet.load(key_file) if key_file else None)
    except (HomeError, KeyFileError) as exc:
        fail(str(exc))
    if as_json:
        emit_json({"home": str(home), key_name: keys.public.hex(), **extra})
        return
    console.print(f"created {role} home [bold]{home}[/]: {key_name} key {keys.public.hex()}")
    console.print(f"run it with: {run}")


@group.command("model")
@click.option("--home", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help=HOME_HELP)
@click.option("--org-keys", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The organisation's key file: registers the node (or updates its address and capacity) "
                   "when the ledger does not match the configuration.")
@log_level_option()
@click.option("--json", "as_json", is_flag=True, help="Print the ready line as JSON.")
def model(home: Path, org_keys: Path | None, log_level: str, as_json: bool) -> None:
    """Run a model node: register on the ledger, serve the model, forward within the group.

    A node whose --memory-mib is less than its model needs (a model registered with its size) is a
    pipeline stage: it registers, waits until a deployment assigns it a layer range, loads only those
    layers, and answers requests by running them through the deployment's stages.

    The node serves an OpenAI-compatible API (/v1/models, /v1/completions, /v1/chat/completions,
    streaming) and a TLS peer port for the other trusted nodes of its model. Every answer carries a
    `planetserve` object: the node's key, address, time, token ids and its signature over them.
    """
    from planetserve.chain.client import QueryRefused
    from planetserve.chain.lightclient import VerificationError
    from planetserve.chain.rpc import RpcError
    from planetserve.models import ModelError
    from planetserve.node.home import HomeError
    from planetserve.node.model_node import ModelNode
    from planetserve.node.pipeline.assignment import AssignmentError
    from planetserve.node.registration import Registered, RegistrationError
    from planetserve.node.runner import run_model_node

    setup_logging(log_level)
    try:
        org = KeySet.load(org_keys) if org_keys else None
    except KeyFileError as exc:
        fail(str(exc))

    def ready(node: ModelNode, registered: Registered) -> None:
        line = {"node": node.node_id, "model_id": node.config.model_id, "http": node.http_url,
                "peer": f"{node.config.peer.rpartition(':')[0]}:{node.peer_port}",
                "registration": registered.action,
                "stage": list(node.stage.layers) if node.stage is not None else None}
        if as_json:
            click.echo(json.dumps(line), nl=True)
        else:
            part = (f", layers {node.stage.layers[0]}-{node.stage.layers[1] - 1} of pipeline "
                    f"{node.stage.layers[2]}" if node.stage is not None else "")
            console.print(f"model node {node.node_id[:16]}… serving {node.config.model_id} at "
                          f"{node.http_url} (peer port {node.peer_port}, {registered.action}{part})")

    try:
        uvloop.run(run_model_node(home, org, ready))
    except (HomeError, RegistrationError, ModelError, KeyFileError, ValueError, OSError,
            AssignmentError) as exc:
        fail(str(exc))
    except (RpcError, VerificationError, QueryRefused) as exc:
        fail(f"the ledger could not be read: {exc}")


@group.command("rotate-key")
@click.option("--home", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help=HOME_HELP)
@click.option("--org-keys", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The organisation's key file: the organisation sends the rotation.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def rotate_key(home: Path, org_keys: Path, as_json: bool) -> None:
    """Move a model node to a fresh key at the next epoch's first block.

    Writes the new key to node_keys.next.json in the home and sends rotate-node-key, signed by the
    node's current key and the new one. At the rotation height the node's registration, listing,
    reputation and deployment move to the new key and the old key is refused. A running node switches
    to the new key by itself (its model stays loaded); a stopped one does when it next starts.
    """
    from planetserve.chain.client import TRANSIENT, LedgerClient
    from planetserve.node.home import HomeError, ModelNodeConfig, load_keys, prepare_next_keys
    from planetserve.node.registration import RegistrationError, rotate_key

    try:
        config = ModelNodeConfig.load(home)
        keys, org = load_keys(home), KeySet.load(org_keys)
        new = prepare_next_keys(home)
        with LedgerClient.verified(config.rpc, config.genesis, witness=config.witness,
                                   max_age=config.max_age) as ledger:
            rotation = rotate_key(ledger, config, keys, new, org)
    except (HomeError, KeyFileError, RegistrationError) as exc:
        fail(str(exc))
    except TRANSIENT as exc:
        fail(f"the ledger could not be reached: {exc}")
    if as_json:
        emit_json({"node": keys.public.hex(), "new": new.public.hex(), "height": rotation.height})
        return
    console.print(f"node {keys.public.hex()[:16]}… rotates to key {new.public.hex()} at height "
                  f"{rotation.height}; a running node switches then, a stopped one when it starts")


USER_HOME_HELP = "The relay's home directory (configuration user.json and key file node_keys.json)."


@group.command("init-user")
@click.option("--home", required=True, type=click.Path(file_okay=False, path_type=Path), help=USER_HOME_HELP)
@click.option("--genesis", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Genesis file the ledger is verified against.")
@rpc_option
@witness_option()
@max_age_option()
@metrics_option()
@click.option("--http", "http_addr", default="127.0.0.1:8080", show_default=True,
              help="host:port of the local OpenAI-compatible endpoint (keep it on loopback).")
@click.option("--peer", default="127.0.0.1:9100", show_default=True,
              help="host:port of the TLS port other relays and model nodes dial.")
@click.option("--advertise", default="", help="Address registered on the ledger (default: --peer).")
@click.option("--region", default="global", show_default=True, help="Where it runs (registered).")
@click.option("--proxies", default=5, show_default=True, type=click.IntRange(1, 16),
              help="Live proxies (onion paths) to keep; at least n.")
@click.option("--n", "n", default=4, show_default=True, type=click.IntRange(1, 16),
              help="Cloves per message (one per path).")
@click.option("--k", "k", default=3, show_default=True, type=click.IntRange(1, 16),
              help="Cloves that recover a message; k - 1 reveal nothing.")
@click.option("--keys", "key_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Use this key file (copied into the home) instead of a fresh key.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def init_user(home: Path, genesis: Path, http_addr: str, key_file: Path | None, as_json: bool,
              **settings: object) -> None:
    """Create a user relay's home: configuration and a key (never overwritten)."""
    from planetserve.node.home import UserConfig

    config = UserConfig(genesis=str(check_genesis(genesis).resolve()), http=http_addr,
                        **settings)  # type: ignore[arg-type]
    if not config.proxies >= config.n >= config.k:
        fail(f"need --proxies >= --n >= --k, got {config.proxies}, {config.n}, {config.k}")
    _create_home(home, config, key_file, as_json, role="user relay", key_name="user",
                 extra={"address": config.address, "http": config.http},
                 run=f"planetserve node user --home {home}")


@group.command("user")
@click.option("--home", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help=USER_HOME_HELP)
@log_level_option()
@click.option("--json", "as_json", is_flag=True, help="Print the ready line as JSON.")
def user(home: Path, log_level: str, as_json: bool) -> None:
    """Run a user relay: register (heartbeats keep it listed), relay other users' paths, keep proxies,
    and serve a local OpenAI-compatible endpoint (/v1/models, /v1/completions, /v1/chat/completions,
    streaming) whose requests reach trusted model nodes anonymously.

    Point any OpenAI client at it, e.g. `OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="none")`.
    Follow-ups of a chat go to the same model node. /v1/planetserve/status shows the relay's paths
    and counters; /health says whether enough paths are live.
    """
    from planetserve.chain.client import QueryRefused
    from planetserve.chain.lightclient import VerificationError
    from planetserve.chain.rpc import RpcError
    from planetserve.node.home import HomeError
    from planetserve.node.registration import RegistrationError
    from planetserve.node.runner import run_user_relay
    from planetserve.node.user import UserRelay
    from planetserve.registry.entities import User

    setup_logging(log_level)

    def ready(relay: UserRelay, registered: User, action: str) -> None:
        live = len(relay.paths.live())
        line = {"user": relay.keys.public.hex(), "http": relay.http_url, "peer": relay.config.address,
                "registration": action, "live_paths": live, "expires_at": registered.expires_at}
        if as_json:
            click.echo(json.dumps(line), nl=True)
            return
        console.print(f"user relay {line['user'][:16]}… ({action}) relaying at {relay.config.address}; "
                      f"OpenAI endpoint {relay.http_url}/v1 with {live} live path(s)")
        if live < relay.config.k:
            console.print(f"[yellow]only {live} live path(s), {relay.config.k} needed: "
                          f"{relay.paths.last_error or 'still building'}[/]")

    try:
        uvloop.run(run_user_relay(home, ready))
    except (HomeError, RegistrationError, KeyFileError, ValueError, OSError) as exc:
        fail(str(exc))
    except (RpcError, VerificationError, QueryRefused) as exc:
        fail(f"the ledger could not be read: {exc}")


def _layers(_ctx: click.Context, _param: click.Parameter, text: str) -> tuple[int, int]:
    start, sep, end = text.partition(":")
    if not (sep and start.isdigit() and end.isdigit() and int(start) < int(end)):
        raise click.BadParameter(f"takes START:END with START < END, got {text!r}")
    return int(start), int(end)


def _peer_keys(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> set[bytes]:
    keys = set()
    for text in values:
        try:
            key = bytes.fromhex(text)
        except ValueError:
            key = b""
        if len(key) != 32:
            raise click.BadParameter(f"a peer key is 64 hex digits, got {text[:80]!r}")
        keys.add(key)
    return keys


@group.command("stage")
@click.option("--model", required=True, help="A family name (gt) or a checkpoint directory.")
@click.option("--layers", required=True, callback=_layers,
              help="START:END, the half-open layer range served.")
@click.option("--keys", "key_file", required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="This stage's key file (its TLS identity).")
@click.option("--allow", multiple=True, required=True, callback=_peer_keys,
              help="Hex key of a peer that may send it steps (repeatable): the pipeline's coordinator "
                   "and the stages before it.")
@click.option("--data-dir", default=None, help="Where the model family is cached.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the TLS peer port listens on.")
@click.option("--port", default=0, show_default=True, type=click.IntRange(0, 65535),
              help="0 picks a free port (printed when ready).")
@click.option("--device", default="cpu", show_default=True, help="torch device of the layers, e.g. cuda:0.")
@click.option("--max-tokens", type=click.IntRange(1), help="Positions per request (default: the model's).")
@click.option("--idle-timeout", type=click.FloatRange(min=0.1),
              help="Seconds before an idle request's KV cache is freed (default 60).")
def stage(model: str, layers: tuple[int, int], key_file: Path, allow: set[bytes], data_dir: str | None,
          host: str, port: int, device: str, max_tokens: int | None, idle_timeout: float | None) -> None:
    """Serve one layer range of a model as a pipeline stage (Parallax): hidden states in, hidden states
    (or, on the last stage, logits) out, over TLS with one KV cache per request. Prints one JSON line,
    {"key", "layers", "address"}, once it listens."""
    from planetserve.models import ModelError
    from planetserve.node.pipeline.stages import RunningStage, StageError, StageModel, run_stage

    def ready(running: RunningStage) -> None:
        click.echo(json.dumps({"key": keys.public.hex(), "layers": list(layers),
                               "address": f"{host}:{running.port}"}))

    try:
        keys = KeySet.load(key_file)
        served = StageModel.load(model, *layers, data_dir=data_dir, device=device)
        limits = {"idle_timeout": idle_timeout} if idle_timeout is not None else {}
        uvloop.run(run_stage(keys, served, allow, host, port, ready, max_tokens=max_tokens, **limits))
    except KeyboardInterrupt:
        pass
    except (ModelError, KeyFileError, StageError, ValueError, OSError) as exc:
        fail(str(exc))
