"""The collector's passes: timed by the process's watch, and kept off a frozen heap."""
import gc

from actors.worker.gc_pauses import freeze_heap, stats, watch


def _cycles(n: int) -> None:
    for _ in range(n):
        a: list = []
        a.append(a)  # only the collector frees a cycle


def test_watch_times_full_passes():
    w = watch()
    assert watch() is w  # one per process: gc.callbacks are the process's
    w.take_seconds()
    full = w.full
    _cycles(1000)
    gc.collect()
    assert w.full == full + 1
    assert w.take_seconds() > 0
    assert w.take_seconds() == 0.0


def test_freeze_heap_keeps_started_objects_out_of_full_passes():
    w = watch()
    kept = [[i] for i in range(50_000)]  # alive at "start-up"
    gc.unfreeze()
    try:
        _cycles(100)
        freeze_heap("test")
        assert stats()["frozen"] >= len(kept)
        assert w.seconds == 0.0  # start-up's own collection is not a pause of serving
        # What the collector walks now is what was made since, not the frozen heap.
        gc.collect()
        assert len(gc.get_objects(generation=2)) < len(kept)
    finally:
        gc.unfreeze()
    assert len(gc.get_objects(generation=2)) >= len(kept)


def test_frozen_heap_lets_a_dropped_engine_go():
    """A benchmark's engine frozen for its runs is collected once dropped after the block:
    a frozen cycle would otherwise outlive it (with its GPU memory)."""
    import weakref

    from actors.worker.gc_pauses import frozen_heap

    class Engine:
        pass

    gc.unfreeze()
    eng = Engine()
    eng.me = eng  # a cycle, as a real engine's are
    gone = weakref.ref(eng)
    with frozen_heap("test", True):
        assert stats()["frozen"] > 0
        del eng
        gc.collect()
        assert gone() is not None  # frozen: not collected
    assert stats()["frozen"] == 0
    gc.collect()
    assert gone() is None
    with frozen_heap("test", False):  # serve.gc_freeze off: nothing frozen
        assert stats()["frozen"] == 0
