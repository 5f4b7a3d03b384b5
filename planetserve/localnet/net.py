"""`make localnet`: the whole system on 127.0.0.1, composed by localnet/localnet.toml (`config`).

`up` trains (or reuses) the model family, builds the network once (validators with a genesis that
declares each model node's organisation), starts every process that is not running (validators,
model nodes, user relays, the client's relay, a verifier daemon beside each validator, the dashboard),
waits until all are ready, and sends one prompt through the client's relay over the anonymous overlay.

State lives under `localnet/build/` (ignored by git). Running `up` again reuses what is there:
stopped processes are restarted, running ones are left alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from planetserve.chain.client import LedgerClient
from planetserve.chain.keys import KeySet
from planetserve.chain.messages.registry import RegisterOrg
from planetserve.genesis.committee import app_state_builder
from planetserve.genesis.network import SPEC_FILE, NetworkSpec, ValidatorInfo, build_network
from planetserve.localnet import roles
from planetserve.localnet.cluster import Cluster, stop_all
from planetserve.localnet.config import LocalnetConfig
from planetserve.localnet.plan import CLIENT, DASHBOARD, NODES, Plan, genesis_organisations, organisation_keys
from planetserve.localnet.probes import http_status, http_url, ledger_for
from planetserve.models.recipes import PRESETS
from planetserve.registry.entities import ModelNode

if TYPE_CHECKING:
    from planetserve.models.family import Reporter

DEFAULT_ROOT = Path("localnet/build")
MANIFEST = "localnet.json"
"""Written when `up` builds a network: marks a root as the whole system's (older ones ran validators only)."""
READY_TIMEOUT = 300.0
ANSWER_TIMEOUT = 120.0

Progress = Callable[[str], None]


class LocalnetError(Exception):
    """The localnet could not be brought up; the message says what failed and which log to read."""


def app_command(home: Path) -> list[str]:
    """The command line of a validator's ABCI app."""
    return list(roles.planetserve("chain", "app", "--home", str(home)))


def cluster_app(info: ValidatorInfo) -> list[str]:
    """`app_command` in the form a Cluster asks for."""
    return app_command(info.home)


@dataclass(frozen=True)
class Answer:
    text: str
    node: str
    """The key (hex) of the model node that signed the answer."""
    seconds: float


@dataclass
class UpResult:
    spec: NetworkSpec
    height: int
    nodes: list[ModelNode]
    """The verified node list of the client's model."""
    names: dict[str, str]
    """Node key (hex) → the node's name in the configuration."""
    model_id: str
    client: str | None
    """The client relay's OpenAI-compatible base URL (None without model nodes)."""
    answer: Answer | None
    started: list[str] = field(default_factory=list)
    """The processes this call started (the others were running)."""
    dashboard: str | None = None
    """The dashboard's URL (None without a client relay)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "chain_id": self.spec.chain_id, "genesis": str(self.spec.genesis_path),
            "rpc": [v.rpc_url for v in self.spec.validators], "height": self.height,
            "model_id": self.model_id, "client": self.client, "dashboard": self.dashboard,
            "started": self.started,
            "answer": None if self.answer is None else {"text": self.answer.text, "node": self.answer.node,
                                                       "name": self.names.get(self.answer.node),
                                                       "seconds": round(self.answer.seconds, 2)},
            "nodes": [{**n.to_record(), "name": self.names.get(n.pubkey.hex())} for n in self.nodes],
        }


def existing(root: Path, config: LocalnetConfig) -> NetworkSpec | None:
    """The network already under `root` (None: none yet), if `config` can run on it."""
    if (root / SPEC_FILE).exists():
        if not (root / MANIFEST).exists():
            raise LocalnetError(f"{root} holds a network made by an older `localnet up` (validators only); "
                                f"stop it with `planetserve localnet down --root {root}`, then delete {root}")
        spec = NetworkSpec.load(root)
        if len(spec.validators) != config.validators:
            raise LocalnetError(f"the network under {root} has {len(spec.validators)} validators and the "
                                f"configuration asks for {config.validators}; delete {root} to build it "
                                "again")
        return spec
    return None


def build(root: Path, config: LocalnetConfig, org_keys: dict[str, KeySet]) -> NetworkSpec:
    """Build the network under `root` from `config`, its genesis declaring the organisations of `org_keys`."""
    preset = PRESETS[config.preset]
    models = [(model_id, preset.recipe(model_id).role) for model_id in config.model_ids] or [
        ("gt", preset.recipe("gt").role)]
    organisations = genesis_organisations(org_keys)
    spec = build_network(root, config.validators, config.chain_id,
                         app_state_builder(models, config.params, organisations=organisations),
                         timeout_commit=config.timeout_commit, keep_heights=config.keep_heights)
    (root / MANIFEST).write_text(json.dumps({"format": 1, "config": str(config.source or "built-in")}) + "\n")
    return spec


def make_plan(root: Path, config: LocalnetConfig, spec: NetworkSpec | None) -> Plan:
    """The plan of `config` under `root`: each organisation's key read (or made) once, and the network
    `spec` already there, else built now with those keys."""
    org_keys = organisation_keys(root, config)
    return Plan(root, config, spec or build(root, config, org_keys), org_keys)


def ensure_organisations(plan: Plan, ledger: LedgerClient) -> None:
    """Register the organisations a configuration added after the genesis was made."""
    for org in plan.organisations:
        if ledger.org(org.org_id) is None:
            done = ledger.submit(plan.org_keys[org.org_id], RegisterOrg(org.org_id, org.name))
            if not done.outcome.ok:
                raise LocalnetError(f"registering organisation {org.org_id} failed: {done.outcome.log}")


def up(root: Path, config: LocalnetConfig, progress: Progress = lambda _: None,
       reporter: Reporter | None = None) -> UpResult:
    """Start (or resume) everything `config` lists and check it end to end."""
    from planetserve.models.family import train_family

    root = root.absolute()
    spec = existing(root, config)
    if config.nodes:
        family = config.family_dir(root)
        progress(f"training or reusing the {config.preset} model family in {family}")
        train_family(config.preset, family, reporter=reporter)
    progress("starting validators and waiting for blocks")
    plan = make_plan(root, config, spec)
    spec = plan.spec
    cluster = Cluster(spec, cluster_app, start_timeout=60.0)
    before = [f"validator {v.moniker}" for v in spec.validators if not all(cluster.running(v.index).values())]
    cluster.start()
    reached = cluster.wait_for_height(2, timeout=90.0)
    # a resumed network reports the height it stopped at before it commits anything: wait for a block of
    # this run, whose header is fresh enough for the light client's max_age (clients refuse older ones)
    cluster.wait_for_height(max(reached.values()) + 1, timeout=90.0)
    ledger = ledger_for(spec)
    ensure_organisations(plan, ledger)

    everyone = roles.roles(plan)
    started = [r for r in everyone if roles.start(r) is not None]
    roles.wait_ready(everyone, READY_TIMEOUT, lambda waiting: progress(
        f"waiting for {len(waiting)} process(es) to be ready: {', '.join(r.describe() for r in waiting[:4])}"
        + ("…" if len(waiting) > 4 else "")))

    client = answer = None
    if config.has_client:
        relay = next(r for r in everyone if r.name == CLIENT)
        client = http_url(relay.http) + "/v1"
        progress(f"asking {config.client_model} through the client relay: {config.prompt!r}")
        answer = ask(relay, config)
    listing, nodes = ledger.nodes(config.client_model)
    names = {r.key.hex(): r.name for r in everyone if r.kind == "node"}
    board = next((r for r in everyone if r.kind == DASHBOARD), None)
    return UpResult(spec, listing.height, nodes, names, config.client_model, client, answer,
                    before + [r.describe() for r in started],
                    http_url(board.http) + "/" if board is not None else None)


def ask(relay: roles.Role, config: LocalnetConfig) -> Answer:
    """One chat completion through the client relay. Its 502 and 503 answers (a proxy the model node
    has not read yet, a path that just broke) are worth a retry, as its documentation says."""
    url = http_url(relay.http)
    body = {"model": config.client_model, "messages": [{"role": "user", "content": config.prompt}],
            "max_tokens": config.max_tokens, "temperature": 0}
    deadline = time.monotonic() + ANSWER_TIMEOUT
    errors: list[str] = []
    while True:
        status = http_status(relay.http) or {}
        if status.get("model_nodes"):  # the relay has read the trusted list
            began = time.monotonic()
            try:
                reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=ANSWER_TIMEOUT)
            except httpx.HTTPError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            else:
                if reply.status_code == 200:
                    data = reply.json()
                    return Answer(data["choices"][0]["message"]["content"], data["planetserve"]["node"],
                                  time.monotonic() - began)
                errors.append(f"{reply.status_code}: {reply.text[:300]}")
                if reply.status_code not in (502, 503):
                    break
        if time.monotonic() > deadline:
            break
        time.sleep(2.0)
    why = "; ".join(errors[-3:]) or "it lists no trusted model node"
    raise LocalnetError(f"the client relay gave no answer ({why}); see {relay.log} and the model nodes' "
                        f"logs under {relay.home.parent.parent / NODES}/*/logs/ (the processes keep "
                        "running until `planetserve localnet down`)")


def down(root: Path = DEFAULT_ROOT) -> bool:
    """Stop every process of the network; False when there is no network under root."""
    root = root.absolute()
    if not (root / SPEC_FILE).exists():
        return False
    roles.stop(root)
    stop_all(root)
    return True
