"""Starting a role from its home until it is told to stop: a model node (its engine, built-in over a
trained family model or a checkpoint directory, an external OpenAI-compatible server, or a layer
pipeline when it cannot hold its model whole; registration; its group) or a user relay (registration
and heartbeats; relaying; its proxies and local endpoint)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from pathlib import Path

from planetserve.chain.client import TRANSIENT, LedgerClient, QueryRefused
from planetserve.chain.keys import KeySet
from planetserve.chain.lightclient import VerificationError
from planetserve.chain.rpc import RpcError
from planetserve.metrics import serve_role
from planetserve.node.behaviours import HONEST
from planetserve.node.engine.base import Engine, Tokenizer
from planetserve.node.home import ModelNodeConfig, UserConfig, load_keys, next_keys, promote_next_keys
from planetserve.node.metrics import model_node_collector, relay_collector
from planetserve.node.model_node import ModelNode
from planetserve.node.overlay.directory import Directory
from planetserve.node.pipeline.assignment import (
    PipelineStage,
    assignment_ended,
    needs_pipeline,
    pipeline_engine,
    wait_for_assignment,
)
from planetserve.node.registration import (
    Registered,
    RegistrationError,
    ensure_registered,
    ensure_user,
    heartbeat,
    rotated_record,
)
from planetserve.node.routing.group import Group
from planetserve.node.user import UserRelay
from planetserve.registry.credits import Deployment
from planetserve.registry.entities import Model, User
from planetserve.registry.entities import ModelNode as NodeRecord

log = logging.getLogger(__name__)


def builtin_engine(config: ModelNodeConfig) -> tuple[Engine, Tokenizer, int, tuple[int, ...]]:
    """The built-in engine over the configured model, on the GPU when there is one; also its tokenizer,
    vocabulary and stop ids."""
    import torch

    from planetserve.models import load
    from planetserve.node.engine.builtin import BuiltinEngine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load(config.model, data_dir=config.data_dir or None, device=device)
    # No engine-wide stop ids: each request carries its own (EOS unless the client asked ignore_eos).
    engine = BuiltinEngine(loaded.model, config.model_id, block_size=config.block_size,
                           max_batch=config.capacity, cache_capacity_tokens=config.cache_tokens,
                           prefill_chunk=config.prefill_chunk,
                           kv_budget_tokens=config.kv_budget_tokens or None)
    return engine, loaded.tokenizer, engine.vocab_size, loaded.stop_token_ids


async def remote_engine(config: ModelNodeConfig) -> tuple[Engine, Tokenizer, int, tuple[int, ...]]:
    """An external server; the tokenizer still comes from the model's checkpoint, which the node
    needs for the HR-tree's token ids and for signing what it returns."""
    from transformers import AutoTokenizer

    from planetserve.models import resolve
    from planetserve.node.engine.remote import RemoteEngine

    _, directory = resolve(config.model, config.data_dir or None)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    engine = await RemoteEngine.connect(config.engine_url, capacity=config.capacity,
                                        block_size=config.block_size,
                                        kv_events_endpoint=config.kv_events or None,
                                        kv_events_replay_endpoint=config.kv_events_replay or None,
                                        vllm_processor=config.engine_sampling == "vllm-processor")
    stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    return engine, tokenizer, len(tokenizer), stop


async def run_model_node(home: Path, org_keys: KeySet | None = None,
                         on_ready: Callable[[ModelNode, Registered], None] | None = None) -> None:
    """Run until SIGINT/SIGTERM. A node that declares less memory than its sized model needs serves
    it as a pipeline stage (`pipeline.assignment`): it registers, waits for a deployment to assign it layers,
    loads only those, and goes back to waiting when the deployment ends or changes."""
    config = ModelNodeConfig.load(home)
    keys = load_keys(home)
    if config.behaviour != HONEST:
        log.warning("fault injection: this node behaves %s", config.behaviour)
    ledger = LedgerClient.verified(config.rpc, config.genesis, witness=config.witness, max_age=config.max_age)
    stop_event = _stop_on_signals()
    # only a node that declares its memory may be too small for its model (the ledger says how big)
    model = await asyncio.to_thread(ledger.model, config.model_id) if config.memory_mib else None
    if model is not None and needs_pipeline(model, config):
        keys = await asyncio.to_thread(_settle_rotation, ledger, home, keys)
        registered = await asyncio.to_thread(ensure_registered, ledger, config, keys, org_keys)
        while not stop_event.is_set():
            await _serve_assignment(ledger, home, keys, config, model, registered, on_ready, stop_event)
            rotated = await _rotated(ledger, home)
            if rotated is not None:  # the ledger moved its stage to the new key: serve it under that
                keys, registered = promote_next_keys(home), Registered(rotated, "rotated")
        return
    if config.engine_url:  # the model first: a node that cannot serve should not register
        engine, tokenizer, vocab, stop = await remote_engine(config)
    else:
        engine, tokenizer, vocab, stop = await asyncio.to_thread(builtin_engine, config)
    try:
        keys = await asyncio.to_thread(_settle_rotation, ledger, home, keys)
        registered = await asyncio.to_thread(ensure_registered, ledger, config, keys, org_keys)
        while registered is not None:
            node = ModelNode(config, keys, engine, tokenizer, vocab_size=vocab, eos_ids=stop,
                             group=Group(ledger, config.model_id), users=Directory(ledger, with_nodes=False))
            await node.start()
            stop_metrics = serve_role(config.metrics, model_node_collector(node))
            try:
                if on_ready is not None:
                    on_ready(node, registered)
                rotated = await _until_stopped_or_rotated(ledger, home, config.list_interval, stop_event)
            finally:
                stop_metrics()
                await node.close()
            registered = None if rotated is None else Registered(rotated, "rotated")
            if registered is not None:
                keys = promote_next_keys(home)
                log.info("the ledger rotated this node to key %s: serving under it", keys.public.hex())
    finally:
        with contextlib.suppress(Exception):
            await engine.close()


def _settle_rotation(ledger: LedgerClient, home: Path, keys: KeySet) -> KeySet:
    """The node's key: the one it rotated to while it was down, once the ledger registered it."""
    return promote_next_keys(home) if rotated_record(ledger, next_keys(home)) is not None else keys


async def _until_stopped_or_rotated(ledger: LedgerClient, home: Path, interval: float,
                                    stop_event: asyncio.Event) -> NodeRecord | None:
    """Wait for SIGINT/SIGTERM (None) or for the ledger to move this node to the key it rotates to (the
    node's record under that key): the engine stays loaded while the node restarts under the new key."""
    while not stop_event.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop_event.wait(), interval)
            return None
        record = await _rotated(ledger, home)
        if record is not None:
            return record
    return None


async def _rotated(ledger: LedgerClient, home: Path) -> NodeRecord | None:
    """The node's record under the key it rotates to, once in effect; None meanwhile, and when the
    ledger cannot be read now (the next look tries again)."""
    try:
        return await asyncio.to_thread(rotated_record, ledger, next_keys(home))
    except TRANSIENT as exc:
        log.warning("could not read the ledger for a pending key rotation: %s", exc)
        return None


async def _serve_assignment(ledger: LedgerClient, home: Path, keys: KeySet, config: ModelNodeConfig,
                            model: Model, registered: Registered,
                            on_ready: Callable[[ModelNode, Registered], None] | None,
                            stop_event: asyncio.Event) -> None:
    """Serve one deployment's layers until it stops assigning them (a rotation of this node's key ends
    the assignment under the old key) or the process is stopped."""
    waiting = asyncio.ensure_future(wait_for_assignment(ledger, keys, config))
    interval = config.list_interval
    stopping = asyncio.ensure_future(_until_stopped_or_rotated(ledger, home, interval, stop_event))
    await asyncio.wait((waiting, stopping), return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not waiting.done():
        waiting.cancel()
        return
    deployment = waiting.result()
    stage = await _load_stage(ledger, keys, config, model, deployment)
    try:
        node = ModelNode(config, keys, stage.engine, stage.tokenizer, vocab_size=stage.vocab_size,
                         eos_ids=stage.stop_ids, group=Group(ledger, config.model_id),
                         users=Directory(ledger, with_nodes=False), stage=stage.role)
        await stage.engine.start(node.peering)
        await node.start()
        stop_metrics = serve_role(config.metrics, model_node_collector(node))
        try:
            if on_ready is not None:
                on_ready(node, registered)
            ended = asyncio.ensure_future(assignment_ended(ledger, keys, deployment, config.list_interval))
            stopping = asyncio.ensure_future(stop_event.wait())
            await asyncio.wait((ended, stopping), return_when=asyncio.FIRST_COMPLETED)
            for task in (ended, stopping):
                task.cancel()
            if ended.done() and not ended.cancelled():
                log.warning("deployment %d no longer assigns this node layers; waiting for a new assignment",
                            deployment.deployment_id)
        finally:
            stop_metrics()
            await node.close()
    finally:
        with contextlib.suppress(Exception):
            await stage.engine.close()


async def _load_stage(ledger: LedgerClient, keys: KeySet, config: ModelNodeConfig, model: Model,
                      deployment: Deployment) -> PipelineStage:
    addresses = {}
    for key, *_ in deployment.stages:
        record = await asyncio.to_thread(ledger.node, key)
        if record is not None:
            addresses[key] = record.address
    log.info("deployment %d assigns this node layers %s of %s; loading them", deployment.deployment_id,
             deployment.stage_of(keys.public), model.model_id)
    return await asyncio.to_thread(pipeline_engine, config, keys, deployment, model, addresses)


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _heartbeats(ledger: LedgerClient, keys: KeySet, config: UserConfig, interval: float) -> None:
    """Renew the registration every `interval` seconds; a failed renewal is retried sooner."""
    while True:
        await asyncio.sleep(interval)
        try:
            await asyncio.to_thread(heartbeat, ledger, keys, config)
        except (RegistrationError, QueryRefused, VerificationError, RpcError) as exc:
            log.warning("heartbeat failed, re-registering if needed: %s", exc)
            with contextlib.suppress(RegistrationError, QueryRefused, VerificationError, RpcError):
                await asyncio.to_thread(ensure_user, ledger, config, keys)
            await asyncio.sleep(min(interval, 10.0))


async def run_user_relay(home: Path, on_ready: Callable[[UserRelay, User, str], None] | None = None,
                         ready_timeout: float = 60.0) -> None:
    """Run until SIGINT/SIGTERM; `on_ready` once k paths are live (or `ready_timeout` passed)."""
    config = UserConfig.load(home)
    keys = load_keys(home)
    if config.n < config.k or config.proxies < config.n:
        raise ValueError(f"need proxies >= n >= k, got proxies {config.proxies}, n {config.n}, k {config.k}")
    ledger = LedgerClient.verified(config.rpc, config.genesis, witness=config.witness, max_age=config.max_age)
    user, action = await asyncio.to_thread(ensure_user, ledger, config, keys)
    params = await asyncio.to_thread(ledger.params)
    relay = UserRelay(config, keys, Directory(ledger))
    stop_event = _stop_on_signals()
    await relay.start()
    stop_metrics = serve_role(config.metrics, relay_collector(relay))
    try:
        relay.start_paths()
        relay.spawn(_heartbeats(ledger, keys, config, max(1.0, params.user_ttl_seconds / 3)))
        await relay.paths.wait_live(config.k, ready_timeout)
        if on_ready is not None:
            on_ready(relay, user, action)
        await stop_event.wait()
    finally:
        stop_metrics()
        await relay.close()
