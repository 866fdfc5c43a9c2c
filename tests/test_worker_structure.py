"""The worker's structure, checked on its source: no import circle in worker_mlx/
(function-level and TYPE_CHECKING imports count), modes chosen at construction (no
attribute of a runner assigned from outside it), no function over 60 lines, and one
owner of a request's slot list."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _sources(*folders: str):
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path, ast.parse(path.read_text(), filename=str(path))


def _names_a_runner(node: ast.expr) -> bool:
    """`runner`, `x.runner`, `self.h.runner`: an expression that names a runner."""
    if isinstance(node, ast.Name):
        return node.id.endswith("runner")
    return isinstance(node, ast.Attribute) and node.attr.endswith("runner")


def _assigned_attributes(tree: ast.AST):
    """(line, the expression whose attribute is assigned, the attribute) of every
    `x.attr = ...`, `x.attr += ...` and `setattr(x, "attr", ...)` in `tree`."""
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                yield node.lineno, node.args[0], node.args[1].value
        for t in targets:
            if isinstance(t, ast.Attribute):
                yield node.lineno, t.value, t.attr


def test_no_runner_attribute_is_assigned_from_outside():
    """Modes are constructor arguments: code outside model_runner.py never writes
    `runner.<attribute> = ...` (tests and benchmarks included)."""
    found = []
    for path, tree in _sources("worker_mlx", "tests", "benchmarks"):
        if path.name == "model_runner.py":
            continue
        for line, owner, attr in _assigned_attributes(tree):
            if _names_a_runner(owner):
                found.append(f"{path.relative_to(ROOT)}:{line}: .{attr}")
    assert not found, "runner attributes assigned from outside:\n" + "\n".join(found)


def test_the_checks_find_what_they_look_for():
    tree = ast.parse("runner.mode = 1\nself.runner.x += 2\nsetattr(runner, 'y', 3)\nr.z = 4")
    found = [(attr, _names_a_runner(owner)) for _, owner, attr in _assigned_attributes(tree)]
    assert sorted(found) == [("mode", True), ("x", True), ("y", True), ("z", False)]
    assert _long_functions(ast.parse("def f():\n" + "    pass\n" * 60)) == [("f", 61)]
    assert _long_functions(ast.parse("def f():\n" + "    pass\n" * 59)) == []


MAX_FUNCTION_LINES = 60


def _long_functions(tree: ast.AST) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in `tree` longer than the limit, from
    its `def` (or first decorator) to its last line."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            lines = node.end_lineno - first + 1
            if lines > MAX_FUNCTION_LINES:
                out.append((node.name, lines))
    return out


def test_no_function_in_the_worker_is_over_60_lines():
    found = [
        f"{path.relative_to(ROOT)}: {name} ({lines} lines)"
        for path, tree in _sources("worker_mlx")
        for name, lines in _long_functions(tree)
    ]
    assert not found, "functions over 60 lines:\n" + "\n".join(found)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, here: str, modules: set[str]) -> set[str]:
    """The modules of `modules` that one import statement in module `here` names."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    if not isinstance(node, ast.ImportFrom):
        return set()
    if node.level:  # relative: from the package of `here`
        package = here.split(".")[: -node.level]
        base = ".".join(package + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    # `from package import module` imports that module (the package runs first for any
    # of its modules, so it is no edge); `from module import name` imports the module
    submodules = {f"{base}.{a.name}" for a in node.names} & modules
    names = [a.name for a in node.names if f"{base}.{a.name}" not in modules]
    return submodules | ({base} if names and base in modules else set())


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its body."""
    trees = {_module_name(p): t for p, t in _sources(package)}
    modules = set(trees)
    graph = {}
    for name, tree in trees.items():
        edges = set()
        for node in ast.walk(tree):
            edges |= _imported(node, name, modules)
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (its modules in order, the first repeated), or None."""
    done, path = set(), []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        path.append(module)
        for nxt in sorted(graph[module]):
            cycle = visit(nxt)
            if cycle:
                return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module)
        if cycle:
            return cycle
    return None


def test_the_cycle_finder_finds_circles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_in_the_worker():
    graph = import_graph("worker_mlx")
    assert "worker_mlx.model_runner" in graph and "worker_mlx.backends" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_only_the_ledger_changes_a_requests_slot_list():
    """A request's slots are appended in one place, the KV ledger (kv_ledger.py)."""
    found = []
    for path, tree in _sources("worker_mlx"):
        if path.name == "kv_ledger.py":
            continue
        for node in ast.walk(tree):
            target = None
            if isinstance(node, ast.AugAssign):
                target = node.target
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in ("append", "extend", "insert"):
                    target = node.func.value
            if isinstance(target, ast.Attribute) and target.attr == "slots":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "slot lists changed outside the ledger: " + ", ".join(found)


def test_only_the_ledger_builds_the_decode_buffer_and_changes_its_rows():
    """The buffer is built, seated, dropped from and flushed by the KV ledger alone (its
    flush rule then holds for every caller); others step it and read it."""
    owned = {"DecodeBuffer", "seat", "drop", "flush", "reseat"}
    found = []
    for path, tree in _sources("worker_mlx"):
        if path.name in ("kv_ledger.py", "decode_buffer.py"):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name not in owned:
                continue
            owner = func.value if isinstance(func, ast.Attribute) else None
            # the ledger's own flush, called through it, is the rule itself
            if isinstance(owner, ast.Attribute) and owner.attr == "ledger":
                continue
            if name == "reseat" and path.name == "lookahead.py":  # the kept buffer's rewind
                continue
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert not found, "the decode buffer changed outside the ledger:\n" + "\n".join(found)
