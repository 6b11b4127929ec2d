"""rlsync for TRL's ``GRPOTrainer`` with ``use_vllm=True, vllm_mode="server"``: ``trainer.add_callback(RlsyncSyncCallback(trainer))``.

``GRPOTrainer`` has no injection point for its weight sync: it calls ``trainer.vllm_generation.sync_weights()``
before generating whenever the optimizer stepped. The callback takes that call over on this trainer only:
every rank walks TRL's own parameter iterator (``VLLMGeneration._iter_named_params``: TRL's PEFT merge and
FSDP/ZeRO-3 gathering stay), and the main process makes the result live on the server through
``rlsync.adapters.vllm.VllmServer``. TRL's constructor needs CUDA only to join vLLM's NCCL group, which an
rlsync server does not have: ``import rlsync.adapters.trl`` patches that away (``rlsync.patches.trl``).

Versions: the weights after ``global_step`` optimizer steps go live as version ``base + global_step + 1``
(``base`` is the server's live version at the first sync, 0 on a fresh server). Every generated token is
stamped with the version that produced it (GRPOTrainer never generates during a sync, so the version live at
generation, checked against the weight version vLLM reports after each sync), ``rlsync_versions`` beside
``completion_ids``. With ``max_staleness=N``, rlsync's ``MaxStaleness``
gate runs on each sample before the loss: a sample whose oldest token lags the trainer by more than ``N`` steps
(``steps_per_generation`` or ``num_iterations`` above 1 reuse generations) is masked out of the loss entirely.
TRL's truncated importance weights (``vllm_importance_sampling_correction``) stay as TRL computes them.
Canary (``SyncOptions(canary=True)``, the default): every rank computes the log-probs of a small fixed token batch
with the model it syncs (one tiny forward, collective under FSDP/ZeRO-3 as TRL's own forward), and the server's
own log-probs of the same tokens must match before the version serves (``VllmServer.publish``); a version that
deviates is undone and the step raises ``rlsync.CanaryError`` naming the largest deviation.
Logged per step: ``rlsync/sync_seconds``, ``rlsync/bytes``, ``rlsync/version``, ``rlsync/canary_deviation``,
``rlsync/staleness_mean``, ``rlsync/dropped_stale``.

MoE models: with a server that records routes (``--worker-extension-cls rlsync.adapters.vllm.RlsyncWorkerExtension
--no-enable-prefix-caching``), every policy forward routes each generated sequence's tokens to the experts that
sampled them (routing replay, ``rlsync.adapters.trl._routes``); ``routes=False`` turns it off, ``routes=True``
requires it. Logged: ``rlsync/routes_replayed``, ``rlsync/routes_differing``.

Sampling mask: with ``top_k``/``top_p`` in ``GRPOConfig``, the policy's log-probs (TRL's old log-probs, its
importance ratio against vLLM's and its loss) are those of the distribution vLLM sampled from, the kept set
renormalized (``rlsync.adapters.trl._sampling``); ``sampling_mask=False`` keeps TRL's full-softmax log-probs.

LoRA: with a PEFT model and a server started with ``--enable-lora`` (and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``),
only the adapter's A/B matrices (and ``modules_to_save``) cross, never the base model (``VllmServer.publish_lora``):
each version is served as adapter ``policy@V`` and TRL's client generates with the newest; the previous
``max_staleness`` versions stay served. Without LoRA on the server (or with FSDP, whose sharded adapters this route
does not gather) TRL's merged weights are sent, as TRL does; a log line says which route was taken.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from transformers import TrainerCallback

from rlsync import Canary, ConfigError, MaxStaleness, SyncOptions, VersionError, record_timeline
from rlsync.core import recording
from rlsync.adapters.trl._routes import RouteReplay
from rlsync.adapters.trl._sampling import SamplingMask
from rlsync.adapters.trl._weight_transfer import choose_lora_route
from rlsync.adapters.vllm import VllmServer
from rlsync.patches.trl import rlsync_owns_sync
from rlsync.wire import lora_state

VERSIONS = "rlsync_versions"  # per generated token: the policy version that produced it


class RlsyncSyncCallback(TrainerCallback):
    """Takes over ``trainer``'s weight sync (``trainer.add_callback(RlsyncSyncCallback(trainer))``).

    ``max_staleness``: drop samples whose oldest token is more than this many optimizer steps behind
    (``None``: keep all, as TRL does). ``options`` (``rlsync.SyncOptions``): ``transport`` (``shm``, same
    host, or ``tcp``), ``timeout`` (seconds one sync may take), ``wire="delta"`` (send only the values that
    changed since the last sync: a few percent of them at RL learning rates; ``rlsync/bytes`` logs what moved),
    ``verify=True`` (the engine checks a CRC per tensor of every version and refuses one whose bytes differ).
    ``routes``: routing replay for MoE models (None: wherever the server records routes; True: required; False: off).
    ``sampling_mask``: the policy's log-probs under the top-k/top-p the tokens were sampled with (None: wherever
    ``GRPOConfig`` sets them; True: required; False: off, TRL's full-softmax log-probs).
    ``timeline``: record the run's timeline there (a ``.jsonl`` file, or a directory: a file a process; ``rlsync timeline``
    reads it): the main process's generations (``request``, its wait for them ``wait_batch``), its train steps
    (``train``, after the step's generation), each sync, and the run (``run``, mode ``lockstep``: GRPOTrainer
    generates and trains in turn).
    """

    def __init__(self, trainer: Any, *, max_staleness: int | None = None, options: SyncOptions | None = None,
                 routes: bool | None = None, sampling_mask: bool | None = None,
                 timeline: str | os.PathLike[str] | None = None) -> None:
        generation = getattr(trainer, "vllm_generation", None)
        if generation is None or getattr(generation, "mode", None) != "server":
            raise ConfigError("RlsyncSyncCallback needs a GRPOTrainer generating with a vLLM server: "
                              "GRPOConfig(use_vllm=True, vllm_mode='server', vllm_server_base_url=...)")
        self.trainer, self.generation = trainer, generation
        self.options = options or SyncOptions()
        self.gate = MaxStaleness(max_staleness) if max_staleness is not None else None
        self.server: VllmServer | None = None
        if trainer.accelerator.is_main_process:
            client = generation.vllm_client
            if not rlsync_owns_sync(client):
                raise ConfigError(f"the vLLM server at {client.base_url} does not receive weights through rlsync: start it "
                                  "with --weight-transfer-config '{\"backend\": \"rlsync\"}' and import rlsync.adapters.trl "
                                  "before building the trainer")
            self.server = VllmServer(client.base_url, options=options)
        self._base: int | None = None
        self._adapter_only: bool | None = None  # decided at the first sync, the same on every rank
        self._adapters_kept = (max_staleness or 1) + 1  # adapter versions served: a sample may be max_staleness versions old
        generation.sync_weights = self._sync
        self.routes = RouteReplay(trainer, self.server, routes)  # MoE: routing replay (see the module docstring)
        self.sampling_mask = SamplingMask(trainer, sampling_mask)  # top-k/top-p: the sampler's log-probs
        self._generate = trainer._generate_and_score_completions
        trainer._generate_and_score_completions = self._generate_and_stamp
        self._compute_loss = trainer.compute_loss
        trainer.compute_loss = self._gated_loss
        self._timeline = timeline if trainer.accelerator.is_main_process else None
        self._recording = contextlib.ExitStack()
        self._train_began = self._run_began = 0.0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._timeline is not None:
            self._recording.enter_context(record_timeline(self._timeline))
            self._run_began = recording().now()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._train_began = recording().now()  # moved to the end of the step's generation, when it generates

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        timeline = recording()
        timeline.event("train", self._train_began, timeline.now(), step=state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The server keeps serving the last version; its receiving side is released (a later train() opens it again)."""
        if self.server is not None:
            self.server.close()
        timeline = recording()
        timeline.event("run", self._run_began, timeline.now(), mode="lockstep", framework="trl")
        self._recording.close()

    def _version_of(self, step: int) -> int:
        return (self._base or 0) + step + 1

    def _route_is_adapter_only(self) -> bool:
        """PEFT model, unsharded by FSDP, and a server serving LoRA: only the adapter is sent. Said once in the log."""
        from accelerate.utils import broadcast_object_list, is_peft_model

        if self._adapter_only is None:
            peft = is_peft_model(self.generation.model)
            choice = [False]
            if self.server is not None and peft:
                choice = [choose_lora_route(self.server, self.generation._dist.is_fsdp, "TRL's client generates")]
            if self.trainer.accelerator.num_processes > 1:
                broadcast_object_list(choice, from_process=0)
            self._adapter_only = bool(choice[0])
        return self._adapter_only

    def _adapter(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The adapter's tensors and config on the main process (None elsewhere): under ZeRO-3 gathered, as TRL gathers
        for its merge, so every rank takes part."""
        model = self.generation.model
        with self.generation._dist.gather_params([p for n, p in model.named_parameters() if "lora_" in n or "modules_to_save" in n]):
            if self.server is None:
                return None
            tensors, config = lora_state(model)
            return {n: t.clone() for n, t in tensors.items()}, config  # copies: the gathered memory goes on exit

    def _sync(self) -> None:
        """TRL's ``sync_weights``, through rlsync: every rank walks the parameters, the main process publishes."""
        step = self.trainer.state.global_step
        # every rank: under FSDP/ZeRO-3 the forward is collective, as the parameter walk below is
        canary = Canary.of(self.trainer.model) if self.options.canary else None
        version = None if self._base is None else self._version_of(step)  # first: the next after the server's live one
        if self._route_is_adapter_only():
            adapter = self._adapter()
            if adapter is None or self.server is None:
                return
            stats = self.server.publish_lora(*adapter, version, keep=self._adapters_kept, canary=canary)
            self.generation.vllm_client.model = stats.adapter  # TRL's requests name the newest adapter version
        else:
            named = self.generation._iter_named_params()
            if self.server is None:
                for _ in named:  # take part in the gather collectives (FSDP, ZeRO-3)
                    pass
                return
            stats = self.server.publish(named, version, canary=canary)
            self.server.reset_prefix_cache()  # cached prefixes were computed with the previous weights
        if self._base is None:
            self._base = stats.version - step - 1
        reported = self.server.weight_version()  # what vLLM stamps on its outputs from now on
        if reported != stats.label:
            raise VersionError(f"the vLLM server reports weight version {reported!r} after rlsync made {stats.label!r} live")
        metrics = self.trainer._metrics["train"]
        metrics["rlsync/sync_seconds"].append(stats.seconds)
        metrics["rlsync/bytes"].append(float(stats.bytes))
        metrics["rlsync/version"].append(float(stats.version))
        if stats.canary_deviation is not None:
            metrics["rlsync/canary_deviation"].append(stats.canary_deviation)

    def _generate_and_stamp(self, inputs: Any) -> Any:
        timeline = recording()
        began = timeline.now()
        output = self._generate(inputs)  # syncs first when the optimizer stepped (TRL's schedule)
        ids = output["completion_ids"]
        if timeline.path is not None:  # the server's generation of this batch, which the trainer waited for
            self._train_began = ended = timeline.now()
            tokens = int(output["completion_mask"].sum())
            timeline.event("request", began, ended, sequences=int(ids.shape[0]), tokens=tokens, engine="vllm")
            timeline.event("wait_batch", began, ended, samples=int(ids.shape[0]))
        # the version live since the sync above; every rank computes it alike (staleness is a difference of two)
        output[VERSIONS] = torch.full(ids.shape, self._version_of(self.trainer.state.global_step), dtype=torch.long, device=ids.device)
        return output

    def _gated_loss(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        versions = inputs.get(VERSIONS)
        if versions is not None:
            trainer_version = self._version_of(self.trainer.state.global_step)
            mask = inputs["completion_mask"]
            # per row, its oldest generated token's version (a row with no generated token: its oldest), judged on
            # the batch's device: no copy of the batch to the host
            real = mask.bool()
            generated = real | ~real.any(dim=1, keepdim=True)
            oldest = versions.masked_fill(~generated, torch.iinfo(versions.dtype).max).min(dim=1).values
            keep = torch.ones_like(oldest, dtype=torch.bool) if self.gate is None else self.gate.keeps(oldest, trainer_version)
            inputs = {**inputs, "completion_mask": mask * keep[:, None].to(mask.dtype)}  # a dropped one adds nothing
            lag = (trainer_version - oldest).float() * keep  # the kept rows' (0/0: nan when none is kept)
            mean, dropped = torch.stack([lag.sum() / keep.sum(), (~keep).sum().float()]).tolist()  # one wait
            metrics = self.trainer._metrics["train"]
            metrics["rlsync/staleness_mean"].append(mean)
            metrics["rlsync/dropped_stale"].append(dropped)
            timeline = recording()
            if timeline.path is not None:  # the staleness of the tokens this micro-batch trains on
                lags = torch.bincount((trainer_version - oldest).clamp(min=0)[keep], weights=mask.sum(1)[keep].float())
                timeline.event("batch", samples=int(keep.sum()),
                               lags={str(k): int(n) for k, n in enumerate(lags.tolist()) if n})
        return self._compute_loss(model, inputs, *args, **kwargs)
