"""node/'s import map (docs/architecture.md, "node/ wings"): each wing imports only itself, the wings
below it and the shared modules the map allows, and nothing in node/ imports the verifier, the dashboard,
the localnet or the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import planetserve.node

NODE = Path(planetserve.node.__file__).parent
ROLES = {"model_node", "user", "registration", "runner"}
ALLOWED = {
    "engine": {"engine", "tasks"},
    "api": {"api", "engine"},
    "routing": {"routing"},
    "overlay": {"overlay", "api", "tasks"},
    "pipeline": {"pipeline", "engine", "overlay", "routing", "home", "tasks"},
    "tasks": set(),
    "behaviours": set(),
    "home": {"behaviours"},
}
OUTSIDE = ("planetserve.verifier", "planetserve.dashboard", "planetserve.localnet", "planetserve.cli")


def imported(path: Path) -> set[str]:
    """Every module a file imports, lazily or not; `from planetserve.node import x` counts as node.x."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module == "planetserve.node":
                names.update(f"planetserve.node.{alias.name}" for alias in node.names)
    return names


def part(module: str) -> str:
    """The wing or top-level module of node/ that a module belongs to."""
    return module.removeprefix("planetserve.node.").split(".")[0]


def test_every_wing_imports_only_what_the_map_allows():
    wrong = []
    for path in sorted(NODE.rglob("*.py")):
        importer = path.relative_to(NODE).parts[0].removesuffix(".py")
        for module in imported(path):
            if module.startswith(OUTSIDE):
                wrong.append(f"{path.relative_to(NODE)} imports {module}")
            if not module.startswith("planetserve.node.") or importer in ROLES or importer == "__init__":
                continue
            if importer not in ALLOWED:
                wrong.append(f"{importer} is on no map: add it to docs/architecture.md and ALLOWED")
            elif part(module) not in ALLOWED[importer] | {importer}:
                wrong.append(f"{path.relative_to(NODE)} imports {module}")
    assert not wrong, "\n".join(wrong)
