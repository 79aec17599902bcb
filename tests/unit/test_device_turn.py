"""Engines of processes sharing a GPU take turns (training/device_turn.py): a second
process waits while the first holds the device's turn."""
from __future__ import annotations

import multiprocessing as mp
import threading

from training.device_turn import device_key, device_turn


def _hold(lock_dir: str, log: str, held, release) -> None:
    with device_turn("gpu-x", lock_dir):
        with open(log, "a") as f:
            f.write("in\n")
        held.set()
        release.wait(30)
        with open(log, "a") as f:
            f.write("out\n")


def test_a_second_process_waits_for_the_turn(tmp_path):
    ctx = mp.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    log = tmp_path / "log"
    child = ctx.Process(target=_hold, args=(str(tmp_path), str(log), held, release))
    child.start()
    try:
        assert held.wait(60)
        seen: list[str] = []

        def take():
            with device_turn("gpu-x", str(tmp_path)):
                seen.append(log.read_text())

        t = threading.Thread(target=take)
        t.start()
        t.join(0.5)
        assert t.is_alive() and not seen  # blocked while the child holds the turn
        release.set()
        t.join(30)
        assert seen == ["in\nout\n"]
    finally:
        release.set()
        child.join(30)


def test_other_devices_and_the_cpu_do_not_wait(tmp_path):
    assert device_key("cpu") is None
    with device_turn("gpu-x", str(tmp_path)):
        with device_turn("gpu-y", str(tmp_path)):
            with device_turn(None):
                pass
