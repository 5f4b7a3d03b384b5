"""Starting a model node from its home: the engine (built-in over a trained family model or a
checkpoint directory, or an external OpenAI-compatible server), the ledger client, registration, the
group, and the node's loops, until it is told to stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from pathlib import Path

from planetserve.chain.client import LedgerClient
from planetserve.chain.keys import KeySet
from planetserve.chain.lightclient import LightClient
from planetserve.chain.rpc import RpcClient
from planetserve.node.directory import Directory
from planetserve.node.engine.base import Engine
from planetserve.node.group import Group
from planetserve.node.home import ModelNodeConfig, load_keys
from planetserve.node.model_node import ModelNode
from planetserve.node.openai_api import Tokenizer
from planetserve.node.registration import Registered, ensure_registered

log = logging.getLogger(__name__)


def builtin_engine(config: ModelNodeConfig) -> tuple[Engine, Tokenizer, int, tuple[int, ...]]:
    """The built-in engine over the configured model; also its tokenizer, vocabulary and stop ids."""
    from planetserve.models import load
    from planetserve.node.engine.builtin import BuiltinEngine

    loaded = load(config.model, data_dir=config.data_dir or None)
    # No engine-wide stop ids: each request carries its own (EOS unless the client asked ignore_eos).
    engine = BuiltinEngine(loaded.model, config.model_id, block_size=config.block_size,
                           max_batch=config.capacity, cache_capacity_tokens=config.cache_tokens)
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
                                        kv_events_endpoint=config.kv_events or None)
    stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    return engine, tokenizer, len(tokenizer), stop


def ledger_client(config: ModelNodeConfig) -> LedgerClient:
    if not config.genesis:
        raise ValueError("the node's configuration names no genesis file to verify the ledger against")
    rpc = RpcClient(config.rpc)
    return LedgerClient(rpc, LightClient.from_genesis_file(Path(config.genesis), rpc))


async def run_model_node(home: Path, org_keys: KeySet | None = None,
                         on_ready: Callable[[ModelNode, Registered], None] | None = None) -> None:
    """Run until SIGINT/SIGTERM."""
    config = ModelNodeConfig.load(home)
    keys = load_keys(home)
    # The model first: a node that cannot serve should not register.
    if config.engine_url:
        engine, tokenizer, vocab, stop = await remote_engine(config)
    else:
        engine, tokenizer, vocab, stop = await asyncio.to_thread(builtin_engine, config)
    try:
        ledger = ledger_client(config)
        registered = await asyncio.to_thread(ensure_registered, ledger, config, keys, org_keys)
        group = Group(ledger, config.model_id)
        node = ModelNode(config, keys, engine, tokenizer, vocab_size=vocab, eos_ids=stop, group=group,
                         users=Directory(ledger, with_nodes=False))
        stop_event = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop_event.set)
        await node.start()
        try:
            if on_ready is not None:
                on_ready(node, registered)
            await stop_event.wait()
        finally:
            await node.close()
    finally:
        with contextlib.suppress(Exception):
            await engine.close()
