"""vLLM adapter. Importing this package imports nothing from vLLM; the worker extension is
``rlsync.adapters.vllm.RlsyncWorkerExtension`` (pass it as ``worker_extension_cls``), and
``engine_layout`` is the destination layout a trainer writes to, and ``apply_next_version(llm)`` the
driver's call per version. ``VllmServer`` is the trainer's side of a stock vLLM server started with
``--weight-transfer-config '{"backend": "rlsync"}'`` (its HTTP routes, no vLLM import)."""

from rlsync.adapters.vllm._driver import apply_next_version
from rlsync.adapters.vllm._extension import RlsyncWorkerExtension
from rlsync.adapters.vllm._server import PublishStats, VllmServer, reserve_ports
from rlsync.adapters.vllm._staging import engine_layout

__all__ = ["PublishStats", "RlsyncWorkerExtension", "VllmServer", "apply_next_version", "engine_layout", "reserve_ports"]
