"""The test bed's network: a router in one process, joining every pod of the bed by a TUN device.

Why not veth pairs and a bridge: the faults need latency between hosts, and the kernels we run on
may lack ``tc netem`` (the development machine's does: ``CONFIG_NET_SCH_NETEM`` is not set). A
router in user space works on any kernel with ``/dev/net/tun``: it reads each IPv4 packet a pod
sends, and writes it to the pod that owns the destination address, after the configured delay,
unless a partition drops it. Dropping is silent, as a real partition is: no reset, no ICMP; the
sockets on both sides find out only through their own timeouts and keepalives.

It also counts, for the round-trip figures: per service (by the server's port), the packets and
the *request bursts* that crossed it. A burst is a run of TCP segments carrying data in one
direction on one connection; a request burst is one from the client side (the side whose port is
not the service's). A request and its answer are one round trip, so request bursts are round trips
(HTTP/2 pings and window updates that cross on their own count too; the idle rate is measured and
subtracted by the caller).

Started by ``tests.cluster.bed`` as ``python -m tests.cluster.wire --control SOCKET --port
NAME=IP@HOST ...``: it creates one TUN device per port in its own network namespace, prints
``ready`` and serves JSON lines on the control socket (a Unix socket: it works across network
namespaces). The bed moves each device into its pod's namespace. Stops on SIGTERM or when its
control socket's owner says ``stop``.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
# Every bed address is in this network; a packet to any other address is dropped.
BED_NET = bytes([10, 77])
MAX_PACKET = 65_535
TCP = 6


@dataclass(frozen=True)
class Port:
    """One pod's link: its TUN device, address and the host (failure domain) it belongs to."""

    name: str
    ip: str
    host: str


@dataclass
class Rule:
    """Drop every packet between side ``a`` and side ``b`` (either direction). A side is a set of
    addresses and, optionally, one TCP port on them (``0``: every port)."""

    name: str
    a_ips: frozenset[bytes]
    a_port: int
    b_ips: frozenset[bytes]
    b_port: int

    def drops(self, src: bytes, sport: int, dst: bytes, dport: int) -> bool:
        return self._one_way(src, sport, dst, dport) or self._one_way(dst, dport, src, sport)

    def _one_way(self, src: bytes, sport: int, dst: bytes, dport: int) -> bool:
        return (
            src in self.a_ips
            and dst in self.b_ips
            and (self.a_port == 0 or self.a_port == sport)
            and (self.b_port == 0 or self.b_port == dport)
        )


@dataclass
class Counters:
    """What crossed, per service port: packets, request bursts and answer bursts."""

    packets: dict[int, int] = field(default_factory=dict)
    requests: dict[int, int] = field(default_factory=dict)
    answers: dict[int, int] = field(default_factory=dict)
    dropped: int = 0
    delayed: int = 0
    # Per connection (the two endpoints, sorted): which side sent data last.
    last_sender: dict[tuple[bytes, bytes], bytes] = field(default_factory=dict)

    def snapshot(self) -> dict[str, Any]:
        return {
            "packets": {str(k): v for k, v in self.packets.items()},
            "requests": {str(k): v for k, v in self.requests.items()},
            "answers": {str(k): v for k, v in self.answers.items()},
            "dropped": self.dropped,
            "delayed": self.delayed,
        }


class Wire:
    """The router: TUN devices, the delay, the drop rules and the counters."""

    def __init__(self, ports: Sequence[Port], service_ports: frozenset[int]) -> None:
        self.ports = list(ports)
        self.service_ports = service_ports
        self.fds: dict[str, int] = {}
        self.by_ip: dict[bytes, int] = {}
        self.host_of: dict[bytes, str] = {}
        self.delay_seconds = 0.0
        self.every_hop = False
        self.rules: dict[str, Rule] = {}
        self.counters = Counters()
        self._queue: list[tuple[float, int, int, bytes]] = []
        self._seq = 0

    def open(self) -> None:
        for port in self.ports:
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", port.name.encode(), IFF_TUN | IFF_NO_PI))
            self.fds[port.name] = fd
            ip = socket.inet_aton(port.ip)
            self.by_ip[ip] = fd
            self.host_of[ip] = port.host

    def forward(self, packet: bytes, now: float) -> None:
        if len(packet) < 20 or packet[0] >> 4 != 4:
            return  # IPv4 only (the pods have no IPv6 address on the bed's network)
        src, dst = packet[12:16], packet[16:20]
        out = self.by_ip.get(dst)
        if out is None or dst[:2] != BED_NET:
            return
        sport = dport = 0
        payload = 0
        ihl = (packet[0] & 0x0F) * 4
        if packet[9] == TCP and len(packet) >= ihl + 20:
            sport, dport = struct.unpack_from("!HH", packet, ihl)
            total = struct.unpack_from("!H", packet, 2)[0]
            payload = total - ihl - (packet[ihl + 12] >> 4) * 4
        for rule in self.rules.values():
            if rule.drops(src, sport, dst, dport):
                self.counters.dropped += 1
                return
        if sport or dport:
            self._count(src, sport, dst, dport, payload)
        if self.delay_seconds > 0 and (self.every_hop or self.host_of[src] != self.host_of[dst]):
            self._seq += 1
            self.counters.delayed += 1
            heapq.heappush(self._queue, (now + self.delay_seconds, self._seq, out, packet))
            return
        _write(out, packet)

    def _count(self, src: bytes, sport: int, dst: bytes, dport: int, payload: int) -> None:
        service = dport if dport in self.service_ports else sport if sport in self.service_ports else 0
        if not service:
            return
        c = self.counters
        c.packets[service] = c.packets.get(service, 0) + 1
        if payload <= 0:
            return
        a, b = src + struct.pack("!H", sport), dst + struct.pack("!H", dport)
        key = (a, b) if a < b else (b, a)
        if c.last_sender.get(key) == a:
            return
        c.last_sender[key] = a
        if dport == service:
            c.requests[service] = c.requests.get(service, 0) + 1
        else:
            c.answers[service] = c.answers.get(service, 0) + 1

    def release_due(self, now: float) -> float | None:
        """Write every delayed packet whose time has come; the seconds until the next one (None: none)."""
        while self._queue and self._queue[0][0] <= now:
            _, _, out, packet = heapq.heappop(self._queue)
            _write(out, packet)
        return max(0.0, self._queue[0][0] - now) if self._queue else None

    def control(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "delay":
            self.delay_seconds = float(request["ms"]) / 1000.0
            self.every_hop = bool(request.get("every_hop", False))
        elif op == "drop":
            self.rules[str(request["name"])] = Rule(
                name=str(request["name"]),
                a_ips=frozenset(socket.inet_aton(ip) for ip in request["a"]),
                a_port=int(request.get("a_port", 0)),
                b_ips=frozenset(socket.inet_aton(ip) for ip in request["b"]),
                b_port=int(request.get("b_port", 0)),
            )
        elif op == "heal":
            name = request.get("name")
            if name is None:
                self.rules.clear()
            else:
                self.rules.pop(str(name), None)
        elif op == "counters":
            snapshot = self.counters.snapshot()
            if request.get("reset"):
                self.counters = Counters()
            return {"ok": True, "counters": snapshot}
        elif op == "state":
            return {
                "ok": True,
                "delay_ms": self.delay_seconds * 1000,
                "every_hop": self.every_hop,
                "rules": sorted(self.rules),
            }
        elif op == "stop":
            return {"ok": True, "stop": True}
        else:
            return {"ok": False, "error": f"unknown op {op!r}"}
        return {"ok": True}


def _write(fd: int, packet: bytes) -> None:
    try:
        os.write(fd, packet)
    except (BlockingIOError, OSError):
        pass  # a full queue or a pod going away: the packet is lost, as on a real link


def serve(wire: Wire, control_path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(control_path)
    listener.listen(8)
    listener.setblocking(False)
    poll = select.epoll()
    tun_of: dict[int, int] = {}
    for fd in wire.fds.values():
        poll.register(fd, select.EPOLLIN)
        tun_of[fd] = fd
    poll.register(listener.fileno(), select.EPOLLIN)
    clients: dict[int, tuple[socket.socket, bytearray]] = {}
    stopping = False

    def on_term(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    print("ready", flush=True)
    next_due: float | None = None
    try:
        while not stopping:
            timeout = 0.5 if next_due is None else min(0.5, next_due)
            try:
                events = poll.poll(timeout)
            except InterruptedError:
                continue
            now = time.monotonic()
            for fd, _ in events:
                if fd in tun_of:
                    for _ in range(64):
                        try:
                            packet = os.read(fd, MAX_PACKET)
                        except (BlockingIOError, OSError):
                            break
                        wire.forward(packet, now)
                elif fd == listener.fileno():
                    conn, _ = listener.accept()
                    conn.setblocking(False)
                    clients[conn.fileno()] = (conn, bytearray())
                    poll.register(conn.fileno(), select.EPOLLIN)
                elif fd in clients:
                    conn, buf = clients[fd]
                    try:
                        data = conn.recv(65536)
                    except BlockingIOError:
                        continue
                    if not data:
                        poll.unregister(fd)
                        conn.close()
                        del clients[fd]
                        continue
                    buf.extend(data)
                    while b"\n" in buf:
                        line, _, rest = bytes(buf).partition(b"\n")
                        buf[:] = rest
                        try:
                            answer = wire.control(json.loads(line))
                        except (ValueError, KeyError, TypeError, OSError) as exc:
                            answer = {"ok": False, "error": str(exc)}
                        conn.setblocking(True)
                        conn.sendall(json.dumps(answer).encode() + b"\n")
                        conn.setblocking(False)
                        if answer.get("stop"):
                            stopping = True
            next_due = wire.release_due(time.monotonic())
    finally:
        for conn, _ in clients.values():
            conn.close()
        listener.close()
        poll.close()
        for fd in wire.fds.values():
            os.close(fd)


def parse_port(text: str) -> Port:
    """``NAME=IP@HOST``."""
    name, _, rest = text.partition("=")
    ip, _, host = rest.partition("@")
    if not (name and ip and host) or len(name) > 15:
        raise argparse.ArgumentTypeError(f"expected NAME=IP@HOST (NAME at most 15 characters), got {text!r}")
    return Port(name=name, ip=ip, host=host)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--control", required=True, help="path of the control Unix socket")
    parser.add_argument("--port", action="append", type=parse_port, default=[], help="NAME=IP@HOST")
    parser.add_argument("--service-port", action="append", type=int, default=[], help="a server port to count")
    args = parser.parse_args(argv)
    wire = Wire(args.port, frozenset(args.service_port))
    wire.open()
    serve(wire, args.control)
    return 0


if __name__ == "__main__":
    sys.exit(main())
