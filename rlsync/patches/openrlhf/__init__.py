"""Version-guarded patches of OpenRLHF, applied where ``rlsync launch openrlhf`` asks for them.

OpenRLHF has no plugin point for weight sync. The launcher puts the options in the environment variable
``RLSYNC_OPENRLHF`` (JSON) of every process it starts, and:

- the trainer side (``apply_trainer_side``; in the driver and, through Ray's ``worker_process_setup_hook``
  ``setup_worker``, in every Ray worker): ``ActorPPOTrainer._init_vllm_sync_group`` and
  ``ActorPPOTrainer.broadcast_to_vllm`` become rlsync's (``rlsync.adapters.openrlhf._trainer``);
  ``SamplesGenerator.generate_samples`` stamps each sample with the weight version that generated it and
  ``BasePPOTrainer.train_step`` drops the stale ones first (``rlsync.adapters.openrlhf._versions``);
- the vLLM side (``apply_engine_side``; from rlsync's ``vllm.general_plugins`` entry point, which every vLLM
  process runs before it resolves ``worker_extension_cls``: vLLM's engine processes are not Ray workers):
  ``openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap``, the ``worker_extension_cls`` OpenRLHF passes to vLLM,
  becomes ``RlsyncWorkerWrap`` (``rlsync.adapters.openrlhf._worker``).

Supported OpenRLHF versions: ``SUPPORTED``. Any other is a ``ConfigError`` naming it, on either side.
"""

from __future__ import annotations

import json
import os
from importlib import metadata
from typing import Any

from rlsync import ConfigError
from rlsync.patches import minor_supported

SUPPORTED = ("0.11",)  # OpenRLHF major.minor versions whose code these patches were written against
OPTIONS_ENV = "RLSYNC_OPENRLHF"


def check_version(version: str) -> None:
    """Raise ``ConfigError`` unless ``version`` (OpenRLHF's) is one the patches were written for."""
    if not minor_supported(version, SUPPORTED):
        raise ConfigError(f"rlsync's OpenRLHF launcher supports OpenRLHF {', '.join(v + '.x' for v in SUPPORTED)}; this "
                          f"is OpenRLHF {version}. Install a supported one (pip install 'openrlhf=={SUPPORTED[-1]}.*' "
                          "--no-deps) or run without rlsync.")


def installed_version() -> str:
    try:
        return metadata.version("openrlhf")
    except metadata.PackageNotFoundError:
        raise ConfigError("OpenRLHF is not installed here: pip install 'rlsync[openrlhf]'") from None


def options() -> dict[str, Any] | None:
    """The launcher's options in this process (None: not started by ``rlsync launch openrlhf``)."""
    raw = os.environ.get(OPTIONS_ENV)
    return None if not raw else dict(json.loads(raw))


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook``: every Ray worker the launcher's cluster starts runs this first."""
    if options() is not None:
        apply_trainer_side()


def apply_trainer_side() -> None:
    check_version(installed_version())
    from openrlhf.trainer.ray import ppo_actor

    from rlsync.adapters.openrlhf import _trainer

    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ppo_utils import samples_generator

    from rlsync.adapters.openrlhf import _versions

    trainer = ppo_actor.ActorPPOTrainer
    if getattr(trainer, "_rlsync_patched", False):
        return
    trainer._init_vllm_sync_group = _trainer.init_vllm_sync_group
    trainer.broadcast_to_vllm = _trainer.broadcast_to_vllm
    generator = samples_generator.SamplesGenerator
    generator.generate_samples = _versions.tag_samples(generator.generate_samples)
    base = ppo_trainer.BasePPOTrainer
    base.train_step = _versions.gate_samples(base.train_step, (options() or {}).get("max_staleness"))
    trainer._rlsync_patched = True


def apply_engine_side() -> None:
    check_version(installed_version())
    from openrlhf.trainer.ray import vllm_worker_wrap

    from rlsync.adapters.openrlhf._worker import RlsyncWorkerWrap

    vllm_worker_wrap.WorkerWrap = RlsyncWorkerWrap  # what worker_extension_cls resolves to
