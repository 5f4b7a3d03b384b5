"""The planetserve ABCI 2.0 application: deterministic execution of registry transactions.

One batch holds the block being executed (from InitChain or FinalizeBlock until Commit); another
holds mempool state for CheckTx and is rebuilt after every Commit. Only Commit writes to the store.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import msgpack
from sqlalchemy.exc import SQLAlchemyError
from tendermint.abci import types_pb2 as abci
from tendermint.crypto import keys_pb2, proof_pb2
from tendermint.types import params_pb2, validator_pb2

from planetserve.chain import layout, messages
from planetserve.chain.abci import deployments, epochs, governance, rotations
from planetserve.chain.abci.handlers import HANDLERS
from planetserve.chain.abci.handlers.context import Context
from planetserve.chain.abci.metrics import AppMetrics
from planetserve.chain.abci.snapshots import FORMAT, Metadata, Restore, SnapshotError, Snapshots
from planetserve.chain.abci.state import IterableKV, State, TxScope, due, members
from planetserve.chain.abci.store import Batch, StateStore, StoreError, TooManyEntriesError
from planetserve.chain.errors import CODESPACE, Code, TxError, from_registry
from planetserve.chain.tx import Tx, decode
from planetserve.registry.credits import Credits
from planetserve.registry.entities import Member, Proposal
from planetserve.registry.errors import RegistryError
from planetserve.registry.genesis import parse_app_state
from planetserve.registry.params import Params

log = logging.getLogger(__name__)

APP_VERSION = 1
"""The newest chain version this app runs (chain/abci/governance.py: a higher one needs a newer app)."""
BLOCK_TIME_META = "block_time"
CHAIN_ID_META = "chain_id"
VERIFIED_CACHE = 100_000
"""Digests of transactions whose envelope checked (signature and sequence): 32 bytes each, so the cache
holds a few MiB whatever the transactions held."""
ANSWER_CACHE_ENTRIES = 16
ANSWER_CACHE_MAX_BYTES = 8 << 20


UNDECODABLE = "undecodable"
UNKNOWN_TX_TYPE = "unknown"


@dataclass
class Outcome:
    code: Code
    log: str
    events: list[abci.Event]
    tx_type: str = UNDECODABLE
    """The transaction's type, where it has one of the known types (a bounded set: a metric label)."""


@dataclass
class Admission:
    """What one block (FinalizeBlock), or the mempool since the last commit (CheckTx), has admitted:
    registrations against `max_registrations_per_block`; in the mempool also the transactions and bytes
    of signers that are not committee members, against their share of it."""

    mempool: bool
    registrations: int = 0
    non_member_txs: int = 0
    non_member_bytes: int = 0


def proposal_rank(tx_type: str) -> int:
    """The order of a proposal: the committee's epoch and membership work, then other traffic, then
    new registrations."""
    if tx_type in messages.EPOCH_FAMILY or tx_type in messages.COMMITTEE_FAMILY:
        return 0
    return 2 if tx_type in messages.REGISTRATIONS else 1


def _events(raw: list[tuple[str, dict[str, str]]]) -> list[abci.Event]:
    return [
        abci.Event(
            type=kind,
            attributes=[abci.EventAttribute(key=k, value=v, index=True) for k, v in sorted(attrs.items())],
        )
        for kind, attrs in raw
    ]


class Application:
    """`snapshots`: the state sync snapshots this validator makes and serves, and where a snapshot
    being restored is kept (None: neither). `retain_blocks`: the blocks CometBFT keeps (0: all), never
    fewer than a kept snapshot needs. `chain_id`: the chain this node belongs to, before its state
    says so (a node restoring a snapshot refuses one of another chain). `metrics`: what it records for
    Prometheus (None: nothing)."""

    VERSION = APP_VERSION
    MIGRATIONS: dict[str, governance.Migration] = {}
    """The migration of each upgrade (by its plan's name) that this version of the app runs."""

    def __init__(self, store: StateStore, snapshots: Snapshots | None = None, retain_blocks: int = 0,
                 chain_id: str = "", metrics: AppMetrics | None = None) -> None:
        if retain_blocks < 0:
            raise ValueError("retain_blocks must be at least 0")
        self.store = store
        self.snapshots = snapshots
        self.metrics = metrics
        self.retain_blocks = retain_blocks
        self._restore: Restore | None = None
        self.block: Batch | None = None
        self.block_height = 0
        self.block_time = 0
        self.chain_id = (store.get_meta(CHAIN_ID_META) or b"").decode() or chain_id
        self.committed_time = int.from_bytes(store.get_meta(BLOCK_TIME_META) or b"", "big")
        self.check = store.batch()
        self._admitted = Admission(mempool=True)
        self._verified: OrderedDict[bytes, None] = OrderedDict()
        self._params: Params | None = None
        if store.height:  # queries, on other threads, read them without a batch
            self._params = State(store.batch()).params()
        # Many clients read the same signed list at the same height: keep the latest answers. Queries
        # run on worker threads (server.py), so the cache has its lock.
        self._answers: OrderedDict[tuple[str, bytes, int, bool], abci.ResponseQuery] = OrderedDict()
        self._answers_lock = threading.Lock()

    @property
    def params(self) -> Params:
        """Read once, and again when a block changes them (governance.begin_block)."""
        if self._params is None:
            self._params = State(self.block or self.store.batch()).params()
        return self._params

    # -- handshake -------------------------------------------------------------------------------

    def info(self, _req: abci.RequestInfo) -> abci.ResponseInfo:
        """`data` tells clients which heights this validator can prove (`abci_info` over RPC)."""
        kept = {"keep_heights": self.store.keep_heights, "earliest_height": self.store.earliest_height}
        return abci.ResponseInfo(
            data=json.dumps({"app": "planetserve", "runs": self.VERSION, **kept}, separators=(",", ":")),
            version="0.1.0",
            app_version=State(self.store.batch()).app_version(),
            last_block_height=self.store.height,
            last_block_app_hash=self.store.app_hash if self.store.height else b"",
        )

    def init_chain(self, req: abci.RequestInitChain) -> abci.ResponseInitChain:
        """Load parameters, committee, models, organisations and their credits from genesis; refuse a
        genesis whose validator set does not match its committee. Genesis organisations are registered
        at the genesis time (whole seconds, as a block's time)."""
        app_state = parse_app_state(json.loads(req.app_state_bytes or b"{}"))
        genesis_validators = sorted((v.pub_key.ed25519, v.power) for v in req.validators)
        committee_validators = sorted((m.consensus_key, m.power) for m in app_state.committee)
        if genesis_validators != committee_validators:
            raise ValueError("genesis validators do not match the app_state committee")
        self.chain_id = req.chain_id
        self.block = self.store.batch()
        self.block_height = 0  # a handshake repeating InitChain after FinalizeBlock(1) builds on this batch
        st = State(self.block)
        for key, value in app_state.exported:
            self.block.set(key, value)
        if app_state.exported and req.initial_height > 1:  # this chain goes on from an export of itself
            return self._continue(st, app_state.committee)
        st.put_params(app_state.params)
        self._params = app_state.params
        genesis_time = req.time.seconds
        for member in app_state.committee:
            lapses = member.expires_at or genesis_time + app_state.params.credential_ttl_seconds
            st.put_member(replace(member, expires_at=lapses))
        for model in app_state.models:
            st.put_model(model)
        for org in sorted(app_state.organisations, key=lambda o: o.org_id):
            st.put_org(org.organisation(genesis_time))
            if org.credits > 0:
                st.put_credits(Credits(org.org_id, balance=org.credits, earned=0, spent=0))
        for hardware, rate in app_state.prices:
            st.put_int(layout.price_key(hardware), rate)
        epochs.genesis(st, req.chain_id, list(app_state.committee))
        return abci.ResponseInitChain(app_hash=self.block.root())

    def _continue(self, st: State, committee: tuple[Member, ...]) -> abci.ResponseInitChain:
        """InitChain of a chain that goes on from its own export at the height before its first: the
        exported state is the whole state (its app hash is the exported height's), and its committee is
        the genesis's."""
        if sorted(members(self.block).values(), key=lambda m: m.operator) != \
                sorted(committee, key=lambda m: m.operator):
            raise ValueError("the exported state's committee is not the genesis committee")
        self._params = st.params()
        return abci.ResponseInitChain(app_hash=self.block.root())

    # -- mempool ---------------------------------------------------------------------------------

    def check_tx(self, req: abci.RequestCheckTx) -> abci.ResponseCheckTx:
        """A new transaction runs in full against the mempool state. A recheck after a block only
        re-validates the envelope and takes the sequence: a transaction the block made invalid in
        other ways is refused with its code in FinalizeBlock, as any block may contain such. A refused
        transaction never reaches the mempool, so it leaves the mempool state, its sequence included,
        as it was: the sender's next transaction reuses that sequence."""
        scope = TxScope(self.check)
        outcome = self._execute(
            scope, req.tx, self.store.height + 1, self.committed_time,
            envelope_only=req.type == abci.RECHECK, admission=self._admitted,
        )
        if outcome.code == Code.OK:
            scope.apply()
        if self.metrics is not None and req.type != abci.RECHECK:
            self.metrics.checked.labels(outcome.tx_type, str(int(outcome.code))).inc()
        return abci.ResponseCheckTx(
            code=outcome.code, log=outcome.log, codespace=CODESPACE if outcome.code else "", gas_wanted=1
        )

    # -- consensus -------------------------------------------------------------------------------

    def prepare_proposal(self, req: abci.RequestPrepareProposal) -> abci.ResponsePrepareProposal:
        """Propose the transactions that decode, within the byte limit: the committee's first (epoch
        and membership work), then other traffic, then at most `max_registrations_per_block`
        registrations; in mempool order within each rank. A signer's transactions keep their order:
        all of them take the rank of its most urgent one, and once one of them is left out (no room),
        so are its later ones, which could only fail on their sequence."""
        params = self.params
        decoded: list[tuple[bytes, Tx]] = []
        for raw in req.txs:
            try:
                decoded.append((raw, self._decode(raw, params.max_tx_bytes)[0]))
            except TxError:
                continue
        rank: dict[bytes, int] = {}
        for _, tx in decoded:
            rank[tx.signer] = min(rank.get(tx.signer, 2), proposal_rank(tx.type))
        order = sorted(range(len(decoded)), key=lambda i: (rank[decoded[i][1].signer], i))
        chosen: list[bytes] = []
        left_out: set[bytes] = set()
        size = registrations = 0
        for i in order:
            raw, tx = decoded[i]
            registration = tx.type in messages.REGISTRATIONS
            if (tx.signer in left_out or size + len(raw) > req.max_tx_bytes
                    or (registration and registrations >= params.max_registrations_per_block)):
                left_out.add(tx.signer)
                continue
            chosen.append(raw)
            size += len(raw)
            registrations += registration
        return abci.ResponsePrepareProposal(txs=chosen)

    def process_proposal(self, req: abci.RequestProcessProposal) -> abci.ResponseProcessProposal:
        """Reject a proposal carrying bytes that are not transaction envelopes."""
        limit = self.params.max_tx_bytes
        status = abci.ResponseProcessProposal.ACCEPT
        for raw in req.txs:
            try:
                self._decode(raw, limit)
            except TxError:
                status = abci.ResponseProcessProposal.REJECT
                break
        return abci.ResponseProcessProposal(status=status)

    def finalize_block(self, req: abci.RequestFinalizeBlock) -> abci.ResponseFinalizeBlock:
        started = time.perf_counter()
        if self.block is None or self.block_height:
            self.block = self.store.batch()
        self.block_height = req.height
        self.block_time = req.time.seconds
        self._params = None  # this block's, as the committed state and its first changes make them
        changed = governance.begin_block(self.block, req.height, self.VERSION, self.MIGRATIONS)
        self._expire_rate_windows(self.block, req.height)
        self._expire_users(self.block, self.block_time)
        deployments.expire(self.block, self.block_time)
        rotated = rotations.begin_block(self.block, self.params, req.height, self.block_time)
        epochs.begin_block(self.block, self.params, req.height, self.block_time)
        epochs.record_commit(self.block, self.params, req.height,
                             (v.validator.address for v in req.decided_last_commit.votes
                              if v.block_id_flag == validator_pb2.BLOCK_ID_FLAG_ABSENT))
        results: list[abci.ExecTxResult] = []
        updates: dict[bytes, int] = dict(rotated.validator_updates)
        admission = Admission(mempool=False)
        for raw in req.txs:
            outcome = self._execute(self.block, raw, req.height, self.block_time, updates,
                                    admission=admission)
            if self.metrics is not None:
                self.metrics.transactions.labels(outcome.tx_type, str(int(outcome.code))).inc()
            results.append(
                abci.ExecTxResult(
                    code=outcome.code,
                    log=outcome.log,
                    codespace=CODESPACE if outcome.code else "",
                    events=outcome.events,
                )
            )
        self._expire_proposals(self.block, req.height)
        removed = epochs.end_block(self.block, self.params, req.height, self.block_time)
        healed = deployments.heal_at_epoch_end(self.block, self.params, req.height, self.block_time)
        updates.update((r.consensus_key, 0) for r in removed)
        if self.metrics is not None:
            self.metrics.block(self.params, req.height, started)
        return abci.ResponseFinalizeBlock(
            tx_results=results,
            events=_events([*changed.events, *rotated.events,
                            *(("member_removed", {"operator": r.operator.hex(), "faults": str(r.faults),
                                                  "reason": r.reason})
                              for r in removed), *healed]),
            consensus_param_updates=None if changed.app_version is None else params_pb2.ConsensusParams(
                version=params_pb2.VersionParams(app=changed.app_version)),
            validator_updates=[
                abci.ValidatorUpdate(pub_key=keys_pb2.PublicKey(ed25519=k), power=p)
                for k, p in sorted(updates.items())
            ],
            app_hash=self.block.root(),
        )

    def commit(self, _req: abci.RequestCommit) -> abci.ResponseCommit:
        started = time.perf_counter()
        if self.block is None or not self.block_height:
            raise RuntimeError("Commit without a finalized block")
        self.store.commit(
            self.block,
            self.block_height,
            {BLOCK_TIME_META: self.block_time.to_bytes(8, "big"), CHAIN_ID_META: self.chain_id.encode()},
        )
        self.committed_time = self.block_time
        self.block = None
        self.block_height = 0
        self.check = self.store.batch()
        self._admitted = Admission(mempool=True)
        if self.snapshots is not None:
            self.snapshots.after_commit(self.store, self.store.height, self.committed_time, self.chain_id)
        retain = self._retain_height()
        if self.metrics is not None:
            newest = max(self.snapshots.heights(), default=0) if self.snapshots is not None else 0
            self.metrics.committed(self.store.height, started, retain, newest)
        return abci.ResponseCommit(retain_height=retain)

    def _retain_height(self) -> int:
        """The lowest block CometBFT must keep (0: keep all): the last `retain_blocks`, and every block
        from the oldest kept snapshot on, which a joining node's light client and block sync read.
        CometBFT itself keeps the headers and commits that evidence still needs."""
        if not self.retain_blocks:
            return 0
        retain = max(1, self.store.height - self.retain_blocks + 1)
        oldest = self.snapshots.oldest_needed() if self.snapshots is not None else None
        return retain if oldest is None else min(retain, oldest)

    # -- state sync ------------------------------------------------------------------------------

    def list_snapshots(self, _req: abci.RequestListSnapshots) -> abci.ResponseListSnapshots:
        return abci.ResponseListSnapshots(snapshots=self.snapshots.list() if self.snapshots else [])

    def load_snapshot_chunk(self, req: abci.RequestLoadSnapshotChunk) -> abci.ResponseLoadSnapshotChunk:
        chunk = self.snapshots.load_chunk(req.height, req.format, req.chunk) if self.snapshots else b""
        return abci.ResponseLoadSnapshotChunk(chunk=chunk)

    def offer_snapshot(self, req: abci.RequestOfferSnapshot) -> abci.ResponseOfferSnapshot:
        """Accept a snapshot to restore into this node's empty state: one of format 1, whose metadata
        matches its hash and the chunk count, of this chain. The app hash it must reach comes with the
        offer, verified by CometBFT's light client."""
        offer = abci.ResponseOfferSnapshot
        if self.snapshots is None:
            return offer(result=offer.ABORT)
        if self.store.height:
            log.error("state sync offered, but this node's state is at height %d: it needs an empty state",
                      self.store.height)
            return offer(result=offer.ABORT)
        snapshot = req.snapshot
        if snapshot.format != FORMAT:
            return offer(result=offer.REJECT_FORMAT)
        try:
            if hashlib.sha256(snapshot.metadata).digest() != snapshot.hash:
                raise SnapshotError("its metadata does not match its hash")
            metadata = Metadata.decode(snapshot.metadata)
            if len(metadata.chunk_hashes) != snapshot.chunks:
                raise SnapshotError(f"it claims {snapshot.chunks} chunks and lists "
                                    f"{len(metadata.chunk_hashes)}")
            if self.chain_id and metadata.chain_id != self.chain_id:
                raise SnapshotError(f"it is of chain {metadata.chain_id!r}, this node's is {self.chain_id!r}")
            if len(req.app_hash) != 32 or snapshot.height < 1:
                raise SnapshotError("it comes without a trusted app hash")
        except SnapshotError as exc:
            log.warning("state sync: snapshot of height %d refused: %s", snapshot.height, exc)
            return offer(result=offer.REJECT)
        if self._restore is not None:
            self._restore.discard()
        self._restore = Restore(req, metadata, self.snapshots.directory / "restoring",
                                self.snapshots.disk_reserve)
        log.info("state sync: restoring the snapshot of height %d (%d chunks)", snapshot.height,
                 snapshot.chunks)
        return offer(result=offer.ACCEPT)

    def apply_snapshot_chunk(self, req: abci.RequestApplySnapshotChunk) -> abci.ResponseApplySnapshotChunk:
        restore = self._restore
        if restore is None:
            return abci.ResponseApplySnapshotChunk(result=abci.ResponseApplySnapshotChunk.ABORT)
        meta = {BLOCK_TIME_META: restore.metadata.block_time.to_bytes(8, "big"),
                CHAIN_ID_META: restore.metadata.chain_id.encode()}
        answer = restore.apply(req, lambda entries, root: self.store.bulk_load(entries, restore.height, meta,
                                                                               expect_root=root))
        if answer.result == abci.ResponseApplySnapshotChunk.REJECT_SNAPSHOT or restore.done:
            restore.discard()
            self._restore = None
        if self.store.height:  # restored: this node now runs from that height
            self.chain_id = restore.metadata.chain_id
            self.committed_time = restore.metadata.block_time
            self._params = State(self.store.batch()).params()
            self.check = self.store.batch()
        return answer

    # -- queries ---------------------------------------------------------------------------------

    def query(self, req: abci.RequestQuery) -> abci.ResponseQuery:
        """`/prefix` (data: a key prefix) answers every entry under it, as msgpack [[key without the
        prefix, value], ...]; `/key` (data: a key) one value.
        Both answer at the requested committed height (0: the latest) and carry a proof against
        that height's app hash, which header height + 1 carries.

        Safe to call from another thread while blocks execute: it reads only committed state, through
        a snapshot of the store (its own database connection and read transaction), never the block
        being executed, the mempool's batch or the store's lock for its reads. The answer is that of
        one committed height whatever commits meanwhile: the latest height is taken before the
        snapshot opens, and a snapshot shows whole commits only, that one or a later one."""
        if req.path not in ("/prefix", "/key"):
            return self._query_error(Code.UNKNOWN_TYPE, f"unknown query path {req.path!r}")
        height = req.height or self.store.height
        cache_key = (req.path, req.data, height, req.prove)
        with self._answers_lock:
            cached = self._answers.get(cache_key)
            if cached is not None:
                self._answers.move_to_end(cache_key)
                return cached
        prefix = req.data + b"\x00" if req.path == "/key" else req.data
        params = self._params  # set at InitChain, or at start on a store that has committed
        max_entries = (params or Params()).max_query_entries
        try:
            with self.store.snapshot() as snapshot:
                entries, proof = snapshot.prove_prefix(prefix, max_entries, height)
        except TooManyEntriesError as exc:  # the client reads such a list in parts (LedgerClient.entries)
            return self._query_error(Code.OVERSIZE, str(exc))
        except (TypeError, ValueError) as exc:
            return self._query_error(Code.INVALID_FIELD, str(exc))
        if req.path == "/key":
            value = entries[0][1] if entries else b""
        else:  # keys without the prefix the client asked for: it knows that part
            cut = len(req.data)
            value = msgpack.packb([[k[cut:], v] for k, v in entries], use_bin_type=True)
        op = proof_pb2.ProofOp(type=layout.PROOF_OP_TYPE, key=req.data, data=proof.encode())
        ops = proof_pb2.ProofOps(ops=[op])
        answer = abci.ResponseQuery(
            code=0,
            key=req.data,
            value=value,
            height=height,
            proof_ops=ops if req.prove else None,
            info="found" if entries else "absent",
        )
        if len(value) <= ANSWER_CACHE_MAX_BYTES:  # a committed height's answer never changes
            with self._answers_lock:
                self._answers[cache_key] = answer
                self._answers.move_to_end(cache_key)
                if len(self._answers) > ANSWER_CACHE_ENTRIES:
                    self._answers.popitem(last=False)
        return answer

    @staticmethod
    def _query_error(code: Code, message: str) -> abci.ResponseQuery:
        return abci.ResponseQuery(code=code, log=message, codespace=CODESPACE)

    # -- execution -------------------------------------------------------------------------------

    def _execute(
        self,
        batch: IterableKV,
        raw: bytes,
        height: int,
        time: int,
        updates: dict[bytes, int] | None = None,
        envelope_only: bool = False,
        admission: Admission | None = None,
    ) -> Outcome:
        """Run one transaction against a batch. A refused transaction changes nothing but, once its
        envelope is valid and its signer has an account, that account's sequence, so it cannot be
        replayed later. A key without an account (sequence 0) that is not a committee member gets one
        only with a transaction that succeeds: refused transactions from fresh keys leave no record."""
        try:
            tx, digest = self._decode(raw, self.params.max_tx_bytes)
        except TxError as exc:
            return Outcome(exc.code, exc.log, [])
        outcome = self._run(batch, tx, digest, len(raw), height, time, updates, envelope_only, admission)
        outcome.tx_type = tx.type if tx.type in messages.MESSAGES else UNKNOWN_TX_TYPE
        return outcome

    def _run(self, batch: IterableKV, tx: Tx, digest: bytes, size: int, height: int, time: int,
             updates: dict[bytes, int] | None, envelope_only: bool, admission: Admission | None) -> Outcome:
        """`_execute` once the envelope decoded."""
        st = State(batch)
        params = self.params
        try:
            self._check_envelope(st, tx, digest)
        except TxError as exc:
            return Outcome(exc.code, exc.log, [])
        member = st.is_member(tx.signer)
        registration = tx.type in messages.REGISTRATIONS
        window = height // params.rate_window_blocks

        def consume() -> None:
            st.put_int(layout.account_key(tx.signer), tx.sequence + 1)
            if not member:
                key = layout.rate_key(window, tx.signer)
                st.put_int(key, st.get_int(key) + 1)

        def admitted(outcome: Outcome) -> Outcome:
            if admission is not None and outcome.code == Code.OK:
                admission.registrations += registration
                if not member:
                    admission.non_member_txs += 1
                    admission.non_member_bytes += size
            return outcome

        try:
            self._admit(st, tx, size, window, member, admission)
        except TxError as exc:
            if tx.sequence > 0 or member:
                st.put_int(layout.account_key(tx.signer), tx.sequence + 1)
            return Outcome(exc.code, exc.log, [])
        fresh = tx.sequence == 0 and not member
        if not fresh or envelope_only:
            consume()
        if envelope_only:
            return admitted(Outcome(Code.OK, "ok", []))
        scope = TxScope(batch)
        ctx = Context(
            state=State(scope),
            signer=tx.signer,
            height=height,
            time=time,
            chain_id=self.chain_id,
            params=params,
            load_committee=lambda: members(batch),
        )
        try:
            msg = messages.decode(tx.type, tx.body)
            HANDLERS[type(msg)](ctx, msg)
        except RegistryError as exc:
            err = from_registry(exc)
            return Outcome(err.code, err.log, [])
        except (StoreError, SQLAlchemyError, MemoryError, RecursionError):
            raise  # the database or this process failed, not the transaction: stop rather than diverge
        except Exception as exc:  # a handler bug is deterministic: every validator refuses alike
            log.exception("handler %s failed", tx.type)
            return Outcome(Code.INTERNAL, f"internal: {tx.type} failed ({type(exc).__name__})", [])
        scope.apply()
        if fresh:
            consume()
        if updates is None:  # a mempool check: its events would be thrown away
            return admitted(Outcome(Code.OK, "ok", []))
        updates.update(ctx.validator_updates)
        return admitted(Outcome(Code.OK, "ok", _events([("tx", {"type": tx.type}), *ctx.events])))

    def _admit(self, st: State, tx: Tx, size: int, window: int, member: bool,
               admission: Admission | None) -> None:
        """The limits on traffic (docs/threat-model.md, "Client"): registrations per block, and the
        transactions of a signer that is not a committee member per window of blocks (kept in the
        state, so every validator counts alike); in the mempool also the non-members' share of it.
        Committee members are not limited: their epoch work must always get through."""
        params = self.params
        if admission is not None and tx.type in messages.REGISTRATIONS \
                and admission.registrations >= params.max_registrations_per_block:
            where = "the mempool holds" if admission.mempool else "this block has"
            raise TxError(Code.RATE_LIMITED,
                          f"rate limited: {where} the {params.max_registrations_per_block} registrations "
                          f"a block allows; retry in a later block")
        if member:
            return
        sent = st.get_int(layout.rate_key(window, tx.signer))
        if sent >= params.max_signer_txs:
            first = window * params.rate_window_blocks
            raise TxError(Code.RATE_LIMITED,
                          f"rate limited: the signer sent {sent} transactions in blocks {first}.."
                          f"{first + params.rate_window_blocks - 1}, the most a window allows; retry from "
                          f"block {first + params.rate_window_blocks}")
        if admission is not None and admission.mempool and (
                admission.non_member_txs >= params.mempool_non_member_txs
                or admission.non_member_bytes + size > params.mempool_non_member_bytes):
            raise TxError(Code.RATE_LIMITED,
                          "rate limited: the mempool's share for signers outside the committee is full "
                          "until the next block; retry")

    @staticmethod
    def _decode(raw: bytes, max_bytes: int) -> tuple[Tx, bytes]:
        return decode(raw, max_bytes), hashlib.sha256(raw).digest()

    def _check_envelope(self, st: State, tx: Tx, digest: bytes) -> None:
        """The cheap checks first, the signature last, and only a transaction that passed them all is
        remembered (by digest), so that recheck, proposals and FinalizeBlock do not verify its
        signature again. Nothing a refused transaction carries is kept: a client flooding CheckTx with
        well-signed transactions at a wrong sequence, or with bodies that decode into many objects,
        leaves nothing behind."""
        if tx.chain_id != self.chain_id:
            raise TxError(
                Code.WRONG_CHAIN_ID, f"wrong chain id: {tx.chain_id!r}, this chain is {self.chain_id!r}"
            )
        if tx.type not in messages.MESSAGES:
            raise TxError(Code.UNKNOWN_TYPE, f"unknown transaction type {tx.type!r}")
        expected = st.sequence(tx.signer)
        if tx.sequence != expected:
            kind = "replayed" if tx.sequence < expected else "out of order"
            raise TxError(Code.BAD_SEQUENCE, f"bad sequence ({kind}): got {tx.sequence}, expected {expected}")
        if digest in self._verified:
            self._verified.move_to_end(digest)
            return
        if not tx.signature_valid():
            raise TxError(Code.BAD_SIGNATURE, "bad signature: does not verify under the signer's key")
        self._verified[digest] = None
        if len(self._verified) > VERIFIED_CACHE:
            self._verified.popitem(last=False)

    def _expire_rate_windows(self, batch: Batch, height: int) -> None:
        """At the first block of a window, drop the previous window's counts."""
        blocks = self.params.rate_window_blocks
        if height % blocks == 0 and height >= blocks:
            stale = [k for k, _ in batch.iterate(layout.rate_prefix(height // blocks - 1))]
            for k in stale:
                batch.delete(k)

    @staticmethod
    def _expire_users(batch: Batch, now: int) -> None:
        """Remove every user whose time-to-live ran out at or before this block's time."""
        st = State(batch)
        for ident in due(batch, layout.EXPIRY_PREFIX, now):
            user = st.user(bytes.fromhex(ident.decode()))
            if user is not None:
                st.delete_user(user)

    @staticmethod
    def _expire_proposals(batch: Batch, height: int) -> None:
        st = State(batch)
        stale = [
            int(k.split(b"/")[1])
            for k, v in batch.iterate(layout.PROPOSAL_PREFIX)
            if Proposal.decode(v).expires_height < height
        ]
        for proposal_id in stale:
            st.delete_proposal(proposal_id)
