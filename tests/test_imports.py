"""medusa/'s import graph: every import of medusa.* (at the top of a module or inside a function) goes down the
layers below, and no chain of imports comes back to where it started. A lazy import inside a function is an edge
like any other: it may not dodge a cycle.

Tiers, bottom to top (a module imports its own tier or lower ones):
  low      data structures, files and the machine: no model code
  runtime  medusa/runtime/, everything that runs the target (the engines); the only place for private torch names
  mid      one decoding step and its parts: heads, proposing, accepting and the decode loop
  high  whole models and their files: loading heads in every layout, planning, the draft model, MedusaModel
  apps  the `medusa` command (medusa/cli/, one node of the graph), the HTTP server it runs (serve: fastapi is
        imported there only, never by `import medusa`) and training (medusa/train/, one node: the `train` extra)
"""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
from pathlib import Path

from medusa.quiet import loggers_held_to_errors

PACKAGE = Path(__file__).resolve().parent.parent / "medusa"
SCRIPTS = PACKAGE.parent / "scripts"
INIT = "__init__"  # the package itself: `from medusa import X` for a name that is not a module

TIERS = {
    "low": {
        "tree",
        "sampling",
        "fileio",
        "hardware",
        "ngram",
        "config",
        "loading",
        "generate_args",
        "hub",
        "custom_generate",
        "sequence",
        "questions",
        "llama_cpp",
        "quiet",
    },
    "runtime": {"runtime"},
    "mid": {
        "heads",
        "propose",
        "precision",
        "acceptance",
        "decode",
        "guard",
        "dynamic_tree",
        "prompt_lookup",
        "proposers",
        "evaluation",
        "answers",
        "batch",
    },
    "high": {"heads_io", "tree_builder", "plan", "draft", "eagle3", "eagle3_io", "model", INIT},
    "apps": {"cli", "__main__", "serve", "train"},
}
RANK = {module: rank for rank, tier in enumerate(TIERS.values()) for module in tier}


def imported_modules(source: str, modules: set[str]) -> set[str]:
    """The medusa modules `source` imports anywhere in its body (top level, functions, methods, branches)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("medusa.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "medusa":  # `from medusa import kv_cache` is a module; any other name is the package
                found |= {alias.name if alias.name in modules else INIT for alias in node.names}
            elif node.module.startswith("medusa."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(
                f"relative import `from {'.' * node.level}{node.module or ''} import ...`: "
                "medusa/ imports by absolute name (medusa.x)"
            )
        elif (
            _is_import_module(node)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("medusa.")
        ):  # an import by string is an edge too
            found.add(str(node.args[0].value).split(":")[0].split(".")[1])
    return found


def _is_import_module(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"


def sources() -> dict[str, list[Path]]:
    """module -> its files: a subpackage (medusa/cli/) is one module."""
    files = {path.stem: [path] for path in PACKAGE.glob("*.py")}
    files.update(
        {
            package.name: sorted(package.glob("*.py"))
            for package in PACKAGE.iterdir()
            if (package / "__init__.py").is_file()
        }
    )
    return files


def import_graph() -> dict[str, set[str]]:
    """module -> the medusa modules it imports."""
    files = sources()
    return {
        name: set().union(*(imported_modules(path.read_text(), set(files)) for path in paths)) - {name}
        for name, paths in files.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle as its modules in import order, first repeated at the end ([a, b, a]), or None."""
    done, path = set(), []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            cycle = visit(imported)
            if cycle:
                return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module)
        if cycle:
            return cycle
    return None


def test_no_import_cycle_in_medusa():
    cycle = find_cycle(import_graph())
    assert cycle is None, f"import cycle in medusa/: {' -> '.join(cycle)}"


def test_every_module_has_a_tier():
    unplaced = sorted(set(import_graph()) - set(RANK))
    assert not unplaced, f"medusa modules {unplaced} have no tier: add each to TIERS in {Path(__file__).name}"


def test_imports_go_down_the_tiers():
    tier_of = {module: name for name, tier in TIERS.items() for module in tier}
    upward = [
        f"{module} ({tier_of[module]}) imports {imported} ({tier_of[imported]})"
        for module, imports in sorted(import_graph().items())
        for imported in sorted(imports)
        if module in RANK and imported in RANK and RANK[imported] > RANK[module]
    ]
    assert not upward, "upward imports in medusa/: " + "; ".join(upward)


def edits_sys_path(source: str) -> bool:
    """Whether `source` touches sys.path (sys.path.insert, sys.path = ..., `from sys import path`)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
            return True
    return False


def test_scripts_import_medusa_as_installed():
    """Scripts run against the installed package (`pip install -e .`), never a path pushed onto sys.path (#18):
    what they need from the repository belongs in medusa/."""
    editing = sorted(path.name for path in SCRIPTS.glob("*.py") if edits_sys_path(path.read_text()))
    assert not editing, f"scripts/{editing} edit sys.path: import from the installed medusa package instead"


# ------------------------------------------------------------------ the checks can fail
def test_a_lazy_import_inside_a_function_is_an_edge():
    source = "import torch\nfrom medusa.config import X\n\ndef f():\n    from medusa.model import load_heads_weights\n"
    assert imported_modules(source, {"config", "model"}) == {"config", "model"}
    assert imported_modules("from medusa import kv_cache, MedusaModel\n", {"kv_cache"}) == {"kv_cache", INIT}


def test_the_former_export_model_cycle_is_caught():
    """export.py imported medusa.model inside load_heads, and model.py imported medusa.export inside _load."""
    export = "def load_heads(d):\n    from medusa.model import load_heads_weights\n"
    model = "from medusa.config import CONFIG_NAME\n\ndef _load(p):\n    from medusa.export import import_heads\n"
    modules = {"export", "model", "config"}
    graph = {"export": imported_modules(export, modules), "model": imported_modules(model, modules), "config": set()}
    assert find_cycle(graph) == ["export", "model", "export"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_imports_by_string_in_medusa():
    """importlib.import_module hides an edge from readers (and from tools); medusa/ imports modules by name."""
    users = sorted(
        path.name
        for path in PACKAGE.rglob("*.py")
        if any(_is_import_module(node) for node in ast.walk(ast.parse(path.read_text())))
    )
    assert not users, f"importlib.import_module in {users}: import the module by name instead"


def test_an_import_by_string_is_an_edge():
    source = "import importlib\n\ndef f():\n    return importlib.import_module('medusa.dynamic_tree')\n"
    assert imported_modules(source, {"dynamic_tree"}) == {"dynamic_tree"}


def test_a_sys_path_edit_is_caught():
    assert edits_sys_path("import sys\nsys.path.insert(0, '..')\n")
    assert edits_sys_path("from sys import path\npath.append('..')\n")
    assert not edits_sys_path("import os\nos.path.join('a', 'b')\n")


# ------------------------------------------------------------------ the runtime's room
RUNTIME = PACKAGE / "runtime"
PRIVATE_ROOTS = ("torch", "transformers")


def private_names(source: str) -> list[str]:
    """torch's and transformers' private names `source` uses: `torch._x` anywhere in an attribute chain, imports
    from or of a private module, and private names imported from theirs."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in PRIVATE_ROOTS:
                parts = [value.id, *reversed(chain)]
                if any(_private(part) for part in parts[1:]):
                    found.append(".".join(parts))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PRIVATE_ROOTS:
            names = node.module.split(".") + [alias.name for alias in node.names]
            if any(_private(part) for part in names):
                found.append(f"from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            found += [
                a.name
                for a in node.names
                if a.name.split(".")[0] in PRIVATE_ROOTS and any(map(_private, a.name.split(".")))
            ]
    # an attribute chain is walked at each of its links: keep the longest
    return sorted({name for name in found if not any(other.startswith(name + ".") for other in found)})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_private_torch_names_only_in_the_runtime():
    outside = {
        str(path.relative_to(PACKAGE.parent)): names
        for path in sorted([*PACKAGE.rglob("*.py"), *SCRIPTS.glob("*.py")])
        if RUNTIME not in path.parents
        for names in [private_names(path.read_text())]
        if names
    }
    assert not outside, (
        f"private torch/transformers names outside medusa/runtime/ (move the workaround there): {outside}"
    )


def test_the_rest_of_the_library_imports_the_runtime_package_only():
    """medusa.runtime's __init__ is its interface: no module outside reaches into medusa.runtime.<module>."""
    reaching = sorted(
        f"{path.relative_to(PACKAGE.parent)}: {name}"
        for path in [*PACKAGE.rglob("*.py"), *SCRIPTS.glob("*.py")]
        if RUNTIME not in path.parents
        for node in ast.walk(ast.parse(path.read_text()))
        for name in _imported_names(node)
        if name.startswith("medusa.runtime.")
    )
    assert not reaching, f"imports of the runtime's own modules: {reaching}; import them from medusa.runtime"


def test_apps_and_scripts_use_the_public_library():
    """scripts/ and medusa/cli/ import no command module (medusa.cli) from scripts, and no private medusa name."""
    problems = []
    for path in [*SCRIPTS.glob("*.py"), *(PACKAGE / "cli").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("medusa"):
                problems += [f"{path.name}: {node.module}.{a.name}" for a in node.names if _private(a.name)]
                if path.parent == SCRIPTS and node.module.startswith("medusa.cli"):
                    problems.append(f"{path.name}: from {node.module}")
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and getattr(node.value, "id", "") in ("model", "medusa")
            ):
                problems.append(f"{path.name}: {node.value.id}.{node.attr}")
    assert not problems, f"private or command-module imports: {problems}"


def _imported_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [node.module]
    return []


def test_the_runtime_checks_can_fail():
    assert private_names("import torch\ntorch._dynamo.mark_static(x, 1)\n") == ["torch._dynamo.mark_static"]
    assert private_names("from torch._inductor import config\n") == ["from torch._inductor import config"]
    assert private_names("from transformers.cache_utils import _private\n")
    assert private_names("import torch\ntorch.ops.aten._weight_int8pack_mm(a, b, c)\n")
    assert not private_names("import torch\nx = torch.nn.functional.linear(a, b)\ny = a.__version__\n")


def test_importing_medusa_and_what_loads_a_model_prints_nothing():
    """torchao's import-time warnings (its wheel's extensions that cannot load here) and torch's about the enums it
    registers are held back (medusa.quiet), and nothing else prints."""
    code = "import medusa, transformers.modeling_utils"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert (result.stdout, result.stderr) == ("", "")


def test_loggers_held_to_errors_get_their_levels_back():
    logger = logging.getLogger("torchao")
    before = logger.level
    try:
        logger.setLevel(logging.INFO)
        with loggers_held_to_errors():
            assert logger.level == logging.ERROR
        assert logger.level == logging.INFO
    finally:
        logger.setLevel(before)
