"""TRL adapter (``pip install 'rlsync[trl]'``). Importing it applies ``rlsync.patches.trl`` (version-guarded).

- ``AsyncGRPOTrainer(..., weight_transfer=RlsyncWeightTransfer())`` for ``trl.experimental.async_grpo``;
- ``trainer.add_callback(RlsyncSyncCallback(trainer))`` for ``GRPOTrainer`` in vLLM server mode.

The vLLM server is a stock one: ``VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --host 127.0.0.1
--weight-transfer-config '{"backend": "rlsync"}'`` with rlsync installed beside vLLM.
"""

try:
    import trl  # noqa: F401
except ModuleNotFoundError as exc:  # say which extra, not only which module
    if exc.name != "trl":
        raise
    raise ModuleNotFoundError("rlsync.adapters.trl needs TRL: pip install 'rlsync[trl]'", name="trl") from None

from rlsync.patches import trl as _patches  # noqa: E402

_patches.apply()

from rlsync.adapters.trl._callback import VERSIONS, RlsyncSyncCallback  # noqa: E402  (after the patches)
from rlsync.adapters.trl._episodes import tool_call_key  # noqa: E402
from rlsync.adapters.trl._weight_transfer import RlsyncWeightTransfer  # noqa: E402

__all__ = ["VERSIONS", "RlsyncSyncCallback", "RlsyncWeightTransfer", "tool_call_key"]
