"""A pipeline stage follows its deployment on the ledger (node/pipeline/assignment.py): a standby node
picks up the stage a healed deployment gives it, and a stage whose layers the ledger re-allocates, or
that the deployment no longer holds, stops serving its old assignment (the runner then reloads)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from planetserve.node.pipeline.assignment import AssignmentError, assignment_ended, wait_for_assignment
from planetserve.registry.credits import Deployment

OWN, OTHER, THIRD = b"a" * 32, b"b" * 32, b"c" * 32
INTERVAL = 0.01
CONFIG = SimpleNamespace(model_id="big", memory_mib=4_000, list_interval=INTERVAL)
KEYS = SimpleNamespace(public=OWN)


def deployment(stages: tuple, model_id: str = "big", ident: int = 1) -> Deployment:
    nodes = tuple(sorted({key for key, *_ in stages}))
    return Deployment(ident, "acme", model_id, "cpu", nodes, 0, 3_600, 1, stages)


class Ledger:
    """What the node reads of the ledger: its deployment, changed by the test as blocks would."""

    def __init__(self, *answers: Deployment | None) -> None:
        self.answers = list(answers)

    def deployment_of(self, node: bytes) -> Deployment | None:
        assert node == OWN
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


BEFORE = deployment(((OWN, 0, 4, 0), (OTHER, 4, 8, 0)))


def test_a_standby_node_picks_up_the_stage_a_healed_deployment_gives_it():
    healed = deployment(((THIRD, 0, 4, 0), (OWN, 4, 8, 0)))
    ledger = Ledger(None, deployment(((THIRD, 0, 4, 0), (OTHER, 4, 8, 0))), healed)
    assert asyncio.run(wait_for_assignment(ledger, KEYS, CONFIG)) == healed


@pytest.mark.parametrize("now", [
    deployment(((OWN, 0, 3, 0), (OTHER, 3, 8, 0))),  # its own layers change
    deployment(((OWN, 0, 4, 0), (THIRD, 4, 8, 0))),  # another stage is replaced: new peers to chain
    None,  # the deployment ended, or dropped the node
])
def test_a_stage_the_ledger_reallocates_stops_serving_its_old_assignment(now):
    ledger = Ledger(BEFORE, BEFORE, now)
    asyncio.run(asyncio.wait_for(assignment_ended(ledger, KEYS, BEFORE, INTERVAL), 5))
    assert ledger.answers == [now]


def test_an_unchanged_assignment_keeps_serving():
    with pytest.raises(TimeoutError):
        asyncio.run(asyncio.wait_for(assignment_ended(Ledger(BEFORE), KEYS, BEFORE, INTERVAL), 0.2))


def test_layers_of_another_model_are_refused():
    with pytest.raises(AssignmentError, match="of model 'gt'"):
        asyncio.run(wait_for_assignment(Ledger(deployment(((OWN, 0, 8, 0),), "gt")), KEYS, CONFIG))
