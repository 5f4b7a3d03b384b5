"""The Prometheus metrics of a model node and of a user relay (docs/operators.md, "Monitoring"), read
from their running counts when scraped. Every name is fixed here: nothing a peer sends becomes a name
or a label."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from planetserve.metrics import StatusCollector

if TYPE_CHECKING:
    from planetserve.node.model_node import ModelNode
    from planetserve.node.user import UserRelay

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


MODEL_NODE_COUNTERS = {
    "served": "Requests this node computed",
    "forwarded": "Requests forwarded to a peer holding their prefix, or less loaded",
    "received_forwards": "Requests peers forwarded here",
    "forward_failures": "Forwards that failed and were served here instead",
    "sync_errors": "Cache-state sync messages refused",
    "tokens": "Tokens generated",
    "prompt_tokens": "Prompt tokens of the requests served",
    "cached_prompt_tokens": "Prompt tokens whose KV came from the prefix cache",
    "cache_hits": "Requests served whose prompt started in the prefix cache",
}
RELAY_COUNTERS = {
    "requests": ("counters", "requests", "Requests from the local endpoint sent into the overlay"),
    "answered": ("counters", "answered", "Requests answered"),
    "failed": ("counters", "failed", "Requests that failed"),
    "bad_cloves": ("counters", "bad_cloves", "Answer cloves refused"),
    "dropping_paths": ("counters", "dropping_paths", "Paths found dropping answer parts"),
    "paths_built": ("paths", "built", "Onion paths built"),
    "path_setup_failures": ("paths", "setup_failures", "Path setups that failed"),
    "paths_died": ("paths", "died", "Paths found dead"),
    "path_rotations": ("paths", "rotated", "Paths replaced at the end of their lifetime"),
    "paths_used_up": ("paths", "used_up", "Paths retired after their uses"),
    "paths_lost": ("paths", "lost", "Live paths a relay ended (down, or its connection closed)"),
    "paths_rebuilt": ("paths", "rebuilt", "Lost paths built again over the same relays"),
    "paths_lost_again": ("paths", "lost_again", "Rebuilt paths lost again soon after: their relays avoided"),
    "requests_resent": ("counters", "resent", "Requests sent again over other proxies after too many "
                        "said the node cannot be reached"),
    "cloves_forwarded": ("relay", "forwarded", "Cloves relayed for other users"),
    "cloves_to_nodes": ("relay", "to_nodes", "Cloves delivered to model nodes as a proxy"),
    "cloves_returned": ("relay", "returned", "Answer cloves relayed back"),
    "relay_refusals": ("relay", "refused", "Cloves or setups refused"),
}
"""name -> (which counts, the key there, help)."""


def model_node_collector(node: ModelNode) -> StatusCollector:
    def counters() -> dict[str, tuple[float, str]]:
        out = {name: (node.counters[name], text) for name, text in MODEL_NODE_COUNTERS.items()}
        out.update({f"route_{reason.replace('-', '_')}": (count, f"Requests routed as {reason!r}")
                    for reason, count in node.routes.items()})
        return out

    def gauges() -> dict[str, tuple[float, str]]:
        load = node.engine.load()
        return {"running": (load.running, "Sequences the engine is decoding"),
                "queued": (load.queued, "Requests waiting for the engine"),
                "capacity": (load.capacity, "Sequences the engine decodes at once"),
                "group_size": (len(node.view.members), "Model nodes listed for this node's model"),
                "listed": (1 if node.keys.public in node.view.members else 0, "1 while this node is listed"),
                "forwards_inflight": (sum(node.forwards.inflight(time.monotonic()).values()),
                                      "Forwards awaiting their peer")}

    def more() -> list[Metric]:
        return [node.ttft.family("planetserve_model_node_ttft_seconds",
                                 "Time to the first token of the requests computed here")]

    return StatusCollector("planetserve_model_node", counters, gauges, more)


def relay_collector(relay: UserRelay) -> StatusCollector:
    def counters() -> dict[str, tuple[float, str]]:
        counts = {"counters": relay.counters, "paths": relay.paths.counters, "relay": relay.relay.counters}
        return {name: (counts[which][key], text) for name, (which, key, text) in RELAY_COUNTERS.items()}

    def gauges() -> dict[str, tuple[float, str]]:
        live = relay.paths.live()
        return {"paths_live": (len(live), "Onion paths ready to carry a request"),
                "distinct_proxies": (len({p.proxy for p in live}), "Proxies at the ends of the live paths"),
                "relayed_paths": (len(relay.relay.forward), "Other users' paths through this relay"),
                "listed_users": (len(relay.view.users), "Users in the verified list"),
                "listed_model_nodes": (len(relay.view.nodes), "Model nodes in the verified lists")}

    return StatusCollector("planetserve_relay", counters, gauges)
