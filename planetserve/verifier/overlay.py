"""Sending a challenge to one model node through a user relay's local OpenAI-compatible endpoint, as
any program of a user would: on the wire it is an ordinary chat or completion request, streamed as
often as users' programs stream (`workloads.STREAM_SHARE`) and asking for each token's log-probability
as often as they ask (`workloads.LOGPROBS_SHARE`; the answer's signed tokens are scored, not the
log-probabilities it reports). The relay's `planetserve.node` extension picks the node (trusted or
not); the relay re-encodes every request canonically, so what leaves it is the same whichever program
sent it."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import httpx

from planetserve import workloads
from planetserve.chain.challenge import (
    ANSWERED_BY,
    Challenge,
    ResponseFormatError,
    response_from_extension,
    served_from_extension,
)
from planetserve.chain.messages.epochs import parse_response
from planetserve.chain.rpc import TooLarge, read_limited
from planetserve.registry import codec, fields
from planetserve.registry.epochs import MILLI, SEED_BITS, SignedResponse
from planetserve.registry.errors import InvalidField

MAX_ANSWER_BYTES = 4 << 20
MAX_ANSWER_VALUES = 1 << 18
"""JSON values a node's answer may build, by `codec.json_values_bound`: `challenge.MAX_CHALLENGE_TOKENS`
tokens streamed with twenty alternative log-probabilities each, their bytes spelled out, come to
185,000 (challenges ask for at most five)."""
MAX_ANSWER_CONTAINERS = 1 << 16
ONE = 1_000_000


@dataclass(frozen=True)
class Reply:
    """The challenged node's signed response and, when it forwarded the prompt within its group, the
    serving node's own signature over the same response (checked; None otherwise)."""

    response: SignedResponse
    served: SignedResponse | None = None


class NoAnswer(Exception):
    """The node gave no usable answer: the reason is what the ledger records as an invalid response. It
    may quote the node (an error's message), so it is kept to one printable line: a node's control
    characters reach neither the ledger, which would refuse the claim, nor an operator's terminal."""

    def __init__(self, reason: str) -> None:
        super().__init__(fields.one_line(reason, 256))


@dataclass(frozen=True)
class OverlayChannel:
    relay: str
    timeout: float = 60.0
    max_tokens: int = 64
    """The most tokens a challenge asks for (a drawn cap above it is lowered to it)."""
    stream_share: float = workloads.STREAM_SHARE
    logprobs_share: float = workloads.LOGPROBS_SHARE
    """The share of challenges asking for log-probabilities (with 0..workloads.MAX_TOP_LOGPROBS
    alternatives, uniformly): a program's request that asks for them must not tell a node it is no
    challenge."""

    def ask(self, node: bytes, model_id: str, challenge: Challenge) -> Reply:
        """The node's signed answer to `challenge` (a chat when it has a question, else a completion),
        sampled at its temperature, or NoAnswer. A follow-up's earlier turns go first, under the session
        id the challenge then uses; a failed earlier turn is the node's failure to answer. An answer
        the ledger would not read (an address that is no host:port, a model id it refuses, more tokens
        or characters than a result holds) is none: revealed, it would have the submitter's whole
        transaction refused, and every result batched with it. Whether the answer is the right one
        (its signer, prompt, temperature and content) is for the caller to check."""
        stream = secrets.randbelow(ONE) < self.stream_share * ONE
        logprobs = secrets.randbelow(workloads.MAX_TOP_LOGPROBS + 1)
        if secrets.randbelow(ONE) >= self.logprobs_share * ONE:
            logprobs = None
        options: dict = {"node": node.hex()}
        chat = bool(challenge.question)
        *earlier, text = challenge.turns()
        if earlier:
            options["session_id"] = secrets.token_hex(16)
        for turn, before in enumerate(earlier, start=1):
            try:
                fresh = secrets.randbits(SEED_BITS)
                body = request_body(model_id, challenge, before, chat, stream, options, fresh, logprobs)
                self._answer(body, chat, stream)
            except NoAnswer as exc:
                raise NoAnswer(f"turn {turn} of the session failed: {exc}") from None
        return self._answer(request_body(model_id, challenge, text, chat, stream, options, logprobs=logprobs),
                            chat, stream)

    def _answer(self, body: dict, chat: bool, stream: bool) -> Reply:
        url = f"{self.relay.rstrip('/')}/v1/{'chat/completions' if chat else 'completions'}"
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
            streamed = stream and answer.status_code == 200
            payload = _assembled(content, chat) if streamed else _decoded(content)
        except ValueError:
            raise NoAnswer(f"HTTP {answer.status_code} with a body that is not JSON") from None
        if answer.status_code != 200:
            error = payload.get("error", {}) if isinstance(payload, dict) else {}
            code = error.get("code") if isinstance(error, dict) else None
            relay_said = answer.headers.get(ANSWERED_BY) == "relay"  # not a node's words, which could say it
            if answer.status_code == 503 and code in ("too_few_paths", "no_model_nodes") and relay_said:
                raise RelayUnavailable(f"the user relay cannot send now ({code})")
            message = error.get("message", "") if isinstance(error, dict) else ""
            raise NoAnswer(f"HTTP {answer.status_code} {code or ''}: {message}")
        try:
            choice = payload["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            if not isinstance(text, str):
                raise TypeError("text")
            extension = payload.get("planetserve")
            response = response_from_extension(extension, text)
            parse_response(response.to_record())
        except InvalidField as exc:
            raise NoAnswer(f"an answer the ledger would refuse: {exc}") from None
        except (KeyError, IndexError, TypeError, ResponseFormatError) as exc:
            raise NoAnswer(f"malformed answer: {exc}") from None
        return Reply(response, served_from_extension(extension.get("served"), response))


def request_body(model_id: str, challenge: Challenge, text: str, chat: bool, stream: bool,
                 options: dict[str, Any], seed: int | None = None, logprobs: int | None = None
                 ) -> dict[str, Any]:
    """What a user's program would send for `text` at the challenge's temperature, output cap and stop
    strings, with the relay told to send `seed` unchanged (a program's seed it would key): the
    challenge's committed one unless another is given (earlier turns, which are not scored, get fresh
    ones as a program's turns do); asking for `logprobs` alternatives per token, as the API's form spells
    it, unless None."""
    exact = challenge.seed if seed is None else seed
    body: dict[str, Any] = {"model": model_id, "max_tokens": challenge.max_tokens, "stream": stream,
                            "temperature": challenge.sampling_temperature,
                            "planetserve": {**options, "seed": exact}}
    if challenge.top_p < MILLI:
        body["top_p"] = challenge.sampling_top_p
    if challenge.stop:
        body["stop"] = list(challenge.stop)
    if challenge.stop_token_ids:
        body["stop_token_ids"] = list(challenge.stop_token_ids)
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if logprobs is not None:
        body |= {"logprobs": True, "top_logprobs": logprobs} if chat else {"logprobs": logprobs}
    return body


def _decoded(raw: bytes) -> Any:
    """A node's JSON, decoded only where it builds no more than an answer of `MAX_ANSWER_VALUES` values
    needs: 4 MiB of `[[],[],...]` would be some 90 MB of lists, and of `[[[...]]]` a RecursionError
    that ended the daemon's tick, with every answer it had collected (ValueError for what is not JSON,
    or nests too deeply)."""
    try:
        return codec.json_loads_bounded(raw, MAX_ANSWER_VALUES, MAX_ANSWER_CONTAINERS)
    except codec.LimitExceeded as exc:
        raise NoAnswer(f"an answer that holds {exc}") from None
    except codec.CodecError as exc:
        raise ValueError(str(exc)) from None


def _assembled(content: bytes, chat: bool) -> Any:
    """A streamed answer as the one body it would have been: its text joined, the signed extension of
    its last chunk (ValueError for an event that is not JSON). The events together are held to what
    one answer may build (`_decoded`)."""
    containers, values = codec.json_values_bound(content)
    if containers > MAX_ANSWER_CONTAINERS or values > MAX_ANSWER_VALUES:
        raise NoAnswer(f"a streamed answer that may build {values} values in {containers} arrays and objects")
    chunks = [_decoded(line[6:].encode()) for line in content.decode(errors="replace").splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    text, extension, choices = [], None, 0
    for chunk in chunks:
        if not isinstance(chunk, dict):
            raise NoAnswer("malformed answer: a streamed event is not an object")
        if "error" in chunk:
            return chunk
        listed = chunk.get("choices") or []
        if not isinstance(listed, list):  # iterated, it raised past the tries (nothing claimed)
            raise NoAnswer("malformed answer: a streamed event's choices are not a list")
        for choice in listed:
            if not isinstance(choice, dict) or (chat and not isinstance(choice.get("delta"), dict)):
                raise NoAnswer("malformed answer: a streamed choice is not a chat delta" if chat
                               else "malformed answer: a streamed choice is not an object")
            part = choice["delta"].get("content", "") if chat else choice.get("text")
            if not isinstance(part, str):
                raise NoAnswer("malformed answer: a streamed choice carries no text")
            text.append(part)
            choices += 1
        extension = chunk.get("planetserve", extension)
    if not choices:
        raise NoAnswer("malformed answer: the stream carried no choice")
    joined = "".join(text)
    choice = {"message": {"content": joined}} if chat else {"text": joined}
    return {"choices": [choice], "planetserve": extension}


class RelayUnavailable(Exception):
    """The relay itself cannot carry the challenge now (down, or too few paths): not the node's fault,
    so it is retried rather than reported."""
