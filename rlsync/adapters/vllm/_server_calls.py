"""The HTTP calls a trainer makes to a stock vLLM server besides the weights: health, config, the served version,
pause and resume, prompt log-probs, the prefix cache, and the MoE routes through rlsync's worker extension.

``ServerCalls`` is the base of ``VllmServer``, which adds the weight versions (``publish``, ``publish_lora``). Plain HTTP
with JSON (the standard library), nothing pickled."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Sequence
from typing import Any

from rlsync import ConfigError, PeerLostError, RlsyncWarning, SyncOptions
from rlsync.core import span

MAX_TOKEN_IDS = 128  # vLLM's MAX_LOGPROB_TOKEN_IDS: the ids one request may ask log-probs of
SERVER_FLAGS = "VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --host 127.0.0.1 --weight-transfer-config '{\"backend\": \"rlsync\"}'"


class ServerCalls:
    """JSON calls to the vLLM server at ``url`` (``options.timeout``: how long one may take)."""

    def __init__(self, url: str, options: SyncOptions) -> None:
        self.url = url.rstrip("/")
        self.options = options
        self._model: str | None = None  # the served model's name (its completions route wants it)
        self.paused = False  # generation frozen by pause(): no request (nor a canary) runs until resume()

    def call(self, route: str, body: dict[str, Any] | None = None, *, method: str = "POST", timeout: float | None = None) -> Any:
        """One JSON request to the server; an HTTP error raises ``PeerLostError`` with the server's answer."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + route, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.options.timeout) as response:
                text = response.read()
                plain = response.headers.get_content_type() != "application/json"  # the LoRA routes answer text
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            if exc.code == 404:
                raise ConfigError(f"the vLLM server at {self.url} has no route {route}: start it as {SERVER_FLAGS}") from exc
            raise PeerLostError(f"vLLM server {self.url}{route} answered {exc.code}: {detail}") from exc
        except OSError as exc:
            raise PeerLostError(f"vLLM server {self.url}{route}: {exc}") from exc
        if plain:
            return text.decode(errors="replace")
        return json.loads(text) if text.strip() else None

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.call("/health", method="GET", timeout=5)
                return
            except (PeerLostError, ConfigError):
                if time.monotonic() > deadline:
                    raise PeerLostError(f"the vLLM server at {self.url} did not answer /health within {timeout:.0f} s") from None
                time.sleep(1.0)

    def config(self) -> dict[str, Any]:
        """The server's resolved ``VllmConfig`` (``/server_info``); checks that its weight transfer is rlsync's."""
        cfg = dict(self.call("/server_info?config_format=json", method="GET")["vllm_config"])
        backend = (cfg.get("weight_transfer_config") or {}).get("backend")
        if backend != "rlsync":
            raise ConfigError(f"the vLLM server at {self.url} has weight-transfer backend {backend!r}, not rlsync's: "
                              f"start it as {SERVER_FLAGS} (with rlsync installed beside vLLM)")
        return cfg

    def weight_version(self) -> str:
        """The version the server reports for what it serves (``/weight_info``)."""
        return str(self.call("/weight_info", method="GET")["weight_version"])

    def pause(self) -> None:
        """Freeze in-flight requests (they continue on ``resume``), as TRL's async trainer does."""
        with span("pause"):  # the timeline: the engine generates nothing from here to the end of the next resume
            self.call("/pause?mode=keep")
        self.paused = True

    def resume(self) -> None:
        with span("resume"):
            self.call("/resume")
        self.paused = False

    def prompt_logprobs(self, tokens: Sequence[Sequence[int]], *, model: str | None = None) -> list[list[float]]:
        """log p(``tokens[i][j + 1]`` | ``tokens[i][: j + 1]``) as the server computes them (its completions route with
        ``prompt_logprobs``: vLLM's raw log-probs of the prompt's own tokens), with the served adapter ``model``
        (``NAME@VERSION``) if given."""
        if self._model is None:
            self._model = str(self.call("/v1/models", method="GET")["data"][0]["id"])
        if model is not None and model != self._model:
            return self._adapter_logprobs(tokens, model)
        # one request for every row (the completions route takes a batch of token-id prompts)
        answer = self.call("/v1/completions", {"model": model or self._model, "prompt": [list(row) for row in tokens],
                                               "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0})
        choices = sorted(answer["choices"], key=lambda choice: int(choice["index"]))
        rows = []
        for choice, row in zip(choices, tokens):
            positions = choice["prompt_logprobs"][1:]
            rows.append([float(position[str(token)]["logprob"]) for position, token in zip(positions, row[1:])])
        return rows

    def _adapter_logprobs(self, tokens: Sequence[Sequence[int]], model: str) -> list[list[float]]:
        """``prompt_logprobs`` with a LoRA adapter, computed without vLLM's prompt log-probs: those run on the wrong
        LoRA mapping once a batch holds more than one request, and the engine core dies (vLLM issues 16668 and 29955:
        ``einsum(): subscript b has size 2 ...`` in the LoRA logits path). Each position is a one-token generation
        from the prefix before it instead, with the log-prob of its own token asked by id (``logprob_token_ids``,
        vLLM's raw log-probs of the unprocessed logits: the same numbers the prompt's would be)."""
        rows = [[0.0] * max(len(row) - 1, 0) for row in tokens]
        wanted = [(i, j) for i, row in enumerate(tokens) for j in range(1, len(row))]
        targets = sorted({int(tokens[i][j]) for i, j in wanted})
        for start in range(0, len(targets), MAX_TOKEN_IDS):  # vLLM takes so many ids per request
            chunk = targets[start : start + MAX_TOKEN_IDS]
            asked = [(i, j) for i, j in wanted if int(tokens[i][j]) in set(chunk)]
            answer = self.call("/v1/completions", {
                "model": model, "prompt": [list(map(int, tokens[i][:j])) for i, j in asked], "max_tokens": 1,
                "temperature": 0.0, "logprobs": 0, "logprob_token_ids": chunk, "return_tokens_as_token_ids": True})
            for choice in answer["choices"]:
                i, j = asked[int(choice["index"])]
                rows[i][j - 1] = float(choice["logprobs"]["top_logprobs"][0][f"token_id:{int(tokens[i][j])}"])
        return rows

    def reset_prefix_cache(self) -> bool:
        """Drop cached prefixes (computed with the previous weights). vLLM refuses while requests hold KV
        blocks (requests frozen by ``pause``, say): then it warns and returns False, the engine unchanged."""
        answer = self.call("/reset_prefix_cache")
        done = bool(answer.get("success", True)) if isinstance(answer, dict) else True
        if not done:
            warnings.warn(f"the vLLM server at {self.url} kept its prefix cache (requests in flight hold KV blocks): "
                          "new requests may reuse prefixes computed with the previous weights", RlsyncWarning, stacklevel=2)
        return done

    # --- MoE routes ---------------------------------------------------------------------------------------
    def record_routes(self) -> int:
        """From now on the server's workers record the experts every MoE layer routes each token to (the rollout's
        half of routing replay; ``take_routes`` hands them over). Needs the server started with
        ``--worker-extension-cls rlsync.adapters.vllm.RlsyncWorkerExtension --no-enable-prefix-caching`` (a prefix-cache
        hit runs no router) and ``VLLM_SERVER_DEV_MODE=1`` (its ``/collective_rpc`` route). Returns the MoE layers."""
        return int(self._rpc("rlsync_record_routes")[0])

    def take_routes(self, sequences: Sequence[Sequence[int]]) -> list[Any]:
        """For each finished sequence the server generated (prompt and completion token ids, as its answer gave them),
        the experts of every position it ran: ``[len - 1, layers, top_k]``, the prompt's first (``rlsync.Sample(routes=
        ...)`` as it is), taken from the workers. Raises naming the sequence where none was recorded."""
        from rlsync.adapters.vllm._routes import decode_routes

        answer = self._rpc("rlsync_take_routes_of", json.dumps([list(map(int, s)) for s in sequences]))[0]
        out = []
        for i, encoded in enumerate(answer["routes"]):
            if encoded is None:
                raise ConfigError(f"no routes recorded for sequence {i} ({len(sequences[i])} tokens): call record_routes() "
                                  "before generating, and start the server with --no-enable-prefix-caching (a "
                                  "prefix-cache hit runs no router for those positions)")
            out.append(decode_routes(encoded))
        return out

    def _rpc(self, method: str, *args: str) -> list[Any]:
        """A method of rlsync's worker extension on every worker (the dev-mode ``/collective_rpc`` route)."""
        try:
            answer = self.call("/collective_rpc", {"method": method, "args": list(args)})
        except PeerLostError as exc:
            if "has no attribute" in str(exc) or "not found" in str(exc).lower():
                raise ConfigError(f"the vLLM server at {self.url} runs no rlsync worker extension: start it with "
                                  "--worker-extension-cls rlsync.adapters.vllm.RlsyncWorkerExtension") from exc
            raise
        return list(answer["results"])
