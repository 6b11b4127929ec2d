"""The ``vllm.general_plugins`` entry point (every vLLM process runs it): registers the weight-transfer backend
``rlsync``; in a run started by ``rlsync launch openrlhf`` (``RLSYNC_OPENRLHF`` set), also applies the OpenRLHF
engine-side patch, before vLLM resolves OpenRLHF's ``worker_extension_cls``."""

import os


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    WeightTransferEngineFactory.register_engine("rlsync", "rlsync.adapters.vllm._engine", "RlsyncWeightTransferEngine")
    if os.environ.get("RLSYNC_OPENRLHF"):
        from rlsync.patches.openrlhf import apply_engine_side

        apply_engine_side()
