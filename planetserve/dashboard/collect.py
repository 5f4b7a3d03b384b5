"""One snapshot of the whole system for the dashboard (`/api/state`), gathered in a worker thread.

Sources, each read as a client of the system would read it:

- validators: every given CometBFT RPC endpoint's `/status` (height, app hash, block time), in
  parallel;
- the ledger: verified reads (`LedgerClient.verified`: proofs against app hashes that more than 2/3
  of the committee signed, from the genesis file alone) through the first endpoint that answers, in
  one consistent snapshot: the epoch and its phase, the committee, model nodes with their reputation
  and listing, organisations with their credits;
- reputation history: the reputations the ledger held right after each of the last HISTORY_EPOCHS
  epochs was finalized (the state of its last block, read at that past height and verified the same
  way; read once per epoch, a few per snapshot, and kept), then the current values. While a past
  epoch cannot be read, the values this process sampled during that epoch stand in for it;
- the overlay: a user relay's `/v1/planetserve/status` (live paths and its request counters).

Nothing raises out of `Collector.collect`: a source that fails leaves its part empty with an `error`
string saying why.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from planetserve.chain.client import TRANSIENT, LedgerClient, QueryRefused
from planetserve.chain.lightclient import DEFAULT_MAX_AGE
from planetserve.chain.rpc import RpcClient, read_limited
from planetserve.registry.credits import format_credits
from planetserve.registry.entities import ModelNode
from planetserve.registry.epochs import Epoch, Schedule
from planetserve.registry.reputation import ReputationRule, is_trusted

log = logging.getLogger(__name__)

HISTORY_EPOCHS = 48
"""Finalized epochs the reputation plot goes back."""
BACKFILL_PER_SNAPSHOT = 4
"""Past epochs read from the ledger per snapshot (the rest on the next ones)."""
RPC_TIMEOUT = 3.0
RELAY_TIMEOUT = 3.0
MAX_RELAY_STATUS_BYTES = 1 << 20
MAX_ERROR_CHARS = 400


def error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


@dataclass(frozen=True)
class Settings:
    genesis: Path
    rpc: tuple[str, ...]
    """CometBFT RPC endpoints: every validator's, shown each; ledger reads use the first that answers."""
    relay: str | None = None
    """A user relay's HTTP base URL (http://host:port): overlay health and the chat."""
    model: str | None = None
    """The model the chat asks (None: the first the relay lists)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Model node key (hex) → a name to show for it."""
    max_age: float = DEFAULT_MAX_AGE
    """Seconds the latest verified header may be old (the light client's bound): an endpoint serving an
    older state shows as an error, and the next endpoint is read."""
    witness: str = ""
    """A CometBFT RPC endpoint whose header of each height must hash like the one verified from the
    endpoint read ("": none): a fork, or a witness that lies or is down, shows as the ledger's error."""


def _phase(schedule: Schedule, height: int) -> tuple[str, list[str]]:
    """The epoch's phase at `height` and the windows open then (registry/epochs.py's timeline)."""
    windows = [name for name, is_open in (("results", schedule.in_results(height)),
                                          ("plan", schedule.in_plan_window(height)),
                                          ("vrf", schedule.in_vrf_window(height))) if is_open]
    if "vrf" in windows:
        return "election", windows
    if "plan" in windows:
        return "plan", windows
    if "results" in windows:
        return "results", windows
    return "attest", windows


PHASES = {
    "results": "the leader sends its plan's challenges through the overlay and submits the signed answers; "
               "members score and attest them",
    "attest": "members attest results and re-challenge nodes (without a valid answer, and a secret share)",
    "plan": "the leader commits the challenge plan of the next epoch",
    "election": "members submit VRF proofs electing the next epoch's leader; the next plan is committed",
}


class Collector:
    """Gathers snapshots; not thread-safe: one `collect` at a time (the server serializes them)."""

    def __init__(self, settings: Settings) -> None:
        if not settings.rpc:
            raise ValueError("at least one RPC endpoint is needed")
        self.settings = settings
        self._status_rpcs = [RpcClient(url, timeout=RPC_TIMEOUT) for url in settings.rpc]
        self._ledgers: dict[str, LedgerClient] = {}
        self._preferred = 0
        self._history: dict[int, dict[str, Any]] = {}
        """Epoch → reputations right after it was finalized, as the ledger holds them."""
        self._unavailable: set[int] = set()
        """Past epochs the ledger refused to answer for (their state is gone): not asked again."""
        self._samples: dict[int, dict[str, Any]] = {}
        """Epoch → the last reputations this process saw during it (stands in for unread history)."""
        self._http = httpx.Client(timeout=RELAY_TIMEOUT, trust_env=False)
        self._pool = ThreadPoolExecutor(max_workers=len(settings.rpc) + 1, thread_name_prefix="dashboard")
        self._lock = threading.Lock()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for rpc in self._status_rpcs:
            rpc.close()
        for ledger in self._ledgers.values():
            ledger.rpc.close()
        self._http.close()

    # -- the snapshot ------------------------------------------------------------------------------

    def collect(self) -> dict[str, Any]:
        with self._lock:
            began = time.monotonic()
            overlay = self._pool.submit(self.overlay)
            statuses = [self._pool.submit(self.validator, i) for i in range(len(self.settings.rpc))]
            ledger = self.ledger()
            validators = [f.result() for f in statuses]
            _name_leaders(ledger, validators)
            heights = {}
            for v in validators:
                if v["height"] is not None:
                    heights.setdefault(v["height"], set()).add(v["app_hash"])
            chain_id = next((v["chain_id"] for v in validators if v["chain_id"]), None)
            return {
                "time": round(time.time(), 3),
                "chain_id": chain_id,
                "validators": validators,
                "validators_agree": None if not heights else all(len(h) == 1 for h in heights.values()),
                **ledger,
                "overlay": overlay.result(),
                "took_ms": round((time.monotonic() - began) * 1000),
            }

    # -- validators --------------------------------------------------------------------------------

    def validator(self, index: int) -> dict[str, Any]:
        url = self.settings.rpc[index]
        entry: dict[str, Any] = {"rpc": url, "moniker": None, "chain_id": None, "height": None,
                                 "app_hash": None, "block_time": None, "catching_up": None,
                                 "voting_power": None, "consensus_key": None, "error": None}
        try:
            raw = self._status_rpcs[index].status()
            info, node, validator = raw["sync_info"], raw["node_info"], raw["validator_info"]
            entry.update(
                moniker=str(node["moniker"])[:64], chain_id=str(node["network"])[:64],
                height=int(info["latest_block_height"]), app_hash=str(info["latest_app_hash"])[:128],
                block_time=str(info["latest_block_time"])[:64], catching_up=bool(info["catching_up"]),
                voting_power=int(validator["voting_power"]),
                consensus_key=base64.b64decode(validator["pub_key"]["value"], validate=True).hex(),
            )
        except Exception as exc:  # unreachable, or an answer of the wrong shape: shown, never raised
            entry["error"] = error_text(exc)
        return entry

    # -- the ledger --------------------------------------------------------------------------------

    def _ledger(self, url: str) -> LedgerClient:
        if url not in self._ledgers:
            settings = self.settings
            self._ledgers[url] = LedgerClient.verified(url, settings.genesis, witness=settings.witness,
                                                       max_age=settings.max_age)
        return self._ledgers[url]

    def ledger(self) -> dict[str, Any]:
        """The ledger's sections, from the first endpoint whose latest header verifies."""
        urls = self.settings.rpc
        order = [urls[(self._preferred + i) % len(urls)] for i in range(len(urls))]
        errors = []
        for url in order:
            try:
                ledger = self._ledger(url)
                with ledger.snapshot() as header:
                    sections = self._read(ledger, header)
            except TRANSIENT as exc:
                errors.append(f"{url}: {error_text(exc)}")
                continue
            except Exception as exc:  # e.g. a malformed genesis file: the same on every endpoint
                errors.append(f"{url}: {error_text(exc)}")
                break
            self._preferred = urls.index(url)
            sections["ledger"] = {"rpc": url, "height": header - 1, "verified": True,
                                  "error": "; ".join(errors) or None}
            if "current" in sections:
                self._history_points(ledger, sections.pop("current"), sections["nodes"])
            return sections
        why = "no RPC endpoint gave a verified answer: " + " | ".join(errors)
        return {
            "ledger": {"rpc": None, "height": None, "verified": False, "error": why},
            "epoch": {"error": why},
            "nodes": {"error": why, "items": [], "history": [], "threshold": None, "initial": None,
                      "history_error": None},
            "organisations": {"error": why, "items": []},
        }

    def _read(self, ledger: LedgerClient, header: int) -> dict[str, Any]:
        height = header - 1
        params = ledger.params()
        schedule = Schedule.from_params(params)
        rule = ReputationRule.from_params(params)
        out: dict[str, Any] = {}
        try:
            out["epoch"] = self._epoch(ledger, schedule, height)
        except TRANSIENT:
            raise
        except Exception as exc:
            out["epoch"] = {"error": error_text(exc)}
        try:
            registered = ledger.registered_nodes()
            listed = {n.pubkey for n in ledger.nodes()[1]}
            reputations = {r.node: r for r in ledger.reputations()[1]}
        except TRANSIENT:
            raise
        except Exception as exc:
            out["nodes"] = {"error": error_text(exc), "items": [], "history": [], "history_error": None,
                            "threshold": rule.untrusted, "initial": rule.initial}
            out["organisations"] = {"error": error_text(exc), "items": []}
            return out
        items = []
        for node in sorted(registered, key=lambda n: (self._label(n) or "~", n.pubkey)):
            record = reputations.get(node.pubkey)
            value = record.value if record is not None else rule.initial
            items.append({
                "key": node.pubkey.hex(), "name": self._label(node), "org_id": node.org_id,
                "model_id": node.model_id, "address": node.address, "hardware": node.hardware,
                "region": node.region, "capacity": node.capacity, "status": node.status,
                "listed": node.pubkey in listed,
                "trusted": record.trusted if record is not None else is_trusted(rule, value),
                "reputation": value, "scored_epochs": record.epochs if record is not None else 0,
                "last_epoch": record.last_epoch if record is not None else None,
                "window": list(record.window) if record is not None else [],
            })
        out["nodes"] = {"error": None, "items": items, "history": [], "history_error": None,
                        "threshold": rule.untrusted, "initial": rule.initial}
        try:
            out["organisations"] = {"error": None, "items": _organisations(ledger, items, rule)}
        except TRANSIENT:
            raise
        except Exception as exc:
            out["organisations"] = {"error": error_text(exc), "items": []}
        out["current"] = {"epoch": schedule.epoch_of(max(height, 1)), "height": height, "schedule": schedule,
                          "initial": rule.initial,
                          "values": {item["key"]: item["reputation"] for item in items}}
        return out

    def _label(self, node: ModelNode) -> str | None:
        return self.settings.labels.get(node.pubkey.hex())

    def _epoch(self, ledger: LedgerClient, schedule: Schedule, height: int) -> dict[str, Any]:
        number = schedule.epoch_of(max(height, 1))
        record = ledger.epoch(number)
        phase, windows = _phase(schedule, max(height, 1))
        entry: dict[str, Any] = {
            "number": number, "height": height, "start": schedule.start(number), "end": schedule.end(number),
            "offset": schedule.offset(max(height, 1)), "blocks": schedule.epoch_blocks,
            "blocks_left": schedule.end(number) - height, "phase": phase, "phase_detail": PHASES[phase],
            "windows": windows, "error": None,
        }
        entry.update(_epoch_fields(record, "") if record is not None else {"leader": None})
        upcoming = ledger.epoch(number + 1)
        entry.update(_epoch_fields(upcoming, "next_") if upcoming is not None else {"next_leader": None})
        _, members = ledger.committee()
        entry["committee"] = [{"operator": m.operator.hex(), "consensus_key": m.consensus_key.hex(),
                               "power": m.power, "credential": m.credential} for m in members]
        return entry

    # -- reputation history ------------------------------------------------------------------------

    def _history_points(self, ledger: LedgerClient, current: dict[str, Any], nodes: dict[str, Any]) -> None:
        schedule: Schedule = current["schedule"]
        now = current["epoch"]
        low = max(0, now - HISTORY_EPOCHS)
        self._samples[now] = {"epoch": now, "height": current["height"], "values": current["values"]}
        for store in (self._history, self._samples):
            for epoch in [e for e in store if e < low]:
                del store[epoch]
        self._unavailable = {e for e in self._unavailable if e >= low}
        read = 0
        for epoch in range(now - 1, low - 1, -1):  # newest first, a few per snapshot
            if epoch in self._history or epoch in self._unavailable:
                continue
            if read == BACKFILL_PER_SNAPSHOT:
                break
            read += 1
            try:
                self._history[epoch] = self._past(ledger, schedule.end(epoch), epoch, current["initial"])
            except QueryRefused as exc:  # the endpoint's app no longer holds that state
                if "refused (code" not in str(exc):
                    nodes["history_error"] = f"epoch {epoch}: {error_text(exc)}"
                    break
                self._unavailable.add(epoch)
            except Exception as exc:
                nodes["history_error"] = f"epoch {epoch}: {error_text(exc)}"
                break
        points = []
        for epoch in range(low, now):
            if epoch in self._history:
                points.append({**self._history[epoch], "source": "ledger"})
            elif epoch in self._samples:
                points.append({**self._samples[epoch], "source": "sampled"})
        points.append({"epoch": now, "height": current["height"], "values": current["values"],
                       "source": "current"})
        nodes["history"] = points

    @staticmethod
    def _past(ledger: LedgerClient, height: int, epoch: int, initial: int) -> dict[str, Any]:
        """The reputations in the state of `height`, the last block of `epoch` (after its finalization)."""
        with ledger.snapshot(height):
            registered = ledger.registered_nodes()
            values = {r.node: r.value for r in ledger.reputations()[1]}
        return {"epoch": epoch, "height": height,
                "values": {n.pubkey.hex(): values.get(n.pubkey, initial) for n in registered}}

    # -- the overlay -------------------------------------------------------------------------------

    def overlay(self) -> dict[str, Any]:
        relay = self.settings.relay
        entry: dict[str, Any] = {"relay": relay, "live_paths": None, "paths": [], "requests": None,
                                 "answered": None, "failed": None, "delivery_rate": None, "model_nodes": None,
                                 "registered_nodes": None, "users": None, "relayed_paths": None,
                                 "path_counters": {}, "last_path_error": None, "error": None}
        if relay is None:
            entry["error"] = "no user relay given (--relay): overlay health and the chat are off"
            return entry
        try:
            with self._http.stream("GET", f"{relay}/v1/planetserve/status") as reply:
                if reply.status_code != 200:
                    raise ValueError(f"the relay answered HTTP {reply.status_code}")
                status = json.loads(read_limited(reply, MAX_RELAY_STATUS_BYTES))
            counters = status.get("counters") or {}
            paths = [{"proxy": str(p.get("proxy", ""))[:64], "age": p.get("age"), "misses": p.get("misses")}
                     for p in status.get("paths", ())[:64] if isinstance(p, dict)]
            answered, failed = int(counters.get("answered", 0)), int(counters.get("failed", 0))
            entry.update(
                live_paths=len(status.get("paths", ())), paths=paths,
                requests=int(counters.get("requests", 0)), answered=answered, failed=failed,
                delivery_rate=round(answered / (answered + failed), 4) if answered + failed else None,
                model_nodes=status.get("model_nodes"), registered_nodes=status.get("registered_nodes"),
                users=status.get("users"), relayed_paths=status.get("relayed_paths"),
                path_counters={str(k)[:40]: v for k, v in dict(status.get("path_counters") or {}).items()
                               if isinstance(v, int)},
                last_path_error=(str(status["last_path_error"])[:MAX_ERROR_CHARS]
                                 if status.get("last_path_error") else None),
            )
        except Exception as exc:  # unreachable, too large, or not the relay's shape
            entry["error"] = error_text(exc)
        return entry


def _epoch_fields(record: Epoch, prefix: str) -> dict[str, Any]:
    return {f"{prefix}leader": record.leader.hex() or None, f"{prefix}election": record.election,
            f"{prefix}plan_status": record.plan_status, f"{prefix}plan_nodes": record.plan_nodes,
            f"{prefix}finalized": record.finalized, f"{prefix}scored": record.scored,
            f"{prefix}faults": record.faults}


def _organisations(ledger: LedgerClient, nodes: list[dict[str, Any]], rule: ReputationRule) -> list[dict]:
    """Each organisation with its credits and its reputation (the minimum of its nodes')."""
    _, orgs = ledger.organisations()
    _, accounts = ledger.credit_accounts()
    credits = {a.org_id: a for a in accounts}
    out = []
    for org in sorted(orgs, key=lambda o: o.org_id):
        mine = [n for n in nodes if n["org_id"] == org.org_id]
        reputation = min((n["reputation"] for n in mine), default=None)
        account = credits.get(org.org_id)
        balance, earned, spent = (account.balance, account.earned, account.spent) if account else (0, 0, 0)
        out.append({"org_id": org.org_id, "name": org.name, "owner": org.owner.hex(), "nodes": len(mine),
                    "reputation": reputation,
                    "trusted": None if reputation is None else is_trusted(rule, reputation),
                    "balance": format_credits(balance), "earned": format_credits(earned),
                    "spent": format_credits(spent), "balance_credit_seconds": balance})
    return out


def _name_leaders(sections: dict[str, Any], validators: list[dict[str, Any]]) -> None:
    """Name the epoch's leaders by the moniker of the validator whose consensus key is theirs."""
    epoch = sections.get("epoch") or {}
    monikers = {v["consensus_key"]: v["moniker"] for v in validators if v["consensus_key"]}
    operators = {m["operator"]: monikers.get(m["consensus_key"]) for m in epoch.get("committee", ())}
    for prefix in ("", "next_"):
        if f"{prefix}leader" in epoch:
            epoch[f"{prefix}leader_name"] = operators.get(epoch[f"{prefix}leader"])
