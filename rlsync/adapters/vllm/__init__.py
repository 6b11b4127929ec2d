"""vLLM adapter. Importing this package imports nothing from vLLM; the worker extension is
``rlsync.adapters.vllm.RlsyncWorkerExtension`` (pass it as ``worker_extension_cls``)."""

from rlsync.adapters.vllm._extension import RlsyncWorkerExtension

__all__ = ["RlsyncWorkerExtension"]
