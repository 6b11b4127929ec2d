"""vLLM adapter. Importing this package imports nothing from vLLM; the worker extension is
``rlsync.adapters.vllm.RlsyncWorkerExtension`` (pass it as ``worker_extension_cls``), and
``engine_layout`` is the destination layout a trainer writes to, and ``apply_next_version(llm)`` the
driver's call per version."""

from rlsync.adapters.vllm._driver import apply_next_version
from rlsync.adapters.vllm._extension import RlsyncWorkerExtension
from rlsync.adapters.vllm._staging import engine_layout

__all__ = ["RlsyncWorkerExtension", "apply_next_version", "engine_layout"]
