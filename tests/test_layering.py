"""The layers of DESIGN.md, checked on the import statements of the tree (including imports made
only for type checking: an arrow up is an arrow up).

Lower layers never import higher ones; `epp.config` only composes (nothing below it imports it);
one composition root (`epp.core`) builds the request path for `epp serve` and the simulator.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "epp"

# package -> packages of ours it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "epp.params": ("epp.",),
    "epp.errors": ("epp.",),
    "epp.shm": ("epp.",),
    "epp.datastore": ("epp.api", "epp.config", "epp.scheduling", "epp.flowcontrol", "epp.requestcontrol",
                      "epp.datalayer", "epp.discovery", "epp.extproc", "epp.observability", "epp.sim", "epp.scale"),
    "epp.api": ("epp.config", "epp.scheduling", "epp.flowcontrol", "epp.requestcontrol", "epp.datalayer",
                "epp.discovery", "epp.extproc", "epp.observability", "epp.runner", "epp.core", "epp.scale"),
    "epp.plugin": ("epp.config", "epp.scheduling", "epp.flowcontrol", "epp.requestcontrol", "epp.extproc", "epp.scale"),
    "epp.scheduling": ("epp.config", "epp.flowcontrol", "epp.requestcontrol", "epp.discovery", "epp.extproc",
                       "epp.observability", "epp.runner", "epp.core", "epp.sim", "epp.datalayer", "epp.scale"),
    "epp.flowcontrol": ("epp.config", "epp.requestcontrol", "epp.discovery", "epp.extproc",
                        "epp.observability", "epp.runner", "epp.core", "epp.sim", "epp.datalayer", "epp.scale"),
    "epp.datalayer": ("epp.config", "epp.scheduling", "epp.flowcontrol", "epp.requestcontrol",
                      "epp.extproc", "epp.runner", "epp.core", "epp.sim", "epp.scale"),
    "epp.discovery": ("epp.config", "epp.scheduling", "epp.flowcontrol", "epp.requestcontrol",
                      "epp.extproc", "epp.runner", "epp.core", "epp.sim", "epp.scale"),
    "epp.requestcontrol": ("epp.config", "epp.observability.metrics", "epp.extproc", "epp.discovery",
                           "epp.runner", "epp.core", "epp.sim", "epp.scale"),
    "epp.observability": ("epp.config", "epp.requestcontrol", "epp.extproc", "epp.runner", "epp.core",
                          "epp.sim", "epp.scale"),
    "epp.extproc": ("epp.config", "epp.runner", "epp.core", "epp.sim", "epp.discovery", "epp.scale"),
    "epp.config": ("epp.runner", "epp.core", "epp.extproc", "epp.requestcontrol", "epp.sim", "epp.scale"),
    # Workers and replicas sit beside the runner: below them nothing knows they exist.
    "epp.scale": ("epp.sim",),
    # The simulator builds the EPP only through the composition root.
    "epp.sim": ("epp.config.loader", "epp.flowcontrol.factory", "epp.runner", "epp.extproc"),
    # The token-slice sidecar is a client of the gateway, not a part of the request path.
    "epp.slicer": ("epp.config", "epp.scheduling", "epp.flowcontrol", "epp.requestcontrol", "epp.datalayer",
                   "epp.discovery", "epp.extproc", "epp.observability", "epp.runner", "epp.core", "epp.sim"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def _files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "admin/v1" not in p.as_posix())


def _violations() -> list[str]:
    found: list[str] = []
    for path in _files():
        module = _module_name(path)
        rules = [(pkg, banned) for pkg, banned in FORBIDDEN.items() if module == pkg or module.startswith(pkg + ".")]
        for line, imported in _imports(path):
            if not imported.startswith("epp"):
                continue
            for pkg, banned in rules:
                for prefix in banned:
                    target = prefix.rstrip(".")
                    if (imported == target or imported.startswith(target + ".")) and not imported.startswith(pkg):
                        found.append(f"{path.relative_to(ROOT.parent)}:{line}: {module} imports {imported}"
                                     f" (forbidden for {pkg})")
    return sorted(set(found))


def test_no_layer_imports_a_higher_one() -> None:
    assert _violations() == []


@pytest.mark.parametrize("module", ["epp.runner", "epp.sim.cluster.epp_router"])
def test_serve_and_the_simulator_build_the_core_in_one_place(module: str) -> None:
    path = ROOT.parent / (module.replace(".", "/") + ".py")
    imported = {name for _, name in _imports(path)}
    assert "epp.core.build_core" in imported
    assert not {"epp.config.loader.load_config", "epp.requestcontrol.director.Director"} & imported
