"""``WeightsWriter``: the trainer side of one rank. ``put``/``multi_put`` this rank's tensors, then
``complete(version)`` sends its part to every reader at once and returns when each has it live.

A writer whose options say ``wire="delta"`` sends, where it can, only the values that changed since the
version its part of the reader's target slot holds (``rlsync.core.sync._delta``), into an inbox the reader
allocates for it; it sends in full when it does not know what the slot holds, or when the delta would
not fit. A wire codec (``wire="fp8"``, registered through ``rlsync_register_wire_codecs``) changes the
layout that crosses and encodes each tensor in ``put``.
"""

from __future__ import annotations

import logging
import secrets
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pluggy
import torch

from rlsync.core.layouts import tied_aliases
from rlsync.core.sync._delta import ChangeLog
from rlsync.core._errors import (
    ConfigError,
    PlanError,
    RlsyncWarning,
    WeightMismatchError,
    whole_number,
)
from rlsync.core.layouts import Layout, dtype_size
from rlsync.core.sync._control import rank_credential, split_address
from rlsync.core.sync._layout_exchange import ask_layout
from rlsync.core.sync._options import SyncOptions
from rlsync.core.layouts import build_plan
from rlsync.core.hooks import default_plugin_manager, wire_codecs
from rlsync.core.sync._transport import resolve_transport
from rlsync.core.sync._regions import as_bytes, region_offsets, runs_by_pair
from rlsync.core.sync._writer_session import WriterSession
from rlsync.core.sync._writer_state import Binding
from rlsync.core.sync._writer_versions import VersionPosting

_log = logging.getLogger("rlsync")


class WeightsWriter(WriterSession, VersionPosting):
    """Trainer side of one rank: ``put``/``multi_put`` this rank's buffers, then ``complete(version)``.

    ``readers`` maps each destination rank to its reader's ``address``. ``dst=None`` asks the
    first reader for the destination layout (readers know it: an engine derives it from its own
    loader), so a trainer needs nothing but its own layout and the addresses; tensors of ``src``
    that the destination does not hold (a tied ``lm_head.weight``, say) are then simply not sent.

    ``complete`` sends this rank's part to every reader at once (one thread per reader), notifies
    them, and returns once each has the version live; a reader that does not confirm within
    ``timeout`` raises ``TransferTimeoutError`` naming it, after the others got the version.

    ``options`` (``SyncOptions``): transport, secret, timeout, ``verify`` (send CRC-32s the readers check)
    and ``wire``, what crosses (off by default: ``"full"``, every byte of every version):

    * ``"delta"``: only what changed since the version a reader's slot holds (see the module
      docstring); the writer keeps a copy of its last version's bytes to find the changes.
    * ``"fp8"``: for an engine that serves the fp8 block-quantized checkpoint format
      (``rlsync.wire.Fp8Codec``): ``src`` stays the trainer's layout, ``put`` takes the model-dtype tensors
      and quantizes the weights that format quantizes (each shard on 128-element block bounds).
    * ``"fp8+delta"``: both.

    ``last_bytes`` is what the last ``complete`` moved to all readers.
    """

    def __init__(
        self,
        src: Layout,
        dst: Layout | None,
        rank: int,
        readers: Mapping[int, str] | Sequence[str],
        *,
        options: SyncOptions | None = None,
        plugins: pluggy.PluginManager | None = None,
    ) -> None:
        rank = whole_number("rank", rank, 0)
        if isinstance(readers, str) or not all(isinstance(a, str) for a in (
                readers.values() if isinstance(readers, Mapping) else readers)):
            raise ConfigError(f"readers={readers!r}: the readers' addresses, a list of strings (or {{rank: address}})")
        options = options or SyncOptions()
        self.options = options
        self._plugins = plugins or default_plugin_manager()
        self._codec = None
        if options.codec is not None:
            self._codec = wire_codecs(self._plugins).create(options.codec, src, rank)
            src = self._codec.layout
        self.rank = rank
        self._readers = dict(enumerate(readers)) if not isinstance(readers, Mapping) else dict(readers)
        for address in self._readers.values():  # a rank's own credential speaks for that rank alone
            own = rank_credential(split_address(address)[1])
            if own is not None and own[0] != rank:
                raise ConfigError(f"writer rank {rank} was given writer rank {own[0]}'s address (rank_address): give each "
                                  f"rank the address made for it")
        self.next_version = 1  # with dst=None: the first reader's live version + 1
        if dst is None:
            if not self._readers:
                raise WeightMismatchError("WeightsWriter needs the readers' addresses to learn the destination layout")
            dst, live = ask_layout(self._readers[min(self._readers)], src, options.secret, options.timeout)
            self.next_version = live + 1
        self.src, self.dst = src, dst
        unknown = sorted(r for r in self._readers if not 0 <= r < dst.world_size)
        if unknown:  # e.g. one address per engine replica given to one writer: the extra ones would never get a byte
            raise ConfigError(f"WeightsWriter got reader addresses for ranks {unknown}, but the engine's layout has "
                              f"{dst.world_size} rank(s): give one address per engine rank, and one WeightsWriter per "
                              f"engine replica")
        self._plan(src, dst)
        self._transport = resolve_transport(options.transport, self._plugins)
        self._options = options.link_options
        self._secret = options.secret
        self._checksum = options.verify
        self.timeout = options.timeout
        self._changes = ChangeLog(self._itemsizes) if options.delta else None
        if options.delta and not self._transport.compress_deltas:  # said, not refused: a user may measure it themselves
            _log.warning("WeightsWriter rank %d: wire='delta' over transport %r, where a full version usually lands "
                         "sooner (measured: 1 GB over shared memory 0.24 s full, 2.0 s as a delta on 2 CPU cores; 4 GiB over "
                         "cuda_ipc on an H100 26 ms full, 138 ms as a delta). A delta pays where the link is the limit (tcp "
                         "across hosts, below about 6 Gbit/s per writer rank on 2 CPU cores, about 14 Gbit/s from an H100 "
                         "into host readers): wire='full' here",
                         rank, self._transport.name)
        self._init_sessions()
        self._init_versions()

    def _plan(self, src: Layout, dst: Layout) -> None:
        """This rank's runs to each reader, from the plan of ``src`` into ``dst``."""
        plan = build_plan(src, dst)
        # what the trainer exports and the engine does not hold: named at the first multi_put (SyncOptions.extra_tensors)
        self._extra = set() if self.options.extra_tensors == "ignore" else set(src.tensor_map()) - set(dst.tensor_map())
        self.stats = plan.stats  # the whole plan's: bytes sent by all writer ranks, the busiest sender's share
        self._fingerprints = (plan.src_fingerprint, plan.dst_fingerprint, plan.dst_tensors)
        self._session = secrets.token_hex(8)
        mine = plan.for_src_rank(self.rank)
        self._runs = {}
        for dst_rank in sorted({t.dst_rank for t in mine}):
            if dst_rank not in self._readers:
                raise WeightMismatchError(f"writer rank {self.rank} sends to destination rank {dst_rank}, but no reader "
                                          f"address was given for it")
            offsets, _ = region_offsets(dst, dst_rank)
            self._runs[dst_rank] = runs_by_pair((t for t in mine if t.dst_rank == dst_rank), offsets)[(self.rank, dst_rank)]
        self._specs = {b.name: b for b in src.buffers if b.rank == self.rank}
        self._needed = {name for groups in self._runs.values() for name, _ in groups}
        self._part_bytes = {r: sum(n for _, runs in groups for _, _, n in runs) for r, groups in self._runs.items()}  # full send, per reader
        self.bytes_per_version = sum(self._part_bytes.values())
        self._itemsizes = {name: dtype_size(b.dtype) for name, b in self._specs.items()}

    def put(self, name: str, tensor: Any) -> None:
        """Bind this rank's buffer ``name`` (for plain and FSDP layouts: the parameter name) to ``tensor``.

        ``tensor``: a torch tensor on any device, or a numpy array, of the layout's dtype and size. A contiguous
        host tensor is read in place when ``complete`` runs: keep it alive and unchanged until then. Device
        memory (a GPU trainer's parameters) and strided views are copied now into a host buffer that this writer
        allocates once (pinned where CUDA runs) and reuses every version; the copy from a GPU is asynchronous,
        and ``complete`` waits for it. Cast on the device before ``put`` (``t.to(torch.bfloat16)``), so that the
        smaller dtype is what crosses PCIe.
        """
        self._binding = None  # what a multi_put bound is not what is bound now
        if self._codec is not None:
            encoded = self._codec.encode(name, tensor)
            if encoded is not None:  # the codec's tensors replace this one (fp8: the weight and its scales)
                for part, value in encoded.items():
                    self._put_raw(part, value)
                return
        self._put_raw(name, tensor)

    def _put_raw(self, name: str, tensor: Any) -> None:
        spec = self._specs.get(name)
        if spec is None:
            near = sorted(self._specs)[:5]
            raise WeightMismatchError(f"writer rank {self.rank} has no buffer {name!r} in its layout; it has e.g. {near}")
        changed = self._plugins.hook.rlsync_transform_tensor(name=name, tensor=tensor)
        tensor = tensor if changed is None else changed
        dtype = str(getattr(tensor, "dtype", "")).removeprefix("torch.")
        if dtype != spec.dtype:
            raise WeightMismatchError(f"tensor {name!r}: dtype {dtype} but the layout says {spec.dtype}; cast it before put()")
        numel = int(tensor.numel()) if callable(getattr(tensor, "numel", None)) else int(tensor.size)
        if numel != spec.numel:
            raise WeightMismatchError(f"tensor {name!r}: {numel} elements but the layout says {spec.numel} (shape {tuple(tensor.shape)})")
        self._delta_sources.pop(name, None)
        self._epoch += 1
        if isinstance(tensor, np.ndarray):
            self._sources[name] = as_bytes(name, tensor)
            return
        if tensor.device.type != "cpu" or self._staging.needs_staging(tensor):
            self._copies += 1  # not read in place, or (a device's) its stream noted: every version puts it again
        if tensor.device.type != "cpu" and self._transport.device_sources:
            # the transport reads device memory itself (cuda_ipc, nixl): no bounce through the host; the copy may
            # run in another thread, whose current stream is not this one: it waits for this event first
            self._sources[name] = as_bytes(name, tensor if tensor.is_contiguous() else self._contiguous_copy(name, tensor))
            self._streams.note(tensor)
        elif self._staging.needs_staging(tensor):
            # device memory or a strided view: copied (asynchronously from a GPU) into a reused host buffer;
            # each buffer is sent once its own copy is done, so PCIe and the sending overlap
            if tensor.device.type != "cpu" and not self._staging.nbytes:  # said once per writer: the slow path is a choice
                _log.warning("WeightsWriter rank %d: %s tensors go through host memory for transport %r (bound by PCIe, "
                             "about 50 GB/s); transport='cuda_ipc' (same host) or 'nixl' moves device memory directly",
                             self.rank, tensor.device.type, self._transport.name)
            self._sources[name] = as_bytes(name, self._staging.stage(name, tensor))
            if self._changes is not None and tensor.device.type != "cpu":  # a GPU trainer's delta: found on the GPU
                self._delta_sources[name] = as_bytes(name, tensor if tensor.is_contiguous() else self._contiguous_copy(name, tensor))
                self._streams.note(tensor)
        else:
            self._sources[name] = as_bytes(name, tensor)

    def _contiguous_copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A strided device tensor copied into a contiguous buffer on its device, allocated once per name and reused
        every version (a transport that registers memory, NIXL, then registers it once, not every version)."""
        buffer = self._device_copies.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype or buffer.device != tensor.device:
            buffer = self._device_copies[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        return buffer.copy_(tensor)

    def multi_put(self, tensors: Mapping[str, Any]) -> None:
        """``put`` each of ``tensors``; the first time, also say which of them the engine does not hold. The same
        tensors again (the same objects at the same addresses, read in place: host tensors changed by an optimizer
        step) bind nothing new: the version prepared for them is sent again, at a few Python calls per reader."""
        if self._extra:
            self._name_extra(tensors)
        if self._binding is not None and self._binding.holds(tensors):
            return
        copies = self._copies
        for name, tensor in tensors.items():
            self.put(name, tensor)
        in_place = self._copies == copies and self._codec is None and not self._transforms()
        self._binding = Binding.of(tensors) if in_place else None

    def _transforms(self) -> bool:
        """Whether a plugin transforms tensors as they are put (then every put counts: its result may differ)."""
        return bool(self._plugins.hook.rlsync_transform_tensor.get_hookimpls())

    def _name_extra(self, tensors: Mapping[str, Any]) -> None:
        """Tensors put that the engine does not hold are not sent: an error or a warning (``extra_tensors``), once.
        A tied alias (one tensor under a second name) is not extra: the engine ties it itself."""
        torch_only = all(isinstance(t, torch.Tensor) for t in tensors.values())
        aliases = tied_aliases(tensors) if torch_only else set()
        extra = sorted(name for name in tensors if name in self._extra and name not in aliases)
        self._extra = set()
        if not extra:
            return
        listed = ", ".join(repr(n) for n in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        message = (f"writer rank {self.rank}: {len(extra)} tensor(s) put that the engine does not hold, not sent: {listed}; "
                   f"rename them to the engine's names, or leave them out, or SyncOptions(extra_tensors='ignore') if "
                   f"they are meant to stay behind")
        if self.options.extra_tensors == "error":
            raise PlanError(message)
        warnings.warn(message, RlsyncWarning, stacklevel=3)

    def close(self) -> None:
        for dst_rank in list(self._links):
            self._drop(dst_rank)

    def __enter__(self) -> WeightsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
