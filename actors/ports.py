"""TCP ports to hand to a listener that binds them later (HAProxy's side ports, the DP
group's rendezvous): chosen where no other process can be given them in the meantime.

A port from bind(0) lies in the kernel's ephemeral range, where any process's bind(0) or
outgoing connection can take it in the moment between our probe and the listener's bind:
Ray starts dozens of processes in that window, and the listener then fails with 'Address
already in use'. Below the range only an explicit bind can take a port.
"""
from __future__ import annotations

import errno
import random
import socket

__all__ = ["PORTS_FROM", "ephemeral_port_low", "free_ports_below_ephemeral"]

# Ray's workers listen on 10002-19999 by default; our ports go above them.
PORTS_FROM = 20000


def ephemeral_port_low() -> int:
    """The first port the kernel hands out for bind(0) and outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere the range is not known


def _bindable(port: int, hosts: tuple[str, ...]) -> bool:
    for host in hosts:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL:
                    raise  # a host that is not this machine's: no port would do
                return False
    return True


def free_ports_below_ephemeral(n: int, hosts: tuple[str, ...] = ("",)) -> list[int]:
    """n distinct ports, each free now on every address of ``hosts`` ("" = all of them),
    chosen between Ray's worker ports and the kernel's ephemeral range.

    If nothing there is free, the rest come from bind(0) on ``hosts[0]`` (the kernel's
    choice, racy as above). A host that is not this machine's raises OSError."""
    candidates = list(range(PORTS_FROM, max(PORTS_FROM, ephemeral_port_low())))
    random.shuffle(candidates)  # two servers (or groups) starting together pick apart
    ports: list[int] = []
    for port in candidates:
        if _bindable(port, hosts):
            ports.append(port)
            if len(ports) == n:
                return ports
    while len(ports) < n:  # nothing free below the range: the kernel's choice
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((hosts[0], 0))
            ports.append(s.getsockname()[1])
    return ports
