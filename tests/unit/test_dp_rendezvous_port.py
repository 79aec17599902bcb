"""The DP group's rendezvous port (find_free_port): chosen below the kernel's ephemeral
range, where no other process's bind(0) or outgoing connection can take it before rank
0's TCPStore binds it, and free both on the address the ranks meet at and on the
wildcard address TCPStore listens on."""
import random
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from actors import ports
from actors.dp.group import find_free_port


def test_port_lies_below_the_ephemeral_range_and_is_free_on_the_host():
    for host in ("127.0.0.1", ""):
        port = find_free_port(host)
        assert ports.PORTS_FROM <= port < ports.ephemeral_port_low()
        with socket.socket() as s:
            s.bind((host, port))  # still free where the others connect
        with socket.socket() as s:
            s.bind(("", port))  # and where TCPStore listens


def _hold_and_narrow(monkeypatch, held: socket.socket) -> int:
    """The held socket's port as the first of a 50-port range below 'the ephemeral range',
    candidates in order: the pick must step over it."""
    taken = held.getsockname()[1]
    monkeypatch.setattr(random, "shuffle", lambda seq: None)
    monkeypatch.setattr(ports, "PORTS_FROM", taken)
    monkeypatch.setattr(ports, "ephemeral_port_low", lambda: taken + 50)
    return taken


@pytest.mark.parametrize("held_on", ["127.0.0.1", "127.0.0.2", ""])
def test_a_port_bound_on_the_host_or_another_address_is_skipped(monkeypatch, held_on):
    # 127.0.0.2 (loopback, not the host): TCPStore's wildcard bind would still fail on it.
    with socket.socket() as held:
        held.bind((held_on, 0))
        taken = _hold_and_narrow(monkeypatch, held)
        port = find_free_port("127.0.0.1")
    assert taken < port < taken + 50


def test_tcpstore_binds_the_port_chosen():
    port = find_free_port("127.0.0.1")
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10))
    assert store.port == port
    del store


def test_a_host_of_another_machine_fails_at_once():
    with pytest.raises(OSError):
        find_free_port("203.0.113.7")  # TEST-NET-3: no machine's own address
