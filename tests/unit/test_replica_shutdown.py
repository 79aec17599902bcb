"""The replica's shutdown hook: Serve's ingress wrapper awaits the user class's __del__
only when it is a coroutine function (it calls a plain one and drops what it returns), so
the drain must live in an `async def __del__` that Serve's wrapper awaits."""
from __future__ import annotations

import asyncio
import inspect

from serve_app.engine.engine_deployment import EngineDeployment


def user_class():
    """The class Kestrel wrote, under Serve's deployment and ingress wrappers."""
    return next(c for c in EngineDeployment.func_or_class.__mro__
                if c.__module__ == "serve_app.engine.engine_deployment" and "__del__" in c.__dict__)


class FakeEngine:
    def __init__(self):
        self.calls = []

    async def drain(self, timeout):
        self.calls.append(("drain", timeout))

    def stop(self):
        self.calls.append(("stop",))


def test_the_shutdown_hook_is_a_coroutine_function_the_wrapper_awaits():
    cls = user_class()
    assert inspect.iscoroutinefunction(cls.__del__)
    wrapper_del = EngineDeployment.func_or_class.__dict__.get("__del__")
    assert wrapper_del is not None and inspect.iscoroutinefunction(wrapper_del)


def test_the_hook_drains_then_stops_once():
    cls = user_class()
    replica = object.__new__(cls)
    replica._shutdown_started = False
    replica.engine = FakeEngine()
    asyncio.run(cls.__del__(replica))
    asyncio.run(cls.__del__(replica))  # a second call has nothing left to do
    assert [c[0] for c in replica.engine.calls] == ["drain", "stop"]
