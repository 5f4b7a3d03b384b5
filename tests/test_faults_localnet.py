"""Crashes in every epoch phase on the whole localnet (`make faults`; long, so left out of `make test`):
with the verifier daemons running epochs on their own, one validator's app, one whole validator and
one verifier daemon are each SIGKILLed in the results window, the attestation stretch, the plan window
and the VRF window, and restarted. Every epoch still finalizes, no committed state diverges, no
daemon submits anything twice, honest nodes stay trusted, and the client still gets answers."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from chainnet import assert_same_app_hashes
from roles import localnet, quick_config

from planetserve.chain.client import LedgerClient
from planetserve.chain.errors import Code
from planetserve.chain.lightclient import LightClient
from planetserve.chain.rpc import RpcClient
from planetserve.genesis.network import NetworkSpec
from planetserve.localnet import processes, roles
from planetserve.localnet.cluster import Cluster
from planetserve.localnet.config import load_config
from planetserve.localnet.net import cluster_app, make_plan
from planetserve.registry import epochs, reputation
from planetserve.registry.params import Params
from planetserve.verifier.config import read_submissions

pytestmark = [pytest.mark.network, pytest.mark.faults, pytest.mark.soak]

PARAMS = Params(epoch_blocks=40, results_blocks=16, vrf_window_blocks=10, plan_window_blocks=14)
SCHEDULE = epochs.Schedule.from_params(PARAMS)
RULE = reputation.ReputationRule.from_params(PARAMS)
KINDS = ("app", "validator", "verifier")
DOWN_S = 2.0


def phase_heights(epoch: int) -> dict[str, int]:
    """A height inside each phase of `epoch`, early enough to leave the phase time to go on."""
    start, end = SCHEDULE.start(epoch), SCHEDULE.end(epoch)
    return {"results": start + 2, "attestations": start + PARAMS.results_blocks + 2,
            "plan": end - PARAMS.plan_window_blocks + 2, "vrf": end - PARAMS.vrf_window_blocks + 2}


def phase_of(height: int) -> str:
    if SCHEDULE.in_results(height):
        return "results"
    if SCHEDULE.in_vrf_window(height):
        return "vrf"
    if SCHEDULE.in_plan_window(height):
        return "plan"
    return "attestations"


def crash(kind: str, index: int, cluster: Cluster, verifiers: dict[int, roles.Role]) -> None:
    if kind == "verifier":
        role = verifiers[index]
        processes.stop_recorded([role.home], sig=signal.SIGKILL, timeout=5)
        time.sleep(DOWN_S)
        roles.start(role)
        return
    cluster.stop(index, sig=signal.SIGKILL, part="app" if kind == "app" else "all")
    time.sleep(DOWN_S)
    cluster.stop(index, part="cometbft")  # without its app CometBFT stops too; make sure of it
    cluster.start(index)


def test_crashes_in_every_epoch_phase(tmp_path: Path, quick_family):
    config_path = quick_config(tmp_path, quick_family)
    root = tmp_path / "build"
    try:
        up = localnet("up", "--root", str(root), "--config", str(config_path), "--json")
        spec = NetworkSpec.load(root)
        cluster = Cluster(spec, cluster_app)
        config = load_config(config_path)
        everyone = roles.roles(make_plan(root, config, spec))
        verifiers = {i: r for i, r in enumerate(r for r in everyone if r.kind == "verifier")}
        rpc = RpcClient(spec.validators[0].rpc_url)
        client = LedgerClient(rpc, LightClient.from_genesis_file(spec.genesis_path, rpc))

        first = SCHEDULE.epoch_of(rpc.latest_height()) + 1
        hit: list[tuple[str, str, int]] = []
        for round_, kind in enumerate(KINDS):
            epoch = first + round_
            for height in sorted(phase_heights(epoch).values()):
                cluster.wait_for_height(height, validators=[0], timeout=120)
                index = 1 + (len(hit) % 3)
                at = rpc.latest_height()
                hit.append((kind, phase_of(at), index))
                crash(kind, index, cluster, verifiers)
        assert {(k, p) for k, p, _ in hit} == {(k, p) for k in KINDS for p in phase_heights(first)}, hit

        last = first + len(KINDS) + 1
        top = cluster.wait_for_height(SCHEDULE.end(last) + 1, timeout=300)
        client.min_height = SCHEDULE.end(last)
        assert all(client.epoch(n).finalized for n in range(first, last + 1))
        assert_same_app_hashes(cluster, min(top.values()) - 1)
        for role in verifiers.values():
            codes = [entry.get("code") for entry in read_submissions(role.home)]
            assert Code.ALREADY_EXISTS not in codes, f"{role.name} submitted something twice"
        names = {n["pubkey"]: n["name"] for n in up["nodes"]}
        honest = [key for key, name in names.items() if name.startswith("honest")]
        for key in honest:
            assert client.reputation(bytes.fromhex(key)).value >= RULE.untrusted, names[key]
        answer = httpx.post(f"{up['client']}/chat/completions", timeout=120, json={
            "model": "gt", "max_tokens": 8, "messages": [{"role": "user", "content": "Still there?"}]})
        assert answer.status_code == 200, answer.text
    finally:
        subprocess.run([sys.executable, "-m", "planetserve", "localnet", "down", "--root", str(root)],
                       capture_output=True, timeout=120)
