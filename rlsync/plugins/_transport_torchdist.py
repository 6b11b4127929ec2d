"""``torchdist``: a torch.distributed broadcast in 256 MiB buckets (gloo here, NCCL's recipe on
GPUs). It is what users run today, kept as the baseline and the last resort: not one-sided (a
thread of the reader takes part in every broadcast) and it copies each bucket twice (pack on the
writer, unpack on the reader).

Each writer gets a two-rank process group with the reader, rendezvousing through a TCPStore the
reader hosts (loopback unless told otherwise). Per batch the writer broadcasts a header
``[kind, count]``, then ``count`` runs ``(slot, offset, nbytes)``, then the packed bytes.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from rlsync import Landing, Link, PeerLostError, Run, Transport, resolve_secret

BUCKET = 256 * 2**20
DATA, FLUSH, CLOSE = 0, 1, 2
TIMEOUT = datetime.timedelta(seconds=600)


def _broadcast(group: Any, tensor: Any, root: int) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = root
    group.broadcast([tensor], options).wait()


class TorchDistLanding(Landing):
    name: ClassVar[str] = "torchdist"
    one_sided: ClassVar[bool] = False

    def __init__(self, nbytes: int, slots: int, options: Mapping[str, Any] | None = None) -> None:
        import torch.distributed as dist

        super().__init__(nbytes, slots, options)
        host = str(self.options.get("host", "127.0.0.1"))
        resolve_secret(host, self.options.get("secret"))  # the store has no authentication: loopback or a secret-guarded network only
        self._regions = [np.zeros(max(nbytes, 1), dtype=np.uint8) for _ in range(slots)]
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)  # type: ignore[attr-defined]  # not re-exported
        self._host = host
        self._closed = threading.Event()
        self._seen = 0
        self._servers: list[threading.Thread] = []
        threading.Thread(target=self._accept, name="rlsync-torchdist-landing", daemon=True).start()

    @property
    def regions(self) -> Sequence[np.ndarray]:
        return self._regions

    def describe(self) -> dict[str, Any]:
        return {"host": self._host, "port": self._store.port}

    def _accept(self) -> None:
        while not self._closed.wait(0.02):
            joined = self._store.add("writers", 0)
            while self._seen < joined:
                self._seen += 1
                server = threading.Thread(target=self._serve, args=(self._seen,), daemon=True)
                server.start()
                self._servers.append(server)

    def _serve(self, index: int) -> None:
        import torch
        import torch.distributed as dist

        group = dist.ProcessGroupGloo(dist.PrefixStore(f"w{index}/", self._store), 1, 2, TIMEOUT)  # type: ignore[attr-defined]
        header = torch.zeros(2, dtype=torch.int64)
        try:
            while True:
                _broadcast(group, header, 0)
                kind, count = header.tolist()
                if kind == CLOSE:
                    return
                if kind == FLUSH:
                    _broadcast(group, torch.ones(1), 1)
                    continue
                table = torch.zeros((count, 3), dtype=torch.int64)
                _broadcast(group, table, 0)
                runs = table.tolist()
                bucket = torch.empty(sum(n for _, _, n in runs), dtype=torch.uint8)
                _broadcast(group, bucket, 0)
                data = bucket.numpy()
                at = 0
                for slot, offset, n in runs:
                    np.copyto(self._regions[slot][offset : offset + n], data[at : at + n])
                    at += n
        except RuntimeError:  # the writer died: its group is gone, the reader carries on
            return

    def close(self) -> None:
        self._closed.set()
        # A writer that closed its link told its server thread to end: wait for it, so that its gloo group is freed
        # here and not at interpreter exit, where gloo's threads end the process with "terminate called without an
        # active exception" (a writer still connected keeps its thread; a second at most is waited for in all)
        deadline = time.monotonic() + 1.0
        for server in self._servers:
            server.join(max(0.0, deadline - time.monotonic()))


class TorchDistLink(Link):
    def __init__(self, description: dict[str, Any]) -> None:
        import torch.distributed as dist

        try:
            store = dist.TCPStore(description["host"], int(description["port"]), is_master=False, timeout=TIMEOUT)  # type: ignore[attr-defined]
        except RuntimeError as exc:
            raise PeerLostError(f"cannot reach the reader's torch.distributed store: {exc}") from exc
        index = store.add("writers", 1)
        self._group = dist.ProcessGroupGloo(dist.PrefixStore(f"w{index}/", store), 0, 2, TIMEOUT)  # type: ignore[attr-defined]
        self._store = store

    def _send(self, source: np.ndarray, runs: Sequence[Run]) -> None:
        import torch

        _broadcast(self._group, torch.tensor([DATA, len(runs)], dtype=torch.int64), 0)
        _broadcast(self._group, torch.tensor([(slot, d, n) for _, slot, d, n in runs], dtype=torch.int64), 0)
        bucket = np.concatenate([source[s : s + n] for s, _, _, n in runs])
        _broadcast(self._group, torch.from_numpy(bucket), 0)

    def write(self, source: np.ndarray, runs: Sequence[Run]) -> None:
        batch: list[Run] = []
        size = 0
        try:
            for run in runs:
                s, slot, d, n = run
                while n:  # split runs larger than a bucket
                    take = min(n, BUCKET - size)
                    batch.append((s, slot, d, take))
                    size += take
                    s, d, n = s + take, d + take, n - take
                    if size == BUCKET:
                        self._send(source, batch)
                        batch, size = [], 0
            if batch:
                self._send(source, batch)
        except RuntimeError as exc:
            raise PeerLostError(f"torch.distributed broadcast to the reader failed: {exc}") from exc

    def flush(self) -> None:
        import torch

        try:
            _broadcast(self._group, torch.tensor([FLUSH, 0], dtype=torch.int64), 0)
            _broadcast(self._group, torch.zeros(1), 1)
        except RuntimeError as exc:
            raise PeerLostError(f"torch.distributed broadcast to the reader failed: {exc}") from exc

    def close(self) -> None:
        import torch

        group = self.__dict__.pop("_group", None)  # freed below, while its threads can still be joined (see
        if group is None:  # TorchDistLanding.close); closed before
            return
        try:
            _broadcast(group, torch.tensor([CLOSE, 0], dtype=torch.int64), 0)
        except RuntimeError:
            pass


class TorchDistTransport(Transport):
    name: ClassVar[str] = "torchdist"
    landing: ClassVar[type[Landing]] = TorchDistLanding

    @classmethod
    def open(cls, description: dict[str, Any], options: Mapping[str, Any] | None = None) -> Link:
        return TorchDistLink(description)
