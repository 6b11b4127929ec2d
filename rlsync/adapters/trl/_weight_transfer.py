"""``weight_transfer=`` for TRL's async GRPO trainer (``trl.experimental.async_grpo.AsyncGRPOTrainer``).

TRL calls, on its main process: ``init_weight_transfer()`` once at train begin, then per sync ``pause()``,
``send_weights(iterator of (name, full tensor))``, ``resume()``, and ``destroy()`` at train end
(``WeightTransferProtocol`` in ``async_grpo_trainer.py``). The server is a stock vLLM server started with
``--weight-transfer-config '{"backend": "rlsync"}'``: this object drives its weight-transfer routes
(``rlsync.adapters.vllm.VllmServer``), and the version it makes live is the trainer's ``model_version``
after the sync (syncs are counted from the server's live version: 1, 2, ... on a fresh server, as TRL counts).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rlsync import ConfigError, PeerLostError, SyncOptions
from rlsync.adapters.vllm import PublishStats, VllmServer
from rlsync.patches.trl import apply_async


class RlsyncWeightTransfer:
    """``AsyncGRPOTrainer(..., weight_transfer=RlsyncWeightTransfer())``.

    ``server_url``: the vLLM server (TRL's default ``vllm_server_base_url`` unless given). ``options``
    (``rlsync.SyncOptions``): transport, timeout, ``wire="delta"`` (only the values that changed since the last
    sync), ``verify=True`` (a CRC per tensor, checked by the engine).
    """

    def __init__(self, server_url: str = "http://localhost:8000", *, options: SyncOptions | None = None) -> None:
        apply_async()  # before the trainer is built: its constructor needs CUDA otherwise
        from rlsync.adapters.trl import _rollout  # trl.experimental: imported only for the async trainer

        _rollout.install()  # its rollout worker stamps every sampled token with the version that sampled it
        self.server = VllmServer(server_url, options=options)
        self.last_stats: PublishStats | None = None  # the last sync's version, bytes and seconds (TRL logs them)

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
        # TRL's iterator yields live parameters (views, fp32 unless the model is bf16): publish casts them to the
        # server's dtype and holds them only until the version is live, which happens before this returns.
        self.last_stats = self.server.publish(iterator)
        self.server.reset_prefix_cache()  # cached prefixes were computed with the previous weights

    def resume(self) -> None:
        self.server.resume()

    def destroy(self) -> None:
        self.server.close()
