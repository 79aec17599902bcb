"""benchmarks/gpu_gaps.py: the device's idle time and where it sits, from intervals."""
from benchmarks.gpu_gaps import gaps, table


def test_idle_time_is_grouped_by_the_activities_around_it():
    # Two steps: draft, verify (overlapped by a copy on another stream), a wait, accept.
    step = [(0, 10, "draft"), (10, 30, "verify"), (25, 32, "copy"), (50, 60, "accept")]
    ivs = step + [(s + 100, e + 100, n) for s, e, n in step]
    out = gaps(ivs, steps=2)
    assert out["span_us"] == 160 / 2
    assert out["busy_us"] == (32 + 10) * 2 / 2
    # 18 us after each step's copy (the copy ended last), 40 us between the steps.
    assert [(g["before"], g["after"], g["us_per_step"], g["count_per_step"]) for g in out["gaps"]] == [
        ("accept", "draft", 20.0, 0.5), ("copy", "accept", 18.0, 1.0)]
    assert out["idle_us"] == out["span_us"] - out["busy_us"]
    assert "| 18.0 | 1.00 | copy | accept |" in table(out)


def test_launch_spacing_counts_as_idle_but_is_not_a_place():
    out = gaps([(0, 10, "a"), (11, 20, "b")], steps=1)
    assert out["idle_us"] == 1 and out["gaps"] == []
    assert gaps([], steps=3)["busy_us"] == 0.0
