"""`vlrl.serving`'s listening sockets: the connections they accept get TCP_NODELAY from asyncio (what uvicorn runs
on), so an answer written as headers then body is not held back until the client's delayed ACK (~40 ms)."""

import asyncio
import socket

from vlrl.serving import bind_socket


def test_connections_accepted_on_a_bound_socket_have_tcp_nodelay():
    async def accepted_nodelay() -> int:
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        listener = bind_socket("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", listener.getsockname()[1])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
            return value
        finally:
            server.close()
            await server.wait_closed()

    # asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP; a socket made with proto=0 (the default of
    # socket.socket) and the connections it accepts would report 0 here
    assert bind_socket("127.0.0.1", 0).proto == socket.IPPROTO_TCP
    assert asyncio.run(accepted_nodelay()) != 0
