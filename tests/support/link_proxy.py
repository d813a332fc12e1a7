"""A user-space TCP link between a client and a PostgreSQL server, to emulate a far or stalled
network path where ``tc netem`` is not available (this machine's kernel has no sch_netem).

``LinkProxy(target_port, delay=0.04, rate=12.5e6)`` listens on 127.0.0.1 and forwards every
connection to the target, each direction through its own pipe that delivers a chunk ``delay``
seconds after it was read (one-way latency; RTT is twice that) and no faster than ``rate`` bytes
per second (a token bucket per direction, per connection; ``None``: unlimited). ``stalled=True``
accepts connections and never forwards a byte: a host that hangs rather than refuses.

``stall()`` turns a working link half-open mid-run: the connections open through it stop
forwarding for good, in both directions, without closing (their bytes are still read, so TCP
acknowledges them: only a deadline above TCP notices), and new connections hang as with
``stalled``; ``heal()`` lets new connections through again (the stalled ones stay dead, as a
path's do after a partition); ``reset()`` closes them too. ``stall_answers()`` stalls only the way
back on the connections open now: what a client sends still reaches the server, its answers never
come (a call's answer lost, certainly: a timer's stall could come after the answer).

The link outlives its server: while the server is down, each connection through the link is
closed at once (as a refused connect is), and once the server is back the next one goes through,
so a test may restart a server behind a link (``test_link_proxy.py``)."""

from __future__ import annotations

import collections
import socket
import threading
import time


class LinkProxy:
    def __init__(
        self,
        target_port: int,
        delay: float = 0.0,
        rate: float | None = None,
        stalled: bool = False,
        target_host: str = "127.0.0.1",
    ) -> None:
        self.target = (target_host, target_port)
        self.delay, self.rate, self.stalled = delay, rate, stalled
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.bytes = 0  # forwarded, both directions
        self.accepted = 0  # connections accepted (a connect tried through the link)
        self._generation = 0  # connections accepted before a stall() belong to an older generation
        self._answers_upto = 0  # connections numbered up to this one no longer forward the server's bytes
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="link-proxy", daemon=True).start()

    def dsn(self, dsn: str) -> str:
        """``dsn`` (key=value form) pointed at this proxy."""
        parts = [p for p in dsn.split() if not p.startswith(("host=", "port="))]
        return " ".join(parts + ["host=127.0.0.1", f"port={self.port}"])

    def stall(self) -> None:
        """Stop forwarding on every open connection and hang new ones (see the module docstring)."""
        self._generation += 1
        self.stalled = True

    def stall_answers(self) -> None:
        """Stop forwarding the servers' bytes on every open connection; the clients' still go through."""
        self._answers_upto = self.accepted

    def heal(self) -> None:
        """Forward new connections again; the ones stalled stay silent."""
        self.stalled = False

    def reset(self) -> None:
        """End a stall as a partition ending in resets: every connection open through the link is
        closed (a call stuck on one fails at once, as on a peer's RST), new ones go through."""
        open_now, self._sockets = self._sockets, []
        for s in open_now:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
        self.stalled = False

    def close(self) -> None:
        self._closed.set()
        for s in [self.listener, *self._sockets]:
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> LinkProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self._sockets.append(client)
            self.accepted += 1
            if self.stalled:
                continue  # held open, never answered
            try:
                server = socket.create_connection(self.target)
            except OSError:  # the server is down: the client meets a closed link, the proxy lives on
                client.close()
                continue
            self._sockets.append(server)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pipe(client, server, self._generation)
            self._pipe(server, client, self._generation, answers_of=self.accepted)

    def _pipe(self, src: socket.socket, dst: socket.socket, generation: int, answers_of: int = 0) -> None:
        """Read from ``src`` at once; deliver each chunk to ``dst`` after the delay, at the rate
        (``answers_of``: the number of the connection whose server's bytes these are, which
        ``stall_answers`` may hold back)."""
        queue: collections.deque[tuple[float, bytes]] = collections.deque()
        ready = threading.Condition()

        def read() -> None:
            while True:
                try:
                    data = src.recv(65536)
                except OSError:
                    data = b""
                with ready:
                    queue.append((time.monotonic() + self.delay, data))
                    ready.notify()
                if not data:
                    return

        def write() -> None:
            sent_at, budget = time.monotonic(), 0.0
            while True:
                with ready:
                    while not queue:
                        ready.wait()
                    due, data = queue.popleft()
                if generation != self._generation or answers_of and answers_of <= self._answers_upto:
                    return  # stalled: nothing more goes through, not even the close (half-open)
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not data:
                    try:
                        dst.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    return
                if self.rate:
                    now = time.monotonic()
                    budget = min(budget + (now - sent_at) * self.rate, self.rate * 0.01) - len(data)
                    sent_at = now
                    if budget < 0:
                        time.sleep(-budget / self.rate)
                try:
                    dst.sendall(data)
                except OSError:
                    return
                self.bytes += len(data)

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()
