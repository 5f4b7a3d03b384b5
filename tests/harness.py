"""Drive the real Application in-process, block by block, as CometBFT would."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from tendermint.abci import types_pb2 as abci
from tendermint.crypto import keys_pb2
from tendermint.types import validator_pb2

from planetserve.chain import tx as txlib
from planetserve.chain.abci.app import Application
from planetserve.chain.abci.epochs import validator_address
from planetserve.chain.abci.state import TxScope
from planetserve.chain.abci.store import Batch, StateStore
from planetserve.chain.errors import TxError
from planetserve.chain.keys import KeySet
from planetserve.chain.messages import REGISTRATIONS
from planetserve.chain.messages.base import wire
from planetserve.chain.messages.registry import node_pop_message
from planetserve.registry import work
from planetserve.registry.entities import Member, Model
from planetserve.registry.genesis import AppState, GenesisOrganisation
from planetserve.registry.params import Params

CHAIN_ID = "planetserve-test"
GENESIS_TIME = 1_700_000_000
RELAXED = {"user_work_bits": 4, "org_work_bits": 4, "max_registrations_per_block": 1_000_000,
           "max_signer_txs": 1_000_000, "mempool_non_member_txs": 1_000_000,
           "mempool_non_member_bytes": 1 << 40}
"""The anti-spam limits of test chains that are not about them: proofs of work of 4 bits, and room for
the bursts that tests send from one key (tests/test_anti_spam.py tests the limits themselves)."""


def relaxed(params: Params) -> Params:
    """`params` with each anti-spam limit that it leaves at its default relaxed as RELAXED says; a limit
    a test sets stays as set."""
    default = Params()
    return dataclasses.replace(params, **{name: value for name, value in RELAXED.items()
                                          if getattr(params, name) == getattr(default, name)})


def node_body(node: KeySet, org_id: str = "org1", **fields: Any) -> dict[str, Any]:
    """A register-model-node body for `node` on the test chain, its proof of possession signed; the
    other fields default to a valid registration."""
    return {"org_id": org_id, "node_pubkey": node.public,
            "pop": node.sign(node_pop_message(CHAIN_ID, org_id, node.public)),
            "model_id": "gt", "address": "10.0.0.1:7000", "hardware": "A100", "capacity": 4, "region": "eu",
            **fields}


def events(result: abci.ResponseFinalizeBlock, kind: str) -> list[dict[str, str]]:
    """The block's events of `kind`, and its transactions'."""
    found = [*result.events, *(e for r in result.tx_results for e in r.events)]
    return [{a.key: a.value for a in e.attributes} for e in found if e.type == kind]


class AppHarness:
    def __init__(self, db_url: str, members: int = 1, params: Params | None = None,
                 models: tuple[tuple[str, str], ...] = (("gt", "reference"),),
                 keys: tuple[list[KeySet], list[KeySet]] | None = None,
                 organisations: tuple[GenesisOrganisation, ...] = (), limits: bool = False,
                 genesis_time: int = GENESIS_TIME) -> None:
        """`keys`: the members' operator and consensus keys, to run two chains of one committee;
        `organisations`: those genesis creates, with their credits; `limits`: keep the anti-spam limits
        of `params` (by default those left at their defaults are relaxed, `relaxed`); `genesis_time`:
        the chain's first time (now, for a chain whose model nodes sign answers by their own clocks)."""
        self.store = StateStore(db_url)
        self.app = Application(self.store)
        self.members, self.consensus = keys or ([KeySet.generate() for _ in range(members)],
                                                [KeySet.generate() for _ in range(members)])
        self.sequences: dict[bytes, int] = {}
        self.responses: list[abci.ResponseFinalizeBlock] = []
        self.absent: set[bytes] = set()
        """Consensus keys of the validators that miss the commits of the blocks to come."""
        self.height = 0
        self.time = genesis_time
        state = AppState(
            params=(params or Params()) if limits else relaxed(params or Params()),
            committee=tuple(
                Member(m.public, c.public, bytes(m.vrf.verify_key), bytes(m.x25519.public_key),
                       f"member {i}", 10)
                for i, (m, c) in enumerate(zip(self.members, self.consensus, strict=True))
            ),
            models=tuple(Model(i, n, 0) for i, n in models),
            organisations=organisations,
        )
        self.genesis = abci.RequestInitChain(
            chain_id=CHAIN_ID,
            validators=[abci.ValidatorUpdate(pub_key=keys_pb2.PublicKey(ed25519=c.public), power=10)
                        for c in self.consensus],
            app_state_bytes=json.dumps(state.to_json()).encode(),
            initial_height=1,
            time=Timestamp(seconds=genesis_time),
        )
        self.app.init_chain(self.genesis)
        self.blocks: list[tuple[abci.RequestFinalizeBlock, bytes]] = []  # each with its app hash

    def tx(self, keys: KeySet, tx_type: str, body: dict[str, Any], sequence: int | None = None,
           chain_id: str = CHAIN_ID) -> bytes:
        """A signed transaction with the signer's next sequence (tracked locally); messages, parts and
        records inside `body` are written in their wire form. A registration without `work` gets a
        proof of work that meets the chain's difficulty."""
        if tx_type in REGISTRATIONS and "work" not in body:
            bits = getattr(self.app.params, "user_work_bits" if tx_type == "register-user" else "org_work_bits")
            body = {**body, "work": work.solve(chain_id, tx_type, keys.public, bits)}
        seq = self.sequences.get(keys.public, 0) if sequence is None else sequence
        if sequence is None:
            self.sequences[keys.public] = seq + 1
        return txlib.build(keys, chain_id, tx_type, wire(body), seq)

    def check(self, raw: bytes) -> abci.ResponseCheckTx:
        return self.app.check_tx(abci.RequestCheckTx(tx=raw))

    def registry_state(self) -> dict[bytes, bytes]:
        """Every committed entry but the account sequences and the signers' counts of transactions,
        which even a refused transaction advances."""
        return {k: v for k, v in self.store.batch().iterate(b"") if not k.startswith((b"acct/", b"rate/"))}

    def block(self, *txs: bytes, seconds: int = 5) -> abci.ResponseFinalizeBlock:
        """The next block, its commit information naming the validators in `absent` as having missed
        the previous block's commit (as CometBFT reports them)."""
        self.height += 1
        self.time += seconds
        votes = [abci.VoteInfo(validator=abci.Validator(address=validator_address(c.public), power=10),
                               block_id_flag=validator_pb2.BLOCK_ID_FLAG_ABSENT if c.public in self.absent
                               else validator_pb2.BLOCK_ID_FLAG_COMMIT)
                 for c in self.consensus]
        request = abci.RequestFinalizeBlock(txs=list(txs), height=self.height, time=Timestamp(seconds=self.time),
                                            decided_last_commit=abci.CommitInfo(votes=votes))
        result = self.app.finalize_block(request)
        self.app.commit(abci.RequestCommit())
        self._forget_refused_first_transactions(txs, result)
        self.blocks.append((request, result.app_hash))
        self.responses.append(result)
        return result

    def _forget_refused_first_transactions(self, txs: tuple[bytes, ...],
                                           result: abci.ResponseFinalizeBlock) -> None:
        """A key whose first transaction was refused still has no account, so its next transaction
        takes sequence 0 again (unless the test already signed one after it)."""
        for raw, outcome in zip(txs, result.tx_results, strict=True):
            if outcome.code == 0:
                continue
            try:
                tx = txlib.decode(raw, 1 << 20)
            except TxError:  # not an envelope: nothing to forget
                continue  # noqa: S112
            if tx.sequence == 0 and self.sequences.get(tx.signer) == 1 and \
                    self.store.batch().get(b"acct/" + tx.signer.hex().encode()) is None:
                self.sequences[tx.signer] = 0

    def replay(self, db_url: str) -> list[tuple[bytes, bytes]]:
        """Run the same genesis and blocks on a fresh store; (app hash here, app hash there) per block."""
        with StateStore(db_url) as store:
            app = Application(store)
            app.init_chain(self.genesis)
            pairs = []
            for request, app_hash in self.blocks:
                pairs.append((app_hash, app.finalize_block(request).app_hash))
                app.commit(abci.RequestCommit())
            return pairs

    def query(self, path: str, data: bytes) -> abci.ResponseQuery:
        return self.app.query(abci.RequestQuery(path=path, data=data, prove=True))


def count_prefix_reads(monkeypatch: pytest.MonkeyPatch) -> Counter[bytes]:
    """How often the application iterates over each key family ("orgnode/", "preq/", ...) from now on:
    a spy on the store's and the transaction scope's iterate that passes every read through."""
    seen: Counter[bytes] = Counter()
    for cls in (Batch, TxScope):
        original = cls.iterate

        def counted(self: Any, prefix: bytes = b"", original: Any = original) -> Iterator[tuple[bytes, bytes]]:
            seen[prefix.split(b"/", 1)[0] + b"/"] += 1
            return original(self, prefix)

        monkeypatch.setattr(cls, "iterate", counted)
    return seen


def sqlite_url(tmp_path: Path, name: str = "state.db") -> str:
    return f"sqlite:///{tmp_path / name}"
