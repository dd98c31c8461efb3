"""The house plan (DESIGN, "Layout"): a room imports only rooms below it, and nothing loops.

Read from the source with ``ast``, so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("wire", "relay", "meshd")

# Higher number = higher room. Rooms of one rank may not import each other,
# except where listed in SIDEWAYS.
RANK: dict[str, float] = {
    "wire": 0,
    "meshd.logs": 0,
    # the step rules both data planes share: above wire's errors, below the engine that applies them
    "meshd.steps": 0.5,
    "relay": 1,
    "meshd.engine": 1,
    "meshd.net": 2,
    "meshd.progress": 2,
    "meshd.mesh": 2,
    "meshd.store": 2,
    "meshd.client": 3,
    "meshd.stage": 3,
    "meshd.relay": 3,
    "meshd.fetch": 3,
    "meshd.status_table": 3,
    "meshd.daemon": 4,
    "meshd.front": 5,
    # `meshd bench`: a model's figures from the stage's describe_model (meshd.stage.model_file) and the engine
    "meshd.bench": 5,
    "meshd.cli": 6,
    "meshd.__main__": 7,
}
SANS_IO = ("wire", "relay", "meshd.steps", "meshd.mesh", "meshd.store", "meshd.stage.books")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(module: str) -> str | None:
    best = None
    for room in RANK:
        if (module == room or module.startswith(room + ".")) and (best is None or len(room) > len(best)):
            best = room
    return best


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # `from meshd.net import wsmask` imports the submodule
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    return {name: {m for m in imports_of(path) if m in modules} for name, path in modules.items()}


def test_every_module_has_a_room() -> None:
    assert [m for m in graph() if room_of(m) is None and m not in ("meshd", "relay", "wire")] == []


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Imports from a room into one of the same rank or above (within one room is fine)."""
    wrong = []
    for module, targets in edges.items():
        here = room_of(module)
        for target in targets:
            there = room_of(target)
            if here is not None and there is not None and here != there and RANK[there] >= RANK[here]:
                wrong.append(f"{module} -> {target}")
    return sorted(wrong)


def test_no_room_imports_a_room_above_or_beside_it() -> None:
    assert upward(graph()) == []


def test_the_check_catches_upward_and_sideways_imports() -> None:
    fake = {"meshd.engine.worker": {"meshd.daemon"}, "meshd.client.ask": {"meshd.stage.service", "wire.stage"},
            "meshd.stage.service": {"meshd.stage.books", "meshd.net.link"}}
    assert upward(fake) == ["meshd.client.ask -> meshd.stage.service", "meshd.engine.worker -> meshd.daemon"]


def test_sans_io_rooms_do_not_import_trio() -> None:
    wrong = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = module_name(path)
            if any(name == s or name.startswith(s + ".") for s in SANS_IO):
                if any(m == "trio" or m.startswith(("trio.", "trio_websocket")) for m in imports_of(path)):
                    wrong.append(name)
    assert wrong == []


def cycles(edges: dict[str, set[str]]) -> list[str]:
    """Every loop a depth-first walk meets, as "a -> b -> a"."""
    found: list[str] = []
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if nxt == node:
                continue
            if state.get(nxt) == 1:
                found.append(" -> ".join([*trail[trail.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_no_import_loops_between_modules_or_rooms() -> None:
    edges = graph()
    rooms: dict[str, set[str]] = {}
    for module, targets in edges.items():
        here = room_of(module) or module
        rooms.setdefault(here, set()).update(r for t in targets if (r := room_of(t) or t) != here)
    assert cycles(edges) == []
    assert cycles(rooms) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a -> b -> c -> a"]
