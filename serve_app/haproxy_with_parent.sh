#!/bin/sh
# HAProxy as Serve's HAProxyManager starts it, for a Ray instance that `kestrel serve`
# owns (serve_app/app.py, local_ray_env names this file in RAY_SERVE_HAPROXY_BINARY_PATH):
# it gets SIGTERM when the manager dies. When the whole instance was killed at once (the
# server's process SIGKILLed, so Ray's processes died by their own parent-death signal),
# nobody stopped HAProxy, and it held the HTTP port under init. Same process, same
# arguments: setpriv arms the signal and executes HAProxy in its place.
exec setpriv --pdeathsig TERM -- "$KESTREL_HAPROXY_BINARY" "$@"
