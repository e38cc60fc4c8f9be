"""Flow-control policy plugins, one file per config `type` (reference §3.3, plus ours).

`PLUGIN_CLASSES` feeds the config loader's plugin table (`epp.config.plugin_types`).
"""

from __future__ import annotations

from epp.flowcontrol.plugins.edf_ordering_policy import EdfOrderingPolicy
from epp.flowcontrol.plugins.fcfs_ordering_policy import FcfsOrderingPolicy
from epp.flowcontrol.plugins.global_strict_fairness_policy import GlobalStrictFairnessPolicy
from epp.flowcontrol.plugins.round_robin_fairness_policy import RoundRobinFairnessPolicy
from epp.flowcontrol.plugins.slo_deadline_ordering_policy import SloDeadlineOrderingPolicy
from epp.flowcontrol.plugins.static_usage_limit_policy import StaticUsageLimitPolicy
from epp.flowcontrol.plugins.token_fairness_policy import TokenFairnessPolicy
from epp.plugin import Plugin

PLUGIN_CLASSES: tuple[type[Plugin], ...] = (
    # fairness between the flows of a band
    GlobalStrictFairnessPolicy,
    RoundRobinFairnessPolicy,
    TokenFairnessPolicy,
    # order within a flow
    FcfsOrderingPolicy,
    EdfOrderingPolicy,
    SloDeadlineOrderingPolicy,
    # saturation ceiling per band
    StaticUsageLimitPolicy,
)

# The defaults the reference always creates (§3.2).
DEFAULT_FAIRNESS = GlobalStrictFairnessPolicy.type
DEFAULT_ORDERING = FcfsOrderingPolicy.type
DEFAULT_USAGE_LIMIT = StaticUsageLimitPolicy.type

__all__ = [
    "DEFAULT_FAIRNESS",
    "DEFAULT_ORDERING",
    "DEFAULT_USAGE_LIMIT",
    "PLUGIN_CLASSES",
    "EdfOrderingPolicy",
    "FcfsOrderingPolicy",
    "GlobalStrictFairnessPolicy",
    "RoundRobinFairnessPolicy",
    "SloDeadlineOrderingPolicy",
    "StaticUsageLimitPolicy",
    "TokenFairnessPolicy",
]
