"""Scoring through an OpenAI-compatible server, such as `vllm serve` with the reference model (or
planetserve's own engine server), by vLLM's `prompt_logprobs` extension.

One /v1/completions request per response: the prompt and the response together as token ids,
`max_tokens` 1 (the generated token is ignored: vLLM generates at least one), `temperature` 0 and
`prompt_logprobs` 0, which returns every prompt token's own log-probability; the response's share is
the score. Requests run concurrently, at most `concurrency` at once. A greedy answer's shortfalls need
only the likeliest token's log-probability at each position (`prompt_logprobs` 1), which is exact. A
sampled answer's need the whole distribution, since the seed's noise can lift any token to the top,
and such a server gives only its likeliest few: those it refuses, clearly, and a verifier checks them
with a local reference.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import httpx

from planetserve.verifier.scoring import Decoding, Pair, TokenScores


class ScoringError(Exception):
    """The scoring server refused, was unreachable, or answered in an unexpected shape."""


class OpenAIScorer:
    """A `Scorer` (see `planetserve.verifier.scoring`) backed by a server."""

    def __init__(self, base_url: str, model: str, *, vocab_size: int, concurrency: int = 8,
                 timeout: float = 120.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.vocab_size = vocab_size
        self.concurrency = concurrency
        self.timeout = timeout

    def score(self, batch: Sequence[Pair]) -> list[list[float]]:
        return [list(s.logprobs) for s in asyncio.run(self._all(batch, 0))]

    def score_choices(self, batch: Sequence[Pair], decodings: Sequence[Decoding]) -> list[TokenScores]:
        """Greedy answers only (see the module docstring)."""
        if len(decodings) != len(batch):
            raise ValueError(f"{len(decodings)} decodings for {len(batch)} items")
        if any(d.temperature > 0 for d in decodings):
            raise ScoringError("a sampled answer's tokens are checked against the reference's whole "
                               "distribution, which prompt_logprobs does not return: score sampled answers "
                               "with a local reference model")
        return asyncio.run(self._all(batch, 1))

    async def _all(self, batch: Sequence[Pair], top: int) -> list[TokenScores]:
        gate = asyncio.Semaphore(self.concurrency)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout) as client:
            async def one(prompt: Sequence[int], response: Sequence[int]) -> TokenScores:
                async with gate:
                    return await self._one(client, list(prompt), list(response), top)

            return list(await asyncio.gather(*(one(p, r) for p, r in batch)))

    async def _one(self, client: httpx.AsyncClient, prompt: list[int], response: list[int],
                   top: int) -> TokenScores:
        if not response:
            return TokenScores((), () if top else None)
        if not prompt:
            raise ValueError("the prompt is empty: its first response token would have no context")
        body = {"model": self.model, "prompt": prompt + response, "max_tokens": 1, "temperature": 0,
                "prompt_logprobs": top}
        try:
            answer = await client.post("/v1/completions", json=body)
        except httpx.HTTPError as exc:
            raise ScoringError(f"cannot reach the scoring server {self.base_url}: {exc}") from exc
        if answer.status_code != 200:
            raise ScoringError(f"the scoring server answered {answer.status_code}: {_message(answer)}")
        try:
            entries = answer.json()["choices"][0]["prompt_logprobs"]
            if len(entries) != len(prompt) + len(response):
                raise ValueError(f"{len(entries)} positions for {len(prompt) + len(response)} tokens")
            scored = entries[len(prompt):]
            logprobs = tuple(float(e[str(t)]["logprob"]) for t, e in zip(response, scored, strict=True))
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ScoringError(f"the scoring server's prompt_logprobs are malformed: {exc}") from exc
        if not top:
            return TokenScores(logprobs)
        try:
            tops = tuple(max(float(v["logprob"]) for v in e.values()) for e in scored)
        except (KeyError, TypeError, ValueError) as exc:
            raise ScoringError(f"the scoring server's prompt_logprobs are malformed: {exc}") from exc
        return TokenScores(logprobs, tuple(top - lp for top, lp in zip(tops, logprobs, strict=True)))


def _message(answer: httpx.Response) -> str:
    try:
        return str(answer.json()["error"]["message"])[:300]
    except Exception:
        return answer.text[:300]
