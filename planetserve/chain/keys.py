"""Key files for every role: an ed25519 identity key, plus VRF and X25519 keys for committee members.

Keys are stored as hex seeds in a JSON file readable only by its owner; nothing here ever logs or
prints a secret.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

from nacl.bindings import crypto_sign_ed25519_pk_to_curve25519
from nacl.exceptions import CryptoError
from nacl.public import PrivateKey
from nacl.signing import SigningKey, VerifyKey


class KeyFileError(Exception):
    """A key file is missing, unreadable or malformed."""


@dataclass(frozen=True)
class KeySet:
    """The private keys of one participant; vrf and x25519 are used only by committee members."""

    identity: SigningKey
    vrf: SigningKey
    x25519: PrivateKey

    @classmethod
    def generate(cls) -> KeySet:
        return cls(
            identity=SigningKey(secrets.token_bytes(32)),
            vrf=SigningKey(secrets.token_bytes(32)),
            x25519=PrivateKey(secrets.token_bytes(32)),
        )

    @property
    def public(self) -> bytes:
        """The identity public key: the account address on the ledger."""
        return bytes(self.identity.verify_key)

    def sign(self, message: bytes) -> bytes:
        return self.identity.sign(message).signature

    def public_summary(self) -> dict[str, str]:
        return {
            "identity": self.public.hex(),
            "vrf": bytes(self.vrf.verify_key).hex(),
            "x25519": bytes(self.x25519.public_key).hex(),
        }

    def save(self, path: Path) -> None:
        """Write the key file with mode 0600, refusing to overwrite an existing one."""
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {
            "identity_seed": bytes(self.identity).hex(),
            "vrf_seed": bytes(self.vrf).hex(),
            "x25519_secret": bytes(self.x25519).hex(),
        }
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(body, fh, indent=2)

    @classmethod
    def load(cls, path: Path) -> KeySet:
        try:
            body = json.loads(Path(path).read_text())
            return cls(
                identity=SigningKey(bytes.fromhex(body["identity_seed"])),
                vrf=SigningKey(bytes.fromhex(body["vrf_seed"])),
                x25519=PrivateKey(bytes.fromhex(body["x25519_secret"])),
            )
        except FileNotFoundError as exc:
            raise KeyFileError(f"no key file at {path}") from exc
        except OSError as exc:
            raise KeyFileError(f"cannot read key file {path}: {exc.strerror or exc}") from exc
        except KeyError as exc:
            raise KeyFileError(f"malformed key file {path}: no {exc} (a key file holds identity_seed, "
                               "vrf_seed and x25519_secret, each 32 bytes in hex)") from exc
        except (ValueError, TypeError) as exc:  # the messages name positions and lengths, never key bytes
            raise KeyFileError(f"malformed key file {path}: {type(exc).__name__}: {exc} (a key file holds "
                               "identity_seed, vrf_seed and x25519_secret, each 32 bytes in hex)") from exc


def next_key_file(path: Path) -> Path:
    """Where the keys a participant rotates to wait until the rotation takes effect."""
    return path.with_name(f"{path.stem}.next{path.suffix}")


def retired_key_file(path: Path) -> Path:
    """Where a member's previous keys stay after a rotation: its X25519 key still opens the plan that
    was sealed to it before the rotation took effect."""
    return path.with_name(f"{path.stem}.retired{path.suffix}")


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read: for anything that may hold a secret, such as a database URL
    with its password. The text goes to a new 0600 file that then replaces `path`: rewriting a file
    that was readable in place would let whoever opened it before read the new secret through that
    descriptor (a file's mode is checked when it is opened), and a link at `path` is replaced, not
    followed."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def append_private(path: Path, text: str, durable: bool = False) -> None:
    """Append `text` to a file only its owner can read (made 0600 if it was not): for journals that
    hold what others must not see, such as the digests of the challenges a member has sent.
    `durable` returns only once it is on disk."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "a") as fh:
        fh.write(text)
        if durable:
            fh.flush()
            os.fsync(fh.fileno())


def exchange_capable(public_key: bytes) -> bool:
    """Whether an ed25519 key converts to the X25519 key that onion layers and cloves are sealed to.
    libsodium refuses a key with a small-order part (aB + T, T of order 8), although signatures under it
    verify: listed as a relay or a model node, such a key made every path or clove built to it fail."""
    try:
        crypto_sign_ed25519_pk_to_curve25519(public_key)
    except (CryptoError, ValueError, TypeError):
        return False
    return True


def verify_signature(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """Check an ed25519 signature; any malformed key or signature is simply invalid. Only the
    library's refusals count as invalid: running out of memory must not read as a bad signature on
    one validator alone."""
    try:
        VerifyKey(public_key).verify(message, signature)
    except (CryptoError, ValueError, TypeError):
        return False
    return True
