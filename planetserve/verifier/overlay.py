"""Sending a challenge to one model node through a user relay's local OpenAI-compatible endpoint, as
any program of a user would: on the wire it is an ordinary chat or completion request. The relay's
`planetserve.node` extension picks the node (trusted or not; the relay strips the field before the
request leaves it)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx

from planetserve.chain.challenge import (
    Challenge,
    ResponseFormatError,
    response_from_extension,
    served_from_extension,
)
from planetserve.chain.rpc import TooLarge, read_limited
from planetserve.registry.epochs import SignedResponse

MAX_ANSWER_BYTES = 4 << 20


@dataclass(frozen=True)
class Reply:
    """The challenged node's signed response and, when it forwarded the prompt within its group, the
    serving node's own signature over the same response (checked; None otherwise)."""

    response: SignedResponse
    served: SignedResponse | None = None


class NoAnswer(Exception):
    """The node gave no usable answer: the reason is what the ledger records as an invalid response."""


@dataclass(frozen=True)
class OverlayChannel:
    relay: str
    timeout: float = 60.0
    max_tokens: int = 64

    def ask(self, node: bytes, model_id: str, challenge: Challenge) -> Reply:
        """The node's signed answer to `challenge` (a chat when it has a question, else a completion),
        sampled at its temperature, or NoAnswer. Whether the answer is the right one (its signer, prompt,
        temperature and content) is for the caller to check."""
        body: dict = {"model": model_id, "max_tokens": self.max_tokens,
                      "temperature": challenge.sampling_temperature, "planetserve": {"node": node.hex()}}
        if challenge.question:
            body["messages"] = [{"role": "user", "content": challenge.question}]
        else:
            body["prompt"] = challenge.prompt
        endpoint = "chat/completions" if challenge.question else "completions"
        url = f"{self.relay.rstrip('/')}/v1/{endpoint}"
        try:
            with httpx.stream("POST", url, json=body, timeout=self.timeout) as answer:
                content = read_limited(answer, MAX_ANSWER_BYTES)
        except TooLarge:
            raise NoAnswer(f"answer larger than {MAX_ANSWER_BYTES} bytes") from None
        except httpx.TimeoutException:
            raise NoAnswer(f"no answer within {self.timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise RelayUnavailable(f"the user relay at {self.relay} is unreachable: {exc}") from exc
        try:
            payload = json.loads(content)
        except ValueError:
            raise NoAnswer(f"HTTP {answer.status_code} with a body that is not JSON") from None
        if answer.status_code != 200:
            error = payload.get("error", {}) if isinstance(payload, dict) else {}
            code = error.get("code") if isinstance(error, dict) else None
            if answer.status_code == 503 and code in ("too_few_paths", "no_model_nodes"):
                raise RelayUnavailable(f"the user relay cannot send now ({code})")
            message = error.get("message", "") if isinstance(error, dict) else ""
            raise NoAnswer(f"HTTP {answer.status_code} {code or ''}: {message}"[:256])
        try:
            choice = payload["choices"][0]
            text = choice["message"]["content"] if challenge.question else choice["text"]
            if not isinstance(text, str):
                raise TypeError("text")
            extension = payload.get("planetserve")
            response = response_from_extension(extension, text)
        except (KeyError, IndexError, TypeError, ResponseFormatError) as exc:
            raise NoAnswer(f"malformed answer: {exc}"[:256]) from None
        return Reply(response, served_from_extension(extension.get("served"), response))


class RelayUnavailable(Exception):
    """The relay itself cannot carry the challenge now (down, or too few paths): not the node's fault,
    so it is retried rather than reported."""
