"""Challenge prompts for model nodes.

A challenge must look like any user's prompt, or a dishonest node could serve challenges honestly and
everything else cheaply. So challenges are drawn from the very generator of users' synthetic workloads
(`planetserve.workloads`): the same shared prefixes (tool documentation, programming problems, long
documents) with the same popularity, the same question forms, the same length distribution and output
caps, sent in the same forms (chat or completion) and sampled at the same temperatures. Each draw seeds
the generator from `secrets`, so nodes cannot predict the next challenge, and a record of every prompt
already used (by sha256) makes sure none is ever sent twice, to any node in any epoch; given a file,
the record survives restarts.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from planetserve import workloads

MAX_REDRAWS = 64
_ONE = 1_000_000


class ChallengeError(Exception):
    """No fresh challenge could be drawn (every candidate was used before, or too long)."""


@dataclass(frozen=True)
class ChallengePrompt:
    text: str
    max_tokens: int
    """The output cap a user of this workload would ask for."""
    workload: str
    temperature: float
    """The sampling temperature a user of this workload would ask for."""
    chat: bool
    """Whether a user would send it as a chat message rather than as a completion prompt."""


def prompt_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class ChallengeSource:
    """Fresh challenges from one workload, scaled for the served models' context (`scale`, as in
    `workloads.generate`), at most `max_prompt_len` tokens long when given.

    `greedy_share` and `chat_share` replace the workload's own shares of greedy and of chat requests,
    for a network whose users' traffic is known to differ: challenges should look like it."""

    def __init__(self, workload: str = "mixed", *, scale: float = 1.0, max_prompt_len: int | None = None,
                 used_file: Path | None = None, length: Callable[[str], int] | None = None,
                 greedy_share: float | None = None, chat_share: float | None = None) -> None:
        if workload not in workloads.WORKLOADS:
            raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(workloads.WORKLOADS)}")
        for name, share in (("greedy_share", greedy_share), ("chat_share", chat_share)):
            if share is not None and not 0 <= share <= 1:
                raise ValueError(f"{name} must lie in [0, 1], got {share}")
        self.greedy_share = greedy_share
        self.chat_share = chat_share
        self.workload = workload
        self.scale = scale
        self.max_prompt_len = max_prompt_len
        self.used_file = used_file
        self.length = length
        """How long a prompt is for the served models (their tokenizer); default: the workload's count."""
        self.used: set[str] = set()
        if used_file is not None and used_file.exists():
            self.used = {line.strip() for line in used_file.read_text().splitlines() if line.strip()}

    def warm_up(self) -> None:
        """Build the workload's corpus and prefix pools now (seconds), not inside the first plan
        window."""
        workloads.generate(self.workload, rate=1.0, count=1, seed=0, scale=self.scale)

    def draw(self, count: int) -> list[ChallengePrompt]:
        """`count` prompts never drawn before (by this source or, through its file, by an earlier one)."""
        fresh: list[ChallengePrompt] = []
        for _ in range(MAX_REDRAWS):
            seed = secrets.randbits(63)
            for request in workloads.generate(self.workload, rate=1.0, count=2 * (count - len(fresh)),
                                              seed=seed, scale=self.scale):
                text = request.text
                if self._too_long(request.prompt_len, text):
                    continue
                digest = prompt_digest(text)
                if digest in self.used:
                    continue
                self.used.add(digest)
                fresh.append(ChallengePrompt(text, request.max_tokens, request.workload,
                                             self._temperature(request.temperature),
                                             self._chat(request.chat)))
                if len(fresh) == count:
                    self._record(fresh)
                    return fresh
        self._record(fresh)
        raise ChallengeError(f"only {len(fresh)} of {count} fresh challenges after {MAX_REDRAWS} draws; "
                             f"raise max_prompt_len or scale")

    def _temperature(self, drawn: float) -> float:
        if self.greedy_share is None:
            return drawn
        if secrets.randbelow(_ONE) < self.greedy_share * _ONE:
            return 0.0
        sampled = sorted(t for t in workloads.TEMPERATURES if t > 0)
        weights = [workloads.TEMPERATURES[t] for t in sampled]
        pick = secrets.randbelow(sum(weights))
        return next(t for t, upto in zip(sampled, itertools.accumulate(weights), strict=True) if pick < upto)

    def _chat(self, drawn: bool) -> bool:
        return drawn if self.chat_share is None else secrets.randbelow(_ONE) < self.chat_share * _ONE

    def _too_long(self, pieces: int, text: str) -> bool:
        if self.max_prompt_len is None:
            return False
        return (self.length(text) if self.length is not None else pieces) > self.max_prompt_len

    def _record(self, drawn: list[ChallengePrompt]) -> None:
        """Append before the prompts are used, and flush to disk, so a crash cannot lead to a repeat."""
        if self.used_file is None or not drawn:
            return
        self.used_file.parent.mkdir(parents=True, exist_ok=True)
        with self.used_file.open("a") as fh:
            fh.write("".join(prompt_digest(c.text) + "\n" for c in drawn))
            fh.flush()
            os.fsync(fh.fileno())
