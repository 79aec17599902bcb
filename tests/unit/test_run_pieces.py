"""A training run carried in pieces: packed, checked and unpacked to the same files."""
import io
import json
import os
import tarfile

import pytest

from training.run_pieces import MANIFEST, PREFIX, _PieceWriter, main, pack, unpack


def _run(tmp_path):
    run = tmp_path / "run"
    (run / "data0" / "data").mkdir(parents=True)
    (run / "eagle1" / "train_state").mkdir(parents=True)
    files = {"data0/data/train.jsonl": b'{"input_ids": [1, 2, 3]}\n' * 20000,
             "eagle1/train_state/state.pt": os.urandom(3 * 2**20),  # incompressible: several pieces
             "eagle1/train_state/progress.json": b'{"step": 200}', "eagle1.log": b"leg 1\n"}
    for name, data in files.items():
        (run / name).write_bytes(data)
    return run, files


def test_pack_and_unpack_round_trip(tmp_path):
    run, files = _run(tmp_path)
    m = pack(run, tmp_path / "pieces", 2**20)
    assert len(m["pieces"]) >= 3 and all(p["bytes"] <= 2**20 for p in m["pieces"])
    assert sorted(f.name for f in (tmp_path / "pieces").iterdir()) == sorted(
        [MANIFEST] + [p["name"] for p in m["pieces"]])
    out = tmp_path / "elsewhere"
    (out / "eagle1" / "train_state").mkdir(parents=True)
    (out / "eagle1" / "train_state" / "progress.json").write_bytes(b"old")  # replaced
    assert unpack(tmp_path / "pieces", out) == len(files)
    for name, data in files.items():
        assert (out / name).read_bytes() == data


def test_a_bad_or_missing_piece_is_refused_before_anything_is_written(tmp_path):
    run, _ = _run(tmp_path)
    m = pack(run, tmp_path / "pieces", 2**20)
    second = tmp_path / "pieces" / m["pieces"][1]["name"]
    data = bytearray(second.read_bytes())
    data[100] ^= 1
    second.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="differs"):
        unpack(tmp_path / "pieces", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    second.unlink()
    assert main(["unpack", str(tmp_path / "pieces"), str(tmp_path / "out")]) == 1


def test_pack_replaces_older_pieces(tmp_path):
    run, _ = _run(tmp_path)
    pack(run, tmp_path / "pieces", 2**19)
    m = pack(run, tmp_path / "pieces", 2**21)
    assert len(list((tmp_path / "pieces").glob(PREFIX + "*"))) == len(m["pieces"])


def test_a_path_outside_the_run_is_refused(tmp_path):
    dest = tmp_path / "pieces"
    dest.mkdir()
    writer = _PieceWriter(dest, 2**20)
    with tarfile.open(fileobj=writer, mode="w|gz") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    writer.close()
    (dest / MANIFEST).write_text(json.dumps({"pieces": writer.pieces, "sha256": writer.whole.hexdigest()}))
    with pytest.raises(tarfile.TarError):
        unpack(dest, tmp_path / "run")
    assert not (tmp_path / "escaped.txt").exists()
    assert main(["unpack", str(dest), str(tmp_path / "run2")]) == 1
