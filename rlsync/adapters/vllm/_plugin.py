"""The ``vllm.general_plugins`` entry point (every vLLM process runs it): registers the weight-transfer backend
``rlsync``."""


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    WeightTransferEngineFactory.register_engine("rlsync", "rlsync.adapters.vllm._engine", "RlsyncWeightTransferEngine")
