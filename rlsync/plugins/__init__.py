"""Built-in implementations of rlsync's hooks: transports (shm, cuda_ipc, tcp, nixl, torchdist), rollout-buffer backends
(memory, redis, ray), the staleness gate and the fp8 wire codec. Each registers the way a third-party plugin
does (``rlsync.plugins.transports``, ``.buffers``, ``.gates``, ``.wires``); the classes are public here for
code that builds one directly. Optional dependencies (nixl, redis, ray) are imported only when used.
"""

from rlsync.plugins._buffer_ray import RayRolloutBuffer
from rlsync.plugins._buffer_redis import RedisEpisodes, RedisStorage
from rlsync.plugins._transport_cuda_ipc import CudaIpcTransport
from rlsync.plugins._transport_nixl import NixlTransport
from rlsync.plugins._transport_shm import ShmLink, ShmTransport, remove_stale_regions
from rlsync.plugins._transport_tcp import TcpTransport
from rlsync.plugins._transport_torchdist import TorchDistTransport

__all__ = ["CudaIpcTransport", "NixlTransport", "RayRolloutBuffer", "RedisEpisodes", "RedisStorage", "ShmLink", "ShmTransport", "TcpTransport",
           "TorchDistTransport", "remove_stale_regions"]
