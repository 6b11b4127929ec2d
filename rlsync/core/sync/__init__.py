"""Sync: a version of the weights from the trainer's ranks into the engine's, landing whole or not at all.

Owns the writer (a trainer rank), the reader (an engine rank), the node relay, the control plane (signed sessions
over ZeroMQ CURVE), the transports' contract, staging and the hand-off to an engine's loader, checksums, deltas,
wire codecs' contract, the sync options, the host staging and device ordering, the layout exchange, the landing
regions, the memory checks and the canary. It may import ``layouts`` and ``hooks`` (transports and codecs are
plugins), never ``rollouts``.
"""

from __future__ import annotations

from rlsync.core.sync._options import DEFAULT_TIMEOUT, WIRES, SyncOptions
from rlsync.core.sync._transport import Landing, Link, Region, Run, Transport, resolve_transport
from rlsync.core.sync._canary import Canary, canary_tokens, causal_lm_logprobs
from rlsync.core.sync._checksum import Checksums, same_bytes, version_label
from rlsync.core.sync._control import host_port, is_loopback, keyed, rank_address, resolve_secret, shift_port, split_address, with_key
from rlsync.core.sync._delta import INBOX_SHARE, ChangeLog
from rlsync.core.sync._device_order import CurrentStreams, synchronize_devices
from rlsync.core.sync._batched_copies import BatchedCopies, PreparedCopies
from rlsync.core.sync._handoff import Finish, LandedVersions
from rlsync.core.sync._host_staging import HostStaging
from rlsync.core.sync._regions import region_offsets
from rlsync.core.sync._layout_exchange import reader_layout
from rlsync.core.sync._wire import WireCodec
from rlsync.core.sync._reader import WeightsReader
from rlsync.core.sync._reader_state import LandingMode
from rlsync.core.sync._writer import WeightsWriter
from rlsync.core.sync._staging import SLACK, RankBoxes, StagedReceiver, engine_layout, tensor_metas, whole_tensor_view
from rlsync.core.sync._relay import NodeRelay
from rlsync.core.sync._user_key import KEY_FILE_ENV, key_file, user_key
from rlsync.core.sync._delta import apply as apply_delta
from rlsync.core.sync._delta import encode as encode_delta

__all__ = ["KEY_FILE_ENV", "key_file", "user_key", "BatchedCopies", "Canary", "ChangeLog", "Checksums", "CurrentStreams", "DEFAULT_TIMEOUT", "Finish", "HostStaging", "INBOX_SHARE", "LandedVersions", "Landing", "LandingMode", "Link", "NodeRelay", "PreparedCopies", "RankBoxes", "Region", "Run", "SLACK", "StagedReceiver", "SyncOptions", "Transport", "WIRES", "WeightsReader", "WeightsWriter", "WireCodec", "apply_delta", "canary_tokens", "causal_lm_logprobs", "encode_delta", "engine_layout", "host_port", "is_loopback", "keyed", "reader_layout", "region_offsets", "resolve_secret", "resolve_transport", "same_bytes", "shift_port", "split_address", "with_key", "rank_address", "synchronize_devices", "tensor_metas", "version_label", "whole_tensor_view"]
