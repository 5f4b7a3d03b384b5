"""Light-client verification: offline against captured CometBFT data and synthetic chains, and
against a real 5-node CometBFT network (kvstore app) behind a tampering HTTP proxy."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import time
from dataclasses import dataclass, replace
from typing import Any

import pytest
from chainnet import FAST_P2P
from nacl.signing import SigningKey
from tamper import TamperProxy

from planetserve.chain.lightclient import (
    FLAG_ABSENT,
    FLAG_COMMIT,
    BlockID,
    Commit,
    CommitSig,
    FreshnessError,
    Genesis,
    Header,
    LightBlock,
    LightClient,
    ProviderError,
    Timestamp,
    Validator,
    ValidatorSet,
    VerificationError,
    WitnessMismatch,
    address_of,
    merkle_root,
)
from planetserve.chain.rpc import RpcClient, hexb

# Captured from a 4-validator cometbft v0.38.26 kvstore network (genesis, /commit at heights 1
# and 2, /validators at 2): the exact bytes CometBFT hashed and signed.
GOLDEN = json.loads(
    """
{
"genesis":{
"genesis_time":"2026-01-02T03:04:05.123456789Z",
"chain_id":"golden-chain",
"initial_height":"1",
"validators":[
{
"pub_key":{
"type":"tendermint/PubKeyEd25519",
"value":"gu1UGFU0kT3/cBsfqX9Ug5wc3Za8DD10QKFkYmPmkSg="
},
"power":"10",
"name":"v0"
},
{
"pub_key":{
"type":"tendermint/PubKeyEd25519",
"value":"DldwDKSQqrsDHA0uu7LmOWtdf9/69Hd9QjtgWwdCdHU="
},
"power":"10",
"name":"v1"
},
{
"pub_key":{
"type":"tendermint/PubKeyEd25519",
"value":"iAhv+asvE3MT4xlx9sCSzcVv/YlglArDxxSe2+xi/5U="
},
"power":"10",
"name":"v2"
},
{
"pub_key":{
"type":"tendermint/PubKeyEd25519",
"value":"6lxOC4MeyBhrfag8/SN+YF0n2x7XSXjH/xXV0Xl/o8c="
},
"power":"10",
"name":"v3"
}
]
},
"commits":{
"1":{
"header":{
"version":{
"block":"11",
"app":"1"
},
"chain_id":"golden-chain",
"height":"1",
"time":"2026-01-02T03:04:05.123456789Z",
"last_block_id":{
"hash":"",
"parts":{
"total":0,
"hash":""
}
},
"last_commit_hash":"E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
"data_hash":"E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
"validators_hash":"3747C77506DE307791378E97D765DE2BFABECFEC98695E115308D6170C368B35",
"next_validators_hash":"3747C77506DE307791378E97D765DE2BFABECFEC98695E115308D6170C368B35",
"consensus_hash":"BAB5041D16246E2757DB17AF4B55FAAFBFD8660F7EB32871C99F91D0E58D5BF2",
"app_hash":"0000000000000000",
"last_results_hash":"E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
"evidence_hash":"E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
"proposer_address":"0009CD00DF6C1B4A705E0CB4F53C9758F650A03A"
},
"commit":{
"height":"1",
"round":0,
"block_id":{
"hash":"2B56CB7D9C654507686EA55CEF51E96ACD4226CAE648A832B936696C21148A95",
"parts":{
"total":1,
"hash":"1BC46C95837169758161144B042B89760FE5C306AECFDE335D4B6812D1CB0683"
}
},
"signatures":[
{
"block_id_flag":2,
"validator_address":"0009CD00DF6C1B4A705E0CB4F53C9758F650A03A",
"timestamp":"2026-11-21T11:39:20.722402466Z",
"signature":"Tpn+MnJpK7RgB22DflyIzATCUzQJNS+2BZdKa6PKBQHr5IRY/23pJ3s82J0HvvPjp57eNQutYltSzOzPgtO/Aw=="
},
{
"block_id_flag":2,
"validator_address":"6089DE1C1B11DD021267C9927D5C862C40F8C0E5",
"timestamp":"2026-11-21T11:39:20.696404315Z",
"signature":"YiTmCRnrxSLfTi2L57D7CAVZ8JPtGoGihsTKicPuTedA2+rIxIvZIkG90seTEs99bKl8EYB/4atvuKkUorRrAg=="
},
{
"block_id_flag":2,
"validator_address":"A636C5ABE72C3BF4ACA64B4951BE6C74A40A38F2",
"timestamp":"2026-11-21T11:39:20.62248815Z",
"signature":"h6zUWjd44+XHwhFBsVzY5AFopSH8IftQGtd8AlbYWWG1coyNF064wa+7Wzs1CoW2fTfGuyZbSnbaW2ebWln7Dw=="
},
{
"block_id_flag":2,
"validator_address":"C626AFC3E0D03350E30E7F0F4EFE203AA3C71C2F",
"timestamp":"2026-11-21T11:39:20.722767301Z",
"signature":"HaZIDBnlrKa95mBL/tQUfEDHHO7j1AI6YPcD6Y+Y/5N1FBD9PjTXoFJMaZcvUNJzG2cn0ep5KqBDAzDvZ4boBA=="
}
]
}
},
"2":{
"header":{
"version":{
"block":"11",
"app":"1"
},
"chain_id":"golden-chain",
"height":"2",
"time":"2026-11-21T11:39:20.696404315Z",
"last_block_id":{
"hash":"2B56CB7D9C654507686EA55CEF51E96ACD4226CAE648A832B936696C21148A95",
"parts":{
"total":1,
"hash":"1BC46C95837169758161144B042B89760FE5C306AECFDE335D4B6812D1CB0683"
}
},
"last_commit_hash":"57480A8075ED74D021B464119D2C2503AF2AF68306026AE68A7F0E23EF1ACD69",
"data_hash":"E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
"validators_hash":"3747C77506DE307791378E97D765DE2BFABECFEC98695E115308D6170C368B35",
"next_validators_hash":"3747C77506DE307791378E97D765DE2BFABECFEC98695E115308D6170C368B35",
"consensus_hash":"BAB5041D16246E2757DB17AF4B55FAAFBFD8660F7EB32871C99F91D0E58D5BF2",
"app_hash":"0000000000000000",
"last_results_hash":"E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
"evidence_hash":"E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
"proposer_address":"6089DE1C1B11DD021267C9927D5C862C40F8C0E5"
},
"commit":{
"height":"2",
"round":0,
"block_id":{
"hash":"73E9C10E7E67C221ACD1403C9D1FE23920DD4A17EB4FCDF67092F8A23F3D8B8D",
"parts":{
"total":1,
"hash":"3B2938D4D6DFE2964BBEEEF7CD4A7F851E860102E24DEE40F7DB04E6AA0F1FBF"
}
},
"signatures":[
{
"block_id_flag":2,
"validator_address":"0009CD00DF6C1B4A705E0CB4F53C9758F650A03A",
"timestamp":"2026-11-21T11:39:21.530706432Z",
"signature":"jx0jML0e1I5UnO3m4ytOH7wwDqLfoUk97dw0MhD3rIPF2rk2f+GVYVBjFMuBbmS7Cr9YwX5PcwZmMV7Up0VhDw=="
},
{
"block_id_flag":2,
"validator_address":"6089DE1C1B11DD021267C9927D5C862C40F8C0E5",
"timestamp":"2026-11-21T11:39:21.531110595Z",
"signature":"dk7bqSZG0kCOASejYk7qFThB+1cwOPNqm/wVmiieQXnnWOjVyOfnrh1eGYdYtS6My601MfNhmXOAgeup+0xBCA=="
},
{
"block_id_flag":2,
"validator_address":"A636C5ABE72C3BF4ACA64B4951BE6C74A40A38F2",
"timestamp":"2026-11-21T11:39:21.530597399Z",
"signature":"uy90tlMJd69kvSiS5O9psbehD+VwbpuViLhTqzSI5eE6ntloRfQWvvwj6S7RNSOPeVQgeCRztqPFRDD76tDLDA=="
},
{
"block_id_flag":2,
"validator_address":"C626AFC3E0D03350E30E7F0F4EFE203AA3C71C2F",
"timestamp":"2026-11-21T11:39:21.531079518Z",
"signature":"ADPgmTmcs0Yn8lxyfkvXd2S7rqfl0hawT3k6xWAHh+TI9z5LPxsNwQx26kzkkbQe950uafjCMH9We4bLqkOsBg=="
}
]
}
}
},
"validators":{
"2":[
{
"address":"0009CD00DF6C1B4A705E0CB4F53C9758F650A03A",
"pub_key":{
"type":"tendermint/PubKeyEd25519",
"value":"iAhv+asvE3MT4xlx9sCSzcVv/YlglArDxxSe2+xi/5U="
},
"voting_power":"10"
},
{
"address":"6089DE1C1B11DD021267C9927D5C862C40F8C0E5",
"pub_key":{
"type":"tendermint/PubKeyEd25519",
"value":"6lxOC4MeyBhrfag8/SN+YF0n2x7XSXjH/xXV0Xl/o8c="
},
"voting_power":"10"
},
{
"address":"A636C5ABE72C3BF4ACA64B4951BE6C74A40A38F2",
"pub_key":{
"type":"tendermint/PubKeyEd25519",
"value":"gu1UGFU0kT3/cBsfqX9Ug5wc3Za8DD10QKFkYmPmkSg="
},
"voting_power":"10"
},
{
"address":"C626AFC3E0D03350E30E7F0F4EFE203AA3C71C2F",
"pub_key":{
"type":"tendermint/PubKeyEd25519",
"value":"DldwDKSQqrsDHA0uu7LmOWtdf9/69Hd9QjtgWwdCdHU="
},
"voting_power":"10"
}
]
}
}"""  # noqa: E501
)


# --- offline: captured CometBFT data ------------------------------------------------------------


class DictRpc:
    """Serves light blocks from dicts, with the RpcClient methods the light client uses."""

    def __init__(self, commits: dict[int, Any], validators: dict[int, Any], latest: int) -> None:
        self.commits, self.vals, self.latest = commits, validators, latest
        self.calls: list[tuple[str, int]] = []

    def commit(self, height: int) -> dict[str, Any]:
        self.calls.append(("commit", height))
        return copy.deepcopy(self.commits[height])

    def validators(self, height: int) -> tuple[int, list[dict[str, Any]]]:
        self.calls.append(("validators", height))
        return height, copy.deepcopy(self.vals[height])

    def latest_height(self) -> int:
        return self.latest


def golden_rpc() -> DictRpc:
    return DictRpc(
        {int(h): c for h, c in GOLDEN["commits"].items()},
        {int(h): v for h, v in GOLDEN["validators"].items()},
        latest=2,
    )


def test_merkle_root_follows_rfc6962_with_cometbft_split() -> None:
    def sha(b: bytes) -> bytes:
        return hashlib.sha256(b).digest()

    def leaf(x: bytes) -> bytes:
        return sha(b"\x00" + x)

    def node(a: bytes, b: bytes) -> bytes:
        return sha(b"\x01" + a + b)

    a, b, c, d, e = (bytes([i]) for i in range(5))
    assert merkle_root([]) == sha(b"")
    assert merkle_root([a]) == leaf(a)
    assert merkle_root([a, b, c]) == node(node(leaf(a), leaf(b)), leaf(c))
    four = node(node(leaf(a), leaf(b)), node(leaf(c), leaf(d)))
    assert merkle_root([a, b, c, d, e]) == node(four, leaf(e))


def test_timestamps_parse_exactly() -> None:
    t = Timestamp.parse("2026-01-02T03:04:05.123456789Z")
    assert t.nanos == 123456789 and str(t) == "2026-01-02T03:04:05.123456789Z"
    assert Timestamp.parse("2026-01-02T03:04:05Z").nanos == 0
    assert Timestamp.parse("2026-01-02T05:04:05.5+02:00") == Timestamp(t.seconds, 500_000_000)
    assert Timestamp.parse("0001-01-01T00:00:00Z").seconds == -62135596800
    for bad in ("2026-01-02 03:04:05Z", "2026-13-02T03:04:05Z", 5, "2026-01-02T03:04:05.1234567891Z"):
        with pytest.raises(VerificationError, match="malformed time"):
            Timestamp.parse(bad)


def test_golden_hashes_match_cometbft() -> None:
    genesis = Genesis.from_json(GOLDEN["genesis"])
    for h, sh in GOLDEN["commits"].items():
        header = Header.from_json(sh["header"])
        assert header.hash.hex().upper() == sh["commit"]["block_id"]["hash"], h
    header1 = Header.from_json(GOLDEN["commits"]["1"]["header"])
    header2 = Header.from_json(GOLDEN["commits"]["2"]["header"])
    assert genesis.validators.hash == header1.validators_hash
    assert ValidatorSet.from_json(GOLDEN["validators"]["2"]).hash == header2.validators_hash
    assert header1.time == genesis.genesis_time  # nanosecond genesis time survives the round trip
    assert Header.from_json(header2.to_json()).hash == header2.hash


def test_golden_commit_signatures_verify() -> None:
    lc = LightClient(GOLDEN["genesis"], golden_rpc())  # type: ignore[arg-type]
    header = lc.verified_header(2)
    assert lc.last_trace == [1, 2]
    assert header.height == 2 and lc.trusted_heights() == [1, 2]
    lc.verified_header(2)
    assert lc.last_trace == []  # already trusted


def test_golden_tampered_signature_refused() -> None:
    rpc = golden_rpc()
    sig = rpc.commits[1]["commit"]["signatures"][0]
    raw = bytearray(base64.b64decode(sig["signature"]))
    raw[10] ^= 1
    sig["signature"] = base64.b64encode(bytes(raw)).decode()
    lc = LightClient(GOLDEN["genesis"], rpc)  # type: ignore[arg-type]
    with pytest.raises(VerificationError, match="commit signature invalid for validator " + sig[
        "validator_address"
    ]):
        lc.verified_header(1)


def test_genesis_without_validators_is_no_trust_root() -> None:
    doc = dict(GOLDEN["genesis"], validators=[])
    with pytest.raises(VerificationError, match="no validators"):
        Genesis.from_json(doc)


# --- offline: synthetic chains signed with our own keys -----------------------------------------


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def make_keys(n: int, tag: str) -> list[SigningKey]:
    return [SigningKey(_sha(f"{tag}-{i}".encode())) for i in range(n)]


class FakeChain:
    """A chain whose validator set at height h is sets[h-1]; the last entry is only announced."""

    def __init__(
        self, sets: list[list[tuple[SigningKey, int]]], *, chain_id: str = "fake", t0: int = 0
    ) -> None:
        self.chain_id = chain_id
        self.t0 = t0 or int(time.time()) - 3600
        self.keys: dict[bytes, SigningKey] = {}
        self.vs: dict[int, ValidatorSet] = {}
        for h, members in enumerate(sets, start=1):
            vals = []
            for sk, power in members:
                pk = bytes(sk.verify_key)
                self.keys[address_of(pk)] = sk
                vals.append(Validator(address_of(pk), pk, power))
            self.vs[h] = ValidatorSet(vals)
        self.top = len(sets) - 1
        self.headers: dict[int, Header] = {}
        self.commits: dict[int, Commit] = {}
        prev = BlockID(b"", 0, b"")
        for h in range(1, self.top + 1):
            self.headers[h] = Header(
                version_block=11, version_app=1, chain_id=chain_id, height=h,
                time=Timestamp(self.t0 + h, 0), last_block_id=prev,
                last_commit_hash=_sha(b"lc"), data_hash=_sha(b""),
                validators_hash=self.vs[h].hash, next_validators_hash=self.vs[h + 1].hash,
                consensus_hash=_sha(b"params"), app_hash=_sha(f"app-{h}".encode()),
                last_results_hash=_sha(b""), evidence_hash=_sha(b""),
                proposer_address=self.vs[h].validators[0].address,
            )  # fmt: skip
            self.sign(h)
            prev = self.commits[h].block_id

    def sign(self, h: int, signers: set[int] | None = None) -> None:
        """(Re)sign header h by the validators at the given indices (default all)."""
        vs, header = self.vs[h], self.headers[h]
        sigs = [
            CommitSig(FLAG_COMMIT, v.address, Timestamp(self.t0 + h, 500 + i), b"")
            if signers is None or i in signers
            else CommitSig(FLAG_ABSENT, b"", Timestamp(-62135596800, 0), b"")
            for i, v in enumerate(vs.validators)
        ]
        commit = Commit(h, 0, BlockID(header.hash, 1, _sha(f"parts-{h}".encode())), tuple(sigs))
        signed = tuple(
            replace(s, signature=self.keys[s.validator_address].sign(
                commit.vote_sign_bytes(self.chain_id, i)).signature)
            if s.flag == FLAG_COMMIT else s
            for i, s in enumerate(sigs)
        )  # fmt: skip
        self.commits[h] = replace(commit, signatures=signed)

    def genesis(self) -> dict[str, Any]:
        return {
            "chain_id": self.chain_id,
            "genesis_time": str(Timestamp(self.t0 + 1, 0)),
            "initial_height": "1",
            "validators": [
                {
                    "pub_key": {
                        "type": "tendermint/PubKeyEd25519",
                        "value": base64.b64encode(v.pub_key).decode(),
                    },
                    "power": str(v.power),
                }
                for v in self.vs[1].validators
            ],
        }

    def rpc(self) -> DictRpc:
        commits, vals = {}, {}
        for h in range(1, self.top + 1):
            lb = LightBlock(self.headers[h], self.commits[h], self.vs[h]).to_json()
            commits[h] = {"header": lb["header"], "commit": lb["commit"]}
            vals[h] = lb["validators"]
        return DictRpc(commits, vals, latest=self.top)

    def client(self, **kw: Any) -> LightClient:
        return LightClient(self.genesis(), self.rpc(), **kw)  # type: ignore[arg-type]


def uniform(keys: list[SigningKey], power: int = 10) -> list[tuple[SigningKey, int]]:
    return [(k, power) for k in keys]


def test_synthetic_sequential_and_skipping_agree() -> None:
    chain = FakeChain([uniform(make_keys(4, "a"))] * 8)
    seq = chain.client(sequential=True)
    assert seq.verified_header(7).hash == chain.headers[7].hash
    assert seq.last_trace == [1, 2, 3, 4, 5, 6, 7]
    skip = chain.client()
    assert skip.verified_header(7).hash == chain.headers[7].hash
    assert skip.last_trace == [1, 7]


def test_synthetic_skipping_bisects_through_disjoint_sets() -> None:
    a, b, c, d, e, f, g, h = make_keys(8, "bisect")
    sets = [uniform([a, b, c, d])] * 4 + [uniform([c, d, e, f])] * 4 + [uniform([e, f, g, h])] * 5
    chain = FakeChain(sets)
    lc = chain.client()
    assert lc.verified_header(12).hash == chain.headers[12].hash
    assert lc.last_trace == [1, 6, 12]  # 1 -> 12 lacks 1/3 of the genesis set: pivot at 6
    assert chain.client(sequential=True).verified_header(12).hash == chain.headers[12].hash


def test_synthetic_unannounced_set_change_refused_sequentially() -> None:
    keys = make_keys(4, "adj")
    chain = FakeChain([uniform(keys)] * 6)
    chain.headers[2] = replace(chain.headers[2], next_validators_hash=_sha(b"someone else"))
    chain.sign(2)
    with pytest.raises(VerificationError, match="next validators hash mismatch"):
        chain.client(sequential=True).verified_header(4)


def test_synthetic_insufficient_power_and_unknown_signer() -> None:
    chain = FakeChain([uniform(make_keys(4, "pow"))] * 5)
    chain.sign(3, signers={0, 1})
    with pytest.raises(VerificationError, match="insufficient voting power: 20/40"):
        chain.client(sequential=True).verified_header(3)
    chain = FakeChain([uniform(make_keys(4, "unk"))] * 5)
    sigs = list(chain.commits[3].signatures)
    sigs[2] = replace(sigs[2], validator_address=b"\x01" * 20)
    chain.commits[3] = replace(chain.commits[3], signatures=tuple(sigs))
    with pytest.raises(VerificationError, match="unknown validator 0101"):
        chain.client(sequential=True).verified_header(3)


def test_synthetic_duplicate_signature_refused_when_skipping() -> None:
    chain = FakeChain([uniform(make_keys(4, "dup"))] * 6)
    sigs = list(chain.commits[4].signatures)
    sigs[1] = sigs[0]
    chain.commits[4] = replace(chain.commits[4], signatures=tuple(sigs))
    with pytest.raises(VerificationError, match="duplicate signature from validator"):
        chain.client().verified_header(4)


def test_synthetic_header_times_are_checked() -> None:
    chain = FakeChain([uniform(make_keys(4, "future"))] * 4, t0=int(time.time()) + 3600)
    with pytest.raises(FreshnessError, match="in the future: 36\\d\\d s ahead of the local clock"):
        chain.client().verified_header(3)
    chain = FakeChain([uniform(make_keys(4, "past"))] * 4)
    chain.headers[3] = replace(chain.headers[3], time=Timestamp(chain.t0 + 1, 0))
    chain.sign(3)
    with pytest.raises(VerificationError, match="not after trusted header time"):
        chain.client().verified_header(3)


def test_synthetic_latest_header_must_be_fresh() -> None:
    """The synthetic chain's blocks are an hour old: its latest header is refused as a view, with the
    height, time and age named; the same header asked for by height (history) is not."""
    chain = FakeChain([uniform(make_keys(4, "stale"))] * 6)
    lc = chain.client()
    with pytest.raises(FreshnessError, match=r"header 5 has time \S+Z, 3\d\d\d s old, older than max_age "
                                             r"300 s: a stale view") as refused:
        lc.verified_header()
    assert refused.value.height == 5 and refused.value.time == chain.headers[5].time
    assert 3590 < refused.value.age < 3700
    assert isinstance(refused.value, ProviderError)  # what the clients already retry on
    assert lc.verified_header(5).hash == chain.headers[5].hash
    assert chain.client(max_age=None).verified_header().height == 5
    assert chain.client(max_age=4000).verified_header().height == 5
    with pytest.raises(ValueError, match="max_age must be a positive number of seconds"):
        chain.client(max_age=0)


def test_synthetic_genesis_set_must_match_initial_header() -> None:
    chain = FakeChain([uniform(make_keys(4, "gen"))] * 4)
    other = FakeChain([uniform(make_keys(4, "other"))] * 4)
    lc = LightClient(other.genesis(), chain.rpc())  # type: ignore[arg-type]
    with pytest.raises(VerificationError, match="validators hash mismatch at the initial height"):
        lc.verified_header(2)


def test_trusted_store_persists_and_is_bound_to_its_genesis(tmp_path) -> None:
    chain = FakeChain([uniform(make_keys(4, "store"))] * 10)
    path = tmp_path / "trust.json"
    lc = chain.client(store_path=path)
    lc.verified_header(4)
    assert path.exists()
    rpc = chain.rpc()
    again = LightClient(chain.genesis(), rpc, store_path=path)  # type: ignore[arg-type]
    assert again.trusted_heights() == [1, 4]
    again.verified_header(8)
    assert again.last_trace == [8]
    assert ("commit", 1) not in rpc.calls  # started from the stored header, not from genesis
    other = FakeChain([uniform(make_keys(4, "elsewhere"))] * 3)
    with pytest.raises(VerificationError, match="another genesis"):
        LightClient(other.genesis(), other.rpc(), store_path=path)  # type: ignore[arg-type]


def test_trust_level_bounds() -> None:
    chain = FakeChain([uniform(make_keys(1, "tl"))] * 2)
    with pytest.raises(ValueError, match=r"trust level must be within \[1/3, 1\]"):
        chain.client(trust_level=(1, 4))


# --- against a real CometBFT network ------------------------------------------------------------



@dataclass
class Net:
    spec: Any
    cluster: Any
    kv_height: int  # block holding the tx planet=serve
    s2_from: int  # first height with the 5th validator
    s3_from: int  # first height of {C 10, D 10, E 30}
    s4_from: int  # first height of {D 10, E 30}: genesis validators hold only 1/4 of it
    top: int

    @property
    def rpc(self) -> RpcClient:
        return self.cluster.rpc(0)

    def client(self, rpc: RpcClient | None = None, **kw: Any) -> LightClient:
        return LightClient.from_genesis_file(self.spec.genesis_path, rpc or self.rpc, **kw)


def _val_tx(pub_key: bytes, power: int) -> bytes:
    return f"val=ed25519!{base64.b64encode(pub_key).decode()}!{power}".encode()


def _commit_tx(rpc: RpcClient, tx: bytes) -> int:
    res = rpc.broadcast_tx_commit(tx)
    assert res.ok, (res.check_tx, res.tx_result)
    return res.height


def _wait_signing(rpc: RpcClient, address: bytes, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sigs = rpc.commit()["commit"]["signatures"]
        if any(s["validator_address"] == address.hex().upper() for s in sigs):
            return
        time.sleep(0.1)
    raise TimeoutError(f"validator {address.hex()} never signed")


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    from planetserve.genesis.network import build_network
    from planetserve.localnet.cluster import Cluster

    root = tmp_path_factory.mktemp("lightnet")
    spec = build_network(root, 5, "lc-test", None, n_genesis=4, timeout_commit="300ms",
                         extra_config=FAST_P2P)
    cluster = Cluster(spec)
    try:
        cluster.start()
        cluster.wait_for_height(2, timeout=60)
        rpc = cluster.rpc(0)
        a, b, c, _d, e = spec.validators
        kv_height = _commit_tx(rpc, b"planet=serve")
        s2_from = _commit_tx(rpc, _val_tx(e.pub_key, 10)) + 2
        cluster.wait_for_height(s2_from)
        _wait_signing(rpc, e.address)
        s3_from = 2 + max(
            _commit_tx(rpc, _val_tx(a.pub_key, 0)),
            _commit_tx(rpc, _val_tx(b.pub_key, 0)),
            _commit_tx(rpc, _val_tx(e.pub_key, 30)),
        )
        cluster.wait_for_height(s3_from)
        s4_from = _commit_tx(rpc, _val_tx(c.pub_key, 0)) + 2
        top = s4_from + 2
        cluster.wait_for_height(top, timeout=60)
        assert len(rpc.validators(s2_from)[1]) == 5
        assert len(rpc.validators(s4_from)[1]) == 2
        yield Net(spec, cluster, kv_height, s2_from, s3_from, s4_from, top)
    finally:
        cluster.close()


@pytest.mark.network
def test_headers_verify_and_hash_like_cometbft(net: Net) -> None:
    lc = net.client()
    for h in (1, 2, net.kv_height, net.s2_from - 1):
        header = lc.verified_header(h)
        block = net.rpc.block(h)
        assert header.hash.hex().upper() == block["block_id"]["hash"]
        assert Header.from_json(block["block"]["header"]).hash == header.hash
        assert header.height == h and header.chain_id == "lc-test"


@pytest.mark.network
def test_verified_app_hash_is_from_the_next_header(net: Net) -> None:
    lc = net.client()
    app_hash = lc.verified_app_hash(net.kv_height)
    assert set(net.cluster.app_hashes(net.kv_height).values()) == {app_hash}
    assert lc.verified_header(net.kv_height + 1).app_hash == app_hash
    assert lc.verified_app_hash(net.kv_height - 1) != app_hash  # the tx changed the state
    latest = net.rpc.latest_height()  # its app hash is only known once block latest+1 is in
    assert lc.verified_app_hash(latest, wait=10) == hexb(net.rpc.header(latest + 1)["app_hash"])


@pytest.mark.network
def test_skipping_bisects_across_validator_set_changes(net: Net) -> None:
    lc = net.client()
    header = lc.verified_header(net.top)
    assert header.validators_hash == ValidatorSet.from_json(net.rpc.validators(net.top)[1]).hash
    trace = lc.last_trace
    assert trace[0] == 1 and trace[-1] == net.top
    assert 2 < len(trace) < net.top  # the genesis set alone cannot vouch for the final set
    # within the 5-validator set, the genesis validators still hold > 1/3: one skip suffices
    fresh = net.client()
    fresh.verified_header(net.s3_from - 1)
    assert fresh.last_trace == [1, net.s3_from - 1]


@pytest.mark.network
def test_sequential_follows_every_validator_set_change(net: Net) -> None:
    lc = net.client(rpc=net.cluster.rpc(3), sequential=True)
    header = lc.verified_header(net.top)
    assert lc.last_trace == list(range(1, net.top + 1))
    assert header.hash == net.client().verified_header(net.top).hash


@pytest.mark.network
def test_trusted_store_resumes_from_latest_trusted(net: Net, tmp_path) -> None:
    path = tmp_path / "trusted.json"
    net.client(store_path=path).verified_header(net.s3_from)
    again = net.client(store_path=path)
    assert max(again.trusted_heights()) == net.s3_from
    again.verified_header(net.top)
    assert again.last_trace[0] != 1 and again.last_trace[-1] == net.top


@pytest.mark.network
def test_unreachable_endpoint_is_a_provider_error(net: Net) -> None:
    from planetserve.genesis.network import free_ports

    dead = RpcClient(f"http://127.0.0.1:{free_ports(1)[0]}", timeout=0.5)
    with pytest.raises(ProviderError, match="unreachable"):
        net.client(rpc=dead).verified_header(2)


# --- a lying endpoint: a real HTTP forwarder that rewrites the JSON answers ---------------------

@pytest.fixture(scope="module")
def proxy(net: Net):
    p = TamperProxy(net.spec.validators[1].rpc_url)
    yield p
    p.close()


def _signed_header(answer: dict[str, Any]) -> dict[str, Any]:
    return answer["result"]["signed_header"]


def flip_signature(method: str, params: dict[str, Any], answer: dict[str, Any]) -> None:
    if method == "commit":
        sig = next(s for s in _signed_header(answer)["commit"]["signatures"]
                   if s["block_id_flag"] == FLAG_COMMIT)  # fmt: skip
        raw = bytearray(base64.b64decode(sig["signature"]))
        raw[0] ^= 0x80
        sig["signature"] = base64.b64encode(bytes(raw)).decode()


def swap_pubkey(method: str, params: dict[str, Any], answer: dict[str, Any]) -> None:
    if method == "validators":
        pk = bytes(SigningKey(_sha(b"intruder")).verify_key)
        val = answer["result"]["validators"][0]
        val["pub_key"]["value"] = base64.b64encode(pk).decode()
        val["address"] = address_of(pk).hex().upper()


def change_power(method: str, params: dict[str, Any], answer: dict[str, Any]) -> None:
    if method == "validators":
        val = answer["result"]["validators"][0]
        val["voting_power"] = str(int(val["voting_power"]) + 1)


def duplicate_validator(method: str, params: dict[str, Any], answer: dict[str, Any]) -> None:
    if method == "validators":
        vals = answer["result"]["validators"]
        vals[1] = copy.deepcopy(vals[0])


def change_app_hash(method: str, params: dict[str, Any], answer: dict[str, Any]) -> None:
    if method == "commit":
        _signed_header(answer)["header"]["app_hash"] = "AB" * 32


def forge_block_id(method: str, params: dict[str, Any], answer: dict[str, Any]) -> None:
    """A forged header whose commit points at it: only the signatures can tell."""
    if method == "commit":
        sh = _signed_header(answer)
        sh["header"]["app_hash"] = "AB" * 32
        sh["commit"]["block_id"]["hash"] = Header.from_json(sh["header"]).hash.hex().upper()


def change_chain_id(method: str, params: dict[str, Any], answer: dict[str, Any]) -> None:
    if method == "commit":
        _signed_header(answer)["header"]["chain_id"] = "evil-chain"


def drop_signatures(method: str, params: dict[str, Any], answer: dict[str, Any]) -> None:
    if method == "commit":
        sigs = _signed_header(answer)["commit"]["signatures"]
        for s in sigs[:2]:
            s.update(block_id_flag=FLAG_ABSENT, validator_address="", signature=None,
                     timestamp="0001-01-01T00:00:00Z")  # fmt: skip


def error_object(method: str, params: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": answer.get("id"), "error": {"code": -32603, "message": "no"}}


def garbage(method: str, params: dict[str, Any], answer: dict[str, Any]) -> bytes:
    return b"<html>not json</html>"


def deeply_nested(method: str, params: dict[str, Any], answer: dict[str, Any]) -> bytes:
    """A few KB of brackets: Python's JSON decoder recurses once per level."""
    return b"[" * 5_000 + b"]" * 5_000


@pytest.mark.network
@pytest.mark.parametrize(
    ("rewrite", "error", "message"),
    [
        (flip_signature, VerificationError, r"commit signature invalid for validator [0-9A-F]{40}"),
        (swap_pubkey, VerificationError, "validators hash mismatch at height 3"),
        (change_power, VerificationError, "validators hash mismatch at height 3"),
        (duplicate_validator, VerificationError, "duplicate validator"),
        (change_app_hash, VerificationError, "header hash mismatch"),
        (forge_block_id, VerificationError, "commit signature invalid for validator"),
        (change_chain_id, VerificationError, "chain id mismatch"),
        (drop_signatures, VerificationError, r"insufficient voting power: \d+/40"),
        (error_object, ProviderError, "JSON-RPC error -32603"),
        (garbage, ProviderError, "not JSON"),
        (deeply_nested, ProviderError, "nests too deeply"),
    ],
    ids=lambda x: getattr(x, "__name__", None),
)
def test_lying_endpoint_is_refused(net: Net, proxy: TamperProxy, rewrite, error, message) -> None:
    honest = net.client(rpc=RpcClient(proxy.url))
    proxy.rewrite = None
    assert honest.verified_header(3).hash == net.client().verified_header(3).hash
    proxy.rewrite = rewrite
    try:
        with pytest.raises(error, match=message):
            net.client(rpc=RpcClient(proxy.url)).verified_header(3)
    finally:
        proxy.rewrite = None


@pytest.mark.network
def test_lying_about_a_changed_set_is_refused(net: Net, proxy: TamperProxy) -> None:
    """After the set changed, serving the older (genesis) set for a later height fails."""
    stale = net.rpc.validators(2)[1]

    def old_set(method: str, params: dict[str, Any], answer: dict[str, Any]) -> None:
        if method == "validators" and int(params["height"]) >= net.s4_from:
            answer["result"]["validators"] = copy.deepcopy(stale)
            answer["result"]["count"] = answer["result"]["total"] = str(len(stale))

    proxy.rewrite = old_set
    try:
        with pytest.raises(VerificationError, match="validators hash mismatch"):
            net.client(rpc=RpcClient(proxy.url)).verified_header(net.top)
    finally:
        proxy.rewrite = None


# --- a stale endpoint, clocks, and a witness ------------------------------------------------------


def frozen_at(height: int):
    """An endpoint stuck at `height`: it says that is its latest block and serves the (validly signed)
    headers and state of that height, as one replaying old answers or left behind does."""

    def rewrite(method: str, params: dict[str, Any], answer: dict[str, Any]) -> None:
        if method == "status" and "result" in answer:
            answer["result"]["sync_info"]["latest_block_height"] = str(height)

    return rewrite


def _age(rpc: RpcClient, height: int) -> float:
    t = Header.from_json(rpc.commit(height)["header"]).time
    return time.time() - (t.seconds + t.nanos / 1e9)


@pytest.mark.network
def test_an_endpoint_serving_an_old_signed_header_is_refused(net: Net, proxy: TamperProxy) -> None:
    max_age = 5.0
    assert net.client(max_age=max_age).verified_header().height > 3  # the honest endpoint is fresh
    while _age(net.rpc, 3) <= 2 * max_age:
        time.sleep(0.5)
    proxy.rewrite = frozen_at(3)
    try:
        assert net.client(rpc=RpcClient(proxy.url), max_age=None).verified_header().height == 3  # signed
        lc = net.client(rpc=RpcClient(proxy.url), max_age=max_age)
        with pytest.raises(FreshnessError, match=rf"header 3 from {proxy.url} has time \S+Z, \d+ s old, "
                                                 r"older than max_age 5 s: a stale view") as refused:
            lc.verified_header()
        assert refused.value.height == 3 and refused.value.age > 2 * max_age
        assert lc.verified_header(3).height == 3  # history by height stays readable
    finally:
        proxy.rewrite = None


@pytest.mark.network
def test_a_header_too_far_from_the_local_clock_is_refused(net: Net) -> None:
    offset = 0.0
    lc = net.client(clock=lambda: time.time() + offset)
    seen = lc.verified_header().height
    offset = -60.0  # this machine's clock a minute behind the validators'
    with pytest.raises(FreshnessError, match=r"\d+ s ahead of the local clock") as ahead:
        lc.verified_header()
    assert ahead.value.age < -40
    offset = 3600.0  # an hour ahead: every header the endpoint has is an hour old
    net.cluster.wait_for_height(seen + 1)
    with pytest.raises(FreshnessError, match=r"s old, older than max_age 300 s") as behind:
        lc.verified_header()
    assert behind.value.height > seen and behind.value.age > 3500


@pytest.mark.network
def test_an_agreeing_witness_passes(net: Net) -> None:
    lc = net.client(witness=net.cluster.rpc(2))
    header = lc.verified_header()
    assert header.hash == net.client().verified_header(header.height).hash
    assert lc.verified_header(net.kv_height).hash == net.client().verified_header(net.kv_height).hash


@pytest.mark.network
def test_a_disagreeing_witness_is_refused(net: Net, proxy: TamperProxy) -> None:
    proxy.rewrite = change_app_hash  # the witness serves another header at every height
    try:
        lc = net.client(witness=RpcClient(proxy.url))
        with pytest.raises(WitnessMismatch, match=rf"witness {proxy.url} disagrees with primary "
                                                  rf"{net.rpc.url} at height 5: the header verified from "
                                                  r"the primary hashes to [0-9A-F]{64}, the witness's to "
                                                  r"[0-9A-F]{64} \(a fork"):
            lc.verified_header(5)
        assert lc.trusted_heights() == [1]  # a disputed header, and those on the way to it, anchor nothing
        with pytest.raises(WitnessMismatch):
            lc.verified_header()
        earlier = net.client()
        earlier.verified_header(6)  # trusted before any witness was asked
        earlier.witness = RpcClient(proxy.url)
        with pytest.raises(WitnessMismatch, match="at height 6"):
            earlier.verified_header(6)
        assert 6 not in earlier.trusted_heights()
    finally:
        proxy.rewrite = None
    from planetserve.genesis.network import free_ports

    dead = RpcClient(f"http://127.0.0.1:{free_ports(1)[0]}", timeout=0.5)
    with pytest.raises(ProviderError, match=r"witness http://127.0.0.1:\d+ gave no usable header \d+: .*unreachable"):
        net.client(witness=dead).verified_header()


@pytest.mark.parametrize(("path", "value"), [
    (("version", "app"), "-1"),
    (("height",), "9223372036854775808"),
    (("height",), "\u0663"),
    (("height",), "--1"),
], ids=["app version -1", "height 2^63", "an Arabic-Indic digit", "--1"])
def test_a_lying_endpoints_fields_are_a_verification_error_whatever_they_hold(path, value) -> None:
    """A header field no encoder takes (an app version of -1, a height of 2^63) raised a ValueError from
    the header's hash, and digits other than ASCII passed as numbers: past the callers' handlers, which
    ended a relay's directory and a model node's group refreshes for good. Each is a VerificationError."""
    chain = FakeChain([uniform(make_keys(4, "lies"))] * 6)
    rpc = chain.rpc()
    field = rpc.commits[4]["header"]
    for name in path[:-1]:
        field = field[name]
    field[path[-1]] = value
    with pytest.raises(VerificationError):
        LightClient(chain.genesis(), rpc, max_age=None).verified_header(4)  # type: ignore[arg-type]
