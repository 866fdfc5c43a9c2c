"""The router's structure, checked on its source: no import circle in router/, among its
modules or its subsystems (function-level and TYPE_CHECKING imports count), and the worker
known only by the function the router spawns, `worker_mlx.worker.run_worker`, imported
where it is spawned: whatever else both sides need lives in common/, so the worker's
insides can change without the router noticing."""

from __future__ import annotations

import ast

from tests.test_worker_structure import ROOT, _sources, find_cycle, import_graph

WORKER_ENTRY = ("worker_mlx.worker", "run_worker")


def test_no_import_circle_in_the_router():
    graph = import_graph("router")
    assert "router.api.http_server" in graph and "router.serving.launcher" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_subsystems_import_each_other_one_way():
    """No circle among router/'s subpackages and top-level modules either: serving
    starts the sdk's front door and the api's server, which send through replicas."""
    graph = import_graph("router")
    subsystem = {m: ".".join(m.split(".")[:2]) for m in graph}
    layers: dict[str, set[str]] = {s: set() for s in subsystem.values()}
    for module, imported in graph.items():
        layers[subsystem[module]] |= {subsystem[m] for m in imported} - {subsystem[module]}
    assert {"router.api", "router.replicas"} <= layers["router.serving"]
    cycle = find_cycle(layers)
    assert cycle is None, "subsystems in a circle: " + " -> ".join(cycle)


def _worker_imports(tree: ast.Module):
    """(line, module, names, inside a function) of each import of worker_mlx in `tree`."""
    functions = [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    nested = {id(n) for f in functions for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            pairs = [(a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            pairs = [(node.module or "", tuple(a.name for a in node.names))]
        else:
            continue
        for module, names in pairs:
            if module == "worker_mlx" or module.startswith("worker_mlx."):
                yield node.lineno, module, names, id(node) in nested


def test_the_router_imports_the_worker_only_by_its_entry_point():
    found, entries = [], 0
    for path, tree in _sources("router"):
        for line, module, names, in_function in _worker_imports(tree):
            where = f"{path.relative_to(ROOT)}:{line}"
            if (module, names) != (WORKER_ENTRY[0], WORKER_ENTRY[1:]) or not in_function:
                found.append(f"{where}: {module} {names} (in a function: {in_function})")
            entries += 1
    assert not found, "router/ imports the worker beyond its entry point:\n" + "\n".join(found)
    assert entries, "the router spawns the worker through worker_mlx.worker.run_worker"
