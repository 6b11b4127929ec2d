"""Version-guarded patches of OpenRLHF, applied where ``rlsync launch openrlhf`` asks for them.

OpenRLHF has no plugin point for weight sync. The launcher puts the options in the environment variable
``RLSYNC_OPENRLHF`` (JSON) of every process it starts, and:

- the trainer side (``apply_trainer_side``): ``ActorPPOTrainer._init_vllm_sync_group`` and
  ``ActorPPOTrainer.broadcast_to_vllm`` become the given functions; ``ActorPPOTrainer.__init__`` and
  ``training_step``, ``SamplesGenerator.generate_samples``, ``_process_response_into_experience``,
  ``_dispatch_prompts_to_vllm`` and ``generate_eval_samples``, ``BasePPOTrainer.train_step`` (twice: the staleness
  gate outside, the routes inside) and ``init_checkpoint_states``, and ``GenerateSamplesActor.fit`` are wrapped by the
  given decorators;
- OpenRLHF's engine actor (``apply_engine_actor``, in the driver that starts the engines): ``RolloutRayActor``'s
  ``__init__``, ``update_weight``, ``generate`` and ``generate_responses`` are wrapped by the given decorators;
- the sampling mask (``apply_sampling_mask``, beside the trainer side): ``PolicyModelActor.init_model_from_pretrained``
  and ``openrlhf.models.actor.Actor.forward`` are wrapped by the given decorators, and the actor module's
  ``log_probs_from_logits`` and ``compute_entropy`` (names ``Actor.forward`` looks up at call time) become the given
  functions' wrappers of them;
- the vLLM side (``apply_engine_side``): ``openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap``, the
  ``worker_extension_cls`` OpenRLHF passes to vLLM, becomes the given class.

What replaces OpenRLHF's code is the adapter's (``rlsync.adapters.openrlhf``), handed in by its caller: these
patches import no adapter. The adapter applies them in the launcher's driver, in every Ray worker (Ray's
``worker_process_setup_hook``) and in vLLM's engine processes (its ``vllm.general_plugins`` entry point).

OpenRLHF's ``@ray.remote`` classes (``PPOTrainer``, ``TrainingActor``, ``GenerateSamplesActor``, ``PolicyModelActor``,
``RolloutRayActor``) are patched in the class Ray builds their actors from (``_actor_class``): Ray copies every method
into it when the class is decorated, at import, and ships that class to the actor's process by value, so a patch of
the plain class or its base never reaches those actors.

Supported OpenRLHF versions: ``SUPPORTED``. Any other is a ``ConfigError`` naming it, on either side.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
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


Wrap = Callable[[Any], Any]  # takes OpenRLHF's method, returns its replacement


def _actor_class(remote: Any) -> Any:
    """The class Ray builds the actors of a ``@ray.remote`` class from (a subclass holding a copy of every method)."""
    return remote.__ray_metadata__.modified_class if hasattr(remote, "__ray_metadata__") else remote


def apply_trainer_side(*, init_vllm_sync_group: Callable[..., Any], broadcast_to_vllm: Callable[..., Any],
                       tag_samples: Wrap, gate_samples: Wrap, trainer_init: Wrap, training_step: Wrap,
                       process_response: Wrap, routes_step: Wrap, dispatch: Wrap, eval_samples: Wrap,
                       checkpoint_states: Wrap, generator_fit: Wrap) -> None:
    """Replace OpenRLHF's trainer-side weight sync and wrap its trainer, sample generation and train step (once).
    Like ``apply_engine_actor``, this must run in OpenRLHF's driver before it starts its trainer actors."""
    check_version(installed_version())
    from openrlhf.trainer import ppo_trainer, ppo_trainer_async
    from openrlhf.trainer.ppo_utils import samples_generator
    from openrlhf.trainer.ray import ppo_actor

    trainer = ppo_actor.ActorPPOTrainer
    if getattr(trainer, "_rlsync_patched", False):
        return
    trainer._init_vllm_sync_group = init_vllm_sync_group
    trainer.broadcast_to_vllm = broadcast_to_vllm
    trainer.__init__ = trainer_init(trainer.__init__)
    trainer.training_step = training_step(trainer.training_step)
    generator = samples_generator.SamplesGenerator
    generator.generate_samples = tag_samples(generator.generate_samples)
    generator._process_response_into_experience = process_response(generator._process_response_into_experience)
    generator._dispatch_prompts_to_vllm = dispatch(generator._dispatch_prompts_to_vllm)
    generator.generate_eval_samples = eval_samples(generator.generate_eval_samples)
    base = ppo_trainer.BasePPOTrainer
    base.train_step = gate_samples(routes_step(base.train_step))
    base.init_checkpoint_states = checkpoint_states(base.init_checkpoint_states)
    for remote in (ppo_trainer.PPOTrainer, ppo_trainer_async.TrainingActor):  # their copies of the base's methods
        cls = _actor_class(remote)
        cls.train_step, cls.init_checkpoint_states = base.train_step, base.init_checkpoint_states
    samples_actor = _actor_class(ppo_trainer_async.GenerateSamplesActor)
    samples_actor.fit = generator_fit(samples_actor.fit)
    trainer._rlsync_patched = True


def apply_sampling_mask(*, policy_init: Wrap, actor_forward: Wrap, log_probs: Wrap, entropy: Wrap) -> None:
    """Wrap ``PolicyModelActor.init_model_from_pretrained`` and ``Actor.forward``, and the actor module's
    ``log_probs_from_logits`` and ``compute_entropy`` (what ``Actor.forward`` calls), once."""
    check_version(installed_version())
    from openrlhf.models import actor
    from openrlhf.trainer.ray import ppo_actor

    if getattr(actor, "_rlsync_patched", False):
        return
    policy = _actor_class(ppo_actor.PolicyModelActor)
    policy.init_model_from_pretrained = policy_init(policy.init_model_from_pretrained)
    actor.Actor.forward = actor_forward(actor.Actor.forward)
    actor.log_probs_from_logits = log_probs(actor.log_probs_from_logits)
    actor.compute_entropy = entropy(actor.compute_entropy)
    actor._rlsync_patched = True


def apply_engine_side(worker_wrap: type) -> None:
    """Make ``worker_wrap`` what OpenRLHF's ``worker_extension_cls`` resolves to in this (vLLM) process."""
    check_version(installed_version())
    from openrlhf.trainer.ray import vllm_worker_wrap

    vllm_worker_wrap.WorkerWrap = worker_wrap


def apply_engine_actor(*, wrap_init: Wrap, wrap_update_weight: Wrap, wrap_generate: Wrap,
                       wrap_generate_responses: Wrap) -> None:
    """Wrap the ``__init__``, ``update_weight``, ``generate`` and ``generate_responses`` of OpenRLHF's engine actor (once). ``RolloutRayActor`` names Ray's
    actor wrapper, so Ray pickles the class itself by value where an engine is started: this must run in that process
    (OpenRLHF's driver) before the first engine is created."""
    check_version(installed_version())
    from openrlhf.trainer.ray import vllm_engine

    cls = _actor_class(vllm_engine.RolloutRayActor)
    if getattr(cls, "_rlsync_patched", False):
        return
    cls.__init__ = wrap_init(cls.__init__)
    cls.update_weight = wrap_update_weight(cls.update_weight)
    cls.generate = wrap_generate(cls.generate)
    cls.generate_responses = wrap_generate_responses(cls.generate_responses)
    cls._rlsync_patched = True
