"""Run every benchmark of bench/ with its default settings, one after the other."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHES = ["commit_cost.py", "trie_shape.py", "tx_throughput.py", "app_cost.py", "list_verify.py",
           "list_paging.py", "lightclient_verify.py", "vrf_speed.py", "epoch_finalization.py",
           "whitewashing.py", "hrtree_fpr.py", "cache_sync.py", "engine_prefix.py", "forwarding.py",
           "forwarding_real.py", "clove_speed.py", "relay_overhead.py", "overlay_cost.py", "linkability.py",
           "anonymity.py", "churn.py", "verify_throughput.py", "detection.py", "allocation.py", "chains.py",
           "pipeline_sim.py", "state_sync.py", "block_retention.py", "verifier_start.py", "tx_decode.py"]


def main() -> int:
    here = Path(__file__).parent
    failed = []
    for name in BENCHES:
        print(f"\n=== {name} ===", flush=True)
        if subprocess.run([sys.executable, str(here / name)], check=False).returncode != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
