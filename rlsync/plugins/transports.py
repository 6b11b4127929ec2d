"""Built-in transports, registered like any third-party plugin's (``trylast`` so those win)."""

from __future__ import annotations

from typing import Any

from rlsync import Registry, hookimpl


@hookimpl(trylast=True)
def rlsync_register_transports(registry: Registry[Any]) -> None:
    from rlsync.plugins._transport_cuda_ipc import CudaIpcTransport
    from rlsync.plugins._transport_nixl import NixlTransport
    from rlsync.plugins._transport_shm import ShmTransport
    from rlsync.plugins._transport_tcp import TcpTransport
    from rlsync.plugins._transport_torchdist import TorchDistTransport

    for transport in (ShmTransport, CudaIpcTransport, NixlTransport, TcpTransport, TorchDistTransport):
        registry.add(transport.name, transport)
