"""Hook specifications: every extension point rlsync offers.

Plugins implement these with ``@rlsync.hookimpl``. Built-in implementations live in
``rlsync.plugins`` and are registered with ``trylast=True`` so third-party plugins
(entry-point group ``rlsync_plugins``) win where a hook stops at the first result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    import torch

    from rlsync.core.hooks._registry import Registry

PROJECT = "rlsync"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ---------------------------------------------------------------------------------------------
# Setup: historic, so plugins loaded late still see them.
# ---------------------------------------------------------------------------------------------


@hookspec(historic=True)
def rlsync_addhooks(pluginmanager: pluggy.PluginManager) -> None:
    """Add new hook specifications (``pluginmanager.add_hookspecs(module)``).

    .. versionadded:: 0.1

    Called on: trainer and rollout worker, once, when the plugin manager is built.
    """


# ---------------------------------------------------------------------------------------------
# Registration of named pieces: transports, buffer backends, gates.
# ---------------------------------------------------------------------------------------------


@hookspec
def rlsync_register_transports(registry: Registry[Any]) -> None:
    """Add transport classes to ``registry`` (``registry.add("name", TransportClass)``).

    .. versionadded:: 0.1

    Called on: trainer and rollout worker, when the transport registry is first used.
    """


@hookspec
def rlsync_register_buffer_backends(registry: Registry[Any]) -> None:
    """Add rollout-buffer backends to ``registry`` (``registry.add("name", factory)``).

    .. versionadded:: 0.1

    Called on: whichever process creates the rollout buffer.
    """


@hookspec
def rlsync_register_wire_codecs(registry: Registry[Any]) -> None:
    """Add wire codecs to ``registry`` (``registry.add("name", factory)``, ``factory(src_layout, rank)``
    returning a ``rlsync.WireCodec``); ``SyncOptions(wire="name")`` picks one.

    .. versionadded:: 0.1

    Called on: trainer, each rank, when a ``WeightsWriter`` is built with a codec.
    """


# ---------------------------------------------------------------------------------------------
# Weight export.
# ---------------------------------------------------------------------------------------------


@hookspec
def rlsync_before_export(version: int, names: Sequence[str]) -> None:
    """A weight version is about to be exported.

    :param version: the version being exported.
    :param names: the global tensor names that will be sent.

    .. versionadded:: 0.1

    Called on: trainer, each rank, before its first byte of ``version`` moves.
    """


@hookspec(firstresult=True)
def rlsync_transform_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor | None:
    """Transform a tensor on its way out (for example cast or quantize it).

    Stops at the first non-None result. The result must keep shape and dtype of the
    destination layout; a mismatch fails before any byte is written.

    :param name: the buffer name the tensor is put under.
    :param tensor: what the trainer put (after a wire codec's encoding).
    :return: the tensor to send instead, or None to send ``tensor`` unchanged.

    .. versionadded:: 0.1

    Called on: trainer, in ``WeightsWriter.put``, for each tensor it puts.
    """


@hookspec
def rlsync_after_export(version: int, stats: Mapping[str, Any]) -> None:
    """A weight version was published (``complete`` returned).

    :param stats: at least ``bytes`` and ``seconds``; ``canary_deviation`` (the largest an engine reported) when
        the version came with a canary.

    .. versionadded:: 0.1

    Called on: trainer, each rank.
    """


@hookspec
def rlsync_weights_applied(version: int, stats: Mapping[str, Any]) -> None:
    """A weight version became live on an engine (all bytes landed, version flipped).

    :param version: the version now live.
    :param stats: ``rank`` (the reader's rank) and ``writers`` (the writer ranks whose parts it holds);
        ``canary_deviation`` when the engine checked the version's canary.

    .. versionadded:: 0.1

    Called on: rollout worker.
    """


# ---------------------------------------------------------------------------------------------
# Rollout buffering and staleness gating.
# ---------------------------------------------------------------------------------------------


@hookspec
def rlsync_on_put(samples: Sequence[Any]) -> None:
    """Samples were accepted into the rollout buffer.

    :param samples: the ``rlsync.Sample``-s of one ``put``.

    .. versionadded:: 0.1

    Called on: the process that owns the buffer.
    """


@hookspec
def rlsync_on_get(batch: Any) -> None:
    """A batch was handed to a trainer.

    :param batch: the ``rlsync.Batch``.

    .. versionadded:: 0.1

    Called on: the process that owns the buffer.
    """


@hookspec(firstresult=True)
def rlsync_gate_sample(sample: Any, trainer_version: int, max_staleness: int) -> Any | None:
    """Decide whether one sample trains or is dropped: the one gate mechanism.

    Stops at the first non-None result. The built-in ``MaxStaleness`` runs last (``trylast``); gates
    handed to one buffer (``RolloutBuffer(gates=[...])``) run first, for that buffer only.

    :param sample: the ``rlsync.Sample`` about to join a batch.
    :param trainer_version: the buffer's published version.
    :param max_staleness: the buffer's bound (``RolloutBuffer(max_staleness=...)``).
    :return: ``rlsync.Decision.DROP`` or ``Decision.TRAIN``, or None to leave it to the next gate.

    .. versionadded:: 0.1

    Called on: the process that owns the buffer, when a batch is formed.
    """


@hookspec
def rlsync_report(kind: str, stats: Mapping[str, Any]) -> None:
    """Telemetry: a summary of ``kind`` is available.

    :param kind: ``"buffer"`` (``RolloutBuffer.report()``).
    :param stats: the summary's figures (samples put, dropped, staleness, stall seconds).

    .. versionadded:: 0.1

    Called on: the process that owns the buffer, whenever ``report()`` runs.
    """
