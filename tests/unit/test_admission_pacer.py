"""AdmissionPacer: a burst of handlers is admitted over several loop rounds, in arrival
order; running streams wait while handlers admit; a lone request never waits."""
import asyncio

from serve_app.api.admission_pacer import AdmissionPacer

GUARD_S = 5.0  # a hang fails the test instead of stalling the run; no timing is asserted


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, GUARD_S))


async def admit(pacer, i, entered):
    async with pacer.admission():
        entered.append(i)


def test_a_burst_is_admitted_over_rounds_in_order():
    async def main():
        pacer = AdmissionPacer(slice_s=1e-12, defer_s=GUARD_S)  # every turn fills its round
        entered = []
        tasks = [asyncio.create_task(admit(pacer, i, entered)) for i in range(4)]
        await asyncio.sleep(0)  # the tasks' first round
        assert entered == [0] and pacer.backlog
        await asyncio.gather(*tasks)
        assert entered == [0, 1, 2, 3] and not pacer.backlog
    run(main())


def test_no_pacing_admits_a_burst_in_one_round():
    async def main():
        pacer = AdmissionPacer(slice_s=0.0, defer_s=GUARD_S)
        entered = []
        tasks = [asyncio.create_task(admit(pacer, i, entered)) for i in range(4)]
        await asyncio.sleep(0)
        assert entered == [0, 1, 2, 3] and not pacer.backlog
        await asyncio.gather(*tasks)
    run(main())


def test_streams_wait_while_a_handler_admits_without_slices():
    async def main():
        pacer = AdmissionPacer(slice_s=0.0, defer_s=GUARD_S)  # only the handler's exit releases
        inside, leave = asyncio.Event(), asyncio.Event()

        async def handler():
            async with pacer.admission():
                inside.set()
                await leave.wait()  # its template, its encoding...
        task = asyncio.create_task(handler())
        await inside.wait()
        assert pacer.backlog
        paused = asyncio.create_task(pacer.pause())
        await asyncio.sleep(0.01)
        assert not paused.done()  # the running stream holds its chunk back
        leave.set()
        await paused
        await task
        assert not pacer.backlog
    run(main())


def test_without_defer_streams_never_wait():
    async def main():
        pacer = AdmissionPacer(slice_s=0.0, defer_s=0.0)
        async with pacer.admission():
            assert not pacer.backlog
    run(main())


def test_a_stream_paused_for_a_backlog_resumes_when_it_drains():
    async def main():
        pacer = AdmissionPacer(slice_s=1e-12, defer_s=GUARD_S)  # only the drain releases it
        entered = []
        tasks = [asyncio.create_task(admit(pacer, i, entered)) for i in range(3)]
        await asyncio.sleep(0)
        assert pacer.backlog
        await pacer.pause()
        assert not pacer.backlog and entered[:2] == [0, 1]
        await asyncio.gather(*tasks)
    run(main())


def test_a_paused_stream_resumes_after_defer_s_while_the_backlog_lasts():
    async def main():
        pacer = AdmissionPacer(slice_s=1e-12, defer_s=1e-6)
        blocker = asyncio.Event()

        async def slow():
            async with pacer.admission():
                await blocker.wait()
        first = asyncio.create_task(slow())
        queued = [asyncio.create_task(admit(pacer, i, [])) for i in range(2)]
        await asyncio.sleep(0)
        assert pacer.backlog
        await pacer.pause()  # released by its bound, not by the queue
        blocker.set()
        await asyncio.gather(first, *queued)
    run(main())


def test_a_handler_cancelled_in_the_queue_is_skipped():
    async def main():
        pacer = AdmissionPacer(slice_s=1e-12, defer_s=GUARD_S)
        entered = []
        tasks = [asyncio.create_task(admit(pacer, i, entered)) for i in range(3)]
        await asyncio.sleep(0)
        tasks[1].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert entered == [0, 2] and not pacer.backlog
    run(main())
