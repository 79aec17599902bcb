"""HAProxy's metrics and stats ports for a server of this machine alone: chosen where no
other process's bind(0) or outgoing connection can take them before HAProxy binds them."""
import random
import socket

from actors import ports
from configs.schema import load_config
from serve_app import app


def test_side_ports_are_free_distinct_and_below_the_ephemeral_range():
    picked = ports.free_ports_below_ephemeral(2)
    assert len(set(picked)) == 2
    for port in picked:
        assert ports.PORTS_FROM <= port < ports.ephemeral_port_low()
        with socket.socket() as s:
            s.bind(("", port))  # still free


def test_a_port_already_bound_is_skipped(monkeypatch):
    monkeypatch.setattr(random, "shuffle", lambda seq: None)  # candidates in order
    with socket.socket() as held:
        held.bind(("", 0))
        taken = held.getsockname()[1]
        # a range whose first port is the one held: the pick must step over it
        monkeypatch.setattr(ports, "PORTS_FROM", taken)
        monkeypatch.setattr(ports, "ephemeral_port_low", lambda: taken + 50)
        picked = ports.free_ports_below_ephemeral(2)
    assert taken not in picked
    assert all(taken < p < taken + 50 for p in picked)


def test_local_ray_env_gives_haproxy_those_ports():
    env = app.local_ray_env(load_config(overrides=["device=cpu", "serve.http_proxy=haproxy"]))
    for key in ("RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT"):
        assert ports.PORTS_FROM <= int(env[key]) < ports.ephemeral_port_low()
