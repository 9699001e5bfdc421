"""The package's layers go one way: no module imports from a layer above its own, whether at import time, inside a
function (a lazy import is still a dependency), or by name (a registry's module list, `importlib`). Imports under
`if TYPE_CHECKING:` are annotations only and are not counted.

A new top-level module or package must be given its layer here, which is the point: where it sits is a decision.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import vembed

PACKAGE = Path(vembed.__file__).parent

# Lowest first. A module may import its own layer and the layers below. The most specific prefix decides.
LAYERS: list[tuple[str, ...]] = [
    ("vembed.errors", "vembed.resources", "vembed.files"),  # what everything may use
    ("vembed.recipe",),  # the schema: imports nothing of vembed but errors
    ("vembed.registry", "vembed.distributed"),
    ("vembed.data",),  # sources, records, images, collation
    ("vembed.models", "vembed.losses"),  # embedding adapters and losses: what every kind shares, without the trainer
    ("vembed.generation", "vembed.reranking", "vembed.classification"),  # the wings, one per kind whose data, loss and
    # metrics are not pairs: their registries, models, losses and data, built on the shared ones (the wings' evaluation
    # and tasks: below, in the layers of their job)
    ("vembed.components",),  # a recipe read with its components' settings (needs the registries above)
    ("vembed.api", "vembed.export", "vembed.extraction", "vembed.retrieval", "vembed.model_card"),  # using trained
    # models (encoding is the models' own), searching a corpus with them, mining negatives, describing them
    ("vembed.evaluation", "vembed.reranking.evaluation", "vembed.classification.evaluation",
     "vembed.classification.metric_evaluation"),  # measuring them (retrieval metrics, zero-shot accuracy)
    ("vembed.tasks", "vembed.generation.task", "vembed.reranking.task", "vembed.classification.task",
     "vembed.classification.metric_task", "vembed.planning",
     "vembed.recipe_checks"),  # what a run trains and measures; its memory plan; every recipe rule, in order
    ("vembed.training", "vembed.strategy_bench"),  # the one loop and the launch strategies
    ("vembed.entrypoints", "vembed.cli", "vembed.__main__", "vembed"),  # parse, build, run; `vembed.load`
]


def layer_of(module: str) -> int:
    matches = [(len(prefix), rank) for rank, prefixes in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    if not matches:
        raise LookupError(f"{module} has no layer: add it to LAYERS in tests/test_layers.py")
    return max(matches)[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    relative = Path(*name.split("."))
    root = PACKAGE.parent / relative
    return root.with_suffix(".py").is_file() or (root / "__init__.py").is_file()


def _type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, vembed module) for every import of `source` outside `if TYPE_CHECKING:`, at any depth, plus string
    constants naming a vembed module (imports by name: registries' module lists, importlib)."""
    found: list[tuple[int, str]] = []
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    found.append((child.lineno, full if is_module(full) else base))
            elif isinstance(child, ast.Constant) and isinstance(child.value, str):
                if re.fullmatch(r"vembed(\.\w+)+", child.value) and is_module(child.value):
                    found.append((child.lineno, child.value))
            visit(child)

    visit(ast.parse(source))
    return [(line, name) for line, name in found if name == "vembed" or name.startswith("vembed.")]


# Today's upward imports that stay, each with why: (importing module, imported module) -> reason. Nothing else may
# reach up; an entry that no longer happens is stale and fails `test_every_allowed_upward_import_still_happens`.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    ("vembed.models.foreign", "vembed.reranking"):
        "require_embedder refuses a folder vembed saved as a reranker wherever an embedder is expected (the losses' "
        "GISTEmbed guide included); which model_types are rerankers is the reranking registry's to say",
}


def upward_imports(path: Path) -> list[str]:
    module = module_name(path)
    own = layer_of(module)
    return [f"{module}:{line} imports {name} (layer {layer_of(name)} > {own})"
            for line, name in imported_modules(path.read_text(), module, path.name == "__init__.py")
            if layer_of(name) > own and (module, name) not in ALLOWED_UPWARD]


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    missing = []
    for path in MODULES:
        try:
            layer_of(module_name(path))
        except LookupError as err:
            missing.append(str(err))
    assert not missing, missing


def test_no_module_imports_from_a_layer_above_it():
    violations = [line for path in MODULES for line in upward_imports(path)]
    assert not violations, "\n".join(violations)


def test_every_allowed_upward_import_still_happens():
    found = {(module_name(path), name) for path in MODULES
             for _, name in imported_modules(path.read_text(), module_name(path), path.name == "__init__.py")}
    stale = [f"{module} -> {name}" for module, name in ALLOWED_UPWARD if (module, name) not in found]
    assert not stale, f"remove from ALLOWED_UPWARD (the import is gone): {stale}"


def test_the_wings_sit_above_the_layers_every_kind_shares():
    # The layer rule of docs/guides/layout.md: models, losses and data never reach into a wing (but for the listed
    # exceptions); a wing's registries are read by the catalog above them (vembed.components).
    shared = ("vembed.data", "vembed.models.base", "vembed.losses.contrastive")
    for wing in ("vembed.generation", "vembed.reranking", "vembed.classification"):
        assert all(layer_of(wing) > layer_of(module) for module in shared), wing
        assert layer_of(wing) < layer_of("vembed.components"), wing


def test_the_scan_counts_lazy_and_by_name_imports_but_not_annotations():
    source = '''
from typing import TYPE_CHECKING
import vembed.errors
if TYPE_CHECKING:
    from vembed.training.loop import Trainer
def build():
    from vembed.tasks import check_recipe
REGISTRY_MODULES = ("vembed.entrypoints.train",)
'''
    names = [name for _, name in imported_modules(source, "vembed.models.clip", False)]
    assert names == ["vembed.errors", "vembed.tasks", "vembed.entrypoints.train"]


@pytest.mark.parametrize("module", ["vembed.recipe", "vembed.models.clip", "vembed.losses.contrastive"])
def test_an_upward_import_is_reported(tmp_path, module, monkeypatch):
    # The check itself fails when a low module reaches up (here into the training loop), naming file and line.
    path = PACKAGE.parent / Path(*module.split(".")).with_suffix(".py")
    reaching_up = "def f():\n    from vembed.training.loop import Trainer\n"
    monkeypatch.setattr(Path, "read_text", lambda self, *args, **kwargs: reaching_up)
    above = layer_of("vembed.training")
    assert upward_imports(path) == [f"{module}:2 imports vembed.training.loop (layer {above} > {layer_of(module)})"]


def import_cycles() -> list[list[str]]:
    """Cycles among vembed's modules (lazy imports count; a package's __init__ re-exports are not edges of their own
    submodules): two modules that import each other have no order to be read in and cannot be moved apart."""
    graph: dict[str, set[str]] = {}
    for path in MODULES:
        module = module_name(path)
        if path.name == "__init__.py":
            continue  # packages re-export their modules; what matters is module to module
        graph[module] = {name for _, name in imported_modules(path.read_text(), module, False)
                         if name != module and not (PACKAGE.parent / Path(*name.split(".")) / "__init__.py").is_file()}
    cycles, state = [], {}

    def visit(module: str, stack: list[str]) -> None:
        state[module] = "open"
        stack.append(module)
        for name in sorted(graph.get(module, ())):
            if state.get(name) == "open":
                cycles.append(stack[stack.index(name):] + [name])
            elif name not in state:
                visit(name, stack)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    return cycles


def test_no_two_modules_import_each_other():
    cycles = import_cycles()
    assert not cycles, "\n".join(" -> ".join(cycle) for cycle in cycles)
