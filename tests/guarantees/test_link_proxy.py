"""The test link (tests/support/link_proxy.py) outlives its server: a fault test that restarts the
server behind a link, or cuts the link while the server is down, goes on through the same link."""

from __future__ import annotations

import socket
import threading

from tests.support.link_proxy import LinkProxy


def _echo_once(listener: socket.socket) -> None:
    conn, _ = listener.accept()
    with conn:
        conn.sendall(conn.recv(64))


def _through(proxy: LinkProxy, payload: bytes) -> bytes:
    """What comes back through the link (b"": closed on the client, as a refused server's link is)."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client:
        try:
            client.sendall(payload)
            return client.recv(64)
        except ConnectionResetError:
            return b""


def test_a_link_whose_server_is_down_refuses_that_client_then_carries_the_next_once_the_server_is_back():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # the server is down: its port refuses
    with LinkProxy(port) as proxy:
        # the client meets a closed link (as a refused connect), not a hang
        assert _through(proxy, b"while down") == b""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))  # the server is back, on its port
        listener.listen(1)
        server = threading.Thread(target=_echo_once, args=(listener,), daemon=True)
        server.start()
        try:
            assert _through(proxy, b"once back") == b"once back"
        finally:
            server.join(10)
            listener.close()
