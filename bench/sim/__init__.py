"""A discrete-event simulator of a group of model nodes serving a workload under a routing policy."""

from .cluster import Cluster, Prepared, RunResult
from .costs import A100_LLAMA3_8B, CostModel, fit_measured
from .metrics import Summary, summarize
from .policies import Centralized, NoForwarding, Overlay

__all__ = ["A100_LLAMA3_8B", "Centralized", "Cluster", "CostModel", "NoForwarding", "Overlay", "Prepared",
           "RunResult", "Summary", "fit_measured", "summarize"]
