"""actors/sampling/output_counts.py: rows restarted from a request's outputs (admission, or after a
preemption) and grown by each step's emitted tokens, on the device without host reads."""
import torch

from actors.sampling.output_counts import TAIL, OutputCounts


def test_reset_then_record():
    c = OutputCounts(4, 20, torch.device("cpu"))
    c.reset([(1, [3, 4], list(range(18))), (2, None, [5, 5, 7]), (1, None, [9, 9])])  # row 1: the last
    c.reset([(3, [1], [])])
    assert c.counts[1].tolist() == [0] * 9 + [2] + [0] * 10 and c.num_out.tolist() == [0, 2, 3, 0]
    assert c.counts[2, 5] == 2 and c.counts[2, 7] == 1 and c.counts[2].sum() == 3
    assert not c.prompt[1].any() and c.prompt[3].tolist() == [i == 1 for i in range(20)]
    assert c.tail[1].tolist() == [-1] * (TAIL - 2) + [9, 9] and c.tail[3].tolist() == [-1] * TAIL
    c.record(torch.tensor([2, 1]), torch.tensor([[6, 8, 0], [4, 0, 0]]), torch.tensor([2, 1]))
    assert c.counts[2, 6] == 1 and c.counts[2, 8] == 1 and c.counts[2, 0] == 0 and c.counts[1, 4] == 1
    assert c.num_out.tolist() == [0, 3, 5, 0]
    assert c.tail[2, -5:].tolist() == [5, 5, 7, 6, 8] and c.tail[1, -3:].tolist() == [9, 9, 4]
    c.reset([(2, None, list(range(20)))])
    assert c.tail[2].tolist() == list(range(20 - TAIL, 20)) and c.counts[2].tolist() == [1] * 20
