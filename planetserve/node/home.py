"""The home directory of a model node (node.json) or a user relay (user.json): its configuration and
its key file (node_keys.json)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from planetserve.chain.keys import KeySet, next_key_file
from planetserve.config import HomeConfig, HomeError, LedgerHome
from planetserve.node.behaviours import HONEST, check_behaviour

CONFIG_FILE = "node.json"
USER_CONFIG_FILE = "user.json"
KEYS_FILE = "node_keys.json"
NEXT_KEYS_FILE = next_key_file(Path(KEYS_FILE)).name
"""The key a node rotates to (`planetserve node rotate-key`), until the ledger's rotation makes it the
node's key and it replaces node_keys.json."""
ENGINE_SAMPLING = ("server", "vllm-processor")
"""How sampled requests reach an engine_url server (`engine/remote.py`): "server" sends temperature and
seed for the server to sample with (its answers verify only if it samples by the protocol, as
planetserve's own engine server does, not plain `vllm serve`); "vllm-processor" sends temperature 0
and the protocol's temperature and seed in vllm_xargs, for `vllm serve` running planetserve's logits
processor (docs/operators.md, "Serving with vLLM")."""
__all__ = ["ENGINE_SAMPLING", "HomeConfig", "HomeError", "ModelNodeConfig", "UserConfig", "init_home",
           "load_keys"]


@dataclass
class ModelNodeConfig(LedgerHome):
    FILE: ClassVar[str] = CONFIG_FILE
    INIT: ClassVar[str] = "node init-model"
    HOST_PORTS: ClassVar[tuple[str, ...]] = ("http", "peer", "advertise")
    URLS: ClassVar[tuple[str, ...]] = ("engine_url",)
    OPTIONAL: ClassVar[tuple[str, ...]] = ("advertise", "engine_url")

    org_id: str
    model_id: str
    """The model id registered on the ledger (the group this node joins)."""
    model: str = "gt"
    """What the built-in engine loads: a trained family name or a Hugging Face checkpoint directory."""
    http: str = "127.0.0.1:8000"
    """OpenAI-compatible API (host:port)."""
    peer: str = "127.0.0.1:9000"
    """TLS peer port (host:port) other model nodes and proxies dial."""
    advertise: str = ""
    """The peer address registered on the ledger; defaults to `peer`."""
    region: str = "global"
    hardware: str = "cpu"
    capacity: int = 4
    """Sequences decoded concurrently; also the registered capacity."""
    memory_mib: int = 0
    """Memory the node offers a model (MiB), registered for pipelines; 0 declares none. Less than a
    sized model needs makes the node a pipeline stage: it waits for a deployment to assign it layers."""
    gflops: int = 0
    """Compute throughput (GFLOP/s), registered for pipelines."""
    engine_url: str = ""
    """An OpenAI-compatible server (e.g. `vllm serve`) to use instead of the built-in engine."""
    kv_events: str = ""
    """That server's KV-event ZMQ endpoint, e.g. ipc:///run/ps-mn1/kv-events.sock (a socket in a directory
    only the engine's account may enter: the events carry every cached prompt's token ids)."""
    kv_events_replay: str = ""
    """Its KV-event replay endpoint (vLLM's `replay_endpoint`), e.g. ipc:///run/ps-mn1/kv-replay.sock:
    events the node misses are asked for there rather than forgetting the mirrored cache."""
    engine_sampling: str = "server"
    """How that server samples (ENGINE_SAMPLING): "vllm-processor" for `vllm serve` with planetserve's
    logits processor, whose sampled answers verify; "server" leaves sampling to the server."""
    data_dir: str = ""
    max_prompt_tokens: int = 896
    max_tokens: int = 128
    cache_tokens: int = 8192
    block_size: int = 16
    prefill_chunk: int = 512
    """Prompt tokens the built-in engine prefills per step, so a long prompt never stalls running decodes
    for more than one chunk's time."""
    kv_budget_tokens: int = 0
    """KV positions the built-in engine may reserve for running sequences; 0 sizes it from the GPU's free
    memory (on a CPU, capacity x the model's length). Beyond it requests wait, and past a full queue
    they are refused with 503."""
    hash_bits: int = 8
    match_depth: int = 2
    sync_interval: float = 5.0
    delta_interval: float = 0.1
    load_interval: float = 1.0
    list_interval: float = 5.0
    behaviour: str = HONEST
    """Fault injection for testnets (`node/behaviours.py`): "honest", or a way of cheating the committee
    must catch."""

    def __post_init__(self) -> None:
        check_behaviour(self.behaviour)
        if self.engine_sampling not in ENGINE_SAMPLING:
            raise ValueError(f"unknown engine_sampling {self.engine_sampling!r}; valid: "
                             f"{', '.join(ENGINE_SAMPLING)}")
        if self.prefill_chunk < 1 or self.kv_budget_tokens < 0:
            raise ValueError("prefill_chunk must be >= 1 and kv_budget_tokens >= 0 (0 sizes it from memory)")

    @property
    def address(self) -> str:
        return self.advertise or self.peer


@dataclass
class UserConfig(LedgerHome):
    """A user relay: relays for others, keeps its own proxies, serves the local OpenAI endpoint."""

    FILE: ClassVar[str] = USER_CONFIG_FILE
    INIT: ClassVar[str] = "node init-user"
    HOST_PORTS: ClassVar[tuple[str, ...]] = ("http", "peer", "advertise")
    OPTIONAL: ClassVar[tuple[str, ...]] = ("advertise",)

    http: str = "127.0.0.1:8080"
    """The local OpenAI-compatible endpoint (host:port); keep it on loopback."""
    peer: str = "127.0.0.1:9100"
    """TLS port other relays and model nodes dial (host:port)."""
    advertise: str = ""
    """The address registered on the ledger; defaults to `peer`."""
    region: str = "global"
    proxies: int = 5
    """N: live proxies kept (at least n)."""
    n: int = 4
    k: int = 3
    response_timeout: float = 120.0
    """Seconds to wait for the first part of an answer, and between parts."""
    list_interval: float = 5.0
    ping_interval: float = 10.0
    path_lifetime: float = 600.0
    """Seconds each path serves before it is replaced over freshly chosen relays (each path's own
    lifetime is drawn within ±25% of it, so they rotate one by one); 0 never rotates. Shorter gives
    a proxy fewer of the user's requests to collect, at one path setup per rotation
    (`node/overlay/paths.py` PathSettings.lifetime says why ten minutes)."""
    path_uses: int = 1
    """Requests each path carries before it is replaced; 1 (the default) gives every request paths, and
    so proxies, that no earlier request of this user had, which is what keeps a model node from linking
    the user's requests by their proxies (PathSettings.uses). 0 leaves rotation to `path_lifetime`."""

    def check(self) -> None:
        super().check()
        value = self.path_lifetime
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
            raise HomeError(f"{self.FILE}: path_lifetime must be a number of seconds >= 0 (0: never "
                            f"rotate), got {value!r}")
        uses = self.path_uses
        if isinstance(uses, bool) or not isinstance(uses, int) or uses < 0:
            raise HomeError(f"{self.FILE}: path_uses must be a whole number of requests >= 0 (0: no limit), "
                            f"got {uses!r}")

    @property
    def address(self) -> str:
        return self.advertise or self.peer


def init_home(home: Path, config: HomeConfig, keys: KeySet | None = None) -> KeySet:
    """Create the home: configuration and a node key, fresh unless `keys` is given (a key the node
    already registered under); an existing home key is never replaced."""
    keys_path = home / KEYS_FILE
    if keys_path.exists():
        raise HomeError(f"{home} already has a node key; edit {home / config.FILE} to change settings")
    config.save(home)
    keys = keys or KeySet.generate()
    keys.save(keys_path)
    return keys


def load_keys(home: Path) -> KeySet:
    return KeySet.load(home / KEYS_FILE)


def next_keys(home: Path) -> KeySet | None:
    """The key the node rotates to, if one was prepared."""
    path = home / NEXT_KEYS_FILE
    return KeySet.load(path) if path.exists() else None


def prepare_next_keys(home: Path) -> KeySet:
    """The key to rotate to: the one already prepared (a rotation sent again reuses it), else a fresh one."""
    keys = next_keys(home)
    if keys is None:
        keys = KeySet.generate()
        keys.save(home / NEXT_KEYS_FILE)
    return keys


def promote_next_keys(home: Path) -> KeySet:
    """Make the rotated-to key the node's key; the old key's file is replaced (a rotation away from a
    key that may be compromised must not leave it lying around)."""
    (home / NEXT_KEYS_FILE).replace(home / KEYS_FILE)
    return load_keys(home)
