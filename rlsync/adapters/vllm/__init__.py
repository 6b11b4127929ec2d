"""vLLM adapter. Importing this package imports nothing from vLLM; the worker extension is
``rlsync.adapters.vllm.RlsyncWorkerExtension`` (pass it as ``worker_extension_cls``), and
``engine_layout`` is the destination layout a trainer writes to."""

from rlsync.adapters.vllm._extension import RlsyncWorkerExtension
from rlsync.adapters.vllm._staging import engine_layout

__all__ = ["RlsyncWorkerExtension", "engine_layout"]
