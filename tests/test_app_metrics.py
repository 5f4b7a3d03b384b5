"""The app's Prometheus metrics, scraped over HTTP from the real Application as blocks run: the documented
names, labels from fixed sets whatever a client sends, and values that follow the traffic."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import AppHarness, sqlite_url
from promscrape import scrape

from planetserve.chain import tx as txlib
from planetserve.chain.abci.metrics import PHASES, AppMetrics
from planetserve.chain.keys import KeySet
from planetserve.metrics import parse_listen, serve
from planetserve.registry.params import Params

APP_METRICS = {
    "planetserve_app_transactions", "planetserve_app_checked_transactions", "planetserve_app_finalize_block_seconds",
    "planetserve_app_commit_seconds", "planetserve_app_epoch_finalization_seconds", "planetserve_app_height",
    "planetserve_app_epoch", "planetserve_app_epoch_phase", "planetserve_app_snapshot_height",
    "planetserve_app_retain_height", "planetserve_app_entities",
}
"""Every name docs/operators.md lists for the app (counters without their _total suffix)."""


def test_the_app_exports_its_metrics_and_they_follow_the_blocks(tmp_path: Path) -> None:
    h = AppHarness(sqlite_url(tmp_path), params=Params(epoch_blocks=10, results_blocks=3, vrf_window_blocks=2,
                                                       plan_window_blocks=2))
    h.app.metrics = metrics = AppMetrics(h.store)
    port, stop = serve("127.0.0.1:0", metrics.registry)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        users = [KeySet.generate() for _ in range(3)]
        txs = [h.tx(k, "register-user", {"address": f"10.5.0.{i}:9000", "region": "eu"}) for i, k in enumerate(users)]
        for raw in txs:
            assert h.check(raw).code == 0
        h.check(b"\x00junk")
        forged = txlib.build(users[0], "planetserve-test", "no-such-type", {"a": 1}, 7)
        h.check(forged)
        h.block(*txs, txs[0])  # the repeat is refused (its sequence is spent)
        first = scrape(url)
        assert {n.removesuffix("_total").removesuffix("_count").removesuffix("_sum").removesuffix("_bucket")
                .removesuffix("_created") for n in first} >= APP_METRICS
        done = first["planetserve_app_transactions_total"]
        assert done[(("code", "0"), ("type", "register-user"))] == 3
        assert sum(v for labels, v in done.items() if ("type", "register-user") in labels) == 4
        checked = first["planetserve_app_checked_transactions_total"]
        assert checked[(("code", "0"), ("type", "register-user"))] == 3
        assert {dict(labels)["type"] for labels in checked} == {"register-user", "undecodable", "unknown"}
        assert first["planetserve_app_height"][()] == 1
        assert first["planetserve_app_entities"][(("kind", "users"),)] == 3
        assert first["planetserve_app_finalize_block_seconds_count"][()] == 1
        for _ in range(9):
            h.block()
        later = scrape(url)
        assert later["planetserve_app_height"][()] == 10 and later["planetserve_app_epoch"][()] == 0
        phases = later["planetserve_app_epoch_phase"]
        assert {dict(k)["phase"] for k, v in phases.items() if v == 1} == {"finalize"}
        assert {dict(k)["phase"] for k in phases} == set(PHASES)
        assert later["planetserve_app_epoch_finalization_seconds_count"][()] == 1
        assert later["planetserve_app_commit_seconds_count"][()] == 10
        h.block()
        assert scrape(url)["planetserve_app_epoch"][()] == 1
    finally:
        stop()


@pytest.mark.parametrize("listen", ["localhost", "host:port", "127.0.0.1:70000"])
def test_a_metrics_address_that_is_not_host_port_is_refused(listen: str) -> None:
    with pytest.raises(ValueError, match="is not host:port"):
        parse_listen(listen)
