"""``weight_transfer=`` for TRL's async GRPO trainer (``trl.experimental.async_grpo.AsyncGRPOTrainer``).

TRL calls, on its main process: ``init_weight_transfer()`` once at train begin, then per sync ``pause()``,
``send_weights(iterator of (name, full tensor))``, ``resume()``, and ``destroy()`` at train end
(``WeightTransferProtocol`` in ``async_grpo_trainer.py``). The server is a stock vLLM server started with
``--weight-transfer-config '{"backend": "rlsync"}'``: this object drives its weight-transfer routes
(``rlsync.adapters.vllm.VllmServer``), and the version it makes live is the trainer's ``model_version``
after the sync, which TRL restores from its checkpoint on a resume: the server's labels (every token's version)
count as TRL does, whether the server is fresh or kept running across the resume.

LoRA: TRL turns its own adapter-only route off when a ``weight_transfer`` is given and hands it the merged weights.
With a PEFT model (not sharded by FSDP) and a server started with ``--enable-lora --max-lora-rank R`` (and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``), this object sends the adapter's tensors alone instead
(``VllmServer.publish_lora``): version V is served as adapter ``policy@V``, the rollout worker names it from
``model_version`` V on (``RlsyncRolloutLoop``), and the newest ``max_staleness + 1`` versions stay served. TRL shows
the trainer through a patch (``rlsync_bind``, before each sync); a log line says which route was taken.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from rlsync import ConfigError, PeerLostError, SyncOptions
from rlsync.adapters.trl import _episodes
from rlsync.adapters.trl._sampling import SamplingMask
from rlsync.adapters.vllm import PublishStats, VllmServer
from rlsync.patches.trl import apply_async
from rlsync.wire import lora_state

ADAPTER = "policy"  # served as policy@V
_log = logging.getLogger("rlsync")


class RlsyncWeightTransfer:
    """``AsyncGRPOTrainer(..., weight_transfer=RlsyncWeightTransfer())``.

    ``server_url``: the vLLM server (TRL's default ``vllm_server_base_url`` unless given). ``options``
    (``rlsync.SyncOptions``): transport, timeout, ``wire="delta"`` (only the values that changed since the last
    sync), ``verify=True`` (a CRC per tensor, checked by the engine). ``sampling_mask``: the loss's log-probs under
    the top-k/top-p the worker sampled with (None: wherever the config sets them; True: required; False: off).
    ``episodes``: a Redis URL (``redis://HOST:6379/0``) where the rollout worker records every rollout's turns and tool
    calls, so that a run resumed from a checkpoint replays them instead of generating them and calling the tools
    again (``rlsync.adapters.trl._episodes``).
    """

    def __init__(self, server_url: str = "http://localhost:8000", *, options: SyncOptions | None = None,
                 sampling_mask: bool | None = None, episodes: str | None = None) -> None:
        apply_async()  # before the trainer is built: its constructor needs CUDA otherwise
        from rlsync.adapters.trl import _rollout  # trl.experimental: imported only for the async trainer

        _rollout.install()  # its rollout worker stamps every sampled token with the version that sampled it
        self.server = VllmServer(server_url, options=options)
        self.last_stats: PublishStats | None = None  # the last sync's version, bytes and seconds (TRL logs them)
        self._trainer: Any = None
        self._adapter_only: bool | None = None  # decided at the first sync
        self._sampling_wanted = sampling_mask
        self.sampling_mask: SamplingMask | None = None  # installed at the first sync, on every rank
        self._episodes_url = episodes
        if episodes is not None:  # a URL redis cannot read is named here, not in TRL's spawned worker
            _episodes.log_for(episodes, "rlsync-episodes").close()

    @property
    def adapter_only(self) -> bool:
        """Whether the syncs send the PEFT adapter alone (decided at the first); TRL's merge before a send and unmerge
        after are then skipped (``rlsync.patches.trl``): they would move the frozen base weights by rounding."""
        return bool(self._adapter_only)

    def rlsync_bind(self, trainer: Any) -> None:
        """Called before each of TRL's syncs (``rlsync.patches.trl``): the trainer whose weights are sent. At the first,
        decide the route; for adapter-only, the rollout worker (not started yet: TRL starts it after the first sync)
        is told to name the adapter versions."""
        self._trainer = trainer
        if self.sampling_mask is None:  # the loss's log-probs under the top-k/top-p the worker sampled with
            self.sampling_mask = SamplingMask(trainer, self._sampling_wanted, every_forward=True)
        if self._adapter_only is not None:
            return
        self._adapter_only = self._route_is_adapter_only(trainer)
        worker = getattr(trainer, "rollout_worker", None)
        if self._episodes_url is not None and worker is not None:
            if getattr(worker, "_process", None) is not None:
                raise ConfigError("the rollout worker started before the first sync: rlsync cannot record its episodes")
            # named after the run's output_dir: a run resumed from its checkpoints finds its episodes, a run started
            # over there (global step 0 at the first sync) gets a generation of its own and replays none of the last's
            log = _episodes.log_for(self._episodes_url, f"rlsync-episodes:{trainer.args.output_dir}")
            try:
                run = log.run_name(fresh=trainer.state.global_step == 0)
            finally:
                log.close()
            worker._loop_kwargs["rlsync_episodes"] = (self._episodes_url, run)
        if self._adapter_only and worker is not None:
            if getattr(worker, "_process", None) is not None:
                raise ConfigError("the rollout worker started before the first sync: rlsync cannot point it at the "
                                  "adapter versions")
            worker._loop_kwargs["rlsync_adapter"] = ADAPTER

    def _route_is_adapter_only(self, trainer: Any) -> bool:
        from accelerate.utils import is_peft_model
        from torch.distributed.tensor import DTensor

        model = trainer.accelerator.unwrap_model(trainer.model)
        if not is_peft_model(model):
            return False
        sharded = any(isinstance(p, DTensor) for p in model.parameters())
        return choose_lora_route(self.server, sharded, "the rollout worker generates")

    def init_weight_transfer(self) -> None:
        self.server.wait_ready()
        self.server.config()  # fails now, naming the server flag, if the server's backend is not rlsync
        self.check_generate_route()

    def check_generate_route(self) -> None:
        """The rollout worker asks vLLM's token-in/token-out route (it reports each token's version): fail at train
        begin, naming the flag, if the server lacks it, not at the worker's first request."""
        from rlsync.adapters.trl import _rollout

        try:
            self.server.call(_rollout.GENERATE_ROUTE, {})  # an empty request: 4xx from a server that has the route
        except ConfigError as exc:  # 404
            raise ConfigError(f"{_rollout.NO_ROUTE} ({self.server.url})") from exc
        except PeerLostError as exc:
            if "answered 4" not in str(exc):
                raise

    def pause(self) -> None:
        self.server.pause()

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        if self._adapter_only:
            # TRL's merge around this send is skipped (rlsync.patches.trl): the iterator, left unread, would yield the
            # base weights alone, and without FSDP reading it gathers nothing.
            trainer = self._trainer
            tensors, config = lora_state(trainer.accelerator.unwrap_model(trainer.model))
            self.last_stats = self.server.publish_lora(
                {n: t.detach().clone() for n, t in tensors.items()}, config, trainer.model_version + 1, name=ADAPTER,
                keep=trainer.args.max_staleness + 1)  # a sample max_staleness versions old may still be generating
            return  # a new adapter name is a new prefix-cache namespace in vLLM: nothing to reset
        # TRL's iterator yields live parameters (views, fp32 unless the model is bf16): publish casts them to the
        # server's dtype and holds them only until the version is live, which happens before this returns.
        version = None if self._trainer is None else self._trainer.model_version + 1  # TRL bumps it after this send
        self.last_stats = self.server.publish(iterator, version)
        self.server.reset_prefix_cache()  # cached prefixes were computed with the previous weights

    def resume(self) -> None:
        self.server.resume()

    def destroy(self) -> None:
        self.server.close()


def choose_lora_route(server: VllmServer, sharded: bool, who: str) -> bool:
    """For a PEFT model: adapter-only when the server serves LoRA and FSDP does not shard the adapter (this route
    does not gather it), else merged; the log says which, and for a server without LoRA the flags that change it."""
    serves_lora = bool(server.config().get("lora_config"))
    if serves_lora and not sharded:
        _log.info("rlsync: adapter-only sync (PEFT model, LoRA server): each version is served as adapter %s@V and %s "
                  "with the newest", ADAPTER, who)
        return True
    _log.warning("rlsync: merged-weight sync of a PEFT model: %s", "FSDP shards the adapter (adapter-only sync does not "
                 "gather it)" if serves_lora else f"the vLLM server at {server.url} serves no LoRA; start it with "
                 "--enable-lora --max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 to send the adapter alone")
    return False
