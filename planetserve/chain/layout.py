"""The state layout: which key holds what. Shared by the ABCI application, which writes these keys,
and by every client, which queries them and checks their proofs.

Every key is ASCII. Identifier components are percent-escaped so that a prefix query for one model
or region can never match another (model ids may contain '/').

    acct/<signer hex>                       account sequence (int)
    params                                  Params
    org/<org>                               Organisation
    user/<pubkey hex>                       User
    ulist/<region>/<pubkey hex>             User            (the signed user list, per region)
    uexp/<expires_at:012d>/<pubkey hex>     b""             (expiry index, swept every block)
    model/<model>                           Model
    node/<pubkey hex>                       ModelNode
    nlist/<model>/<region>/<pubkey hex>     ModelNode       (the signed node list, per model/region)
    delist/<pubkey hex>                     int             (block time the node last left the list)
    lsince/<pubkey hex>                     int             (block time the node last came onto the list)
    orgnode/<org>/<pubkey hex>              b""             (every node an organisation registered)
    orgrep/<org>                            int             (the least reputation of those nodes, ppm)
    member/<operator hex>                   Member
    proposal/<id:012d>                      Proposal
    next/proposal                           int
    pchange/<height:012d>                   {name: value}   (parameter changes approved for that block)
    upgrade                                 UpgradePlan     (the approved upgrade not yet reached)
    appversion                              int             (the app version the chain runs; absent: 1)

Verification epochs (<e> is the epoch number as %010d):
    epoch/<e>                               Epoch
    vrf/<e>/<operator hex>                  VrfEntry        (proofs electing the leader of e)
    preq/<e>/<node hex>                     b""             (the nodes the plan of e must cover, fixed at
                                                             its setup block)
    preqn/<e>                               int             (how many: the plan is whole at that many)
    plan/<e>/<node hex>                     PlanEntry
    pcom/<e>/<commitment hex>               node pubkey     (no commitment twice in an epoch)
    rch/<e>/<member hex>/<tag hex>          Rechallenge     (the tag hides the node until the reveal)
    rchn/<e>/<member hex>                   int             (re-challenges the member committed in e)
    res/<e>/<node hex>/<submitter hex>      ChallengeResult
    att/<e>/<node hex>/<submitter hex>      [[member, credibility ppm], ...] sorted by member
    inv/<e>/<node hex>                      [member, ...]   (reports of no valid response)
    fault/<operator hex>/<e>/<n:04d>        Fault
    miss/<e>/<operator hex>                 int             (commits the member's validator missed in e)
    rep/<node hex>                          Reputation

Key rotations (due at the first block of an epoch, chain/abci/rotations.py):
    nrot/<height:012d>/<old key hex>        NodeRotation    (a model node's, due at the start of that block)
    rkey/<key hex>                          NodeRotation    (a key no registration may take: a pending
                                                             rotation's new key, or a retired one)
    mrot/<height:012d>/<operator hex>       MemberRotation  (a member's, due at the start of that block)
    rcon/<consensus key hex>                [operator, last height] (a member's consensus key rotated
                                                             away, still the one in the commits CometBFT
                                                             reports up to that height)

Contribution credits and deployments:
    price/<hardware>                        credits per server-hour (int)
    credit/<org>                            Credits         (credit-seconds)
    deploy/<id:012d>                        Deployment
    dnode/<node hex>                        deployment id   (nodes serving a deployment)
    dexp/<expires_at:012d>/<id:012d>        b""             (expiry index, swept every block)
    next/deployment                         int
"""

from __future__ import annotations

from typing import TypeVar
from urllib.parse import quote

from planetserve.registry.entities import ModelNode, Record, User

R = TypeVar("R", bound=Record)

PROOF_OP_TYPE = "planetserve/prefix"
"""The type of the proof operation that a /prefix or /key query answer carries."""



def _c(component: str) -> str:
    return quote(component, safe="")


def key(*parts: str) -> bytes:
    return "/".join(parts).encode("ascii")


def account_key(signer: bytes) -> bytes:
    return key("acct", signer.hex())


RATE_PREFIX = key("rate", "")


def rate_prefix(window: int) -> bytes:
    return RATE_PREFIX + f"{window:012d}/".encode()


def rate_key(window: int, signer: bytes) -> bytes:
    """How many transactions a signer that is not a committee member sent in a window of blocks."""
    return rate_prefix(window) + signer.hex().encode()


ORG_PREFIX = key("org", "")


def org_key(org_id: str) -> bytes:
    return key("org", _c(org_id))


def user_key(pubkey: bytes) -> bytes:
    return key("user", pubkey.hex())


def user_list_prefix(region: str | None = None) -> bytes:
    return key("ulist", _c(region), "") if region else key("ulist", "")


def user_list_key(user: User) -> bytes:
    return user_list_prefix(user.region) + user.pubkey.hex().encode()


EXPIRY_PREFIX = key("uexp", "")


def expiry_key(expires_at: int, pubkey: bytes) -> bytes:
    return EXPIRY_PREFIX + f"{expires_at:012d}/{pubkey.hex()}".encode()


def model_key(model_id: str) -> bytes:
    return key("model", _c(model_id))


def node_key(pubkey: bytes) -> bytes:
    return key("node", pubkey.hex())


def node_list_prefix(model_id: str | None = None, region: str | None = None) -> bytes:
    if model_id is None:
        return key("nlist", "")
    if region is None:
        return key("nlist", _c(model_id), "")
    return key("nlist", _c(model_id), _c(region), "")


def node_list_key(node: ModelNode) -> bytes:
    return node_list_prefix(node.model_id, node.region) + node.pubkey.hex().encode()


def delisted_key(pubkey: bytes) -> bytes:
    return key("delist", pubkey.hex())


def listed_key(node: bytes) -> bytes:
    """The block time the node last came onto the list (State.listed_since)."""
    return key("lsince", node.hex())


def org_node_prefix(org_id: str) -> bytes:
    return key("orgnode", _c(org_id), "")


def org_node_key(org_id: str, node: bytes) -> bytes:
    return org_node_prefix(org_id) + node.hex().encode()


def org_reputation_key(org_id: str) -> bytes:
    """The least reputation of the organisation's nodes, kept as they change (State.org_reputation)."""
    return key("orgrep", _c(org_id))


def member_key(operator: bytes) -> bytes:
    return key("member", operator.hex())


MEMBER_PREFIX = key("member", "")


PROPOSAL_PREFIX = key("proposal", "")


def proposal_key(proposal_id: int) -> bytes:
    return PROPOSAL_PREFIX + f"{proposal_id:012d}".encode()


def _e(epoch: int) -> str:
    return f"{epoch:010d}"


def epoch_key(epoch: int) -> bytes:
    return key("epoch", _e(epoch))


def vrf_prefix(epoch: int) -> bytes:
    return key("vrf", _e(epoch), "")


def required_prefix(epoch: int) -> bytes:
    return key("preq", _e(epoch), "")


def required_key(epoch: int, node: bytes) -> bytes:
    return required_prefix(epoch) + node.hex().encode()


def required_count_key(epoch: int) -> bytes:
    return key("preqn", _e(epoch))


def plan_prefix(epoch: int) -> bytes:
    return key("plan", _e(epoch), "")


def plan_key(epoch: int, node: bytes) -> bytes:
    return plan_prefix(epoch) + node.hex().encode()


def commitment_key(epoch: int, commitment: bytes) -> bytes:
    return key("pcom", _e(epoch), commitment.hex())


def rechallenge_prefix(epoch: int, member: bytes) -> bytes:
    return key("rch", _e(epoch), member.hex(), "")


def rechallenge_key(epoch: int, member: bytes, tag: bytes) -> bytes:
    return rechallenge_prefix(epoch, member) + tag.hex().encode()


def rechallenge_count_key(epoch: int, member: bytes) -> bytes:
    return key("rchn", _e(epoch), member.hex())


def result_prefix(epoch: int, node: bytes | None = None) -> bytes:
    return key("res", _e(epoch), node.hex(), "") if node else key("res", _e(epoch), "")


def result_key(epoch: int, node: bytes, submitter: bytes) -> bytes:
    return result_prefix(epoch, node) + submitter.hex().encode()


def attestation_prefix(epoch: int) -> bytes:
    return key("att", _e(epoch), "")


def attestation_key(epoch: int, node: bytes, submitter: bytes) -> bytes:
    return attestation_prefix(epoch) + f"{node.hex()}/{submitter.hex()}".encode()


def report_prefix(epoch: int) -> bytes:
    return key("inv", _e(epoch), "")


def report_key(epoch: int, node: bytes) -> bytes:
    return report_prefix(epoch) + node.hex().encode()


def fault_prefix(operator: bytes | None = None) -> bytes:
    return key("fault", operator.hex(), "") if operator else key("fault", "")


def fault_epoch_prefix(operator: bytes, epoch: int) -> bytes:
    return fault_prefix(operator) + f"{_e(epoch)}/".encode()


def fault_key(operator: bytes, epoch: int, number: int) -> bytes:
    return fault_epoch_prefix(operator, epoch) + f"{number:04d}".encode()


def missed_key(epoch: int, operator: bytes) -> bytes:
    return key("miss", _e(epoch), operator.hex())


def fault_counter_key(operator: bytes) -> bytes:
    return key("next", "fault", operator.hex())


REPUTATION_PREFIX = key("rep", "")


def reputation_key(node: bytes) -> bytes:
    return REPUTATION_PREFIX + node.hex().encode()


def price_key(hardware: str) -> bytes:
    return key("price", _c(hardware))


CREDITS_PREFIX = key("credit", "")


def credits_key(org_id: str) -> bytes:
    return key("credit", _c(org_id))


DEPLOYMENT_PREFIX = key("deploy", "")
ASSIGNED_PREFIX = key("dnode", "")
DEPLOYMENT_EXPIRY_PREFIX = key("dexp", "")
NEXT_DEPLOYMENT_KEY = key("next", "deployment")


def deployment_key(deployment_id: int) -> bytes:
    return DEPLOYMENT_PREFIX + f"{deployment_id:012d}".encode()


def assigned_key(node: bytes) -> bytes:
    return ASSIGNED_PREFIX + node.hex().encode()


def deployment_expiry_key(expires_at: int, deployment_id: int) -> bytes:
    return DEPLOYMENT_EXPIRY_PREFIX + f"{expires_at:012d}/{deployment_id:012d}".encode()


NODE_PREFIX = key("node", "")
PARAMS_KEY = key("params")
UPGRADE_KEY = key("upgrade")
APP_VERSION_KEY = key("appversion")
PARAM_CHANGE_PREFIX = key("pchange", "")


def param_change_key(height: int) -> bytes:
    return PARAM_CHANGE_PREFIX + f"{height:012d}".encode()


NODE_ROTATION_PREFIX = key("nrot", "")
MEMBER_ROTATION_PREFIX = key("mrot", "")


def node_rotation_prefix(height: int) -> bytes:
    return NODE_ROTATION_PREFIX + f"{height:012d}/".encode()


def node_rotation_key(height: int, old: bytes) -> bytes:
    return node_rotation_prefix(height) + old.hex().encode()


def retired_key(pubkey: bytes) -> bytes:
    return key("rkey", pubkey.hex())


def member_rotation_prefix(height: int) -> bytes:
    return MEMBER_ROTATION_PREFIX + f"{height:012d}/".encode()


def member_rotation_key(height: int, operator: bytes) -> bytes:
    return member_rotation_prefix(height) + operator.hex().encode()


RETIRED_CONSENSUS_PREFIX = key("rcon", "")


def retired_consensus_key(consensus_key: bytes) -> bytes:
    return RETIRED_CONSENSUS_PREFIX + consensus_key.hex().encode()


NEXT_PROPOSAL_KEY = key("next", "proposal")


REGISTRY_PREFIXES = tuple(key(family, "") for family in (
    "acct", "org", "user", "ulist", "uexp", "model", "node", "nlist", "orgnode", "orgrep", "lsince", "rep",
    "price", "credit", "deploy", "dnode", "dexp", "rkey")) + (key("next", "deployment"),)
"""The families a new chain takes from another's export (`genesis init --from-export`): its accounts,
registry, reputations and credits; not its committee, proposals, epochs or counters of its heights."""


def last_key_bytes(k: bytes) -> bytes:
    """The bytes a key ends with, written as hex after its last '/' (the node of `plan/<e>/<node hex>`)."""
    return bytes.fromhex(k.rsplit(b"/", 1)[1].decode())


def decode_records(entries: list[tuple[bytes, bytes]], cls: type[R]) -> list[R]:
    return [cls.decode(v) for _, v in entries]
