"""The pure registry domain: records, parameters, genesis app_state, field rules."""

from __future__ import annotations

import pytest

from planetserve.registry import codec, fields, rules
from planetserve.registry.entities import Member, ModelNode, Proposal, User
from planetserve.registry.errors import AlreadyExists, InvalidField
from planetserve.registry.genesis import GenesisOrganisation, parse_app_state
from planetserve.registry.params import Params

NODE = ModelNode(b"\x01" * 32, "org", "gt", "10.0.0.1:7000", "A100", 4, "eu", "active", 5)


def test_records_round_trip_as_field_arrays():
    raw = NODE.encode()
    assert codec.unpack(raw)[:3] == [b"\x01" * 32, "org", "gt"]
    assert ModelNode.decode(raw) == NODE
    proposal = Proposal(1, "add", Member(b"a" * 32, b"b" * 32, b"c" * 32, b"d" * 32, "x", 1).to_record(),
                        b"p" * 32, (b"p" * 32,), (), 3, 9)
    assert Proposal.decode(proposal.encode()) == proposal


@pytest.mark.parametrize("raw", [codec.pack([1, 2]), codec.pack({"pubkey": b""}), codec.pack(None)])
def test_records_of_another_shape_are_refused(raw):
    with pytest.raises(codec.CodecError, match="not a User record"):
        User.decode(raw)


@pytest.mark.parametrize(
    ("value", "words"),
    [(1.5, "no floats"), ({1: "x"}, "map keys"), (2**64, "out of range"), ([[[[[[[[[[1]]]]]]]]]], "too deep")],
)
def test_codec_refuses_what_is_not_canonical_data(value, words):
    with pytest.raises(codec.CodecError, match=words):
        codec.pack(value)


def test_codec_refuses_unsorted_maps():
    import msgpack

    unsorted = msgpack.packb({"b": 1, "a": 2})
    with pytest.raises(codec.CodecError, match="canonical"):
        codec.unpack(unsorted)
    assert codec.unpack(codec.pack({"b": 1, "a": 2})) == {"a": 2, "b": 1}


def test_params_from_genesis():
    assert Params.from_genesis({"user_ttl_seconds": 5}).user_ttl_seconds == 5
    with pytest.raises(InvalidField, match="unknown parameter"):
        Params.from_genesis({"nope": 1})
    with pytest.raises(InvalidField, match="positive integer"):
        Params.from_genesis({"max_tx_bytes": 0})
    with pytest.raises(InvalidField, match="positive integer"):
        Params.from_genesis({"max_tx_bytes": True})
    assert Params().probation_epochs == 3  # the chain's default: trust is earned
    assert Params.from_genesis({"probation_epochs": 0}).probation_epochs == 0  # listed from registration
    with pytest.raises(InvalidField, match="'probation_epochs': must be a non-negative integer"):
        Params.from_genesis({"probation_epochs": -1})
    assert Params.from_genesis({"min_deployment_seconds": 10}).min_deployment_seconds == 10
    with pytest.raises(InvalidField, match="'min_deployment_seconds': must be at most max_deployment_seconds"):
        Params.from_genesis({"min_deployment_seconds": 100, "max_deployment_seconds": 99})


def member_json(i: int) -> dict:
    return {"operator": f"{i:02x}" * 32, "consensus_key": f"{i + 50:02x}" * 32, "vrf_key": "aa" * 32,
            "x25519_key": "bb" * 32, "credential": f"member {i}", "power": 10}


def test_genesis_app_state_is_validated():
    state = parse_app_state({"committee": [member_json(1)], "models": [{"model_id": "gt", "name": "G"}]})
    assert state.committee[0].power == 10 and state.models[0].model_id == "gt"
    assert parse_app_state(state.to_json()) == state
    with pytest.raises(InvalidField, match="'committee': must not be empty"):
        parse_app_state({"committee": []})
    with pytest.raises(AlreadyExists, match="duplicate committee member"):
        parse_app_state({"committee": [member_json(1), member_json(1)]})
    with pytest.raises(AlreadyExists, match="duplicate model"):
        parse_app_state({"committee": [member_json(1)],
                         "models": [{"model_id": "gt", "name": "a"}, {"model_id": "gt", "name": "b"}]})
    with pytest.raises(InvalidField, match="'operator': must be 64 hex"):
        parse_app_state({"committee": [{**member_json(1), "operator": "zz"}]})
    with pytest.raises(InvalidField, match="'extra': unknown field"):
        parse_app_state({"committee": [member_json(1)], "extra": 1})


OWNER = "ab" * 32


def org_json(org_id: str = "acme", **overrides) -> dict:
    return {"org_id": org_id, "name": "Acme", "owner": OWNER, "credits": 7_200, **overrides}


def test_genesis_models_declare_their_size_and_organisations_their_owner_and_credits():
    raw = {"committee": [member_json(1)],
           "models": [{"model_id": "gt", "name": "G"}, {"model_id": "big", "name": "B", "layers": 80,
                                                        "layer_mib": 1_700}],
           "organisations": [org_json("zeta", credits=0), org_json("acme"), org_json("nocredits")]}
    del raw["organisations"][2]["credits"]
    state = parse_app_state(raw)
    assert [(m.model_id, m.layers, m.layer_mib, m.sized) for m in state.models] == [
        ("gt", 0, 0, False), ("big", 80, 1_700, True)]
    assert state.organisations == (
        GenesisOrganisation("zeta", "Acme", bytes.fromhex(OWNER), 0),
        GenesisOrganisation("acme", "Acme", bytes.fromhex(OWNER), 7_200),
        GenesisOrganisation("nocredits", "Acme", bytes.fromhex(OWNER), 0),
    )
    assert state.organisations[1].organisation(123).registered_at == 123
    out = state.to_json()
    assert out["models"] == [{"model_id": "gt", "name": "G"},
                             {"model_id": "big", "name": "B", "layers": 80, "layer_mib": 1_700}]
    assert out["organisations"][2] == {"org_id": "nocredits", "name": "Acme", "owner": OWNER, "credits": 0}
    assert parse_app_state(out) == state
    plain = parse_app_state({"committee": [member_json(1)]})
    assert plain.organisations == () and "organisations" not in plain.to_json()


@pytest.mark.parametrize(
    ("extra", "error", "message"),
    [
        ({"organisations": [org_json(owner="zz")]}, InvalidField, "'owner': must be 64 hex"),
        ({"organisations": [org_json(owner="ab" * 31)]}, InvalidField, "'owner': must be 32 bytes"),
        ({"organisations": [org_json(), org_json()]}, AlreadyExists, "duplicate organisation 'acme'"),
        ({"organisations": [org_json(credits=-1)]}, InvalidField, r"'credits': must be an integer in 0\.\."),
        ({"organisations": [org_json(credits=10**15 + 1)]}, InvalidField, "'credits'"),
        ({"organisations": [org_json(credits=1.5)]}, InvalidField, "'credits'"),
        ({"organisations": [org_json(org_id="bad id")]}, InvalidField, "'org_id'"),
        ({"organisations": [org_json(name="x" * 129)]}, InvalidField, "'name': .* at most 128"),
        ({"organisations": [org_json(role="admin")]}, InvalidField, "'role': unknown field"),
        ({"organisations": [{"org_id": "acme", "name": "Acme"}]}, InvalidField, "'owner': missing"),
        ({"organisations": {"acme": org_json()}}, InvalidField, "'organisations': must be a list"),
        ({"models": [{"model_id": "gt", "name": "G", "layers": 80}]}, InvalidField,
         "'layers': model 'gt': a model's size needs both layers and layer_mib"),
        ({"models": [{"model_id": "gt", "name": "G", "layer_mib": 10}]}, InvalidField, "needs both"),
        ({"models": [{"model_id": "gt", "name": "G", "layers": 0, "layer_mib": 10}]}, InvalidField,
         "'layers': model 'gt': must be an integer in 1..10000"),
        ({"models": [{"model_id": "gt", "name": "G", "layers": 8, "layer_mib": 2**30 + 1}]}, InvalidField,
         "'layer_mib'"),
    ],
)
def test_genesis_organisations_and_model_sizes_are_validated(extra, error, message):
    with pytest.raises(error, match=message):
        parse_app_state({"committee": [member_json(1)], **extra})


@pytest.mark.parametrize(
    ("check", "value", "ok"),
    [
        (fields.address, "10.0.0.1:80", True),
        (fields.address, "[::1]:9000", True),
        (fields.address, "host:0", False),
        (fields.address, "host:70000", False),
        (fields.address, "no-port", False),
        (fields.address, "bad host:80", False),
        (fields.region, "eu-west", True),
        (fields.region, "EU", False),
        (fields.ident, "meta-llama/Llama-3.1-8B", True),
        (fields.ident, "-leading", False),
        (fields.ident, "x" * 65, False),
        (fields.hardware, "A100-80GB", True),
        (fields.hardware, "", False),
    ],
)
def test_field_rules(check, value, ok):
    body = {"f": value}
    if ok:
        assert check(body, "f") == value
    else:
        with pytest.raises(InvalidField, match="'f'"):
            check(body, "f")


def test_text_and_integer_fields():
    assert fields.text({"t": "ok"}, "t", 5) == "ok"
    for bad in ("", "   ", "x" * 6, "a\nb", 3):
        with pytest.raises(InvalidField):
            fields.text({"t": bad}, "t", 5)
    assert fields.integer({"n": 3}, "n", 1, 3) == 3
    for bad in (0, 4, True, "3"):
        with pytest.raises(InvalidField):
            fields.integer({"n": bad}, "n", 1, 3)


def test_supermajority_and_blocking_minority_in_integers():
    assert not rules.supermajority(20, 30) and rules.supermajority(21, 30)
    assert not rules.supermajority(0, 0)
    assert rules.blocking_minority(10, 30) and not rules.blocking_minority(9, 30)
    user = User(b"u" * 32, "h:1", "eu", 0, 100)
    assert rules.is_expired(user, 100) and not rules.is_expired(user, 99)
