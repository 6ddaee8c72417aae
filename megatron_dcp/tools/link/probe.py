"""A throughput probe between two processes: the sender writes for ``duration_s`` and closes its
side; the receiver counts the bytes that arrive after the first read over the time to the last
one (what the link carried, the sender's socket buffers drained included) and sends that figure
back, so that both ends know it. Used on a shaped loopback and across the veth of two nodes."""

from __future__ import annotations

import os
import socket
import time

PROBE_S = 1.2
CHUNK = 64 * 1024
TIMEOUT_S = 30.0


def receive(listener: socket.socket, timeout_s: float = TIMEOUT_S) -> float:
    """Accept one sender on ``listener``, read until it closes its side, reply with the bytes
    per second measured (a text line) and return that figure."""
    listener.settimeout(timeout_s)
    connection, _ = listener.accept()
    with connection:
        connection.settimeout(timeout_s)
        buffer = bytearray(CHUNK)
        if not connection.recv_into(buffer):
            raise ConnectionError("the probe's sender closed before sending anything")
        start = last = time.perf_counter()
        received = 0
        while True:
            count = connection.recv_into(buffer)
            if not count:
                break
            received += count
            last = time.perf_counter()
        rate = received / (last - start) if last > start else 0.0
        connection.sendall(f"{rate!r}\n".encode())
    return rate


def send(host: str, port: int, duration_s: float = PROBE_S, timeout_s: float = TIMEOUT_S) -> float:
    """Connect to the receiver at ``host:port`` (retrying until ``timeout_s``: it may not listen
    yet), send for ``duration_s``, and return the bytes per second it measured."""
    with connect(host, port, timeout_s) as sock:
        payload = bytes(CHUNK)
        end = time.perf_counter() + duration_s
        while time.perf_counter() < end:
            sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while not reply.endswith(b"\n"):
            data = sock.recv(256)
            if not data:
                raise ConnectionError(f"the probe's receiver at {host}:{port} sent no figure")
            reply += data
    return float(reply)


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
            return sock
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def listen(host: str, port: int) -> socket.socket:
    return socket.create_server((host, port), reuse_port=False)


def probe_between_processes(host: str, port: int, duration_s: float = PROBE_S) -> float:
    """Bytes per second from this process to a forked receiver listening on ``host:port``."""
    listener = listen(host, port)
    child = os.fork()
    if child == 0:  # the receiver
        code = 1
        try:
            receive(listener)
            code = 0
        finally:
            os._exit(code)
    listener.close()
    try:
        return send(host, port, duration_s)
    finally:
        os.waitpid(child, 0)
