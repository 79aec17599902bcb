"""benchmarks/race_hunt.py on CPU: a short hunt on the tiny target passes, and a run whose
tokens differ is reported as FAIL with exit code 1."""
from benchmarks import race_hunt


def test_short_hunt_passes_on_cpu(tiny_llama_dir, capsys):
    code = race_hunt.main(["--iterations", "30", "--device", "cpu", "--model", tiny_llama_dir,
                           "--max-tokens", "16", "--seed", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PASS" in out
    # Batches went past the largest captured size (8): replayed and eager steps both ran.
    assert int(out.rsplit("largest batch", 1)[1].split()[0]) > 8


def test_mismatch_fails_and_near_ties_do_not(monkeypatch, capsys):
    from types import SimpleNamespace

    from serve_app.engine.request import SamplingParams

    def req(out):
        return SimpleNamespace(output_ids=out, prompt_ids=[7, 8], params=SamplingParams())

    def fake_run(args, device, graphs):
        reqs = {"r0": req([1, 2, 3]), "r1": req([4, 5 if graphs else 6])}
        return reqs, 2, 2, SimpleNamespace(workers=[None])

    monkeypatch.setattr(race_hunt, "run", fake_run)
    monkeypatch.setattr(race_hunt, "top2_gap", lambda worker, ids: 0.5)
    assert race_hunt.main(["--iterations", "2", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: 1/2 requests identical, 0 near-tie flips, 1 mismatches" in out
    assert "MISMATCH r1: first difference at token 1" in out
    monkeypatch.setattr(race_hunt, "top2_gap", lambda worker, ids: 1e-5)
    assert race_hunt.main(["--iterations", "2", "--device", "cpu"]) == 0
    assert "PASS: 1/2 requests identical, 1 near-tie flips" in capsys.readouterr().out
