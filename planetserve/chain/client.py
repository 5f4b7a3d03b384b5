"""Reading and writing the ledger as a client: verified lists and entities, signed transactions.

A read is verified when a light client is given: the query's Merkle proof must match the app hash
that more than 2/3 of the committee signed (header height + 1). Without one, answers are taken on
the RPC endpoint's word and marked unverified.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from planetserve.chain import state as layout
from planetserve.chain import trie
from planetserve.chain.app import PROOF_OP_TYPE
from planetserve.chain.keys import KeySet
from planetserve.chain.rpc import AbciQuery, RpcClient, RpcResponseError, TxOutcome
from planetserve.chain.tx import build
from planetserve.registry import codec
from planetserve.registry.entities import Member, Model, ModelNode, Organisation, Record, User
from planetserve.registry.params import Params

R = TypeVar("R", bound=Record)


class QueryRefused(Exception):
    """The RPC answer could not be verified, or the application refused the query."""


class AppHashSource(Protocol):
    def verified_app_hash(self, height: int) -> bytes: ...


@dataclass(frozen=True)
class Listing:
    height: int
    entries: list[tuple[bytes, bytes]]
    verified: bool


@dataclass(frozen=True)
class Submitted:
    tx_hash: bytes
    height: int
    outcome: TxOutcome


class LedgerClient:
    def __init__(self, rpc: RpcClient, verifier: AppHashSource | None) -> None:
        self.rpc = rpc
        self.verifier = verifier

    # -- verified reads --------------------------------------------------------------------------

    def _query(self, path: str, data: bytes) -> tuple[AbciQuery, trie.PrefixProof | None]:
        answer = self.rpc.abci_query(path, data, prove=self.verifier is not None)
        if not answer.ok:
            raise QueryRefused(f"query {path} refused (code {answer.code}): {answer.log}")
        if self.verifier is None:
            return answer, None
        ops = [op for op in answer.proof_ops if op.type == PROOF_OP_TYPE]
        if len(ops) != 1 or ops[0].key != data:
            raise QueryRefused(f"proof missing or for another key in the answer to {path}")
        try:
            proof = trie.PrefixProof.decode(ops[0].data)
        except trie.ProofError as exc:
            raise QueryRefused(f"malformed proof: {exc}") from exc
        return answer, proof

    def _app_hash(self, height: int) -> bytes:
        assert self.verifier is not None
        return self.verifier.verified_app_hash(height)

    def entries(self, prefix: bytes) -> Listing:
        """Every entry under a key prefix, complete and unaltered when verified."""
        answer, proof = self._query("/prefix", prefix)
        height = answer.height
        try:
            raw = codec.unpack(answer.value, max_size=64 << 20)
            entries = [(bytes(k), bytes(v)) for k, v in raw]
        except (codec.CodecError, TypeError, ValueError) as exc:
            raise QueryRefused(f"malformed list in the answer: {exc}") from exc
        if proof is not None:
            try:
                trie.verify_prefix(self._app_hash(height), prefix, entries, proof)
            except trie.ProofError as exc:
                raise QueryRefused(f"list does not match the committed app hash: {exc}") from exc
        return Listing(height, entries, proof is not None)

    def value(self, key: bytes) -> tuple[int, bytes | None]:
        """One entry, or None when absent; a verified absence is proven too."""
        answer, proof = self._query("/key", key)
        claimed = answer.value if answer.info == "found" else None
        if proof is not None:
            try:
                trie.verify_key(self._app_hash(answer.height), key, claimed, proof)
            except trie.ProofError as exc:
                raise QueryRefused(f"value does not match the committed app hash: {exc}") from exc
        return answer.height, claimed

    def _entity(self, key: bytes, cls: type[R]) -> R | None:
        _, raw = self.value(key)
        return None if raw is None else cls.from_record(codec.unpack(raw))

    def nodes(
        self, model_id: str | None = None, region: str | None = None
    ) -> tuple[Listing, list[ModelNode]]:
        listing = self.entries(layout.node_list_prefix(model_id, region))
        return listing, layout.decode_entries(listing.entries, ModelNode)

    def users(self, region: str | None = None) -> tuple[Listing, list[User]]:
        listing = self.entries(layout.user_list_prefix(region))
        return listing, layout.decode_entries(listing.entries, User)

    def committee(self) -> tuple[Listing, list[Member]]:
        listing = self.entries(layout.MEMBER_PREFIX)
        return listing, layout.decode_entries(listing.entries, Member)

    def node(self, pubkey: bytes) -> ModelNode | None:
        return self._entity(layout.node_key(pubkey), ModelNode)

    def user(self, pubkey: bytes) -> User | None:
        return self._entity(layout.user_key(pubkey), User)

    def org(self, org_id: str) -> Organisation | None:
        return self._entity(layout.org_key(org_id), Organisation)

    def model(self, model_id: str) -> Model | None:
        return self._entity(layout.model_key(model_id), Model)

    def params(self) -> Params:
        params = self._entity(layout.PARAMS_KEY, Params)
        if params is None:
            raise QueryRefused("the chain has no parameters yet (no block committed)")
        return params

    def sequence(self, account: bytes) -> int:
        _, raw = self.value(layout.account_key(account))
        return 0 if raw is None else int(codec.unpack(raw))

    # -- writes ----------------------------------------------------------------------------------

    def submit(self, keys: KeySet, tx_type: str, body: dict[str, Any], timeout: float = 30.0) -> Submitted:
        """Sign with the account's next sequence, broadcast, and wait until the tx is in a block."""
        chain_id = self.rpc.status()["node_info"]["network"]
        raw = build(keys, chain_id, tx_type, body, self.sequence(keys.public))
        checked = self.rpc.broadcast_tx_sync(raw)
        if not checked.ok:
            return Submitted(checked.hash, 0, TxOutcome(code=checked.code, data=b"", log=checked.log,
                                                        codespace=checked.codespace))
        deadline = time.monotonic() + timeout
        while True:
            try:
                found = self.rpc.tx(checked.hash)
                return Submitted(checked.hash, found.height, found.result)
            except RpcResponseError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
