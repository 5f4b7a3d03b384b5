"""The one direction of imports that docs/architecture.md's maps draw (the packages, and node/'s wings),
held against the code: every import of every module (at its top or inside a function) is walked, and an
import that runs against the map fails here naming the two modules. Clients are also shown, in a fresh interpreter, not to
load the ABCI application."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import planetserve

PACKAGE = Path(planetserve.__file__).parent

NODE_OUTSIDE = {"chain", "registry", "models", "config", "sampling", "metrics", "browserguard"}
NODE = {"node", "node.engine", "node.api", "node.routing", "node.overlay", "node.pipeline", "node.tasks",
        "node.home", "node.behaviours"}
"""node/'s roles (model_node, user, registration, runner), its wings and its shared modules."""
ALLOWED: dict[str, set[str]] = {
    "registry": set(),
    "models": set(),
    "config": set(),
    "browserguard": set(),
    "metrics": {"browserguard"},
    "sampling": {"registry"},
    "workloads": {"models"},
    "chain": {"registry"},
    "chain.abci": {"chain", "registry"},
    "verifier": {"chain", "registry", "models", "workloads", "config", "sampling", "metrics"},
    "node": NODE_OUTSIDE | NODE,
    "node.engine": NODE_OUTSIDE | {"node.tasks"},
    "node.api": NODE_OUTSIDE | {"node.engine"},
    "node.routing": NODE_OUTSIDE,
    "node.overlay": NODE_OUTSIDE | {"node.api", "node.tasks"},
    "node.pipeline": NODE_OUTSIDE | {"node.engine", "node.overlay", "node.routing", "node.home", "node.tasks"},
    "node.tasks": set(),
    "node.behaviours": set(),
    "node.home": NODE_OUTSIDE | {"node.behaviours"},
    "genesis": {"chain", "chain.abci", "registry"},
    "dashboard": {"chain", "registry", "browserguard"},
    "localnet": {"chain", "chain.abci", "registry", "models", "config", "genesis", "verifier", "dashboard",
                 "workloads", "sampling"} | NODE,
    "cli": {"chain", "chain.abci", "registry", "models", "config", "metrics", "workloads", "sampling", "genesis",
            "verifier", "dashboard", "localnet"} | NODE,
    "__main__": {"cli"},
    "__init__": set(),
}
"""What each part may import besides itself; a part is the longest name here that a module's starts with."""

CLIENT_ENTRY_POINTS = ["planetserve.chain.client", "planetserve.node.runner", "planetserve.verifier.daemon",
                       "planetserve.dashboard.server"]
"""What model nodes, relays, verifiers and the dashboard run: none of them may load the application."""


def part(module: str) -> str:
    """The part of the map a module (a dotted name below planetserve) belongs to."""
    return max((p for p in ALLOWED if module == p or module.startswith(p + ".")), key=len, default=module)


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")


def imports(path: Path) -> set[str]:
    """Every planetserve module `path` imports, with `from X import Y` counted as X.Y where Y is one."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name.removeprefix("planetserve.") for name in found if name.startswith("planetserve.")}


def violations() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        for target in sorted(imports(path)):
            source_part, target_part = part(importer), part(target)
            if target_part != source_part and target_part in ALLOWED and target_part not in ALLOWED[source_part]:
                out.append(f"{importer} imports {target} ({source_part} -> {target_part})")
    return out


def test_every_import_follows_the_map():
    assert violations() == []


def test_the_map_covers_every_package():
    parts = {part(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert parts <= set(ALLOWED), sorted(parts - set(ALLOWED))


def test_an_import_against_the_map_is_caught(tmp_path, monkeypatch):
    """The walk itself: a registry module that imports the chain is reported."""
    fake = tmp_path / "planetserve"
    (fake / "registry").mkdir(parents=True)
    (fake / "registry" / "bad.py").write_text("def f():\n    from planetserve.chain.abci import app\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert violations() == ["registry.bad imports chain.abci (registry -> chain.abci)",
                            "registry.bad imports chain.abci.app (registry -> chain.abci)"]


@pytest.mark.parametrize("entry", CLIENT_ENTRY_POINTS)
def test_a_client_never_loads_the_abci_application(entry):
    probe = (f"import sys, {entry}\n"
             "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'sqlalchemy' "
             "or m.startswith('planetserve.chain.abci'))\n"
             "print('\\n'.join(bad))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert loaded.stdout.split() == []


def test_a_user_relay_loads_no_model_code():
    """A relay carries requests and never runs a model: it must not pay torch's and transformers'
    start-up and memory (it takes the protocol's seed rules from the registry, not `sampling`)."""
    probe = ("import sys, planetserve.node.user\n"
             "print('\\n'.join(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert loaded.stdout.split() == []

