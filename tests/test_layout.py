"""How tm_slurm's modules depend on each other, checked from the source with `ast`."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tm_slurm"


def import_graph() -> dict[str, set[str]]:
    """Module -> the tm_slurm modules it imports anywhere in its body: an import inside a
    function counts, so a cycle cannot hide behind a lazy import."""
    mods = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in mods.items():
        deps = set()
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)] \
                    if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:
                    for cand in (f"{target}.{a.name}", target):
                        if cand in mods:
                            deps.add(cand)
                            break
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in mods}
        graph[name] = deps - {name}
    return graph


def cycle_from(graph: dict[str, set[str]], start: str) -> list[str] | None:
    stack, seen = [(start, [start])], set()
    while stack:
        n, path = stack.pop()
        for d in graph[n]:
            if d == start:
                return path
            if d not in seen:
                seen.add(d)
                stack.append((d, path + [d]))
    return None


def test_no_import_cycles_in_tm_slurm():
    graph = import_graph()
    assert {"tm_slurm.controller.core", "tm_slurm.worker.loop", "tm_slurm.slurm.backend"} <= set(graph)
    cycles = {m: c for m in graph if (c := cycle_from(graph, m))}
    assert not cycles, cycles
