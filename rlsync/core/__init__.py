"""Framework-free mechanisms: layouts, planner, weight sync, transports' contract, rollout buffer, gates, hooks.

Imports torch, numpy, msgspec, pyzmq (the control plane) and pluggy; never a training framework, an
inference engine, or anything else of rlsync (``rlsync.plugins``, ``rlsync.wire``, the adapters). Its
implementation lives in private modules; this package is the one place the rest of rlsync imports from.
"""

from rlsync.core.rollouts import Batch, MemoryStorage, RolloutBuffer, Storage, Ticket
from rlsync.core.layouts import (
    chunk_bounds,
    data_parallel,
    flat_partitions,
    flat_range_boxes,
    from_state_dict,
    from_dtensors,
    from_megatron,
    from_placements,
    fsdp,
    own_buffer_shard,
    replicated,
    tied_aliases,
    writer_rank,
    zero3,
)
from rlsync.core.sync import Canary, canary_tokens, causal_lm_logprobs
from rlsync.core.sync import Checksums, same_bytes, version_label
from rlsync.core.sync import host_port, is_loopback, keyed, rank_address, resolve_secret, shift_port, split_address, with_key
from rlsync.core.sync import INBOX_SHARE, ChangeLog
from rlsync.core.rollouts import Claim, Episode, EpisodeLog, MemoryEpisodes, Turn
from rlsync.core.sync import apply_delta, encode_delta
from rlsync.core.sync import CurrentStreams, synchronize_devices
from rlsync.core.sync import BatchedCopies, PreparedCopies
from rlsync.core._errors import (
    CanaryError,
    ConfigError,
    LayoutError,
    LeaseLostError,
    PeerLostError,
    PlanError,
    PlanMismatchError,
    PluginError,
    RlsyncError,
    RlsyncWarning,
    RolloutBufferError,
    TransferTimeoutError,
    TransportError,
    VersionError,
    WeightMismatchError,
)
from rlsync.core.rollouts import Decision, Gate, MaxStaleness, freshest_per_group, importance_weights
from rlsync.core.sync import Finish, LandedVersions
from rlsync.core.hooks import hookimpl, hookspec
from rlsync.core.sync import HostStaging
from rlsync.core.layouts import (
    Box,
    BufferSpec,
    Layout,
    Shard,
    TensorMeta,
    contiguous_strides,
    dtype_name,
    dtype_size,
    make_layout,
)
from rlsync.core.sync import reader_layout
from rlsync.core.layouts import engine_tp, megatron
from rlsync.core.rollouts import make_buffer
from rlsync.core.sync import DEFAULT_TIMEOUT, WIRES, SyncOptions
from rlsync.core.layouts import Plan, PlanStats, build_plan
from rlsync.core.hooks import (
    BUILTIN_PLUGINS,
    ENTRY_POINT_GROUP,
    buffer_backends,
    default_plugin_manager,
    make_plugin_manager,
    transports,
    wire_codecs,
)
from rlsync.core.layouts import PRESETS, ModelSpec, Param, load_model_spec, model_spec
from rlsync.core.sync import LandingMode, WeightsReader
from rlsync.core.sync import region_offsets
from rlsync.core.hooks import Registry
from rlsync.core.sync import NodeRelay
from rlsync.core.sync import KEY_FILE_ENV, key_file, user_key
from rlsync.core.rollouts import PolicyVersionClock, Sample, decode_sample, encode_sample
from rlsync.core.rollouts import head_logprobs, kept_sizes, logits_logprobs, masked_entropy, masked_logprobs, sampling_mask
from rlsync.core.sync import SLACK, RankBoxes, StagedReceiver, engine_layout, tensor_metas, whole_tensor_view
from rlsync.core.layouts import Transfer
from rlsync.core.sync import Landing, Link, Region, Run, Transport, resolve_transport
from rlsync.core.layouts import allocate, copy_transfers, gather_shards, raw_dtype, scatter
from rlsync.core.sync import WireCodec
from rlsync.core.sync import WeightsWriter
from rlsync.core.timeline import Recorder, record_from_now, record_timeline, recording, span

__all__ = [
    "KEY_FILE_ENV", "key_file", "user_key", "Recorder", "record_from_now", "record_timeline", "recording", "span",
    "BUILTIN_PLUGINS", "DEFAULT_TIMEOUT", "ENTRY_POINT_GROUP", "PRESETS", "SLACK", "WIRES",
    "INBOX_SHARE", "Batch", "BatchedCopies", "Box", "BufferSpec", "Canary", "CanaryError", "ChangeLog", "Claim", "CurrentStreams", "Episode", "PreparedCopies", "EpisodeLog", "LeaseLostError", "MemoryEpisodes", "Turn", "Checksums", "HostStaging", "ConfigError", "Decision", "Finish", "Gate", "Landing", "LandedVersions",
    "LandingMode", "Layout", "LayoutError", "Link", "MaxStaleness", "MemoryStorage", "ModelSpec", "NodeRelay", "Param",
    "PeerLostError", "Plan", "PlanError", "PlanMismatchError", "PlanStats", "PluginError", "PolicyVersionClock",
    "RankBoxes", "Region", "Registry", "RlsyncError", "RlsyncWarning", "RolloutBuffer", "RolloutBufferError", "Run",
    "Sample", "Shard", "StagedReceiver", "Storage", "SyncOptions", "TensorMeta", "Ticket", "Transfer",
    "TransferTimeoutError", "Transport", "TransportError", "VersionError", "WeightMismatchError", "WeightsReader",
    "WeightsWriter", "WireCodec",
    "allocate", "apply_delta", "buffer_backends", "build_plan", "canary_tokens", "causal_lm_logprobs", "chunk_bounds", "contiguous_strides", "copy_transfers",
    "data_parallel", "decode_sample", "default_plugin_manager", "dtype_name", "dtype_size", "encode_delta", "encode_sample",
    "engine_layout", "synchronize_devices", "engine_tp", "flat_partitions", "flat_range_boxes", "freshest_per_group", "from_dtensors", "from_megatron", "from_placements", "from_state_dict", "fsdp", "gather_shards",
    "hookimpl", "hookspec", "importance_weights", "host_port", "is_loopback", "keyed", "shift_port", "split_address", "with_key", "rank_address", "head_logprobs", "kept_sizes", "load_model_spec", "logits_logprobs", "make_buffer", "make_layout", "masked_entropy",
    "make_plugin_manager", "masked_logprobs", "megatron", "model_spec", "own_buffer_shard", "raw_dtype", "reader_layout", "sampling_mask",
    "region_offsets", "replicated", "resolve_secret", "resolve_transport", "same_bytes", "scatter", "tensor_metas", "tied_aliases", "transports", "version_label",
    "whole_tensor_view", "wire_codecs", "writer_rank", "zero3",
]
