"""Rank 0's commands to the follower ranks: length-prefixed pickles over loopback TCP, one
connection per follower.

Not a torch.distributed broadcast: gloo's send waits for the receiver, so a follower that
hangs would hang rank 0 in the broadcast under whatever timeout its group has, and the
followers' wait for the next command must have none (a server may sit idle for days).
Here a send returns once the bytes are in the socket's buffer (bounded by `timeout` when
it is full), a follower waits for commands without a deadline and sees rank 0 gone as the
connection closing; a stalled follower is found by the forward's next collective, which
times out. Only followers unpickle, and only what the rank 0 they connected to sends; a
connection is accepted only with the run's token (rank 0 writes it to the follower's stdin)."""

from __future__ import annotations

import pickle
import secrets
import socket
import struct
from typing import Any

_HEADER = struct.Struct("!Q")


class ChannelClosed(ConnectionError):
    """The other end is gone."""


class Listening:
    """Rank 0's side before the followers connect: a loopback port and the run's token."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.token = secrets.token_hex(16)

    def accept(self, followers: int, timeout: float, send_timeout: float) -> CommandChannel:
        """Each follower's connection, in rank order (1, 2, ...)."""
        self.server.settimeout(timeout)
        by_rank: dict[int, socket.socket] = {}
        try:
            while len(by_rank) < followers:
                conn, _ = self.server.accept()
                conn.settimeout(timeout)
                hello = _read(conn, len(self.token) + 4)
                if hello[:len(self.token)].decode(errors="replace") != self.token:
                    conn.close()  # not one of ours
                    continue
                conn.settimeout(send_timeout)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                by_rank[struct.unpack("!I", hello[len(self.token):])[0]] = conn
        finally:
            self.server.close()
        return CommandChannel([by_rank[r] for r in sorted(by_rank)])


def connect(port: int, rank: int, token: str) -> CommandChannel:
    """A follower's side: connected to rank 0, identified by the run's token."""
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sendall(token.encode() + struct.pack("!I", rank))
    conn.settimeout(None)  # commands come when the engine has work
    return CommandChannel([conn])


class CommandChannel:
    def __init__(self, conns: list[socket.socket]) -> None:
        self.conns = conns

    def send(self, message: Any) -> None:
        """To every follower (rank 0)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        frame = _HEADER.pack(len(data)) + data
        for conn in self.conns:
            try:
                conn.sendall(frame)
            except OSError as exc:  # reset, closed, or a full buffer past the timeout
                raise ChannelClosed(f"a follower rank does not take commands: {exc!r}") from exc

    def receive(self) -> Any:
        """The next message from rank 0 (a follower)."""
        (n,) = _HEADER.unpack(_read(self.conns[0], _HEADER.size))
        return pickle.loads(_read(self.conns[0], n))

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


def _read(conn: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = conn.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ChannelClosed("the other rank closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
