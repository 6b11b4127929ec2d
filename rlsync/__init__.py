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
from rlsync.core._buffer import Batch, MemoryStorage, RolloutBuffer, Ticket
from rlsync.core._gates import Decision, MaxStaleness, importance_weights
from rlsync.core._handoff import LandedVersions
from rlsync.core._hookspecs import hookimpl, hookspec
from rlsync.core._make_buffer import make_buffer
from rlsync.core._layout import Box, BufferSpec, Layout, Shard, TensorMeta, make_layout
from rlsync.core._planner import Plan, PlanStats, build_plan
from rlsync.core._plugins import make_plugin_manager
from rlsync.core._registry import Registry
from rlsync.core._samples import PolicyVersionClock, Sample
from rlsync.core._transfer import Transfer
from rlsync.core._weights import WeightsReader, WeightsWriter, reader_layout

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "Box",
    "BufferError",
    "BufferSpec",
    "ConfigError",
    "Decision",
    "LandedVersions",
    "Layout",
    "LayoutError",
    "MaxStaleness",
    "MemoryStorage",
    "PeerLostError",
    "Plan",
    "PlanError",
    "PlanMismatchError",
    "PlanStats",
    "PluginError",
    "PolicyVersionClock",
    "Registry",
    "RlsyncError",
    "RlsyncWarning",
    "RolloutBuffer",
    "Sample",
    "Shard",
    "TensorMeta",
    "Ticket",
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
    "importance_weights",
    "make_buffer",
    "make_layout",
    "make_plugin_manager",
    "reader_layout",
]
