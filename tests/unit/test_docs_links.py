"""Every path that README.md and docs/*.md cite exists in the repository.

Two kinds of reference are checked: Markdown links and images (resolved from the citing
file's folder, as a renderer does), and paths written in the text or in code spans that
start at one of the repository's top-level folders (`docs/runs/...`, `benchmarks/x.py`,
`tests/gpu/test_y.py::test_z`), resolved from the repository root. Paths on other
machines (`.stage/`, `/tmp/...`) and placeholders in commands (`docs/runs/DATE-...`) are
not the repository's and are left alone.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ROOT_FILES = ("Makefile", "ray_cluster.yaml", "pyproject.toml", "LICENSE")
# Words that stand for a value the reader supplies in a command.
PLACEHOLDERS = re.compile(r"\b(DATE|OUT|DIR|FILE|HEAD|PART|STAGE|NAME)\b")
# Capitals inside a lower-case name stand for a number: tests/unit/spec/test_cNN_*.py.
NUMBER_SLOT = re.compile(r"(?<=[a-z])[A-Z]{2,}")

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _top_level_dirs() -> list[str]:
    # Folders git ignores (runs/, out/, build/) are a checkout's own, not the repository's.
    ignored = {line.strip().strip("/") for line in (ROOT / ".gitignore").read_text().splitlines()}
    return sorted(p.name for p in ROOT.iterdir()
                  if p.is_dir() and not p.name.startswith((".", "_"))
                  and not p.name.endswith(".egg-info") and p.name not in ignored)


def _repo_path_pattern() -> re.Pattern:
    dirs = "|".join(map(re.escape, _top_level_dirs()))
    files = "|".join(map(re.escape, ROOT_FILES))
    # Not preceded by a path or word character, so `/tmp/docs/x` and `foo_tests/x` do not match.
    return re.compile(rf"(?<![\w./-])((?:{dirs})/[\w.*/-]*|(?:{files})\b)")


def _exists(base: Path, rel: str) -> bool:
    if "*" in rel:
        return any(base.glob(rel))
    return (base / rel).exists()


def cited_paths(doc: Path) -> list[tuple[str, Path, str]]:
    """(as written, base folder, path) for every reference in `doc`."""
    text = doc.read_text()
    refs = []
    for m in LINK.finditer(text):
        target = m.group(1).split("#", 1)[0]
        if not target or re.match(r"^[a-z]+:", target):  # anchors, http:, mailto:
            continue
        refs.append((m.group(0), doc.parent, target))
    for m in _repo_path_pattern().finditer(text):
        path = m.group(1).split("::", 1)[0].rstrip(".")
        if PLACEHOLDERS.search(path):
            continue
        path = NUMBER_SLOT.sub("*", path)  # test_cNN_*.py: any contract's test
        refs.append((m.group(1), ROOT, path))
    return refs


def _anchors(doc: Path) -> set[str]:
    """The heading anchors GitHub makes: lower case, punctuation but - and _ dropped."""
    heads = re.findall(r"^#+ (.+)$", doc.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def broken_anchors(doc: Path) -> list[str]:
    broken = []
    for m in LINK.finditer(doc.read_text()):
        target, _, anchor = m.group(1).partition("#")
        if not anchor or re.match(r"^[a-z]+:", target):
            continue
        linked = (doc.parent / target) if target else doc
        if linked.suffix == ".md" and linked.exists() and anchor not in _anchors(linked):
            broken.append(m.group(0))
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_link_to_a_heading_finds_it(doc):
    assert not broken_anchors(doc), f"{doc.relative_to(ROOT)}: no such heading for {broken_anchors(doc)}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_cited_path_exists(doc):
    missing = [written for written, base, rel in cited_paths(doc) if not _exists(base, rel)]
    assert not missing, f"{doc.relative_to(ROOT)} cites paths that do not exist: {missing}"


def test_the_checker_sees_a_missing_path(tmp_path):
    doc = ROOT / "docs" / "design.md"
    refs = cited_paths(doc)
    assert refs, "docs/design.md cites no path: the pattern no longer matches anything"
    fake = tmp_path / "x.md"
    fake.write_text("See [gone](gone.md) and `benchmarks/no_such_bench.py`.\n")
    missing = [w for w, base, rel in cited_paths(fake) if not _exists(base, rel)]
    assert missing == ["[gone](gone.md)", "benchmarks/no_such_bench.py"]
    fake.write_text("# A heading\n[here](#a-heading) [there](#no-heading)\n")
    assert broken_anchors(fake) == ["[there](#no-heading)"]
