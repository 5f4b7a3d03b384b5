"""Numbered result codes of CheckTx, FinalizeBlock and Query. Zero is success; numbers never change."""

from __future__ import annotations

from enum import IntEnum

from planetserve.registry import errors as registry_errors

CODESPACE = "planetserve"


class Code(IntEnum):
    OK = 0
    UNDECODABLE = 1
    UNKNOWN_TYPE = 2
    BAD_SIGNATURE = 3
    WRONG_CHAIN_ID = 4
    BAD_SEQUENCE = 5
    OVERSIZE = 6
    INVALID_FIELD = 7
    UNKNOWN_ENTITY = 8
    ALREADY_EXISTS = 9
    UNAUTHORIZED = 10
    EXPIRED = 11
    INTERNAL = 12
    LOW_REPUTATION = 13
    INSUFFICIENT_CREDITS = 14
    UNAVAILABLE = 15
    RATE_LIMITED = 16
    INSUFFICIENT_WORK = 17


class TxError(Exception):
    """A transaction is refused; carries its code and a readable log line."""

    def __init__(self, code: Code, log: str) -> None:
        super().__init__(log)
        self.code = code
        self.log = log


_REGISTRY_CODES: dict[type[registry_errors.RegistryError], Code] = {
    registry_errors.InvalidField: Code.INVALID_FIELD,
    registry_errors.UnknownEntity: Code.UNKNOWN_ENTITY,
    registry_errors.AlreadyExists: Code.ALREADY_EXISTS,
    registry_errors.Unauthorized: Code.UNAUTHORIZED,
    registry_errors.Expired: Code.EXPIRED,
    registry_errors.LowReputation: Code.LOW_REPUTATION,
    registry_errors.InsufficientCredits: Code.INSUFFICIENT_CREDITS,
    registry_errors.Unavailable: Code.UNAVAILABLE,
    registry_errors.RateLimited: Code.RATE_LIMITED,
    registry_errors.InsufficientWork: Code.INSUFFICIENT_WORK,
}


def from_registry(exc: registry_errors.RegistryError) -> TxError:
    code = _REGISTRY_CODES.get(type(exc), Code.INVALID_FIELD)
    return TxError(code, f"{code.name.lower().replace('_', ' ')}: {exc}")
