"""rlsync: weight export, rollout buffering and staleness gating for RL post-training.

Importing this package has no side effects: no plugin is loaded, no environment variable read,
no optional dependency imported.
"""

from rlsync.core._errors import (
    BufferError,
    ConfigError,
    LayoutError,
    PeerLostError,
    PlanError,
    PlanMismatchError,
    PluginError,
    RlsyncError,
    RlsyncWarning,
    TransferTimeoutError,
    TransportError,
    VersionError,
    WeightMismatchError,
)
from rlsync.core._hookspecs import hookimpl, hookspec
from rlsync.core._layout import Box, BufferSpec, Layout, Shard, TensorMeta, make_layout
from rlsync.core._planner import Plan, PlanStats, build_plan
from rlsync.core._plugins import make_plugin_manager
from rlsync.core._registry import Registry
from rlsync.core._transfer import Transfer
from rlsync.core._weights import WeightsReader, WeightsWriter

__version__ = "0.1.0"

__all__ = [
    "Box",
    "BufferError",
    "BufferSpec",
    "ConfigError",
    "Layout",
    "LayoutError",
    "PeerLostError",
    "Plan",
    "PlanError",
    "PlanMismatchError",
    "PlanStats",
    "PluginError",
    "Registry",
    "RlsyncError",
    "RlsyncWarning",
    "Shard",
    "TensorMeta",
    "Transfer",
    "TransferTimeoutError",
    "TransportError",
    "VersionError",
    "WeightMismatchError",
    "WeightsReader",
    "WeightsWriter",
    "build_plan",
    "hookimpl",
    "hookspec",
    "make_layout",
    "make_plugin_manager",
]
