"""The package's layers: its import graph, read from the source, has no cycle.

Every ``import`` of an ``engine`` module counts, wherever it is written: at the top, inside a
function, or under ``if TYPE_CHECKING:`` (a type import that closes a loop still says that a
lower layer knows a higher one). Nothing is imported or run to build the graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "engine"


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path = ENGINE) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``; an import of a package counts as one of
    its ``__init__``, an import of a module's own parent package (always run first) does not."""
    files = {_module(p, root): p for p in root.rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([base] if base else [])])
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for target in targets:
                found = known(target)
                if found and found != mod and not mod.startswith(found + "."):
                    graph[mod].add(found)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for nxt in sorted(graph[node]):
            if nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in done:
                found = visit(nxt)
                if found:
                    return found
        on_path.discard(path.pop())
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            found = visit(start)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "engine.trainer" in graph and "engine.events" in graph  # the graph was read
    cycle = find_cycle(graph)
    assert cycle is None, "engine imports in a cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_names_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_listeners_and_events_know_nothing_of_the_trainer():
    """A listener reads ``rec.run`` and returns requests: no listener module, nor the events
    module, imports the Trainer or its private parts."""
    graph = import_graph()
    for mod, imported in graph.items():
        if mod == "engine.events" or mod.startswith("engine.listeners"):
            driver = {m for m in imported if _is_driver(m)}
            assert not driver, (mod, sorted(driver))
    reaching = {"trainer", "save_checkpoint", "_write_checkpoint", "log_metrics"}
    for path in [ENGINE / "events.py", *(ENGINE / "listeners").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                assert node.attr not in reaching, f"{path.name}:{node.lineno}: .{node.attr}"


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules importing ``start`` runs: its imports, transitively, with the packages
    above each one (their ``__init__`` runs first), the package face ``engine`` aside."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        parts = mod.split(".")
        todo.extend(graph[mod])
        todo.extend(p for i in range(2, len(parts)) if (p := ".".join(parts[:i])) in graph)
    return seen


def _is_driver(mod: str) -> bool:
    return mod == "engine.trainer" or mod.startswith(("engine.driver", "engine.loop."))


def test_the_listeners_reach_neither_the_flag_resolution_nor_the_driver():
    """A listener reads the resolved flags (``engine.plan.config``) and the schedule
    (``engine.plan``, below the loops and the listeners both): importing one runs neither the
    flag checks and resolution (``engine.driver``) nor the loops nor the Trainer."""
    graph = import_graph()
    assert "engine.plan.schedule" in reached(graph, "engine.listeners.checkpoint")  # read
    for mod in graph:
        if mod.startswith(("engine.listeners", "engine.plan", "engine.events")):
            found = {m for m in reached(graph, mod) if _is_driver(m)}
            assert not found, (mod, sorted(found))


def test_the_reach_follows_imports_and_the_packages_above_them():
    graph = {
        "engine.a": {"engine.p.b"},
        "engine.p": {"engine.p.c"},
        "engine.p.b": set(),
        "engine.p.c": set(),
        "engine.d": set(),
    }
    assert reached(graph, "engine.a") == {"engine.a", "engine.p", "engine.p.b", "engine.p.c"}


def test_no_module_reads_a_name_from_the_package_face():
    """``engine/__init__.py`` imports every layer (the Trainer too): a module of the package
    that takes a name from it (``from engine import __version__``) depends on all of them.
    ``from engine import <submodule>`` is an import of that submodule and is fine."""
    modules = set(import_graph())
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "engine" and not node.level:
                names = [a.name for a in node.names if f"engine.{a.name}" not in modules]
                assert not names, f"{path.relative_to(ENGINE.parent)}:{node.lineno}: {names}"
    import engine
    from engine import _version

    assert engine.__version__ == _version.__version__


def test_no_module_is_longer_than_800_lines():
    """A file holds one idea: past 800 lines it holds several, and becomes a package."""
    long = {
        str(p.relative_to(ENGINE.parent)): n
        for p in ENGINE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 800
    }
    assert not long, long


# where torch.distributed may be imported outside engine/parallel/, and why (the list in
# docs/architecture.md, "Where torch.distributed lives")
DISTRIBUTED_ELSEWHERE = {
    # a state tells whether it holds DTensors, only once torch's sharding has been imported
    "engine/state.py",
    # the metrics' reduction over a process group, for custom loops (distributed_sync)
    "engine/metrics.py",
    # the progress bar's writes name the rank that prints
    "engine/listeners/progress.py",
}


def test_torch_distributed_is_imported_only_by_the_strategies():
    """A strategy owns its kind: ``torch.distributed`` (DTensor, DCP) is imported under
    ``engine/parallel/`` and in the few places listed, so a fourth strategy touches only
    ``parallel/``."""
    found = set()
    for path in ENGINE.rglob("*.py"):
        rel = str(path.relative_to(ENGINE.parent))
        if rel.startswith("engine/parallel/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
                found.add(rel)
    assert found <= DISTRIBUTED_ELSEWHERE, sorted(found - DISTRIBUTED_ELSEWHERE)


def test_the_tree_drawn_in_the_architecture_page_is_the_tree():
    """docs/architecture.md draws ``engine/``'s top level, a layer or a wing per entry: every
    entry there is in the drawing, and every entry drawn exists."""
    page = (ENGINE.parent / "docs" / "architecture.md").read_text()
    drawing = page.split("## The tree", 1)[1].split("```", 2)[1]
    drawn = {
        word.rstrip("/")
        for line in drawing.splitlines()
        if line.startswith("  ") and not line.startswith("   ")  # an entry (not a description)
        for word in line.strip().split("  ", 1)[0].split()
    }
    here = {p.name for p in ENGINE.iterdir() if p.name not in ("__pycache__", "py.typed")}
    assert here == drawn, (sorted(here - drawn), sorted(drawn - here))
