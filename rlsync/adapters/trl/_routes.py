"""Routing replay in TRL's ``GRPOTrainer`` for MoE models (``RlsyncSyncCallback(trainer, routes=...)``).

The vLLM server records the experts every MoE layer routed each token to (``VllmServer.record_routes``: the server
runs rlsync's worker extension); after each generation the main process takes the routes of every completion by its
tokens (``VllmServer.take_routes``) and hands them to every rank. Every forward of the policy (TRL's old log-probs and
its loss alike, in whatever chunks TRL runs them) then routes each recorded token to the experts that sampled it
(``rlsync.adapters.hf.replay_routes``): a forward pre-hook finds each row's record by the row's tokens (its attention
mask's columns: the prompt and the completion as vLLM returned them), so TRL's shuffling and splitting of the batch
need not be followed. Rows without a record (the canary, a completion TRL masked whole) route themselves; so does the
reference model. Logged: ``rlsync/routes_replayed`` (rows of a forward that had a record) and
``rlsync/routes_differing`` (of the replayed token-layers, those the trainer would have routed elsewhere).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from rlsync import ConfigError
from rlsync.adapters.hf import HeldReplay, routers, routes_at_rows, token_rows
from rlsync.adapters.vllm import VllmServer

_log = logging.getLogger("rlsync")
SERVER_FLAGS = "--worker-extension-cls rlsync.adapters.vllm.RlsyncWorkerExtension --no-enable-prefix-caching"


class RouteReplay:
    """Installed on a ``GRPOTrainer`` by the callback; ``wanted``: True (required), None (wherever the model is MoE
    and the server records), False (off)."""

    def __init__(self, trainer: Any, server: VllmServer | None, wanted: bool | None) -> None:
        self.trainer, self.server, self.wanted = trainer, server, wanted
        model = trainer.model
        found = routers(model)
        if wanted and not found:
            raise ConfigError(f"routes=True, but {type(model).__name__} has no MoE router: routing replay is for MoE models")
        self.on: bool | None = False if wanted is False or not found else None  # None: decided at the first generation
        self.layers, self.top_k = len(found), int(getattr(found[0], "top_k", 0)) if found else 0
        self.routes: dict[tuple[int, ...], np.ndarray] = {}  # this generation's, by sequence (every rank)
        self._taken: dict[tuple[int, ...], np.ndarray] = {}  # the main process's, until handed to every rank
        # the replay of the last policy forward: open until its backward is done (a gradient-checkpointed layer runs
        # its forward again in the backward, and must route as the forward did), closed by the next forward or when
        # TRL's training step returns
        self._held = HeldReplay()
        if self.on is None:
            generation = trainer.vllm_generation
            self._generate = generation.generate
            generation.generate = self.generate
            if server is not None:
                client = generation.vllm_client
                self._client_generate = client.generate
                client.generate = self.client_generate
            model.register_forward_pre_hook(self.before_forward, with_kwargs=True)
            self._training_step = trainer.training_step
            trainer.training_step = self.training_step

    def _decide(self) -> bool:
        """At the first generation, on every rank: the main process asks the server to record."""
        from accelerate.utils import broadcast_object_list

        if self.on is None:
            choice: list[Any] = [False]
            if self.server is not None:
                try:
                    self.server.record_routes()
                    choice = [True]
                    _log.info("rlsync: routing replay on: the server records every token's experts, the trainer's "
                              "forwards use them")
                except ConfigError as exc:
                    if self.wanted:
                        choice = [exc]
                    else:
                        _log.warning("rlsync: MoE model without routing replay (the trainer may route tokens to other "
                                     "experts than those that sampled them): start the vLLM server with %s to turn it "
                                     "on, or pass routes=False (%s)", SERVER_FLAGS, exc)
            if self.trainer.accelerator.num_processes > 1:
                broadcast_object_list(choice, from_process=0)
            if isinstance(choice[0], Exception):
                raise choice[0]
            self.on = bool(choice[0])
        return self.on

    def client_generate(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's client on the main process: after the server answered, take every completion's routes."""
        output = self._client_generate(*args, **kwargs)
        if self.on and self.server is not None:
            n = int(kwargs.get("n", 1))
            prompts, completions = output["prompt_ids"], output["completion_ids"]
            sequences = [tuple(prompts[i // n]) + tuple(c) for i, c in enumerate(completions)]
            self._taken = dict(zip(sequences, self.server.take_routes(sequences)))
        return output

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's ``VLLMGeneration.generate`` on every rank: the routes of this generation go to every rank."""
        from accelerate.utils import broadcast_object_list

        self._decide()
        result = self._generate(*args, **kwargs)
        if self.on:
            taken = [self._taken]
            if self.trainer.accelerator.num_processes > 1:
                broadcast_object_list(taken, from_process=0)
            self.routes, self._taken = taken[0], {}  # a generation's batch is trained on before the next is made
        return result

    def batch_routes(self, ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[np.ndarray, int]:
        """``[batch, seq, layers, top_k]`` for a forward's rows (-1 where a row has no record), and how many had one."""
        rows = token_rows(ids, mask)
        records = [self.routes.get(tuple(int(t) for t in row[row >= 0])) for row in rows]
        return routes_at_rows(rows, records, self.layers, self.top_k)

    def before_forward(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        self.close()  # the previous forward's backward, if any, is done
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not self.routes or not isinstance(ids, torch.Tensor) or ids.ndim != 2:
            return
        routes, found = self.batch_routes(ids, kwargs.get("attention_mask"))
        if not found:
            return
        self._held.open(module, routes)
        self.trainer._metrics["train"]["rlsync/routes_replayed"].append(found / len(ids))

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._training_step(*args, **kwargs)
        finally:
            self.close()

    def close(self) -> None:
        log = self._held.close()
        if log is not None and log.replayed:  # (a checkpointed recompute counts its tokens again: the share is the same)
            self.trainer._metrics["train"]["rlsync/routes_differing"].append(log.differing / log.replayed)
