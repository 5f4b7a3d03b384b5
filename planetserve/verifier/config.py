"""The verifier daemon's home: verifier.json (settings) beside the files the daemon keeps there."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from planetserve import workloads
from planetserve.chain.challenge import MAX_CHALLENGE_TOKENS
from planetserve.chain.keys import append_private
from planetserve.config import HomeError, LedgerHome
from planetserve.verifier.coverage import SILENT_ESCAPE
from planetserve.verifier.credibility import TOLERANCE

RECHALLENGE_SHARE = 0.67
"""With four members, about three answers per node and epoch (the leader's and two re-challenges): the
number bench/detection.py needs to untrust every node whose tokens differ from the model's within five
epochs (docs/detection.md). The daemon raises it where the committee is too small for it to see a silent
node reported (`silent_escape`): four members re-challenge every node."""

CONFIG_FILE = "verifier.json"
USED_PROMPTS_FILE = "used_prompts"
"""sha256 of every challenge prompt ever drawn, so none is sent twice (challenges.ChallengeSource)."""
RECHALLENGE_FILE = "rechallenges.jsonl"
"""Prompt and salt of each re-challenge, written before its commitment goes to the ledger."""
SUBMISSIONS_FILE = "submissions.jsonl"
"""One line per transaction the daemon submitted: what, for which epoch, and the ledger's answer."""
STATUS_FILE = "status.json"
CREDIBILITIES = ("calibrated", "ppl")


def read_submissions(home: Path) -> list[dict]:
    """The submissions journal in order (none before the daemon's first)."""
    return read_journal(home / SUBMISSIONS_FILE)


def read_journal(path: Path) -> list[dict]:
    """The objects of a JSON-lines journal in order; a line cut short by a crash is skipped."""
    if not path.exists():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


class JsonLines:
    """An append-only journal of JSON objects, one a line, readable by the owner only. A crash can cut
    its last line: reading skips it, and opening ends it, so the next entry is not glued onto it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.exists():
            return
        with path.open("rb+") as fh:
            if fh.seek(0, os.SEEK_END):
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":
                    fh.write(b"\n")

    def read(self) -> list[dict]:
        return read_journal(self.path)

    def append(self, entry: dict[str, Any], durable: bool = False) -> None:
        """Add one entry; `durable` returns only once it is on disk."""
        append_private(self.path, json.dumps(entry) + "\n", durable)


@dataclass
class VerifierConfig(LedgerHome):
    FILE: ClassVar[str] = CONFIG_FILE
    INIT: ClassVar[str] = "verifier init"
    URLS: ClassVar[tuple[str, ...]] = ("relay",)

    keys: str
    """The committee member's key file (operator, VRF and X25519 keys): the validator's own."""
    relay: str = "http://127.0.0.1:8080"
    """A user relay's local OpenAI-compatible endpoint: challenges travel the anonymous overlay."""
    models: dict[str, str] = field(default_factory=lambda: {"gt": "gt"})
    """Registered model id → the reference model scoring its nodes (family name or checkpoint dir)."""
    data_dir: str = ""
    credibility: str = "calibrated"
    """calibrated (the default, docs/detection.md) or ppl (the paper's 1/PPL)."""
    tolerance: float = TOLERANCE
    """Nats a token may fall short of the honest choice under its signed decoding for free (rounding)."""
    workload: str = "mixed"
    scale: float = 0.05
    """Workload lengths are scaled by this for the served models' context (workloads.generate)."""
    greedy_share: float | None = None
    """Share of challenges asking for greedy answers; None: the workload's (workloads.TEMPERATURES).
    Set it to what the network's users send, so that challenges look like their requests."""
    chat_share: float | None = None
    """Share of challenges sent as a chat message; None: the workload's (workloads.CHAT_SHARE)."""
    stop_share: float | None = None
    """Share of challenges with stop strings (from workloads.STOPS); None: the workload's
    (workloads.STOP_SHARE)."""
    logprobs_share: float = workloads.LOGPROBS_SHARE
    """Share of challenges asking for each token's log-probability, as the workload's programs ask."""
    rechallenge_share: float = RECHALLENGE_SHARE
    """Share of the planned nodes the leader did answer that this member challenges again with a prompt
    of its own, each epoch, drawn secretly (verifier/daemon.py): more answers per node and epoch, so a
    node that cheats on some requests, or deviates on a few tokens, is caught sooner. The daemon raises
    it where the committee is too small for `silent_escape`."""
    silent_escape: float = SILENT_ESCAPE
    """The most a node silent on all but the leader's challenge may expect to escape an epoch unreported:
    the share above is raised until members the node cannot count on (all but the leader and a colluding
    third of the power) report it with at least 1 - this (verifier/coverage.py; the default, 0.01, has
    every member re-challenge every node in a committee of four). 1 keeps `rechallenge_share` as it
    is."""
    max_prompt_tokens: int = 256
    max_tokens: int = 64
    challenge_timeout: float = 60.0
    poll_interval: float = 1.0
    concurrency: int = 8
    """Challenges in flight at once."""
    attempts: int = 2
    """Tries per challenge (2 s apart) before the node is reported as giving no valid answer."""

    def check(self) -> None:
        super().check()
        if not self.keys:
            raise HomeError(f"{CONFIG_FILE}: `keys` must name the member's key file")
        if self.credibility not in CREDIBILITIES:
            raise HomeError(f"{CONFIG_FILE}: credibility must be one of {', '.join(CREDIBILITIES)}")
        if self.workload not in workloads.WORKLOADS:
            raise HomeError(f"{CONFIG_FILE}: workload must be one of {', '.join(workloads.WORKLOADS)}")
        pairs = self.models.items() if isinstance(self.models, dict) else ()
        if not pairs or not all(isinstance(k, str) and isinstance(v, str) for k, v in pairs):
            raise HomeError(f"{CONFIG_FILE}: models must map model ids to reference models")
        for name in ("max_prompt_tokens", "max_tokens", "concurrency", "attempts"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise HomeError(f"{CONFIG_FILE}: {name} must be a positive integer")
        if self.max_tokens > MAX_CHALLENGE_TOKENS:
            raise HomeError(f"{CONFIG_FILE}: max_tokens must be at most {MAX_CHALLENGE_TOKENS}, so that an "
                            "answer fits the transaction that reveals it")
        for name, nullable in (("greedy_share", True), ("chat_share", True), ("stop_share", True),
                               ("logprobs_share", False), ("rechallenge_share", False),
                               ("silent_escape", False)):
            share = getattr(self, name)
            if share is None and nullable:
                continue
            if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
                either = "be null or " if nullable else ""
                raise HomeError(f"{CONFIG_FILE}: {name} must {either}lie in [0, 1]")
        if not 0 <= self.tolerance < 10:
            raise HomeError(f"{CONFIG_FILE}: tolerance must lie in [0, 10) nats")
        for name in ("scale", "challenge_timeout", "poll_interval"):
            if not getattr(self, name) > 0:
                raise HomeError(f"{CONFIG_FILE}: {name} must be positive")
