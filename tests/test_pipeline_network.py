"""A model too large for any one node, served on the ledger by a layer pipeline: three model node
processes each declare memory for two of the model's six layers; an organisation's deployment records
Parallax's phase-1 allocation on the ledger (one node's key is rotated while it waits, and it is
assigned under the new one); each node reads its layer range from the verified state,
loads only those layers, and coordinates requests through the deployment's stages. Requests through
the anonymous overlay, to each of the three nodes, come back signed with the unsplit model's greedy
tokens, and the verifier's challenge of the pipeline's entry scores as an honest answer. When a stage
leaves (set inactive, then stopped), the ledger plans the pipeline again over the remaining stages and
a standby node, and requests to each of them are served again."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from chainnet import MODELS, SHORT_EPOCHS, ledger, start_network
from modelfix import DEEP_LAYERS
from modelnodes import signed
from openai import OpenAI
from promscrape import scrape, value
from roles import NodeProcess, RelayProcess, planetserve, relay_retried, start_relays
from waiting import wait_until

from planetserve.chain.challenge import Challenge
from planetserve.chain.keys import KeySet
from planetserve.chain.messages import DeployModel, UpdateModelNode
from planetserve.genesis.network import free_ports
from planetserve.models import LoadedModel
from planetserve.node.home import NEXT_KEYS_FILE, ModelNodeConfig
from planetserve.registry.credits import CREDIT_SECONDS
from planetserve.registry.genesis import GenesisOrganisation
from planetserve.verifier.credibility import ReferenceModel
from planetserve.verifier.overlay import OverlayChannel

pytestmark = pytest.mark.network

LAYER_MIB = 100
PROMPT = "Return a new"
RELAYS = 5
SHORT_S = 15


def init_stage_home(home, net, deep: LoadedModel) -> None:
    http, peer, metrics = free_ports(3)
    done = planetserve("node", "init-model", "--home", str(home), "--org-id", "acme", "--model-id", "deep",
                       "--model", str(deep.path), "--genesis", str(net.spec.genesis_path),
                       "--rpc", net.rpc_url(0), "--http", f"127.0.0.1:{http}",
                       "--peer", f"127.0.0.1:{peer}", "--memory-mib", str(2 * LAYER_MIB),
                       "--gflops", "50", "--capacity", "2", "--metrics", f"127.0.0.1:{metrics}", "--json")
    assert done.returncode == 0, done.stderr
    config = ModelNodeConfig.load(home)
    config.list_interval = 1.0
    config.save(home)


def deploy(client, owner: KeySet, seconds: int):
    return client.submit(owner, DeployModel("acme", "deep", "cpu", 3, seconds))


def registered(client, nodes: list[NodeProcess]) -> int:
    for node in nodes:
        if node.proc.poll() is not None:
            raise AssertionError(f"a stage exited: {node.log_tail()}")
    return len(client.nodes("deep")[1])


@torch.inference_mode()
def greedy(deep: LoadedModel, n: int) -> list[int]:
    tokens = deep.tokenizer(PROMPT)["input_ids"]
    start = len(tokens)
    for _ in range(n):
        tokens.append(int(deep.model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[start:]


def ask(openai: OpenAI, node: str) -> dict:
    """A completion from exactly `node`."""
    answer, _ = relay_retried(lambda: openai.completions.create(
        model="deep", prompt=PROMPT, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "planetserve": {"node": node, "no_forward": True}}).model_dump(),
        lambda: f"from {node[:16]}")
    return answer


def test_a_model_split_across_three_nodes_serves_through_the_overlay(tmp_path, deep_gt):
    owner = KeySet.generate()
    owner_path = tmp_path / "acme.json"
    owner.save(owner_path)
    net = start_network(tmp_path / "net", params=dataclasses.replace(SHORT_EPOCHS, min_deployment_seconds=SHORT_S),
                        models=(*MODELS, ("deep", "six-layer gt", DEEP_LAYERS, LAYER_MIB)),
                        organisations=(GenesisOrganisation("acme", "ACME", owner.public, 100 * CREDIT_SECONDS),))
    nodes: list[NodeProcess] = []
    relays: list[RelayProcess] = []
    try:
        client = ledger(net)
        homes = [tmp_path / f"stage{i}" for i in range(3)]
        for home in homes:
            init_stage_home(home, net, deep_gt)
        nodes = [NodeProcess(home, owner_path, wait=False) for home in homes]
        wait_until(lambda: registered(client, nodes) == 3, timeout=90)  # registered, then waiting
        # a waiting stage's key is rotated: from the next epoch it waits, and is assigned, under the new key
        sent = planetserve("node", "rotate-key", "--home", str(homes[0]), "--org-keys", str(owner_path), "--json")
        assert sent.returncode == 0, sent.stderr
        rotated = json.loads(sent.stdout)["new"]
        wait_until(lambda: client.node(bytes.fromhex(rotated)) is not None, timeout=60)
        wait_until(lambda: not (homes[0] / NEXT_KEYS_FILE).exists(), timeout=30)  # the process took it

        # a first, short deployment: the nodes serve it, and go back to waiting when it expires
        assert deploy(client, owner, SHORT_S).outcome.ok
        first = [node.wait_ready() for node in nodes]
        assert sorted(tuple(r["stage"][:2]) for r in first) == [(0, 2), (2, 4), (4, 6)]
        assert first[0]["node"] == rotated and first[0]["registration"] == "rotated"
        relays = start_relays(tmp_path, net, RELAYS)  # they come up while the deployment runs out
        wait_until(lambda: all(client.deployment_of(bytes.fromhex(r["node"])) is None for r in first), timeout=120)

        deployed = deploy(client, owner, 3600)
        assert deployed.outcome.ok, deployed.outcome.log
        ready = [node.wait_ready() for node in nodes]  # the same processes, serving the new assignment
        assert all(node.proc.poll() is None for node in nodes)
        stages = sorted((r["stage"][0], r["stage"][1], r["node"]) for r in ready)
        assert [s[:2] for s in stages] == [(0, 2), (2, 4), (4, 6)]  # equal GPUs, equal blocks, in order
        assert all(client.stage(bytes.fromhex(r["node"])) == tuple(r["stage"]) for r in ready)
        shown = planetserve("query", "node", ready[0]["node"], "--genesis", str(net.spec.genesis_path),
                            "--node", net.rpc_url(1), "--json")
        assert shown.returncode == 0 and '"stage"' in shown.stdout, shown.stderr

        me = relays[0]
        wait_until(lambda: len(me.status()["paths"]) >= 4, timeout=60)
        openai = OpenAI(base_url=f"{me.ready['http']}/v1", api_key="not-needed", max_retries=0)
        assert "deep" in [m.id for m in openai.models.list().data]

        expected = greedy(deep_gt, 8)
        for _, _, key in stages:  # every stage coordinates the requests it is sent
            answer = ask(openai, key)
            response = signed(answer)
            assert response.node.hex() == key and list(response.token_ids) == expected
            assert answer["choices"][0]["text"] == deep_gt.tokenizer.decode(expected, skip_special_tokens=True)
        statuses = [node.status() for node in nodes]
        assert all(s["stage"] is not None and s["counters"]["served"] >= 1 for s in statuses)
        for home in homes:  # each stage serves its metrics too
            served = scrape(f"http://{ModelNodeConfig.load(home).metrics}/metrics")
            assert value(served, "planetserve_model_node_served_total") >= 1

        # the verifier challenges the pipeline through its entry, as it would a single node
        entry = bytes.fromhex(stages[0][2])
        # as a chat: the node signs the rendered template, which the verifier renders the same way
        reference = ReferenceModel.from_loaded(deep_gt, model_id="deep")
        question = "How do I read a file line by line?"
        challenge = Challenge.new(reference.chat_prompt(question), 0, question)
        # asking for log-probabilities, as a tenth of challenges do: a pipeline reports them like any engine
        channel = OverlayChannel(me.ready["http"], max_tokens=16, logprobs_share=1.0)
        reply = channel.ask(entry, "deep", challenge)
        assert reply.response.node == entry and reply.response.temperature == 0
        verdict = reference.verify_one(reply.response, challenge.prompt, entry)
        # greedy through the split model is the unsplit model's choice at every step
        assert verdict.ok and verdict.calibrated == 1.0, verdict

        # a stage leaves: acme sets it inactive and stops it; in that transaction the ledger plans
        # the pipeline again over the two remaining stages and a standby node, which all serve
        process = {r["node"]: node for r, node in zip(ready, nodes, strict=True)}
        init_stage_home(tmp_path / "stage3", net, deep_gt)
        standby = NodeProcess(tmp_path / "stage3", owner_path, wait=False)
        nodes.append(standby)
        wait_until(lambda: registered(client, nodes) == 4, timeout=90)  # registered, then waiting
        leaving = stages[1][2]
        left = client.submit(owner, UpdateModelNode(bytes.fromhex(leaving), status="inactive"))
        assert left.outcome.ok, left.outcome.log
        process.pop(leaving).stop()
        healed = [node.wait_ready() for node in (*process.values(), standby)]
        assert sorted(tuple(r["stage"][:2]) for r in healed) == [(0, 2), (2, 4), (4, 6)]
        assert all(client.stage(bytes.fromhex(r["node"])) == tuple(r["stage"]) for r in healed)
        assert client.deployment_of(bytes.fromhex(leaving)) is None
        for r in healed:  # every stage coordinates again, the standby node's layers included
            response = signed(ask(openai, r["node"]))
            assert response.node.hex() == r["node"] and list(response.token_ids) == expected
    finally:
        for relay in relays:
            relay.stop()
        for node in nodes:
            node.stop()
        net.close()
