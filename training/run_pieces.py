"""Carry a training run (data, checkpoints, reports) between machines in pieces small
enough for one transfer each, for runs longer than one machine's lease.

    python -m training.run_pieces pack RUN DEST [--piece-mb 15]   # DEST/run.tgz.000 ... and DEST/run.manifest
    python -m training.run_pieces unpack DEST RUN                 # checks every piece, then extracts

`pack` writes RUN as one gzipped tar cut into pieces of at most --piece-mb MiB, and a
manifest with each piece's size and SHA-256 and the whole's. `unpack` refuses a missing,
short or altered piece before it writes anything, then extracts into RUN (created if
needed; files already there are replaced), so `python -m training.legs` resumes there.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

MANIFEST = "run.manifest"
PREFIX = "run.tgz."


class _PieceWriter(io.RawIOBase):
    """A write-only stream that cuts what it is given into numbered files."""

    def __init__(self, dest: Path, piece_bytes: int):
        self.dest, self.piece_bytes = dest, piece_bytes
        self.pieces: list[dict] = []
        self._file = None
        self._hash = None
        self._size = 0
        self.whole = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def _next(self) -> None:
        self._close_piece()
        name = f"{PREFIX}{len(self.pieces):03d}"
        self._file = open(self.dest / name, "wb")
        self._hash, self._size = hashlib.sha256(), 0
        self.pieces.append({"name": name})

    def _close_piece(self) -> None:
        if self._file is not None:
            self._file.close()
            self.pieces[-1].update(bytes=self._size, sha256=self._hash.hexdigest())
            self._file = None

    def write(self, b) -> int:
        data = memoryview(b).cast("B")
        done = 0
        while done < len(data):
            if self._file is None or self._size == self.piece_bytes:
                self._next()
            n = min(len(data) - done, self.piece_bytes - self._size)
            chunk = data[done:done + n]
            self._file.write(chunk)
            self._hash.update(chunk)
            self.whole.update(chunk)
            self._size += n
            done += n
        return done

    def close(self) -> None:
        self._close_piece()
        super().close()


def pack(run: Path, dest: Path, piece_bytes: int) -> dict:
    """RUN -> DEST/run.tgz.NNN pieces and DEST/run.manifest; returns the manifest."""
    if not run.is_dir():
        raise FileNotFoundError(f"{run} is not a folder")
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob(PREFIX + "*"):
        old.unlink()
    writer = _PieceWriter(dest, piece_bytes)
    with tarfile.open(fileobj=writer, mode="w|gz") as tar:
        for path in sorted(run.rglob("*")):
            if path.is_file():
                tar.add(path, arcname=str(path.relative_to(run)), recursive=False)
    writer.close()
    manifest = {"pieces": writer.pieces, "sha256": writer.whole.hexdigest(),
                "bytes": sum(p["bytes"] for p in writer.pieces)}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def unpack(src: Path, run: Path) -> int:
    """DEST's pieces -> RUN; returns the number of files extracted."""
    manifest = json.loads((src / MANIFEST).read_text())
    pieces = []
    for p in manifest["pieces"]:
        path = src / p["name"]
        if not path.exists():
            raise FileNotFoundError(f"piece {p['name']} is missing from {src}")
        data = path.read_bytes()
        if len(data) != p["bytes"] or hashlib.sha256(data).hexdigest() != p["sha256"]:
            raise ValueError(f"piece {p['name']} differs from the manifest ({len(data)} of {p['bytes']} bytes)")
        pieces.append(data)
    whole = b"".join(pieces)
    if hashlib.sha256(whole).hexdigest() != manifest["sha256"]:
        raise ValueError("the pieces do not join to the packed run")
    run.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(whole), mode="r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        # the "data" filter refuses absolute paths and any that would land outside RUN
        tar.extractall(run, members=members, filter="data")
    return len(members)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.run_pieces", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="RUN -> pieces in DEST")
    p.add_argument("run")
    p.add_argument("dest")
    p.add_argument("--piece-mb", type=float, default=15.0, help="MiB per piece, at most")
    u = sub.add_parser("unpack", help="pieces in DEST -> RUN")
    u.add_argument("dest")
    u.add_argument("run")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "pack":
            m = pack(Path(args.run), Path(args.dest), int(args.piece_mb * 2**20))
            print(f"packed {args.run}: {m['bytes'] / 2**20:.1f} MiB in {len(m['pieces'])} pieces in {args.dest}")
        else:
            n = unpack(Path(args.dest), Path(args.run))
            print(f"unpacked {n} files into {args.run}")
    except (OSError, ValueError, tarfile.TarError) as e:
        print(f"run_pieces: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
