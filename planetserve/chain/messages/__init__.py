"""Typed transaction messages, one frozen dataclass per transaction type, grouped by family as the
handlers are (chain/abci/handlers/): registry, committee, epochs, credits. Clients submit these;
the application decodes every body into one before its handler runs."""

from __future__ import annotations

from typing import Any

from planetserve.chain.messages.base import Message
from planetserve.chain.messages.committee import (
    ProposeMember,
    ProposeParams,
    ProposeUpgrade,
    RotateMemberKey,
    VoteMember,
)
from planetserve.chain.messages.credits import DeployModel
from planetserve.chain.messages.epochs import (
    Attest,
    CommitPlan,
    CommitRechallenge,
    ReportInvalid,
    SubmitResults,
    SubmitVrf,
)
from planetserve.chain.messages.registry import (
    Heartbeat,
    RegisterModel,
    RegisterModelNode,
    RegisterOrg,
    RegisterUser,
    RotateNodeKey,
    UpdateModelNode,
)

MESSAGES: dict[str, type[Message]] = {
    m.TYPE: m
    for m in (RegisterOrg, RegisterUser, Heartbeat, RegisterModel, RegisterModelNode, UpdateModelNode,
              RotateNodeKey, ProposeMember, ProposeParams, ProposeUpgrade, VoteMember, RotateMemberKey,
              SubmitVrf, CommitPlan, SubmitResults, Attest, ReportInvalid, CommitRechallenge,
              DeployModel)
}

EPOCH_FAMILY = frozenset(m.TYPE for m in (SubmitVrf, CommitPlan, SubmitResults, Attest, ReportInvalid,
                                          CommitRechallenge))
"""The committee's epoch work, which proposals carry first."""
COMMITTEE_FAMILY = frozenset(m.TYPE for m in (ProposeMember, ProposeParams, ProposeUpgrade, VoteMember,
                                              RotateMemberKey))
REGISTRATIONS = frozenset(m.TYPE for m in (RegisterUser, RegisterOrg))
"""New identities: at most `max_registrations_per_block` a block, proposed last."""


def decode(tx_type: str, body: dict[str, Any]) -> Message:
    """The message of a known transaction type; raises InvalidField naming the first bad field."""
    return MESSAGES[tx_type].from_body(body)
