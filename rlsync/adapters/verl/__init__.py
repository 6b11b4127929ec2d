"""verl: the checkpoint-engine backend ``rlsync``.

A verl user adds one flag, ``actor_rollout_ref.rollout.checkpoint_engine.backend=rlsync``; ``import verl``
imports this module through the ``verl.plugins`` entry point, which registers the backend
(``custom_backend_module=rlsync.adapters.verl`` does the same explicitly). Options, all optional:
``+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rlsync.KEY=V`` with KEY one of ``transport``
(``shm`` on one machine, ``nixl`` or ``tcp`` across machines), ``host`` (the address rollout workers listen
on; loopback by default), ``verify`` (checksums per tensor: a mismatch is an error naming the tensor and the
step), ``timeout`` (seconds a sync may take).

Importing this module imports verl (it registers into verl's registry); importing ``rlsync`` does not.
"""

from __future__ import annotations

from rlsync.adapters.verl._engine import RlsyncCheckpointEngine

__all__ = ["RlsyncCheckpointEngine"]
