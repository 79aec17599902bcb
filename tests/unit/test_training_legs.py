"""A training run in legs: each leg resumes the step counter, schedule and data position
where the previous one stopped, and the legs together train the head an uninterrupted run
of as many steps would."""
from __future__ import annotations

import json

import pytest
import torch

from training.data import save_jsonl
from training.legs import MORE_LEGS, run_legs, stage
from training.train import main as train_main


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


def test_resume_refuses_other_data(tiny_llama_dir, data_file, tmp_path):
    out = tmp_path / "run"
    train_main(["--out", str(out), *_args(tiny_llama_dir, data_file, 2), "--resume"])
    rows = [json.loads(line) for line in open(data_file)][:-3]
    other = tmp_path / "other.jsonl"
    save_jsonl(rows, other)
    with pytest.raises(ValueError, match="other data"):
        train_main(["--out", str(out), *_args(tiny_llama_dir, str(other), 2), "--resume"])
