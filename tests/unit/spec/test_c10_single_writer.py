"""C10: kv_committed_len, kv_allocated_len and batch seq_lens have one writer each."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
OWNED = {"kv_committed_len", "kv_allocated_len"}
# who may assign what: the scheduler owns the request lengths (request.py declares them);
# seq_lens is never assigned as an attribute: ForwardBatch derives it, the future map
# updates it only through item assignment in its own store(), and the graph runner
# fills its own static buffers (and restores the caller's values, C04/C05).
OWNERS = {"kv_committed_len": {"serve_app/engine/scheduler.py", "serve_app/engine/request.py"},
          "kv_allocated_len": {"serve_app/engine/scheduler.py", "serve_app/engine/request.py"},
          "seq_lens": {"actors/worker/future_map.py", "actors/graphs/cuda_graph_runner.py"}}


def assignments(tree: ast.AST):
    """(attribute name, function name) for every assignment to `x.attr` or `x.attr[...]`."""
    found = []

    class V(ast.NodeVisitor):
        func = "<module>"

        def visit_FunctionDef(self, node):
            prev, self.func = self.func, node.name
            self.generic_visit(node)
            self.func = prev

        visit_AsyncFunctionDef = visit_FunctionDef

        def _target(self, t):
            while isinstance(t, ast.Subscript):
                t = t.value
            if isinstance(t, ast.Attribute):
                found.append((t.attr, self.func))
            elif isinstance(t, (ast.Tuple, ast.List)):
                for e in t.elts:
                    self._target(e)

        def visit_Assign(self, node):
            for t in node.targets:
                self._target(t)
            self.generic_visit(node)

        def visit_AugAssign(self, node):
            self._target(node.target)
            self.generic_visit(node)

        def visit_AnnAssign(self, node):
            self._target(node.target)
            self.generic_visit(node)

    V().visit(tree)
    return found


def sources():
    for folder in ("serve_app", "actors", "kestrel_kernels", "training"):
        for p in sorted((ROOT / folder).rglob("*.py")):
            yield p.relative_to(ROOT).as_posix(), ast.parse(p.read_text())


def test_c10_only_owners_write_lengths():
    bad = []
    for rel, tree in sources():
        for attr, func in assignments(tree):
            if attr in OWNERS and rel not in OWNERS[attr]:
                bad.append(f"{rel}:{func} assigns .{attr}")
    assert not bad, "lengths written outside their owners:\n" + "\n".join(bad)


def test_c10_scheduler_roles():
    tree = ast.parse((ROOT / "serve_app/engine/scheduler.py").read_text())
    writers = {}
    for attr, func in assignments(tree):
        if attr in OWNED:
            writers.setdefault(attr, set()).add(func)
    # decode preparation owns the allocated length, result processing the committed one;
    # admission and release set both (a request's row starts and ends there).
    assert writers["kv_allocated_len"] <= {"_grow_kv", "_admit", "_release_kv"}
    assert writers["kv_committed_len"] <= {"process_output", "_admit", "_release_kv"}
    assert "_grow_kv" in writers["kv_allocated_len"]
    assert "process_output" in writers["kv_committed_len"]


def test_c10_checker_catches_a_stray_writer():
    stray = ast.parse("class EagleWorker:\n    def f(self, req):\n        req.kv_committed_len += 1\n")
    assert ("kv_committed_len", "f") in assignments(stray)
