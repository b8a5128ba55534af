"""The package layout: no import cycle in `spd`, and dependencies that point one way.

Imports are read from the source (module level and inside functions alike), so a cycle hidden
behind a function-level import fails here too.
"""
import ast
from pathlib import Path

import pytest

SPD = Path(__file__).resolve().parents[1] / "python" / "spd"

# Each subpackage may import only those of a lower rank (and itself); equal ranks are siblings
# that must not import each other. The top-level modules (errors, env, version) are rank 0.
RANKS = {"errors": 0, "env": 0, "version": 0, "cuda_graphs": 1, "device": 1, "data": 1,
         "model": 2, "draft": 3, "runtime": 4, "train": 4, "baselines": 5, "distributed": 5,
         "evaluation": 6, "serve": 6, "cli": 7}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SPD.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, modules) -> set[str]:
    """The spd modules `path` imports. `from spd.x import y` counts spd.x.y when that is a module,
    else spd.x (so `from spd import env` is an import of spd.env, not of the package facade)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "spd"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "spd":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in modules else node.module)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in SPD.rglob("*.py")}
    return {name: {m for m in _imports(path, files) if m in files and m != name}
            for name, path in files.items()}


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_subpackage_has_a_rank(graph):
    unranked = sorted({_subpackage(m) for m in graph} - set(RANKS) - {None, "__main__"})
    assert not unranked, f"give these a rank in RANKS: {unranked}"


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    done, on_path, cycles = set(), [], []

    def visit(m):
        if m in on_path:
            cycles.append(on_path[on_path.index(m):] + [m])
            return
        if m in done:
            return
        on_path.append(m)
        for dep in sorted(graph[m]):
            # a package's __init__ re-exporting its own modules is not a cycle
            if not (dep.startswith(m + ".") or m.startswith(dep + ".") and _is_init(dep)):
                visit(dep)
        on_path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
    return cycles


def test_no_import_cycle(graph):
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _is_init(module: str) -> bool:
    return (SPD.parent / module.replace(".", "/") / "__init__.py").exists()


def test_dependencies_point_one_way(graph):
    """cli -> evaluation -> baselines / distributed -> train / runtime -> draft -> model -> data."""
    wrong = []
    for m, deps in graph.items():
        src = _subpackage(m)
        if src is None or src == "__main__":
            continue  # spd/__init__.py is the public facade; __main__ runs the CLI
        for dep in deps:
            dst = _subpackage(dep)
            if dst is None:
                wrong.append(f"{m} imports the package facade `spd` (import the module itself)")
            elif dst != src and RANKS[dst] >= RANKS[src]:
                wrong.append(f"{m} imports {dep} ({src} rank {RANKS[src]} -> {dst} rank "
                             f"{RANKS[dst]})")
    assert not wrong, "dependencies against the layering:\n" + "\n".join(sorted(wrong))


def test_the_library_never_imports_the_cli(graph):
    users = sorted(m for m, deps in graph.items()
                   if _subpackage(m) not in ("cli", "__main__", None)
                   and any(_subpackage(d) == "cli" for d in deps))
    assert not users, f"library modules importing spd.cli: {users}"


def test_the_checks_see_a_violation(tmp_path):
    """The graph reader finds function-level imports (what a cycle would hide behind)."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from spd.cli.main import main\n    import spd.model.target\n")
    assert _imports(f, {"spd.cli.main", "spd.model.target"}) == {"spd.cli.main",
                                                                  "spd.model.target"}


def test_a_cycle_is_found():
    assert find_cycles({"spd.a.x": {"spd.b.y"}, "spd.b.y": {"spd.a.x"}}) == \
        [["spd.a.x", "spd.b.y", "spd.a.x"]]
    assert find_cycles({"spd.a.x": {"spd.b.y"}, "spd.b.y": set()}) == []
