"""JSON-lines messages over loopback TCP: the testbed's control plane.

Router -> engines, decode -> prefill bootstrap server and decode -> router
token streams all speak one JSON object per line. Lines are bounded so a
confused peer cannot make a process buffer without limit.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from collections.abc import Callable
from typing import Any, cast

# One message: a JSON object (values by message kind).
Message = dict[str, Any]

MAX_LINE = 1 << 20  # agent metadata (base64) is the largest message, a few KiB
HOST = "127.0.0.1"


class WireError(Exception):
    pass


def encode(msg: Message) -> bytes:
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


def decode(line: bytes) -> Message:
    if len(line) > MAX_LINE:
        raise WireError(f"line of {len(line)} bytes exceeds {MAX_LINE}")
    try:
        msg = json.loads(line)
    except ValueError as e:
        raise WireError(f"not JSON: {e}") from None
    if not isinstance(msg, dict):
        raise WireError("message is not an object")
    return msg


def room_of(msg: Message) -> int:
    """The message's bootstrap room, checked: a 63-bit non-negative int."""
    room = msg.get("room")
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 1 << 63:
        raise WireError(f"room must be an int in [0, 2**63), got {room!r}")
    return room


class Conn:
    """One client connection: send a line, read lines, thread-safe sends."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.rfile = sock.makefile("rb")
        self._send_lock = threading.Lock()

    @classmethod
    def connect(cls, port: int, timeout_s: float = 5.0) -> Conn:
        sock = socket.create_connection((HOST, port), timeout=timeout_s)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(sock)

    def send(self, msg: Message) -> None:
        data = encode(msg)
        with self._send_lock:
            self.sock.sendall(data)

    def recv(self) -> Message | None:
        line = self.rfile.readline(MAX_LINE + 1)
        if not line:
            return None
        return decode(line)

    def request(self, msg: Message) -> Message:
        self.send(msg)
        reply = self.recv()
        if reply is None:
            raise WireError("peer closed the connection")
        return reply

    def close(self) -> None:
        # Shut the socket down first: it wakes a thread blocked reading this
        # connection, which holds the reader's lock that rfile.close() needs.
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for closer in (self.rfile.close, self.sock.close):
            try:
                closer()
            except OSError:
                pass


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Conn(self.request)
        try:
            while True:
                try:
                    msg = conn.recv()
                except (WireError, OSError):
                    return
                if msg is None:
                    return
                reply = cast(LineServer, self.server).on_message(msg, conn)
                if reply is not None:
                    conn.send(reply)
        except OSError:
            return


# (message, the connection it came on) -> the reply, or None for none (a stream answers later).
OnMessage = Callable[[Message, Conn], "Message | None"]


class LineServer(socketserver.ThreadingTCPServer):
    """Loopback server calling `on_message(msg, conn) -> reply | None` per line."""

    daemon_threads = True
    allow_reuse_address = True  # a restarted decode binds its old port again

    def __init__(self, port: int, on_message: OnMessage):
        self.on_message = on_message
        super().__init__((HOST, port), _Handler)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def serve_in_thread(self, name: str) -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2}, name=name, daemon=True)
        t.start()
        return t
