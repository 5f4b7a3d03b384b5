"""How long the light client takes to verify one header and its commit.

Offline, on synthetic chains signed with fresh ed25519 keys (4 validators, plus larger sets for
scale): header hash, validator-set hash, one vote's sign bytes, one signature check, and a whole
adjacent / non-adjacent (skipping) verification. With `--rpc URL --genesis PATH` it also times
`LightClient.verified_header` end to end against a running node (RPC round trips included).

    .venv/bin/python bench/lightclient_verify.py [--validators 4,16,64] [--rpc URL --genesis PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import Callable
from dataclasses import replace

from nacl.signing import SigningKey

from planetserve.chain.lightclient import (
    FLAG_COMMIT,
    BlockID,
    Commit,
    CommitSig,
    Header,
    LightBlock,
    LightClient,
    Timestamp,
    Validator,
    ValidatorSet,
    address_of,
    verify_adjacent,
    verify_commit,
    verify_non_adjacent,
)

CHAIN_ID = "bench-chain"


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def signed_block(keys: list[SigningKey], height: int, t0: int) -> LightBlock:
    vals = ValidatorSet(
        Validator(address_of(bytes(k.verify_key)), bytes(k.verify_key), 10) for k in keys
    )
    by_addr = {address_of(bytes(k.verify_key)): k for k in keys}
    header = Header(
        version_block=11, version_app=1, chain_id=CHAIN_ID, height=height,
        time=Timestamp(t0 + height, 0), last_block_id=BlockID(_sha(b"prev"), 1, _sha(b"parts")),
        last_commit_hash=_sha(b"lc"), data_hash=_sha(b""), validators_hash=vals.hash,
        next_validators_hash=vals.hash, consensus_hash=_sha(b"params"), app_hash=_sha(b"app"),
        last_results_hash=_sha(b""), evidence_hash=_sha(b""),
        proposer_address=vals.validators[0].address,
    )  # fmt: skip
    sigs = tuple(
        CommitSig(FLAG_COMMIT, v.address, Timestamp(t0 + height, i), b"")
        for i, v in enumerate(vals.validators)
    )
    commit = Commit(height, 0, BlockID(header.hash, 1, _sha(b"parts")), sigs)
    signed = tuple(
        replace(s, signature=by_addr[s.validator_address].sign(
            commit.vote_sign_bytes(CHAIN_ID, i)).signature)
        for i, s in enumerate(sigs)
    )  # fmt: skip
    return LightBlock(header, replace(commit, signatures=signed), vals)


def timeit(fn: Callable[[], object], min_time: float = 0.3) -> tuple[float, int]:
    """Mean seconds per call, and the number of calls made."""
    fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time:
            return elapsed / n, n


def fresh_header(h: Header) -> Header:
    return replace(h)  # a copy without the cached hash


def fresh(b: LightBlock) -> LightBlock:
    """A copy whose header and validator-set hashes are not cached yet."""
    return LightBlock(fresh_header(b.header), b.commit, ValidatorSet(b.validators.validators))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--validators", default="4,16,64", help="comma-separated set sizes")
    ap.add_argument("--rpc", help="a running node's RPC URL for the end-to-end row")
    ap.add_argument("--genesis", help="its genesis.json (required with --rpc)")
    args = ap.parse_args()

    rows: list[tuple[str, int, float, int]] = []
    t0 = int(time.time()) - 3600
    for n in (int(x) for x in args.validators.split(",")):
        keys = [SigningKey(_sha(f"bench-{i}".encode())) for i in range(n)]
        b1, b2, b5 = (signed_block(keys, h, t0) for h in (1, 2, 5))
        cases: list[tuple[str, Callable[[], object]]] = [
            ("header hash", lambda b=b2: fresh_header(b.header).hash),
            ("validator-set hash", lambda b=b2: ValidatorSet(b.validators.validators).hash),
            ("vote sign bytes (one)", lambda b=b2: b.commit.vote_sign_bytes(CHAIN_ID, 0)),
            ("commit, all signatures", lambda b=b2: verify_commit(
                CHAIN_ID, b.validators, b.header, b.commit)),
            ("adjacent header + commit", lambda a=b1, b=b2: verify_adjacent(
                a, fresh(b), CHAIN_ID)),
            ("skipping header + commit", lambda a=b1, b=b5: verify_non_adjacent(
                a, fresh(b), CHAIN_ID)),
        ]  # fmt: skip
        for name, fn in cases:
            per_call, calls = timeit(fn)
            rows.append((name, n, per_call, calls))

    if args.rpc:
        if not args.genesis:
            ap.error("--rpc needs --genesis")
        from planetserve.chain.rpc import RpcClient

        rpc = RpcClient(args.rpc)
        lc = LightClient.from_genesis_file(args.genesis, rpc)
        latest = rpc.latest_height()
        lc.verified_header(1)
        start = time.perf_counter()
        lc.verified_header(latest)
        rows.append(("end to end via RPC (1 -> latest)", len(lc.latest_trusted().validators),
                     time.perf_counter() - start, 1))  # fmt: skip

    print(f"{'operation':<34} {'validators':>10} {'time/op':>12} {'runs':>7}")
    print("-" * 66)
    for name, n, per_call, calls in rows:
        print(f"{name:<34} {n:>10} {per_call * 1e6:>10.1f}us {calls:>7}")


if __name__ == "__main__":
    main()
