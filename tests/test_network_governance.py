"""Parameter changes and an upgrade voted by four real validators: a change approved by more than 2/3
applies at its height on every validator with identical app hashes, one that lacks 2/3 never applies;
at an upgrade's height every app of the old version halts, and the new one, started on the same state,
carries the chain on; `chain export` then `genesis init --from-export` starts a new network with the
same registry (tests/test_governance.py and tests/test_export.py have the rules in process)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest
from chainnet import LISTED_AT_ONCE, MODELS, assert_same_app_hashes, fast_config, ledger, member_keys
from click.testing import CliRunner
from harness import relaxed
from upgraded_app import MARK
from waiting import wait_until

from planetserve.chain.keys import KeySet
from planetserve.chain.messages import ProposeParams, RegisterOrg, RegisterUser, VoteMember
from planetserve.cli import main
from planetserve.genesis.committee import app_state_builder
from planetserve.genesis.network import KEYS_FILE, NetworkSpec, ValidatorInfo, build_network
from planetserve.localnet.cluster import Cluster
from planetserve.localnet.net import cluster_app
from planetserve.registry import codec

pytestmark = pytest.mark.network

FAST = fast_config({"consensus": {"timeout_propose": "1s"}})
LEAD = 60
"""Blocks between a proposal and its height: the votes' time (about 4 s at these blocks' pace)."""
UPGRADED = str(Path(__file__).with_name("upgraded_app.py"))


def upgraded_app(info: ValidatorInfo) -> list[str]:
    return [sys.executable, UPGRADED, "--home", str(info.home)]


def halted_apps(cluster: Cluster) -> list[int]:
    """The validators whose old app stopped at the upgrade: at least one. The first to gather the
    upgrade block's commit stops, and its CometBFT with it, possibly before its precommit reached the
    others; a validator left without that commit waits below the height, its old app running (seen: two
    of four), until the restarted validators bring it the block."""
    count = len(cluster.spec.validators)

    def stopped() -> list[int]:
        return [i for i in range(count) if not cluster.running(i)["app"]]
    try:
        wait_until(stopped, timeout=60)
    except AssertionError:
        states = {i: (cluster.running(i), cluster.height(i)) for i in range(count)}
        raise AssertionError(f"no old app stopped; processes and heights: {states}") from None
    with contextlib.suppress(AssertionError):
        wait_until(lambda: len(stopped()) == count, timeout=10)
    return stopped()


def test_parameter_changes_and_an_upgrade_by_vote(tmp_path: Path) -> None:
    spec = build_network(tmp_path, 4, "planetserve-gov", app_state_builder(MODELS, relaxed(LISTED_AT_ONCE)),
                         timeout_commit="30ms", extra_config=FAST)
    cluster = Cluster(spec, cluster_app, start_timeout=60.0)
    try:
        cluster.start()
        cluster.wait_for_height(2, timeout=60)
        client = ledger(cluster, 0)
        before = client.params()

        # approved by 3 of 4 (30 of 40): applies at its height; approved by 2 of 4: never
        at = client.rpc.latest_height() + LEAD
        keys = spec.validators[0].home / "config" / KEYS_FILE
        proposed = CliRunner().invoke(main, ["tx", "propose-params", "--height", str(at), "--set", "max_signer_txs=77",
                                             "--keys", str(keys), "--node", cluster.rpc_url(0), "--json"],
                                      catch_exceptions=False)
        assert proposed.exit_code == 0, proposed.output
        assert client.submit(member_keys(cluster, 1), ProposeParams(at, {"user_ttl_seconds": 4321})).outcome.ok
        for i in (1, 2):
            assert client.submit(member_keys(cluster, i), VoteMember(1, True)).outcome.ok
        assert client.submit(member_keys(cluster, 0), VoteMember(2, True)).outcome.ok
        cluster.wait_for_height(at + 2, timeout=60)
        for i in range(4):
            node = ledger(cluster, i)
            with node.snapshot(at - 1):
                assert node.params() == before
            with node.snapshot(at):
                changed = node.params()
            assert changed.max_signer_txs == 77 and changed.user_ttl_seconds == before.user_ttl_seconds
        assert_same_app_hashes(cluster, at + 1)

        # an upgrade: the old apps halt at its height, the new ones go on from the same state
        upgrade_at = client.rpc.latest_height() + LEAD
        proposed = CliRunner().invoke(main, ["tx", "propose-upgrade", "--name", "v2", "--app-version", "2",
                                             "--height", str(upgrade_at), "--keys", str(keys),
                                             "--node", cluster.rpc_url(0), "--json"], catch_exceptions=False)
        assert proposed.exit_code == 0, proposed.output
        for i in (1, 2):  # with the proposer's, 3 of 4: settled
            assert client.submit(member_keys(cluster, i), VoteMember(3, True)).outcome.ok
        halted = halted_apps(cluster)
        for i in halted:
            log = (spec.validators[i].home / "logs" / "app.log").read_text()
            assert f"UPGRADE 'v2' NEEDED at height {upgrade_at}: this app is version 1" in log
        assert max(cluster.height(i) or 0 for i in range(4)) <= upgrade_at
        assert all((cluster.height(i) or 0) < upgrade_at for i in set(range(4)) - set(halted))
        for i in range(4):
            cluster.stop(i)
        cluster.app_cmd = upgraded_app
        cluster.start()
        cluster.wait_for_height(upgrade_at + 3, timeout=90)
        assert_same_app_hashes(cluster, upgrade_at + 2)
        assert int(cluster.rpc(0).header(upgrade_at)["version"]["app"]) == 1
        assert int(cluster.rpc(0).header(upgrade_at + 1)["version"]["app"]) == 2
        shown = CliRunner().invoke(main, ["query", "status", "--node", cluster.rpc_url(1), "--json"],
                                   catch_exceptions=False)
        assert json.loads(shown.output)["app_version"] == 2
        for i in range(4):
            _, mark = ledger(cluster, i).value(MARK)
            assert mark is not None and codec.unpack(mark) == 1
        assert client.submit(member_keys(cluster, 3), VoteMember(3, True)).outcome.code != 0  # settled

        # its registry carried into a new network
        users = [KeySet.generate() for _ in range(3)]
        for i, keys in enumerate(users):
            assert client.submit(keys, RegisterUser(f"10.8.0.{i}:9000", "eu")).outcome.ok
        assert client.submit(KeySet.generate(), RegisterOrg("acme", "Acme")).outcome.ok
        for i in range(4):
            cluster.stop(i)
        exported = tmp_path / "exported.json"
        made = CliRunner().invoke(main, ["chain", "export", "--home", str(spec.validators[0].home),
                                         "--out", str(exported), "--json"], catch_exceptions=False)
        assert made.exit_code == 0, made.output
        assert json.loads(made.output)["initial_height"] > upgrade_at
        built = CliRunner().invoke(main, ["genesis", "init", str(tmp_path / "next"), "-n", "4", "--chain-id",
                                          "planetserve-next", "--timeout-commit", "100ms", "--from-export",
                                          str(exported), "--json"], catch_exceptions=False)
        assert built.exit_code == 0, built.output
        successor = Cluster(NetworkSpec.load(tmp_path / "next"), cluster_app, start_timeout=60.0)
        try:
            successor.start()
            successor.wait_for_height(2, timeout=60)
            follower = ledger(successor, 0)
            assert all(follower.user(k.public) is not None for k in users)
            assert follower.org("acme") is not None
            new_committee = {bytes.fromhex(v.keys["identity"]) for v in successor.validators}
            assert {m.operator for m in follower.committee()[1]} == new_committee
        finally:
            successor.close()
    finally:
        cluster.close()
