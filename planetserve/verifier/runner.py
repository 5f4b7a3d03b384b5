"""Starting the verifier daemon from its home until it is told to stop."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from planetserve.chain.client import LedgerClient
from planetserve.chain.keys import KeySet, retired_key_file
from planetserve.metrics import serve_role
from planetserve.verifier.challenges import ChallengeSource
from planetserve.verifier.config import USED_PROMPTS_FILE, VerifierConfig
from planetserve.verifier.credibility import ReferenceModel
from planetserve.verifier.daemon import Daemon, collector
from planetserve.verifier.overlay import OverlayChannel

log = logging.getLogger(__name__)


def reference_models(config: VerifierConfig) -> dict[str, ReferenceModel]:
    """Each registered model id's reference, loaded once (ids sharing a checkpoint share it)."""
    from planetserve.models import load

    names = sorted(set(config.models.values()))
    loaded = {name: load(name, data_dir=config.data_dir or None) for name in names}
    return {model_id: ReferenceModel.from_loaded(loaded[name], calibrated=config.credibility == "calibrated",
                                                 model_id=model_id, tolerance=config.tolerance)
            for model_id, name in sorted(config.models.items())}


def _longest(references: dict[str, ReferenceModel], text: str) -> int:
    """The most tokens `text` takes for any served model, as a completion or as a rendered chat."""
    return max(len(r.prompt_ids(form)) for r in references.values()
               for form in (text, r.chat_prompt(text)) if form is not None)


def challenge_source(config: VerifierConfig, home: Path,
                     references: dict[str, ReferenceModel]) -> ChallengeSource:
    """The workload generator challenges are drawn from, warmed up now (its first draw builds the
    corpus) rather than inside the first plan window."""
    max_len = min(r.max_len for r in references.values())
    source = ChallengeSource(config.workload, scale=config.scale,
                             max_prompt_len=min(config.max_prompt_tokens, max_len - config.max_tokens),
                             used_file=home / USED_PROMPTS_FILE,
                             length=lambda text: _longest(references, text),
                             greedy_share=config.greedy_share, chat_share=config.chat_share,
                             stop_share=config.stop_share)
    source.warm_up()
    return source


def build_daemon(home: Path) -> tuple[Daemon, VerifierConfig]:
    begun = time.monotonic()
    config = VerifierConfig.load(home)
    keys = KeySet.load(Path(config.keys))
    retired_file = retired_key_file(Path(config.keys))
    retired = KeySet.load(retired_file) if retired_file.exists() else None
    # a bad genesis fails before models load
    ledger = LedgerClient.verified(config.rpc, config.genesis, witness=config.witness, max_age=config.max_age)
    opened = time.monotonic()
    references = reference_models(config)
    loaded = time.monotonic()
    source = challenge_source(config, home, references)
    warm = time.monotonic()
    # a restarted leader must be back before its plan window closes: how long each step took says what to cut
    log.info("started in %.1f s: ledger %.1f s, models %.1f s, workload %.1f s", warm - begun,
             opened - begun, loaded - opened, warm - loaded)
    channel = OverlayChannel(config.relay, timeout=config.challenge_timeout, max_tokens=config.max_tokens,
                             logprobs_share=config.logprobs_share)
    daemon = Daemon(keys, ledger, references, channel, source, home,
                    calibrated=config.credibility == "calibrated", concurrency=config.concurrency,
                    attempts=config.attempts, rechallenge_share=config.rechallenge_share,
                    silent_escape=config.silent_escape, retired=retired)
    return daemon, config


def run_verifier(home: Path, ready: Callable[[Daemon, VerifierConfig], None] | None = None) -> None:
    """Run until SIGINT/SIGTERM; `ready` hears once the models are loaded and the ledger is open."""
    daemon, config = build_daemon(home)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    log.info("verifier %s running against %s", daemon.me.hex()[:16], config.rpc)
    stop_metrics = serve_role(config.metrics, collector(daemon))
    try:
        if ready is not None:
            ready(daemon, config)
        daemon.run(stop, config.poll_interval)
    finally:
        stop_metrics()
