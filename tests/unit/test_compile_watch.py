"""CompileWatch counts and reports the compilations Triton's JIT hooks announce."""
import logging
import time

import pytest

from kestrel_kernels.compile_watch import CompileWatch

knobs = pytest.importorskip("triton").knobs


def test_watch_counts_times_and_names_each_compile(caplog):
    watch = CompileWatch()
    assert watch.arm()
    try:
        sig = "_paged_attn_kernel[num_warps=4](q: *bf16, T: i32)"
        with caplog.at_level(logging.WARNING, logger="kestrel.worker"):
            # What Triton's JIT does around a compile: a true answer would skip it.
            assert not knobs.runtime.jit_cache_hook(key=None, repr=sig, fn=None, compile={},
                                                    is_manual_warmup=False, already_compiled=False)
            time.sleep(0.02)
            knobs.runtime.jit_post_compile_hook(key=None, repr=sig, fn=None, compile={},
                                                is_manual_warmup=False, already_compiled=False)
        assert watch.count == 1 and watch.kernels == [sig]
        assert sig in caplog.text
        assert watch.take_seconds() >= 0.02
        assert watch.take_seconds() == 0.0  # taken once, by the step that met it
    finally:
        watch.disarm()
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None


def test_a_new_worker_pauses_the_armed_watch():
    watch = CompileWatch()
    assert watch.arm()
    CompileWatch.pause_all()  # what a RankWorker does before its own start-up compiles
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None
