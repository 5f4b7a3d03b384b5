"""Why a registry rule refuses an action; the chain maps each kind to a numbered result code."""


class RegistryError(Exception):
    """Base class: the action is refused and changes nothing."""


class InvalidField(RegistryError):
    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"field {field!r}: {reason}")
        self.field = field
        self.reason = reason


class UnknownEntity(RegistryError):
    """The action refers to an organisation, model, node, user, member or proposal that does not exist."""


class AlreadyExists(RegistryError):
    """The key or identifier is already registered."""


class Unauthorized(RegistryError):
    """The signer may not perform this action on this entity."""


class Expired(RegistryError):
    """The entity's time-to-live has run out."""


class LowReputation(RegistryError):
    """The organisation's reputation is below what the action needs."""


class InsufficientCredits(RegistryError):
    """The organisation has not earned enough contribution credits."""


class Unavailable(RegistryError):
    """Not enough trusted, unassigned model nodes of the requested kind."""


class RateLimited(RegistryError):
    """The signer, or registrations as a whole, used up what a window of blocks allows; retry later."""


class InsufficientWork(RegistryError):
    """A registration's proof of work does not meet the chain's difficulty."""
