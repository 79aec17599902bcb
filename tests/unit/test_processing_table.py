"""actors/sampling/processing_table.py: rows written at admission and read by row, entries past the
table widths kept for the eager path, a row cleared when a request without processing
takes it."""
import numpy as np
import torch

from actors.sampling.output_counts import TAIL
from actors.sampling.processing_table import ProcessingTable
from actors.protocol.step_plan import RowProcessing
from configs.schema import ProcessingConfig


def row(bias: dict, stops=(), words=(), **kw) -> RowProcessing:
    return RowProcessing(bias_tokens=np.array(list(bias), dtype=np.int64),
                         bias_values=np.array(list(bias.values()), dtype=np.float32),
                         stop_ids=np.array(stops, dtype=np.int64), bad_words=[list(w) for w in words], **kw)


def test_rows_are_written_at_once_and_read_by_row():
    t = ProcessingTable(6, ProcessingConfig(logit_bias=2, stop_ids=1, bad_words=1), torch.device("cpu"))
    t.reset([(1, row({5: 1.0}, presence=0.5)), (2, row({7: 2.0, 8: 3.0, 9: 4.0}, stops=(2, 3),
                                                        words=[[4], [1, 2, 6]], min_tokens=3)),
             (1, row({6: -1.0}, repetition=1.5))])  # row 1 twice: the last counts
    assert t.has_extra([2, 1]) and not t.has_extra([1, 3])
    p = t.gather(torch.tensor([1, 2, 3]))  # the tables alone (graph paths)
    assert p.presence.tolist() == [0.0, 0.0, 0.0] and p.repetition.tolist() == [1.5, 1.0, 1.0]
    assert p.min_tokens.tolist() == [0, 3, 0]
    assert p.bias_token.tolist() == [[6, -1], [7, 8], [-1, -1]]
    assert p.bias_value.tolist() == [[-1.0, 0.0], [2.0, 3.0], [0.0, 0.0]]
    assert p.stop_token.tolist() == [[-1], [2], [-1]] and p.bad_last.tolist() == [[-1], [4], [-1]]
    e = t.gather(torch.tensor([1, 2, 3]), [1, 2, 3])  # eager: the extra columns too
    assert e.bias_token.tolist() == [[6, -1, -1], [7, 8, 9], [-1, -1, -1]]
    assert e.bias_value[1].tolist() == [2.0, 3.0, 4.0]
    assert e.stop_token.tolist() == [[-1, -1], [2, 3], [-1, -1]]
    assert e.bad_last.tolist() == [[-1, -1], [4, 6], [-1, -1]]
    assert e.bad_prefix.shape == (3, 2, TAIL) and e.bad_prefix[1, 1, -2:].tolist() == [1, 2]
    assert (e.bad_prefix[1, 1, :-2] == -1).all()
    t.reset([(2, None)])  # a request without processing takes row 2
    assert not t.has_extra([2])
    p = t.gather(torch.tensor([2]))
    assert p.min_tokens.tolist() == [0] and (p.bias_token == -1).all() and (p.bad_last == -1).all()
