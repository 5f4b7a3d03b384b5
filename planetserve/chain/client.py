"""Reading and writing the ledger as a client: verified lists and entities, signed transactions.

A read is verified when a light client is given: the query's Merkle proof must match the app hash
that more than 2/3 of the committee signed (header height + 1), and a read of the latest state is
refused when that header is not fresh by the local clock (the light client's `max_age`). Without one,
answers are taken on the RPC endpoint's word and marked unverified.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from tendermint.abci import types_pb2 as abci_pb2

from planetserve.chain import layout, trie
from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet
from planetserve.chain.lightclient import (
    DEFAULT_MAX_AGE,
    FreshnessError,
    Header,
    LightBlock,
    LightClient,
    VerificationError,
    merkle_root,
)
from planetserve.chain.messages.base import Message
from planetserve.chain.messages.registry import Worked
from planetserve.chain.rpc import (
    AbciQuery,
    RpcClient,
    RpcError,
    RpcMalformed,
    RpcResponseError,
    TxOutcome,
    obj,
)
from planetserve.chain.tx import sign
from planetserve.registry import codec
from planetserve.registry.credits import Credits, Deployment
from planetserve.registry.entities import (
    Member,
    MemberRotation,
    Model,
    ModelNode,
    NodeRotation,
    Organisation,
    Record,
    User,
)
from planetserve.registry.epochs import (
    ChallengeResult,
    Epoch,
    Fault,
    PlanEntry,
    Rechallenge,
    Reputation,
    Schedule,
    VrfEntry,
)
from planetserve.registry.params import Params

R = TypeVar("R", bound=Record)
MAX_ANSWER_BYTES = 64 << 20
MAX_ANSWER_ENTRIES = 1 << 20
"""Entries one `/prefix` answer may decode into (the chain's `max_query_entries` is 20,000 by default)."""
ANSWER_LIMITS = codec.Limits(max_objects=1 + 3 * MAX_ANSWER_ENTRIES, max_depth=2, max_len=MAX_ANSWER_ENTRIES,
                             max_str=MAX_ANSWER_BYTES, max_bin=MAX_ANSWER_BYTES)
"""A `/prefix` answer is [[key, value], ...]: two levels of arrays, byte strings inside (text decodes, within
the answer's own size, to be refused by name in `decode_entries`)."""


class QueryRefused(Exception):
    """The RPC answer could not be verified, or the application refused the query (`code`: its
    result code; None when the answer itself was refused)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


log = logging.getLogger(__name__)

TRANSIENT = (RpcError, QueryRefused, VerificationError, TimeoutError, OSError)
"""Ledger trouble that a later read can get past: the endpoint is down, slow or lying for now."""


class Verifier(Protocol):
    """What a LedgerClient needs of a light client."""

    witness: RpcClient | None
    """A second endpoint, asked too before a transaction's refusal or outcome is believed
    (`LedgerClient.submit`)."""

    @property
    def chain_id(self) -> str:
        """The genesis file's chain id."""
        ...

    def verified_light_block(self, height: int | None = None) -> LightBlock: ...
    def verified_header_after(self, height: int) -> Header: ...
    def check_fresh(self, header: Header) -> None: ...


@dataclass(frozen=True)
class Listing:
    height: int
    entries: list[tuple[bytes, bytes]]
    verified: bool
    header: Header | None = None
    """The verified header whose app hash proves the list (None: unverified); its time says how old
    the list is (`LedgerClient.check_fresh`)."""


class TxNotCommitted(RpcError):
    """A broadcast transaction that no block carried in time (it may still be committed)."""


class OutcomeMismatch(RpcError):
    """A transaction's block or outcome, as an endpoint tells it, is not what the witness tells or what
    the verified headers commit to: an endpoint lies."""


def _deterministic(outcome: TxOutcome) -> bytes:
    """An outcome's part that header H+1's last results hash covers (CometBFT's `deterministicExecTxResult`:
    code, data and gas, encoded as an ExecTxResult)."""
    return abci_pb2.ExecTxResult(code=outcome.code, data=outcome.data, gas_wanted=outcome.gas_wanted,
                                 gas_used=outcome.gas_used).SerializeToString()


@dataclass(frozen=True)
class Submitted:
    tx_hash: bytes
    height: int
    outcome: TxOutcome


def decode_entries(value: bytes, prefix: bytes) -> list[tuple[bytes, bytes]]:
    """The (key, value) pairs of a `/prefix` answer, which sends keys without the prefix (a prefix
    ending in NUL, which selects one key, sends it as b""). Not held to canonical form: the proof,
    not the encoding, is what makes an answer trustworthy."""
    if len(value) > MAX_ANSWER_BYTES:
        raise QueryRefused(f"answer of {len(value)} bytes exceeds the limit of {MAX_ANSWER_BYTES}")
    try:
        raw = codec.unpack_bounded(value, ANSWER_LIMITS, use_list=False) if value else ()
        pairs = [(k, v) for k, v in raw]
    except (codec.CodecError, ValueError, TypeError) as exc:
        raise QueryRefused(f"malformed list in the answer: {exc}") from exc
    if not all(type(k) is bytes and type(v) is bytes for k, v in pairs):
        raise QueryRefused("malformed list in the answer: keys and values must be bytes")
    base = prefix.removesuffix(b"\x00")
    return [(base + k, v) for k, v in pairs]


def _sequence(raw: bytes | None) -> int:
    """An account entry's next sequence (0: no account); RpcMalformed for anything else (the entry can
    come from an endpoint's unverified answer)."""
    if raw is None:
        return 0
    try:
        value = codec.unpack(raw)
    except codec.CodecError as exc:
        raise RpcMalformed(f"account sequence: {exc}") from exc
    if type(value) is not int or value < 0:
        raise RpcMalformed(f"account sequence: expected a non-negative integer, got {value!r:.40}")
    return value


def holding_node(prefix: bytes, proof: trie.PrefixProof) -> tuple[bytes, list[int]]:
    """The prefix and child bytes of the trie node that holds every entry under `prefix`, read off
    the proof for the key `prefix` (`prefix` + NUL), whose path ends there: at that node opened, or
    at its child for the key itself."""
    op = proof.opening
    if isinstance(op, trie.InnerOpening) and op.depth >= len(prefix) and op.prefix.startswith(prefix):
        return op.prefix, [c for c, _ in op.children]
    if proof.kind is trie.ProofKind.SUBTREE and proof.steps and proof.steps[-1][0] == len(prefix):
        return prefix, sorted([0, *(c for c, _ in proof.steps[-1][1])])
    raise QueryRefused(f"the list under {prefix[:80]!r} was refused as too long, yet no trie node holds "
                       "more than one of its entries")


class LedgerClient:
    def __init__(self, rpc: RpcClient, verifier: Verifier | None, min_height: int = 0) -> None:
        self.rpc = rpc
        self.verifier = verifier
        # Reads are of this height or later: submit() raises it to the height of each committed
        # transaction, so a client reads its own writes.
        self.min_height = min_height
        self._pinned: LightBlock | None = None
        self._past = False
        """Whether the pinned header was asked for by height: then it is read whatever min_height says."""
        self._listed: dict[tuple[bytes, int], Listing] = {}
        """Lists read inside the current snapshot, by prefix and the `min_height` they were read under:
        one state, so a list a caller reads again there (the verifier's tick reads an epoch's results
        for each of its duties) is not asked for and proven again. A write of ours since moves
        `min_height`, so its own list is read anew."""
        self._next: dict[bytes, tuple[int, int]] = {}
        """Per account this client signs for, the sequence after its last transaction that committed
        and succeeded, and that block's height: spent, though the verified state, a block behind, may
        not show it yet (once it should, it is checked: `sequence`)."""

    def close(self) -> None:
        """Close the endpoint's connections, and the witness's (a long-running role never needs to)."""
        self.rpc.close()
        witness = getattr(self.verifier, "witness", None)
        if isinstance(witness, RpcClient):
            witness.close()

    def __enter__(self) -> LedgerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def snapshot(self, height: int | None = None) -> Iterator[int]:
        """Reads inside the block see one state, the latest verified now (its height is yielded),
        verified once: a consistent view, and one light-client verification instead of one per read.
        Reads of a later height (after a submit) leave it.

        With `height` (verified clients only), the state committed at that past height instead, proven
        against the app hash of verified header `height` + 1, which must exist: history such as the
        reputations right after an epoch was finalized. The yielded height is that header's."""
        if height is not None and self.verifier is None:
            raise ValueError("reading a past height needs a verified client")
        if self.verifier is None:
            self._pinned = None
        else:
            self._pinned = self.verifier.verified_light_block(None if height is None else height + 1)
        self._past = height is not None
        try:
            yield self._pinned.height if self._pinned is not None else 0
        finally:
            self._pinned, self._past = None, False
            self._listed.clear()

    @classmethod
    def verified(cls, rpc_url: str, genesis: str | Path, *, witness: str = "",
                 max_age: float | None = DEFAULT_MAX_AGE) -> LedgerClient:
        """A client whose every read is verified against the genesis file (what long-running roles use):
        latest reads from headers at most `max_age` seconds old, and with a `witness` endpoint, only
        headers the witness has too."""
        if not genesis:
            raise ValueError("no genesis file is configured to verify the ledger against")
        rpc = RpcClient(rpc_url)
        return cls(rpc, LightClient.from_genesis_file(Path(genesis), rpc, max_age=max_age,
                                                      witness=RpcClient(witness) if witness else None))

    def check_fresh(self, header: Header | None) -> None:
        """FreshnessError (a VerificationError) when a view read from verified `header` is now too old
        to serve from; nothing to check for an unverified read (None) or an unverified client."""
        if self.verifier is not None and header is not None:
            self.verifier.check_fresh(header)

    def staleness(self, header: Header | None) -> FreshnessError | None:
        """Why a view read from verified `header` is now too old to serve from, if it is
        (`check_fresh`)."""
        try:
            self.check_fresh(header)
        except FreshnessError as exc:
            return exc
        return None

    # -- verified reads --------------------------------------------------------------------------

    def _query(
        self, path: str, data: bytes, verify: bool = True, height: int = 0, shape: bool = False,
        since: int | None = None,
    ) -> tuple[AbciQuery, trie.PrefixProof | None, Header | None]:
        """Ask for the state whose app hash the latest verified header carries (height L-1 for
        header L), so a verified answer never waits for the next block: the answer, its proof and
        the verified header whose app hash it must be proven against (None: unverified). An
        unverified read is of `height` (0: the latest) and carries a proof, unchecked, only when
        `shape` asks for it. A verified read is of `since` (default: `min_height`, our own latest
        write) or later, waiting for the header after it where needed."""
        since = self.min_height if since is None else since
        if self.verifier is None or not verify:
            if since and verify and not height:
                self._await_height(since)
            answer = self.rpc.abci_query(path, data, height=height, prove=shape)
            self._check_answer(path, answer)
            return answer, self._proof(path, data, answer) if shape else None, None
        latest = self._pinned or self.verifier.verified_light_block()
        height = latest.height - 1
        if height >= max(1, since) or self._past:
            header = latest.header
        else:  # reading our own write, or only genesis exists: wait for the header after it
            height = max(1, since)
            header = self.verifier.verified_header_after(height)
        answer = self.rpc.abci_query(path, data, height=height, prove=True)
        self._check_answer(path, answer)
        if answer.height != height:
            raise QueryRefused(f"answer is for height {answer.height}, asked for height {height}")
        return answer, self._proof(path, data, answer), header

    @staticmethod
    def _proof(path: str, data: bytes, answer: AbciQuery) -> trie.PrefixProof:
        ops = [op for op in answer.proof_ops if op.type == layout.PROOF_OP_TYPE]
        if len(ops) != 1 or ops[0].key != data:
            raise QueryRefused(f"proof missing or for another key in the answer to {path}")
        try:
            return trie.PrefixProof.decode(ops[0].data)
        except trie.ProofError as exc:
            raise QueryRefused(f"malformed proof: {exc}") from exc

    def _await_height(self, height: int, timeout: float = 30.0) -> None:
        """Unverified reads of `min_height`: wait until the endpoint has committed that height."""
        deadline = time.monotonic() + timeout
        while self.rpc.latest_height() < height:
            if time.monotonic() > deadline:
                raise QueryRefused(f"the endpoint has not committed height {height} within {timeout:g} s")
            time.sleep(0.2)

    @staticmethod
    def _check_answer(path: str, answer: AbciQuery) -> None:
        if not answer.ok:
            raise QueryRefused(f"query {path} refused (code {answer.code}): {answer.log}", answer.code)

    def entries(self, prefix: bytes) -> Listing:
        """Every entry under a key prefix, complete and unaltered when verified. A list longer than
        one answer may be (the chain's `max_query_entries`) is read in parts, all of one height. Inside
        a snapshot, a list is read once (`_listed`)."""
        if self._pinned is None:
            return self._entries(prefix)
        key = (prefix, self.min_height)
        listing = self._listed.get(key)
        if listing is None:
            listing = self._listed[key] = self._entries(prefix)
        return listing

    def _entries(self, prefix: bytes) -> Listing:
        try:
            return self._listing(prefix)[0]
        except QueryRefused as exc:
            if exc.code != Code.OVERSIZE:
                raise
        if self.verifier is None or self._pinned is not None:
            return self._listing_in_parts(prefix)
        with self.snapshot():
            return self._listing_in_parts(prefix)

    def _listing(
        self, prefix: bytes, height: int = 0, shape: bool = False
    ) -> tuple[Listing, trie.PrefixProof | None]:
        answer, proof, header = self._query("/prefix", prefix, height=height, shape=shape)
        entries = decode_entries(answer.value, prefix)
        if header is not None:
            try:
                trie.verify_prefix(header.app_hash, prefix, entries, proof)
            except trie.ProofError as exc:
                raise QueryRefused(f"list does not match the committed app hash: {exc}") from exc
        return Listing(answer.height, entries, header is not None, header), proof

    def _listing_in_parts(self, prefix: bytes, height: int = 0) -> Listing:
        """The entries under `prefix`, one part per child of the trie node that holds them all (a part
        still too long is split the same way). The proof for the key `prefix` itself, which no list
        prefix is, ends at that node and shows its children; each part is proven complete on its own,
        so together they are the whole list."""
        probe, proof = self._listing(prefix + b"\x00", height, shape=True)
        base, children = holding_node(prefix, proof)  # type: ignore[arg-type]  # shape: always a proof
        entries: list[tuple[bytes, bytes]] = []
        for child in children:
            part = base + bytes((child,))
            try:
                listing = self._listing(part, probe.height)[0]
            except QueryRefused as exc:
                if exc.code != Code.OVERSIZE:
                    raise
                listing = self._listing_in_parts(part, probe.height)
            entries.extend(listing.entries)
        return Listing(probe.height, entries, probe.verified, probe.header)

    def value(self, key: bytes, since: int | None = None) -> tuple[int, bytes | None]:
        """One entry, or None when absent; a verified absence is proven too. `since`: `_query`'s."""
        answer, proof, header = self._query("/key", key, since=since)
        claimed = answer.value if answer.info == "found" else None
        if header is not None:
            try:
                trie.verify_key(header.app_hash, key, claimed, proof)
            except trie.ProofError as exc:
                raise QueryRefused(f"value does not match the committed app hash: {exc}") from exc
        return answer.height, claimed

    def _entity(self, key: bytes, cls: type[R]) -> R | None:
        _, raw = self.value(key)
        return None if raw is None else cls.decode(raw)

    def nodes(
        self, model_id: str | None = None, region: str | None = None
    ) -> tuple[Listing, list[ModelNode]]:
        listing = self.entries(layout.node_list_prefix(model_id, region))
        return listing, layout.decode_records(listing.entries, ModelNode)

    def users(self, region: str | None = None) -> tuple[Listing, list[User]]:
        listing = self.entries(layout.user_list_prefix(region))
        return listing, layout.decode_records(listing.entries, User)

    def committee(self) -> tuple[Listing, list[Member]]:
        listing = self.entries(layout.MEMBER_PREFIX)
        return listing, layout.decode_records(listing.entries, Member)

    def node(self, pubkey: bytes) -> ModelNode | None:
        return self._entity(layout.node_key(pubkey), ModelNode)

    def rotation(self, pubkey: bytes) -> NodeRotation | None:
        """The rotation that reserves (pending) or retired this node key, if any."""
        return self._entity(layout.retired_key(pubkey), NodeRotation)

    def member_rotations(self) -> list[MemberRotation]:
        """The members' pending key rotations."""
        return layout.decode_records(self.entries(layout.MEMBER_ROTATION_PREFIX).entries, MemberRotation)

    def user(self, pubkey: bytes) -> User | None:
        return self._entity(layout.user_key(pubkey), User)

    def org(self, org_id: str) -> Organisation | None:
        return self._entity(layout.org_key(org_id), Organisation)

    def model(self, model_id: str) -> Model | None:
        return self._entity(layout.model_key(model_id), Model)

    def epoch(self, number: int | None = None) -> Epoch | None:
        """One epoch's record; without a number, the epoch of the latest verified state."""
        if number is None:
            height, raw = self.value(layout.PARAMS_KEY)
            if raw is None:
                raise QueryRefused("the chain has no parameters yet (no block committed)")
            number = Schedule.from_params(Params.decode(raw)).epoch_of(max(height, 1))
        return self._entity(layout.epoch_key(number), Epoch)

    def reputation(self, node: bytes) -> Reputation | None:
        return self._entity(layout.reputation_key(node), Reputation)

    def reputations(self) -> tuple[Listing, list[Reputation]]:
        """Every registered node's reputation record (written at registration: a node never scored stands
        where it registered, `epochs` 0)."""
        listing = self.entries(layout.REPUTATION_PREFIX)
        return listing, layout.decode_records(listing.entries, Reputation)

    def organisations(self) -> tuple[Listing, list[Organisation]]:
        listing = self.entries(layout.ORG_PREFIX)
        return listing, layout.decode_records(listing.entries, Organisation)

    def credit_accounts(self) -> tuple[Listing, list[Credits]]:
        """Every organisation's credit account that the chain has written (others hold nothing)."""
        listing = self.entries(layout.CREDITS_PREFIX)
        return listing, layout.decode_records(listing.entries, Credits)

    def faults(self, operator: bytes | None = None) -> tuple[Listing, list[Fault]]:
        listing = self.entries(layout.fault_prefix(operator))
        return listing, layout.decode_records(listing.entries, Fault)

    def credits(self, org_id: str) -> Credits:
        account = self._entity(layout.credits_key(org_id), Credits)
        return account if account is not None else Credits(org_id, 0, 0, 0)

    def deployments(self) -> tuple[Listing, list[Deployment]]:
        listing = self.entries(layout.DEPLOYMENT_PREFIX)
        return listing, layout.decode_records(listing.entries, Deployment)

    def deployment_of(self, node: bytes) -> Deployment | None:
        """The deployment the node is assigned to serve, if any."""
        _, raw = self.value(layout.assigned_key(node))
        if raw is None:
            return None
        return self._entity(layout.deployment_key(int(codec.unpack(raw))), Deployment)

    def stage(self, node: bytes) -> tuple[int, int, int] | None:
        """(first layer, end layer, pipeline) the node serves in its deployment's layer pipeline; None
        when it serves no deployment or serves the whole model."""
        deployment = self.deployment_of(node)
        return None if deployment is None else deployment.stage_of(node)

    def plan_required(self, number: int) -> list[bytes]:
        """The nodes the plan of epoch `number` must cover, fixed at its setup block."""
        return [layout.last_key_bytes(k) for k, _ in self.entries(layout.required_prefix(number)).entries]

    def plan(self, number: int) -> tuple[Listing, list[PlanEntry]]:
        listing = self.entries(layout.plan_prefix(number))
        return listing, layout.decode_records(listing.entries, PlanEntry)

    def registered_nodes(self) -> list[ModelNode]:
        """Every registered model node, trusted or not (the signed list holds only trusted ones)."""
        return layout.decode_records(self.entries(layout.NODE_PREFIX).entries, ModelNode)

    def vrf_entry(self, number: int, operator: bytes) -> VrfEntry | None:
        return self._entity(layout.vrf_prefix(number) + operator.hex().encode(), VrfEntry)

    def results(self, number: int) -> list[ChallengeResult]:
        """The epoch's submitted challenge results, in (node, submitter) order."""
        return layout.decode_records(self.entries(layout.result_prefix(number)).entries, ChallengeResult)

    def attestations(self, number: int) -> dict[tuple[bytes, bytes], list[list]]:
        """(node, submitter) → [[member, credibility ppm, deviating tokens], …] of the epoch."""
        prefix = layout.attestation_prefix(number)
        out: dict[tuple[bytes, bytes], list[list]] = {}
        for key, raw in self.entries(prefix).entries:
            node, submitter = key[len(prefix):].decode().split("/")
            out[bytes.fromhex(node), bytes.fromhex(submitter)] = codec.unpack(raw)
        return out

    def reports(self, number: int, node: bytes) -> list[bytes]:
        """The members who reported that the node gave no valid response in the epoch."""
        _, raw = self.value(layout.report_key(number, node))
        return [] if raw is None else list(codec.unpack(raw))

    def rechallenge(self, number: int, member: bytes, tag: bytes) -> Rechallenge | None:
        return self._entity(layout.rechallenge_key(number, member, tag), Rechallenge)

    def rechallenges(self, number: int, member: bytes) -> list[Rechallenge]:
        """Every re-challenge the member committed in the epoch, in tag order."""
        listing = self.entries(layout.rechallenge_prefix(number, member))
        return layout.decode_records(listing.entries, Rechallenge)

    def params(self) -> Params:
        params = self._entity(layout.PARAMS_KEY, Params)
        if params is None:
            raise QueryRefused("the chain has no parameters yet (no block committed)")
        return params

    def sequence(self, account: bytes) -> int:
        """The account's next sequence, never above what the ledger proves. An endpoint that said a
        higher one would have us sign a transaction that fails now but that it could keep and send
        once the account reaches that sequence, after the message was signed again at the right one:
        the message applied twice. A lower one only makes the transaction fail. The endpoint's latest
        state leads the verified one by a block: our own last transaction that succeeded counts as
        spent (until the verified state should show it and does not), and a sequence that another
        signer of the account moved in that block is read again from the state the next header
        proves, a block's wait."""
        key = layout.account_key(account)
        answer, _, _ = self._query("/key", key, verify=False)
        said = _sequence(answer.value if answer.info == "found" else None)
        spent, committed = self._next.get(account, (0, 0))
        if self.verifier is None:
            return max(said, spent)
        if said == spent:  # the endpoint agrees with our own last commit: nothing more to prove
            return said
        height, raw = self.value(key, since=0)
        proven = _sequence(raw)
        if proven < spent and height >= committed:  # the endpoint said it committed; the ledger says not
            del self._next[account]
        elif spent > proven:
            proven = spent
        if said <= proven:
            return proven
        # at most the block after the latest verified one: an endpoint naming a far height makes us
        # wait for nothing
        return _sequence(self.value(key, since=min(answer.height, height + 2))[1])

    # -- writes ----------------------------------------------------------------------------------

    def chain_id(self) -> str:
        """The chain transactions are signed for: the genesis file's where a light client verifies the
        endpoint (an endpoint naming another chain had us sign for it, so that what we signed could be
        replayed there), else the endpoint's."""
        if self.verifier is not None:
            return self.verifier.chain_id
        network = obj(self.rpc.status().get("node_info"), "status.node_info").get("network")
        if not isinstance(network, str):
            raise RpcMalformed("status.node_info.network: expected the chain id")
        return network

    def submit(self, keys: KeySet, msg: Message, timeout: float = 30.0) -> Submitted:
        """Sign with the account's next sequence (`sequence`), broadcast, and wait until the tx is in a
        block. A registration gets the proof of work the chain's parameters ask for (`Worked.solved`);
        one refused as RATE_LIMITED (the signer's window, or the block's registrations, are full) is
        sent again, a block later, until `timeout`: the same bytes, never signed again. The refusal
        is the endpoint's word: one that sent the transaction on and said it was refused would have
        us sign the message again at the next sequence, and apply it twice. Sent again once its
        sequence is spent, the transaction is refused as BAD_SEQUENCE: it is in a block (what the
        endpoint says of it is returned), or some block refused it (the refusal is returned).

        With a witness, a refusal in CheckTx (other than RATE_LIMITED, which is sent again) is believed
        only when the witness refuses the same bytes too: an endpoint could otherwise make up refusals
        and have work given up (a verifier daemon gives up a refused duty for the epoch). Where the
        witness takes the transaction, its block is awaited through the witness. A block and outcome
        one of the two tells are believed only once the other tells the same (OutcomeMismatch where it
        does not)."""
        chain_id = self.chain_id()
        if isinstance(msg, Worked):
            msg = msg.solved(chain_id, keys.public, self.params())
        sequence = self.sequence(keys.public)
        raw = sign(keys, chain_id, msg, sequence)
        tx_hash = hashlib.sha256(raw).digest()
        deadline = time.monotonic() + timeout
        refused: Submitted | None = None
        while True:
            done = self._broadcast(raw, tx_hash, msg, deadline, timeout, again=refused is not None)
            if refused is not None and done.outcome.code == Code.BAD_SEQUENCE:
                found = self._committed(tx_hash)
                done = self._witnessed(found, msg, deadline) if found is not None else refused
            elif done.outcome.code == Code.RATE_LIMITED and time.monotonic() <= deadline:
                refused = done
                time.sleep(1.0)
                continue
            if done.height and done.outcome.ok and sequence + 1 > self._next.get(keys.public, (0, 0))[0]:
                self._next[keys.public] = (sequence + 1, done.height)
            return done

    def _committed(self, tx_hash: bytes, rpc: RpcClient | None = None) -> Submitted | None:
        """The transaction's block and outcome, if the endpoint (by default ours) knows it committed."""
        try:
            found = (rpc or self.rpc).tx(tx_hash)
        except RpcResponseError:
            return None
        self.min_height = max(self.min_height, found.height)
        return Submitted(tx_hash, found.height, found.result)

    def _broadcast(self, raw: bytes, tx_hash: bytes, msg: Message, deadline: float, timeout: float,
                   again: bool) -> Submitted:
        try:
            checked = self.rpc.broadcast_tx_sync(raw)
        except RpcResponseError as exc:
            if again and "already exists in cache" in str(exc):  # sent on before: wait for its block
                return self._await_tx(tx_hash, msg, deadline, timeout)
            raise
        if not checked.ok:
            refused = Submitted(checked.hash, 0, TxOutcome(code=checked.code, data=b"", log=checked.log,
                                                           codespace=checked.codespace))
            witness = self._witness
            if witness is None or checked.code == Code.RATE_LIMITED or not self._taken_by(witness, raw):
                return refused
            log.warning("%s refused by %s (code %d: %s) but taken by the witness %s: awaiting it there",
                        msg.TYPE, self.rpc.url, checked.code, checked.log[:200], witness.url)
            return self._await_tx(tx_hash, msg, deadline, timeout, witness)
        return self._await_tx(checked.hash, msg, deadline, timeout)

    def verified_outcome(self, done: Submitted) -> Submitted:
        """`done`, a transaction the endpoint says committed at `done.height`, once the chain shows the
        outcome it was told: block H's transactions hash to header H's data hash (so the transaction is
        the one at its index), and their results to header H+1's last results hash (so its code, data
        and gas are what every validator computed). Waits for block H+1. The log and events are in no
        hash and stay the endpoint's word. OutcomeMismatch where the endpoint said otherwise."""
        if self.verifier is None:
            raise ValueError("an unverified client cannot verify an outcome: give it a genesis file")
        height, url = done.height, self.rpc.url
        txs = [hashlib.sha256(tx).digest() for tx in self.rpc.block_txs(height)]
        if merkle_root(txs) != self.verifier.verified_light_block(height).header.data_hash:
            raise OutcomeMismatch(f"{url}'s block {height} does not hash to the verified header's data hash")
        if done.tx_hash not in txs:
            raise OutcomeMismatch(f"{url} says tx {done.tx_hash.hex().upper()} committed at height {height}; "
                                  f"that block does not hold it")
        results = self.rpc.block_results(height)
        if len(results) != len(txs) or merkle_root([_deterministic(r) for r in results]) != \
                self.verifier.verified_header_after(height).last_results_hash:
            raise OutcomeMismatch(f"{url}'s results of block {height} do not hash to the verified header's "
                                  f"last results hash")
        proven = results[txs.index(done.tx_hash)]
        if (proven.code, proven.data) != (done.outcome.code, done.outcome.data):
            raise OutcomeMismatch(f"{url} says tx {done.tx_hash.hex().upper()} ended with code "
                                  f"{done.outcome.code}; block {height}'s verified results say code "
                                  f"{proven.code}")
        return done

    def _witnessed(self, found: Submitted, msg: Message, deadline: float,
                   source: RpcClient | None = None) -> Submitted:
        """`found`, what `source` (by default our endpoint) says of a transaction's block and outcome,
        once the other of our endpoint and the witness tells the same: with a witness, no one endpoint's
        word is taken. The other, a block behind, is waited for until `deadline`."""
        witness = self._witness
        if witness is None:
            return found
        told_by = source or self.rpc
        other = self.rpc if told_by is witness else witness
        while (theirs := self._committed(found.tx_hash, other)) is None:
            if time.monotonic() > deadline:
                raise OutcomeMismatch(f"{told_by.url} says {msg.TYPE} committed at height {found.height}; "
                                      f"{other.url} does not know it")
            time.sleep(0.2)
        if (theirs.height, theirs.outcome.code) != (found.height, found.outcome.code):
            raise OutcomeMismatch(
                f"{told_by.url} says {msg.TYPE} committed at height {found.height} with code "
                f"{found.outcome.code}; {other.url} says height {theirs.height}, code {theirs.outcome.code}")
        return found

    @property
    def _witness(self) -> RpcClient | None:
        return self.verifier.witness if self.verifier is not None else None

    @staticmethod
    def _taken_by(witness: RpcClient, raw: bytes) -> bool:
        """Whether the witness's CheckTx takes the transaction (or already holds it); a witness that does
        not answer takes nothing."""
        try:
            return witness.broadcast_tx_sync(raw).ok
        except RpcResponseError as exc:
            return "already exists in cache" in str(exc)
        except RpcError:
            return False

    def _await_tx(self, tx_hash: bytes, msg: Message, deadline: float, timeout: float,
                  rpc: RpcClient | None = None) -> Submitted:
        while True:
            found = self._committed(tx_hash, rpc)
            if found is not None:
                return self._witnessed(found, msg, deadline, rpc)
            if time.monotonic() > deadline:
                raise TxNotCommitted(f"{msg.TYPE} was accepted into the mempool as tx "
                                     f"{tx_hash.hex().upper()} but not seen in a block within {timeout:g} s")
            time.sleep(0.2)
