"""`kestrel serve` as two processes: the command itself, and the server in a session of its own.

The server (run_server: Ray's head processes, Serve, HAProxy under Serve's actors) does
not share the command's process group. A signal sent to that group (a terminal's Ctrl-C,
`kill -TERM -PGID`, a supervisor stopping a job) reaches the command alone, which asks
the server to stop as Ctrl-C does: replicas drain, Serve stops HAProxy, then Ray goes.
Sent to the group they shared, SIGTERM killed Ray's head processes at the same moment as
the command, so Serve's actors died mid-way through a reload and the HAProxy it had just
started lived on under init, holding the HTTP port.

If the command dies without a word (SIGKILL), the kernel sends the server SIGTERM (its
parent-death signal), and it stops the same way.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

# Set in the server's environment: the process it names is the server, not the command.
SERVER_ENV = "KESTREL_SERVE_SERVER"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def is_server() -> bool:
    return os.environ.get(SERVER_ENV) == "1"


def _stop_with_parent(parent: int):
    def preexec():
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the command died before the signal was armed
            os._exit(1)
    return preexec


def supervise(argv: list[str]) -> int:
    """Run `python -m serve_app.cli ARGV` as the server; forward the first stop signal as
    SIGINT (further ones would cut the server's shutdown short); return its exit status."""
    env = {**os.environ, SERVER_ENV: "1"}
    preexec = _stop_with_parent(os.getpid()) if sys.platform.startswith("linux") else None
    proc = subprocess.Popen([sys.executable, "-m", "serve_app.cli", *argv], env=env,
                            start_new_session=True, preexec_fn=preexec)
    stopping = False

    def forward(signum, frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            proc.send_signal(signal.SIGINT)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    return proc.wait()
