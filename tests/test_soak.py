"""Sustained load (`make soak`, left out of `make test`): a fixed transaction rate and a fixed prompt rate
through the anonymous overlay for SOAK_SECONDS (default 600) on a real four-validator network with a
model node and user relays. Every accepted transaction is in the committed state at the end, prompts
keep being answered, the validators agree, and each process's resident memory at the end is within
a bound of what it was once warmed up (printed as a table)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from chainnet import assert_same_app_hashes
from openai import OpenAI
from roles import acme_network, start_relays
from waiting import wait_until

from planetserve.chain.keys import KeySet
from planetserve.chain.messages import RegisterOrg
from planetserve.localnet import processes

SECONDS = float(os.environ.get("SOAK_SECONDS", "600"))
SETUP_S = 300
"""Room beyond the load itself for starting the network and checking everything at the end."""

pytestmark = [pytest.mark.network, pytest.mark.faults, pytest.mark.soak,
              pytest.mark.timeout(SECONDS + SETUP_S)]

WARM_UP_S = min(60.0, SECONDS / 5)
TX_INTERVAL_S = 1.0
PROMPT_INTERVAL_S = 5.0
RELAYS = 5
GROWTH_FACTOR, GROWTH_SLACK_MIB = 1.5, 48


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_sustained_load_loses_nothing_and_memory_stays_bounded(tmp_path, quick_family):
    with acme_network(tmp_path, quick_family) as (net, client, node, relays):
        relays += start_relays(tmp_path, net, RELAYS)
        wait_until(lambda: len(relays[0].status()["paths"]) >= 4, timeout=60)
        openai = OpenAI(base_url=f"{relays[0].ready['http']}/v1", api_key="none", max_retries=2, timeout=60)

        pids = {f"{v.moniker} {name}": entry["pid"] for v in net.spec.validators
                for name, entry in processes.read_pids(v.home).items()}
        pids["model node"] = node.proc.pid
        pids.update({f"relay {i}": r.proc.pid for i, r in enumerate(relays)})

        stop = threading.Event()
        accepted: list[str] = []
        refused: list[str] = []
        answers = {"ok": 0, "failed": 0}

        def transactions() -> None:
            i = 0
            while not stop.wait(TX_INTERVAL_S):
                org = f"soak-{i}"
                i += 1
                done = client.submit(KeySet.generate(), RegisterOrg(org, "soak"))
                (accepted if done.outcome.ok else refused).append(org)

        def prompts() -> None:
            while not stop.wait(PROMPT_INTERVAL_S):
                try:
                    openai.chat.completions.create(model="gt", max_tokens=8, temperature=0,
                                                   messages=[{"role": "user", "content": "What is a list?"}])
                    answers["ok"] += 1
                except Exception:  # counted: the assertion below says how many failed
                    answers["failed"] += 1

        workers = [threading.Thread(target=f, daemon=True) for f in (transactions, prompts)]
        for worker in workers:
            worker.start()
        time.sleep(WARM_UP_S)
        start = {name: rss_mib(pid) for name, pid in pids.items()}
        time.sleep(SECONDS - WARM_UP_S)
        end = {name: rss_mib(pid) for name, pid in pids.items()}
        stop.set()
        for worker in workers:
            worker.join(90)

        print(f"\n{'process':<16} {'RSS start MiB':>14} {'RSS end MiB':>12} {'ratio':>6}")
        for name in pids:
            print(f"{name:<16} {start[name]:14.1f} {end[name]:12.1f} {end[name] / start[name]:6.2f}")
        print(f"transactions accepted {len(accepted)}, refused {len(refused)}; "
              f"prompts answered {answers['ok']}, failed {answers['failed']}")

        assert not refused and len(accepted) >= 0.8 * SECONDS / (TX_INTERVAL_S + 1.5)
        assert answers["ok"] >= 0.8 * SECONDS / PROMPT_INTERVAL_S - 2 and answers["failed"] <= 1
        _, orgs = client.organisations()
        assert set(accepted) <= {o.org_id for o in orgs}  # nothing accepted was lost
        top = max(net.wait_for_height(0).values())
        assert_same_app_hashes(net, top - 1)
        grown = {name: (start[name], end[name]) for name in pids
                 if end[name] > start[name] * GROWTH_FACTOR + GROWTH_SLACK_MIB}
        assert not grown, f"memory grew: {grown}"
