"""What a transaction message is: a frozen dataclass whose fields are its body's, checked once when
it is read from the network (types, lengths, ranges: everything that needs no state), so that
handlers receive values they can trust and clients cannot build a body the chain would misread.

A field whose default is None is optional: absent from the body when None. A field holding a part
(another `Body`), a registry record or a tuple is written as a map, a record or an array."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Self

from planetserve.registry import fields
from planetserve.registry.entities import Record
from planetserve.registry.errors import InvalidField


def wire(value: Any) -> Any:
    """The body form of a value: messages, parts and records as maps, sequences as arrays, inside maps
    and arrays too."""
    if isinstance(value, Body):
        return value.body()
    if isinstance(value, Record):
        return value.to_record()
    if isinstance(value, dict):
        return {k: wire(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [wire(item) for item in value]
    return value


def as_map(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidField(name, "must be a map")
    return value


class Body:
    """A map on the wire: a transaction's body, or a part of one."""

    @classmethod
    def keys(cls) -> tuple[set[str], frozenset[str]]:
        """The required and the optional keys of the body."""
        declared = dataclasses.fields(cls)  # type: ignore[arg-type]
        return ({f.name for f in declared if f.default is not None},
                frozenset(f.name for f in declared if f.default is None))

    def body(self) -> dict[str, Any]:
        return {f.name: wire(value) for f in dataclasses.fields(self)  # type: ignore[arg-type]
                if (value := getattr(self, f.name)) is not None}

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Self:
        """Check a body read from the network; raises InvalidField naming the first bad field."""
        fields.check_keys(body, *cls.keys())
        return cls.parse(body)

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        """The message of a body whose keys are known to be the declared ones."""
        raise NotImplementedError


class Message(Body):
    """A transaction's body with the type that names it in the envelope."""

    TYPE: ClassVar[str]
