"""The handler of every transaction message, by family (registry, committee, epochs, credits), as
chain/messages/ groups the messages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from planetserve.chain.abci.handlers import committee, credits, epochs, registry
from planetserve.chain.abci.handlers.context import Context
from planetserve.chain.messages.base import Message

HANDLERS: dict[type[Message], Callable[[Context, Any], None]] = {
    **registry.HANDLERS, **committee.HANDLERS, **epochs.HANDLERS, **credits.HANDLERS,
}
