"""Chain parameters: set in the genesis file's app_state, changed by a committee vote at a stated height."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Self

from planetserve.registry.entities import Record
from planetserve.registry.errors import InvalidField

PPM = 1_000_000
MAY_BE_ZERO = frozenset({"probation_epochs", "user_work_bits", "org_work_bits"})
"""Parameters for which 0 means something (no probation, no proof of work); every other one must be
positive."""
MAX_WORK_BITS = 40
GENESIS_ONLY = frozenset({"epoch_blocks"})
"""Set by the genesis alone: epochs are numbered from the first block by it, so a change would renumber
them (epochs skipped, whose records are never made, or finalized twice, and the fault window with
them). A new chain's genesis (`planetserve chain export`, edited) may set another."""
EPOCH_WINDOWS = frozenset({"results_blocks", "vrf_window_blocks", "plan_window_blocks"})
"""Changed only at an epoch's first block: inside an epoch, a wider VRF or plan window moves the block
that sets up the next epoch to one already past, and the next epoch would have no record or plan."""


@dataclass(frozen=True)
class Params(Record):
    max_tx_bytes: int = 16_384
    user_ttl_seconds: int = 600
    proposal_ttl_blocks: int = 1_000
    max_query_entries: int = 20_000
    # Verification epochs (blocks). Offsets within an epoch: the leader's results are due before
    # results_blocks; the VRF window and the plan window are the epoch's last blocks.
    epoch_blocks: int = 100
    results_blocks: int = 50
    vrf_window_blocks: int = 10
    plan_window_blocks: int = 14
    # the closing windows span AHEAD_BLOCKS + GIVE_UP_BLOCKS + ATTEST_BLOCKS (verifier/daemon.py,
    # registry/epochs.py): the next epoch's re-challenges start where this epoch's end, no block between
    max_plan_nodes: int = 10_000
    response_slack_seconds: int = 120
    credibility_tolerance_ppm: int = 50_000
    # Reputation (seed planetserve.md 3.4), parts per million.
    reputation_alpha_ppm: int = 400_000
    reputation_beta_ppm: int = 600_000
    reputation_window: int = 5
    reputation_gamma_ppm: int = 200_000
    abnormal_threshold_ppm: int = 400_000
    untrusted_threshold_ppm: int = 400_000
    initial_reputation_ppm: int = 500_000
    # Trust is earned: a newly registered node is challenged but not listed until it has been scored
    # trusted in probation_epochs consecutive finalized epochs (0: listed from registration). Its
    # starting reputation is at most its organisation's (registry/reputation.py).
    probation_epochs: int = 3
    # Evidence across epochs (registry/evidence.py): a CUSUM over each node's checked and deviating
    # tokens, in millinats, for an honest deviation rate of 0.1 % against 1 % at a false alarm of 1e-4.
    evidence_deviation_weight: int = 2_303
    evidence_token_weight: int = 9
    evidence_threshold: int = 9_210
    # Consequences of members' faults: a member recorded with member_fault_limit faults within its
    # last member_fault_window epochs loses its power, as a removal vote would take it; a member whose
    # validator missed more than missed_blocks_ppm of an epoch's commits is recorded faulty (one that
    # is down misses them all; one that is merely slow, a few).
    member_fault_window: int = 10
    member_fault_limit: int = 5
    missed_blocks_ppm: int = 900_000
    # A member's credential is good for this long from its admission (or the genesis) or its last
    # renewal (propose-member --action renew); then it lapses and the member loses its power.
    credential_ttl_seconds: int = 365 * 86_400
    # Deployments paid with contribution credits.
    max_deployment_nodes: int = 1_000
    min_deployment_seconds: int = 60
    max_deployment_seconds: int = 90 * 86_400
    # Pipelines (Parallax phase 1's Z(k)): average compute time of one replication and one hop (µs).
    pipeline_compute_us: int = 50_000
    pipeline_hop_us: int = 10_000
    # Anti-spam (docs/threat-model.md, "Client"). A key registers as a user, or registers an
    # organisation, only with a proof of work over (chain id, type, key) of that many leading zero bits
    # (registry/work.py): about 2^bits SHA-256 hashes, a fraction of a second for one user's relay and
    # a few seconds for an organisation, checked with one hash.
    user_work_bits: int = 17
    org_work_bits: int = 21
    # At most this many registrations (register-user, register-org) per block; CheckTx admits at most
    # this many into the mempool between two blocks, and PrepareProposal proposes them last.
    max_registrations_per_block: int = 64
    # A signer that is not a committee member gets at most max_signer_txs transactions per window of
    # rate_window_blocks blocks (windows are height // rate_window_blocks), counted in the state.
    rate_window_blocks: int = 10
    max_signer_txs: int = 30
    # CheckTx admits at most this many transactions, and bytes, of non-members into the mempool between
    # two blocks (rechecked ones included), so that a flood of them can neither fill CometBFT's mempool
    # (5,000 transactions by default) nor the part of it that a proposal reaps (the block's 4 MiB, in
    # arrival order) ahead of the committee's: a rule of admission, not of consensus.
    mempool_non_member_txs: int = 2_000
    mempool_non_member_bytes: int = 2 << 20

    @classmethod
    def from_genesis(cls, raw: dict[str, Any] | None) -> Self:
        """Read parameters from genesis JSON; absent ones take their defaults, unknown ones are errors."""
        return cls().changed(raw or {})

    def changed(self, changes: Mapping[str, Any]) -> Self:
        """These parameters with `changes` (name -> value) applied, each checked as the genesis's are,
        then their relations; InvalidField names the first that fails."""
        self.check_values(changes)
        params = replace(self, **changes)
        params.check()
        return params

    @classmethod
    def check_values(cls, changes: Mapping[str, Any]) -> None:
        """Each named parameter exists and its value is an integer it may take, whatever the others."""
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        for name, value in changes.items():
            if name not in known:
                raise InvalidField(name, "unknown parameter")
            least = 0 if name in MAY_BE_ZERO else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidField(name, f"must be a {'non-negative' if least == 0 else 'positive'} integer")

    def check(self) -> None:
        """Relations between parameters that every block relies on."""
        if self.results_blocks >= self.epoch_blocks:
            raise InvalidField("results_blocks", "must be less than epoch_blocks")
        if self.min_deployment_seconds > self.max_deployment_seconds:
            raise InvalidField("min_deployment_seconds", "must be at most max_deployment_seconds")
        for name in ("vrf_window_blocks", "plan_window_blocks"):
            if getattr(self, name) >= self.epoch_blocks:
                raise InvalidField(name, "must be less than epoch_blocks")
        for name in ("user_work_bits", "org_work_bits"):
            if getattr(self, name) > MAX_WORK_BITS:
                raise InvalidField(name, f"must be at most {MAX_WORK_BITS}")
        for f in fields(self):
            if f.name.endswith("_ppm") and getattr(self, f.name) > PPM:
                raise InvalidField(f.name, f"must be at most {PPM} (parts per million)")
