"""An organisation that deploys on the in-process chain (tests/harness.py, tests/committee.py), and
the events its blocks leave."""

from __future__ import annotations

from typing import Any

from committee import EPOCH_PARAMS, NODE_ADDRESS, Script
from harness import AppHarness, node_body, sqlite_url
from tendermint.abci import types_pb2 as abci

from planetserve.chain import layout
from planetserve.chain.keys import KeySet
from planetserve.registry import credits
from planetserve.registry.credits import Deployment
from planetserve.registry.genesis import GenesisOrganisation

ACME = "acme"
FUNDS = 10_000 * credits.CREDIT_SECONDS
A100 = credits.DEFAULT_PRICES["A100"]
HOUR = 3_600


class Chain:
    """Four gt nodes of org1 (the Script's), and ACME, endowed in genesis, with one gt node of its own
    (an organisation needs a trusted node to deploy)."""

    def __init__(self, tmp_path) -> None:
        self.acme = KeySet.generate()
        self.h = AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS,
                            models=(("gt", "reference"), ("other", "another"), ("third", "a third")),
                            organisations=(GenesisOrganisation(ACME, "ACME", self.acme.public, FUNDS),))
        self.s = Script(self.h, nodes=4)
        self.org1 = list(self.s.nodes)
        own = KeySet.generate()
        assert self.s.block(self.s.tx(self.acme, "register-model-node",
                                      node_body(own, ACME, address=NODE_ADDRESS))) == [(0, "ok")]
        self.s.nodes[own.public] = own  # challenged like the others

    def deploy(self, model_id: str = "gt", nodes: int = 2, seconds: int = HOUR) -> tuple[int, str]:
        body = {"org_id": ACME, "model_id": model_id, "hardware": "A100", "nodes": nodes, "seconds": seconds}
        return self.s.block(self.s.tx(self.acme, "deploy-model", body))[0]

    def update(self, node: bytes, **changes: Any) -> abci.ResponseFinalizeBlock:
        """org1 changes one of its nodes' registration."""
        result = self.h.block(self.s.tx(self.s.owner, "update-model-node", {"node_pubkey": node, **changes}))
        assert result.tx_results[0].code == 0, result.tx_results[0].log
        return result

    def register(self, model_id: str, count: int, **fields: Any) -> list[bytes]:
        """More org1 nodes, of another model or size."""
        keys = [KeySet.generate() for _ in range(count)]
        assert all(c == 0 for c, _ in self.s.block(*[self.s.tx(self.s.owner, "register-model-node", node_body(
            k, model_id=model_id, address=f"10.0.2.{i}:7000", **fields)) for i, k in enumerate(keys)]))
        return [k.public for k in keys]

    def deployment(self, ident: int = 1) -> Deployment | None:
        return self.s.state.deployment(ident)

    def assigned(self) -> list[bytes]:
        return [bytes.fromhex(k[len(layout.ASSIGNED_PREFIX):].decode())
                for k, _ in self.h.store.batch().iterate(layout.ASSIGNED_PREFIX)]

    def replays(self, tmp_path) -> bool:
        return all(here == there for here, there in self.h.replay(sqlite_url(tmp_path, "replay.db")))


def events(result: abci.ResponseFinalizeBlock, kind: str) -> list[dict[str, str]]:
    """The block's and its transactions' events of one kind, as attribute maps."""
    found = [*result.events, *(e for r in result.tx_results for e in r.events)]
    return [{a.key: a.value for a in e.attributes} for e in found if e.type == kind]
