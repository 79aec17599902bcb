"""A training run in legs: each leg resumes the step counter, schedule and data position
where the previous one stopped, and the legs together train the head an uninterrupted run
of as many steps would."""
from __future__ import annotations

import json

import pytest
import torch

from training.data import save_jsonl
from training.legs import MORE_LEGS, run_legs, stage
from training.train import TrainConfig, Trainer, main as train_main


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    """18 random conversations over the tiny target's 128 tokens (2 held out by the split)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(18):
        n = 12 + i % 5
        ids = torch.randint(3, 128, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "loss_mask": [0] * 4 + [1] * (n - 4), "prompt_len": 4,
                     "category": "code" if i % 2 else "chat"})
    path = tmp_path_factory.mktemp("legs_data") / "train.jsonl"
    save_jsonl(rows, path)
    return str(path)


def _args(tiny_llama_dir, data_file, leg_steps):
    # 16 training samples in batches of 4: 4 steps an epoch, 8 planned
    return ["--target", tiny_llama_dir, "--arch", "eagle", "--device", "cpu", "--data", data_file,
            "--eval-fraction", "0.1", "--epochs", "2", "--batch-size", "4", "--lr", "1e-2",
            "--ttt-steps", "2", "--save-every", "0", "--leg-steps", str(leg_steps), "--no-eval",
            "--set", "model.dtype=float32", "--set", "kv_cache.num_slots=4096"]


def test_legs_continue_step_counter_and_data_position(tiny_llama_dir, data_file, tmp_path):
    out = tmp_path / "legs"
    seen = []

    def in_process(argv, timeout):
        train_main(argv)
        seen.append((argv, json.loads((out / "train_state" / "progress.json").read_text())))
        return 0

    args = _args(tiny_llama_dir, data_file, 3)
    assert stage(out, args) == "train"  # --data given: no generation leg
    assert run_legs(out, args, 600, max_legs=2, run_leg=in_process) == MORE_LEGS
    assert [p["step"] for _, p in seen] == [3, 6]  # continued, not restarted
    assert [(p["epoch"], p["batch"]) for _, p in seen] == [(0, 3), (1, 2)]  # the batch stream advanced
    assert all(p["total_steps"] == 8 and not p["done"] for _, p in seen)
    assert all("--resume" in argv and "--leg-time-budget" in argv for argv, _ in seen)
    state = torch.load(out / "train_state" / "state.pt", weights_only=False)
    assert [h["step"] for h in state["history"]] == [3, 6]
    # each unfinished leg leaves the head as it stands, exported, to carry off the machine
    from safetensors.torch import load_file
    leg = json.loads((out / "leg_report.json").read_text())["leg_head"]
    assert leg["step"] == 6 and (out / "leg_head" / "config.json").exists()
    exported = load_file(str(out / "leg_head" / leg["files"][0]))
    fc = next(v for k, v in state["head"].items() if k.endswith("fc.weight"))
    assert torch.equal(exported["fc.weight"], fc.to(torch.bfloat16))

    # six steps in one leg leave the same head, optimizer moments and position
    straight = tmp_path / "straight"
    run_legs(straight, _args(tiny_llama_dir, data_file, 6), 600, max_legs=1,
             run_leg=lambda argv, timeout: train_main(argv) and 0)
    a = torch.load(out / "train_state" / "state.pt", weights_only=False)
    b = torch.load(straight / "train_state" / "state.pt", weights_only=False)
    assert (a["step"], a["epoch"], a["batch"]) == (b["step"], b["epoch"], b["batch"]) == (6, 1, 2)
    for k in a["head"]:
        assert torch.equal(a["head"][k], b["head"][k]), k
    for i, st in a["opt"]["state"].items():
        assert torch.equal(st["exp_avg"], b["opt"]["state"][i]["exp_avg"])

    # the rest: the last training leg finishes the schedule and exports the head
    assert run_legs(out, args, 600, run_leg=in_process) == 0
    assert len(seen) == 3 and seen[2][1]["step"] == 8 and seen[2][1]["done"]
    report = json.loads((out / "report.json").read_text())
    assert report["train"]["finished"] and report["train"]["steps"] == 8
    assert (out / "config.json").exists() and stage(out, args) == "done"
    # without --no-eval the engine's measure is still owed: one evaluation leg
    assert stage(out, [a for a in args if a != "--no-eval"]) == "eval"


@pytest.mark.parametrize("start", ["checkpoint", "leg_head"])
def test_continuing_on_other_data_is_refused(tiny_llama_dir, data_file, tmp_path, start):
    """From the checkpoint (--resume) or from the leg's exported head (--init-head): the data
    position means nothing on other data."""
    out = tmp_path / "run"
    train_main(["--out", str(out), *_args(tiny_llama_dir, data_file, 2), "--resume"])
    rows = [json.loads(line) for line in open(data_file)][:-3]
    other = tmp_path / "other.jsonl"
    save_jsonl(rows, other)
    again = ["--resume"] if start == "checkpoint" else ["--init-head", str(out / "leg_head")]
    with pytest.raises(ValueError, match="other data"):
        train_main(["--out", str(out if start == "checkpoint" else tmp_path / "b"),
                    *_args(tiny_llama_dir, str(other), 2), *again])


def test_a_lost_checkpoint_continues_from_the_legs_exported_head(tiny_llama_dir, data_file, tmp_path):
    """The machine holding the checkpoint is gone and only OUT/leg_head came back: the next
    leg continues from it (weights, feature scale unfolded, step, schedule and data
    position), with fresh optimizer moments behind a learning-rate ramp."""
    from training.legs import LEG_HEAD, POSITION
    from training.train import REWARM_STEPS
    out = tmp_path / "lost"
    args = [a if a != "eagle" else "eagle3" for a in _args(tiny_llama_dir, data_file, 3)]
    args += ["--draft-vocab", "64", "--feature-scale", "rms"]
    train_main(["--out", str(out), *args, "--resume"])
    before = torch.load(out / "train_state" / "state.pt", weights_only=False)
    pos = json.loads((out / LEG_HEAD / POSITION).read_text())
    assert (pos["step"], pos["epoch"], pos["batch"]) == (before["step"], before["epoch"], before["batch"]) == (3, 0, 3)

    import shutil
    shutil.rmtree(out / "train_state")  # the machine was lost; leg_head was carried back
    leg0 = [a if a != "3" else "0" for a in args]  # a leg of no steps: the head as loaded
    train_main(["--out", str(out), *leg0, "--resume"])
    after = torch.load(out / "train_state" / "state.pt", weights_only=False)
    assert (after["step"], after["epoch"], after["batch"], after["total_steps"]) == \
        (3, 0, 3, before["total_steps"])
    assert after["sched"] == before["sched"] and after["rewarm"] == (3, REWARM_STEPS)
    assert torch.equal(after["feat_scale"], before["feat_scale"])
    assert torch.equal(after["draft_ids"], before["draft_ids"])
    assert not after["opt"]["state"]  # no moments: none were carried
    for k, w in before["head"].items():  # the weights as exported (bf16), the fc unfolded
        assert torch.allclose(after["head"][k].float(), w.float(), rtol=2e-2, atol=1e-3), k
    fc = next(k for k in before["head"] if k.endswith("fc.weight"))
    assert not torch.allclose(after["head"][fc] / after["feat_scale"], before["head"][fc], rtol=2e-2)

    # the next leg trains on from there, the learning rate ramping up again
    train_main(["--out", str(out), *args, "--resume"])
    state = torch.load(out / "train_state" / "state.pt", weights_only=False)
    assert (state["step"], state["epoch"], state["batch"]) == (6, 1, 2)
    last = json.loads((out / "leg_report.json").read_text())["train"]["history"][-1]
    plain = Trainer.__new__(Trainer)  # the schedule alone, as the lost checkpoint held it
    plain.cfg, plain.rewarm = TrainConfig(lr=1e-2), (0, 0)
    plain.warm_steps, plain.sched, plain.total_steps = before["warm_steps"], before["sched"], before["total_steps"]
    assert last["lr"] == pytest.approx(plain.lr_at(5) * 3 / REWARM_STEPS)  # step 5: the ramp's third



def test_the_measured_startup_plans_the_next_invocations_leg(tmp_path, monkeypatch):
    """One leg a command: the first plans with the default guess, measures the leg's time
    outside training, and the next command's leg gets the training budget that leaves."""
    from training import legs
    out = tmp_path / "run"
    out.mkdir()
    clock = [0.0]
    monkeypatch.setattr(legs.time, "monotonic", lambda: clock[0])
    budgets = []

    def fake_leg(argv, timeout):  # trains for its whole budget, 12 s outside it
        budget = float(argv[argv.index("--leg-time-budget") + 1])
        budgets.append(budget)
        step = json.loads((out / "train_state" / "progress.json").read_text())["step"] \
            if (out / "train_state" / "progress.json").exists() else 0
        (out / "train_state").mkdir(exist_ok=True)
        (out / "train_state" / "progress.json").write_text(json.dumps(
            {"step": step + 10, "total_steps": 100, "epoch": 0, "batch": step + 10, "done": False}))
        (out / "leg_report.json").write_text(json.dumps({"train": {"seconds": budget}}))
        clock[0] += budget + 12.0
        return 0

    args = ["--data", "x.jsonl", "--no-eval"]
    assert legs.run_legs(out, args, 300, max_legs=1, run_leg=fake_leg) == MORE_LEGS
    assert json.loads((out / legs.STARTUP_FILE).read_text())["seconds"] == 45.0  # half the guess at least
    assert legs.run_legs(out, args, 300, max_legs=1, run_leg=fake_leg) == MORE_LEGS
    assert legs.run_legs(out, args, 300, max_legs=1, run_leg=fake_leg) == MORE_LEGS
    assert budgets == [300 - 90, 300 - 45, round(300 - 22.5)]  # the guess halves at most a leg


def test_a_leg_continued_from_a_carried_head_reports_its_own_steps(tmp_path, capsys):
    """On a fresh machine with only OUT/leg_head carried, the leg's line counts from the
    head's step, not from 0 (the rate and time left come from that count)."""
    from training import legs
    out = tmp_path / "run"
    (out / legs.LEG_HEAD).mkdir(parents=True)
    (out / legs.LEG_HEAD / legs.POSITION).write_text(json.dumps({"step": 50, "total_steps": 100}))

    def fake_leg(argv, timeout):
        (out / "train_state").mkdir(exist_ok=True)
        (out / "train_state" / "progress.json").write_text(json.dumps(
            {"step": 60, "total_steps": 100, "epoch": 1, "batch": 2, "done": False}))
        return 0

    assert legs.run_legs(out, ["--data", "x.jsonl", "--no-eval"], 300, max_legs=1, run_leg=fake_leg) == MORE_LEGS
    assert "steps 50 -> 60 of 100" in capsys.readouterr().err


def test_fine_tuning_an_exported_head_starts_from_its_function(tiny_llama_dir, data_file, tmp_path):
    """--init-head on a head without a position (a shipped head to fine-tune on more data):
    the run starts at step 0 with the head's draft vocabulary, and the feature scale it
    calibrates afresh is unfolded from the exported fc, so the fc applied to scaled
    features computes what the exported head computes on the target's features."""
    import shutil

    from training.legs import LEG_HEAD, POSITION
    args = [a if a != "eagle" else "eagle3" for a in _args(tiny_llama_dir, data_file, 3)]
    args += ["--draft-vocab", "64", "--feature-scale", "rms"]
    first = tmp_path / "first"
    train_main(["--out", str(first), *args, "--resume"])
    shipped = tmp_path / "shipped"
    shutil.copytree(first / LEG_HEAD, shipped)
    (shipped / POSITION).unlink()  # an exported head, not a leg of this run
    exported = torch.load(first / "train_state" / "state.pt", weights_only=False)

    tuned = tmp_path / "tuned"
    leg0 = [a if a != "3" else "0" for a in args]
    train_main(["--out", str(tuned), *leg0, "--init-head", str(shipped)])
    state = torch.load(tuned / "train_state" / "state.pt", weights_only=False)
    assert state["step"] == 0 and (state["epoch"], state["batch"]) == (0, 0)
    assert torch.equal(state["draft_ids"], exported["draft_ids"])
    fc = next(k for k in state["head"] if k.endswith("fc.weight"))
    assert (state["feat_scale"] - 1).abs().max() > 0.1  # the unfold is visible in the fc
    folded = exported["head"][fc].float() / exported["feat_scale"][None, :]  # what the export holds
    assert torch.allclose(state["head"][fc].float() / state["feat_scale"][None, :], folded, rtol=2e-2, atol=1e-4)
    for k, w in exported["head"].items():  # the rest as exported (bf16)
        if k != fc:
            assert torch.allclose(state["head"][k].float(), w.float(), rtol=2e-2, atol=1e-3), k
    # The held-out figure "before" is the exported head's, not a fresh head's: a fresh one,
    # built with the same seed as the first run's, would give the first run's figure exactly.
    before = [json.loads((run / "train_state" / "heldout_before.json").read_text()) for run in (first, tuned)]
    assert before[1] != before[0]
