"""The listening socket uvicorn serves on (lmforge.serve.listen.bind)."""

from __future__ import annotations

import asyncio
import socket

from lmforge.serve.listen import bind


def test_accepted_connections_send_without_waiting_for_an_ack():
    """asyncio sets TCP_NODELAY on an accepted connection only where the listening socket's proto
    is TCP; without it each keep-alive answer (and SSE chunk) waits ~40 ms for the client's
    delayed ACK."""
    sock = bind("127.0.0.1", 0)
    seen: list[int] = []

    async def main():
        async def handle(reader, writer):
            seen.append(
                writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            )
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname())
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
    assert seen and seen[0] != 0
