"""Imports only go down: cli -> application -> gate -> engine -> drafters -> models ->
kernels, over the shared modules below. Every import of every module (also those inside
functions) is checked against this table."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mtpcli"

# Layer of each module (a package's modules share its layer); a module may import its own
# layer or lower ones.
LAYERS = {
    "errors": 0,
    "files": 1, "stats": 1,
    "config": 2, "tokenizer": 2, "example": 2,
    "weights": 3,
    "layout": 4,
    "kernels": 5,
    "options": 6,
    "models": 7,
    "drafters": 8,
    "fixtures": 9,
    "synthetic": 10,
    "engine": 11,
    "gate": 12,
    "loading": 13, "extract": 13, "inventory": 13, "launches": 13,
    "generation": 14,
    "serve": 15, "bench": 15,
    "cli": 16,
    "__main__": 17, "__init__": 17,
}  # fmt: skip


def _layer(module: str) -> int:
    return LAYERS[module.split(".")[0]]


def _modules() -> dict[str, tuple[str, bool]]:
    """Each module's dotted name -> (source, whether it is a package's __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        init = parts[-1] == "__init__" and len(parts) > 1
        out[".".join(parts[:-1] if init else parts)] = (path.read_text(), init)
    return out


def _imports(module: str, source: str, init: bool = False) -> list[tuple[str, int]]:
    """The mtpcli modules ``module`` imports, with line numbers (relative imports resolved)."""
    here = module.split(".") if init else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            elif (node.module or "").startswith("mtpcli."):
                target = node.module[len("mtpcli.") :]
            else:
                continue
            names = [target] if node.module else [f"{target}.{a.name}".strip(".") for a in
                                                  node.names]  # fmt: skip
            found += [(n, node.lineno) for n in names]
        elif isinstance(node, ast.Import):
            found += [(a.name[len("mtpcli.") :], node.lineno) for a in node.names
                      if a.name.startswith("mtpcli.")]  # fmt: skip
    return [(t, line) for t, line in found if t]


def _upward(modules: dict[str, tuple[str, bool]]) -> list[str]:
    return [
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)}) at line "
        f"{line}"
        for module, (source, init) in modules.items()
        for target, line in _imports(module, source, init)
        if _layer(target) > _layer(module)
    ]


def test_every_module_has_a_layer():
    assert sorted({m.split(".")[0] for m in _modules()} - set(LAYERS)) == []


def test_no_module_imports_one_above_it():
    assert _upward(_modules()) == []


@pytest.mark.parametrize("module,source", [
    ("gate", "from .generation import generate\n"),
    ("engine.mtp", "def f():\n    from .. import gate\n"),
    ("models.qwen3_5", "import mtpcli.loading\n"),
    ("kernels", "from ..models import Target\n"),
])  # fmt: skip
def test_the_check_finds_a_back_edge(module, source):
    """Mutation: an upward import, at the top or inside a function, relative or absolute."""
    init = module == "kernels"
    assert len(_upward({module: (source, init)})) == 1
