"""A transparent TCP relay that delays every byte, both ways, by a fixed time: the test hosts' latency (this
kernel has no ``netem``). ``TestHosts.delay`` runs it inside a host and redirects that host's outgoing TCP to it with
an nftables rule; the relay finds where each connection was going (``SO_ORIGINAL_DST``) and connects there itself,
its own sockets marked so the rule lets them pass. Bytes are forwarded in order, each ``delay`` seconds after it
arrived; nothing is buffered beyond what is in flight, nothing changed.

    python delay_relay.py PORT DELAY_SECONDS MARK
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, delay: float) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, chunk = await queue.get()
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            if not chunk:
                if sink.can_write_eof():
                    sink.write_eof()
                return
            sink.write(chunk)
            await sink.drain()

    delivering = asyncio.create_task(deliver())
    try:
        while chunk := await source.read(1 << 16):
            queue.put_nowait((loop.time() + delay, chunk))
        queue.put_nowait((loop.time() + delay, b""))
        await delivering
    except (ConnectionError, OSError):
        delivering.cancel()
        sink.close()


async def _relay(client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter, delay: float, mark: int) -> None:
    raw = client_out.get_extra_info("socket").getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, address = struct.unpack_from("!H", raw, 2)[0], socket.inet_ntoa(raw[4:8])
    upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    upstream.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)  # not redirected again
    upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    upstream.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(upstream, (address, port))
    except OSError:
        upstream.close()
        client_out.close()
        return
    server_in, server_out = await asyncio.open_connection(sock=upstream)
    await asyncio.gather(_pipe(client_in, server_out, delay), _pipe(server_in, client_out, delay))
    for end in (client_out, server_out):
        end.close()


async def main(port: int, delay: float, mark: int) -> None:
    server = await asyncio.start_server(lambda r, w: _relay(r, w, delay, mark), "127.0.0.1", port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])))
