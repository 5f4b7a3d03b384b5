"""Messages of the credits family: spending contribution credits on a deployment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

from planetserve.chain.messages.base import Message
from planetserve.registry import fields

MAX_NODES = 1 << 31
MAX_SECONDS = 1 << 62


@dataclass(frozen=True)
class DeployModel(Message):
    """An organisation spends credits to have its model served by `nodes` servers of a hardware class
    for `seconds`; the chain's parameters bound both."""

    TYPE: ClassVar[str] = "deploy-model"
    org_id: str
    model_id: str
    hardware: str
    nodes: int
    seconds: int

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        return cls(fields.ident(body, "org_id"), fields.ident(body, "model_id"), fields.hardware(body),
                   fields.integer(body, "nodes", 1, MAX_NODES),
                   fields.integer(body, "seconds", 1, MAX_SECONDS))
