"""Challenge prompts for model nodes.

A challenge must look like any user's prompt, or a dishonest node could serve challenges honestly and
everything else cheaply. So challenges are drawn from the very generator of users' synthetic workloads
(`planetserve.workloads`): the same shared prefixes (tool documentation, programming problems, long
documents) with the same popularity, the same question forms, the same length distribution and output
caps and stop strings, sent in the same forms (chat or completion) and sampled at the same temperatures,
as follow-ups of a session as often as users' requests are (the previous turn is sent first). Each draw
seeds the generator from `secrets`, so nodes cannot predict the next challenge, and a record of every
prompt already used (by sha256) makes sure none is ever sent twice, to any node in any epoch; given a
file, the record survives restarts.
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planetserve import workloads
from planetserve.chain.challenge import Challenge
from planetserve.chain.keys import append_private
from planetserve.registry.epochs import milli

MAX_REDRAWS = 64
RUN = 64
"""Requests per generator run a challenge is picked from: enough for sessions to be continued as they
are in users' traffic."""
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
    earlier: tuple[int, ...] = ()
    """For a follow-up: the lengths (in characters) of the session's earlier turns, each a prefix of
    `text`, which a user would have sent first under the same session id (the challenge sends them too,
    unscored, so that a session seen before says nothing)."""
    top_p: float = 1.0
    """The nucleus a user of this workload would ask for."""
    stop: tuple[str, ...] = ()
    """The stop strings a user of this workload would ask for."""
    stop_as_ids: bool = False
    """Whether that user would send them as token ids where it can (`workloads.stop_fields`)."""


def to_challenge(drawn: ChallengePrompt, rendered: str | None, max_tokens: int,
                 encode: Callable[[str], Sequence[int]] | None = None) -> Challenge:
    """The challenge of a drawn prompt, asking for at most `max_tokens`: a chat is committed as
    `rendered`, the text the reference model's chat template makes of it (which the node will sign);
    without one, the prompt goes as a completion. Its stop strings go as token ids where the user would
    send them so and `encode` (the reference model's tokenizer) makes one token of them."""
    cap = min(drawn.max_tokens, max_tokens)
    stop, stop_ids = drawn.stop, ()
    if encode is not None:
        stop, stop_ids = workloads.stop_fields(drawn.stop, drawn.stop_as_ids, encode)
    if rendered is None:
        return Challenge.new(drawn.text, milli(drawn.temperature), max_tokens=cap, earlier=drawn.earlier,
                             top_p=milli(drawn.top_p), stop=stop, stop_token_ids=stop_ids)
    return Challenge.new(rendered, milli(drawn.temperature), drawn.text, cap, drawn.earlier,
                         milli(drawn.top_p), stop, stop_ids)


def _chance(share: float) -> bool:
    """True with probability `share`, from `secrets`."""
    return secrets.randbelow(_ONE) < share * _ONE


def _pick(weights: dict[Any, int]) -> Any:
    """A value of `weights` (value: weight) drawn from `secrets`."""
    values = sorted(weights)
    pick = secrets.randbelow(sum(weights.values()))
    return next(v for v, upto in zip(values, itertools.accumulate(weights[v] for v in values), strict=True)
                if pick < upto)


def prompt_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class ChallengeSource:
    """Fresh challenges from one workload, scaled for the served models' context (`scale`, as in
    `workloads.generate`), at most `max_prompt_len` tokens long when given.

    `greedy_share`, `chat_share` and `stop_share` replace the workload's own shares of greedy requests,
    of chat requests and of requests with stop strings, for a network whose users' traffic is known to
    differ: challenges should look like it."""

    def __init__(self, workload: str = "mixed", *, scale: float = 1.0, max_prompt_len: int | None = None,
                 used_file: Path | None = None, length: Callable[[str], int] | None = None,
                 greedy_share: float | None = None, chat_share: float | None = None,
                 stop_share: float | None = None, followup_share: float = workloads.FOLLOWUP_SHARE) -> None:
        if workload not in workloads.WORKLOADS:
            raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(workloads.WORKLOADS)}")
        for name, share in (("greedy_share", greedy_share), ("chat_share", chat_share),
                            ("stop_share", stop_share), ("followup_share", followup_share)):
            if share is not None and not 0 <= share <= 1:
                raise ValueError(f"{name} must lie in [0, 1], got {share}")
        self.greedy_share = greedy_share
        self.chat_share = chat_share
        self.stop_share = stop_share
        self.followup_share = followup_share
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
        """`count` prompts never drawn before (by this source or, through its file, by an earlier one),
        each picked uniformly from a run of users' requests, so that follow-ups, which a run has only
        once its sessions have started, are as common among challenges as among users' requests."""
        fresh: list[ChallengePrompt] = []
        for _ in range(MAX_REDRAWS):
            need = count - len(fresh)
            fresh += self._run(max(RUN, 2 * need), need)
            if len(fresh) == count:
                self._record(fresh)
                return fresh
        self._record(fresh)
        raise ChallengeError(f"only {len(fresh)} of {count} fresh challenges after {MAX_REDRAWS} draws; "
                             f"raise max_prompt_len or scale")

    def _run(self, length: int, need: int) -> list[ChallengePrompt]:
        """Up to `need` requests of one generator run, picked uniformly among those that fit and were
        never used (each checked only when its turn in a shuffle comes, so a run costs tokenizing only
        what is tried), follow-ups with the lengths of their sessions' earlier turns."""
        sessions: dict[str, tuple[int, ...]] = {}
        turns = []
        for request in workloads.generate(self.workload, rate=1.0, count=length, seed=secrets.randbits(63),
                                          scale=self.scale, followup=self.followup_share):
            earlier = sessions.get(request.session, ()) if request.session is not None else ()
            if request.session is not None:
                sessions[request.session] = (*earlier, len(request.text))
            turns.append((request, earlier))
        secrets.SystemRandom().shuffle(turns)
        picked: list[ChallengePrompt] = []
        for request, earlier in turns:
            if len(picked) == need:
                break
            text = request.text
            digest = prompt_digest(text)
            if digest in self.used or self._too_long(request.prompt_len, text):
                continue
            self.used.add(digest)
            picked.append(ChallengePrompt(text, request.max_tokens, request.workload,
                                          self._temperature(request.temperature), self._chat(request.chat),
                                          earlier, request.top_p, *self._stop(request)))
        return picked

    def _temperature(self, drawn: float) -> float:
        if self.greedy_share is None:
            return drawn
        if _chance(self.greedy_share):
            return 0.0
        return _pick({t: weight for t, weight in workloads.TEMPERATURES.items() if t > 0})

    def _chat(self, drawn: bool) -> bool:
        return drawn if self.chat_share is None else _chance(self.chat_share)

    def _stop(self, request: workloads.Request) -> tuple[tuple[str, ...], bool]:
        """The request's stop strings and whether it sends them as ids; with `stop_share`, drawn afresh
        at that share from the workload's pool."""
        if self.stop_share is None:
            return request.stop, request.stop_as_ids
        if not _chance(self.stop_share):
            return (), False
        return _pick(workloads.STOPS), _chance(workloads.STOP_AS_IDS_SHARE)

    def _too_long(self, pieces: int, text: str) -> bool:
        if self.max_prompt_len is None:
            return False
        return (self.length(text) if self.length is not None else pieces) > self.max_prompt_len

    def _record(self, drawn: list[ChallengePrompt]) -> None:
        """Append before the prompts are used, and flush to disk, so a crash cannot lead to a repeat. The
        file is the owner's alone: whoever reads it recognises each challenge by its prompt's digest."""
        if self.used_file is None or not drawn:
            return
        self.used_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        append_private(self.used_file, "".join(prompt_digest(c.text) + "\n" for c in drawn), durable=True)
