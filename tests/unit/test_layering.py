"""Imports only go down the layers, and nothing imports itself round a loop (docs/architecture.md): read statically
from every module, function-level imports too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "bridge_cli"

LAYERS = {
    "runtime": 0,  # devices, process groups, megatron-core's CPU patches, collectives
    "models": 1,  # model providers, layer specs, attention
    "config": 2,  # the schema (it reads the model provider's fields), composition, recipes
    "data": 3, "checkpoint": 3, "logging": 3, "peft": 3,
    "convert": 4,  # Hugging Face <-> torch_dist; knows no training loop
    "training": 5,  # the loop and its entry points; trains from and exports to Hugging Face folders through convert
    "cli": 6,
}
"""Each package of bridge_cli and its layer: a module may import its own layer and the ones below."""

LEAVES = {"errors"}
"""Modules named so (config/errors.py, ...) hold exception types only and may be imported from anywhere."""


def imports_of(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bridge_cli."):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("bridge_cli.")]
    return found


def module_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the modules of ``root``'s package it imports, at the top or inside a function}. ``from pkg import
    name`` counts as an import of the submodule ``pkg.name`` where there is one, else of ``pkg`` itself; the
    parent packages Python initialises on the way are not counted (a package's __init__ importing its modules
    is not a loop)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == root.name:
                submodules = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                edges.update(submodules)
                if len(submodules) < len(node.names):
                    edges.add(owner(node.module))
            elif isinstance(node, ast.Import):
                edges.update(owner(a.name) for a in node.names if a.name.split(".")[0] == root.name)
        graph[name] = edges - {name, None}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node: each is a set of nodes that import each other
    round a loop (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start), on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child), on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """{package: the other packages of bridge_cli its modules import}, leaves (errors modules) left out."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        parts = module.split(".")
        if len(parts) < 3:
            continue
        for target in targets:
            target_parts = target.split(".")
            if len(target_parts) >= 3 and target_parts[1] != parts[1] and target_parts[-1] not in LEAVES:
                packages.setdefault(parts[1], set()).add(target_parts[1])
    return packages


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(LAYERS), packages ^ set(LAYERS)


def test_imports_only_go_down():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if len(parts) < 2:
            continue  # bridge_cli/__main__.py starts the CLI
        for module in imports_of(path):
            target = module.split(".")
            if target[-1] in LEAVES or len(target) < 3:
                continue
            if LAYERS[target[1]] > LAYERS[parts[0]]:
                upward.append(f"{path.relative_to(PACKAGE.parent)} imports {module}")
    assert not upward, "\n".join(upward)


def test_no_two_packages_import_each_other():
    """Packages of one layer (data, checkpoint, logging, peft) may import each other, but only one way round."""
    loops = cycles(package_graph(module_graph()))
    assert not loops, "packages that import each other: " + "; ".join(" <-> ".join(loop) for loop in loops)


def test_no_module_imports_itself_round_a_loop():
    """A loop of modules, even one closed by imports inside functions, means neither can be read or tested alone:
    move what both need into a module of its own, below both."""
    loops = cycles(module_graph())
    assert not loops, "modules that import each other: " + "; ".join(" <-> ".join(loop) for loop in loops)


def test_the_check_sees_an_upward_import(tmp_path):
    """The test above can fail: a runtime module importing training is caught."""
    module = tmp_path / "probe.py"
    module.write_text("def f():\n    from bridge_cli.training.state import GlobalState\n")
    assert imports_of(module) == ["bridge_cli.training.state"]
    assert LAYERS["training"] > LAYERS["runtime"]


def test_the_checks_see_a_loop_closed_inside_functions(tmp_path):
    """Two modules that import each other only inside functions (as lora.py and lora_experts.py did) are a loop,
    and so are two packages that do; a package's __init__ importing its own modules is not."""
    root = tmp_path / "bridge_cli"
    for folder in ("peft", "data", "peft/families"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "peft" / "a.py").write_text("def f():\n    from bridge_cli.peft.b import g\n")
    (root / "peft" / "b.py").write_text("from bridge_cli.data.c import h\n\n\ndef g():\n    from bridge_cli.peft import a\n")
    (root / "data" / "c.py").write_text("def h():\n    import bridge_cli.peft.families.x\n")
    (root / "peft" / "families" / "__init__.py").write_text("from bridge_cli.peft.families.x import X\n")
    (root / "peft" / "families" / "x.py").write_text("from bridge_cli.peft.families import y\nX = 1\n")
    (root / "peft" / "families" / "y.py").write_text("")
    graph = module_graph(root)
    assert graph["bridge_cli.peft.b"] == {"bridge_cli.data.c", "bridge_cli.peft.a"}
    assert cycles(graph) == [["bridge_cli.peft.a", "bridge_cli.peft.b"]]
    assert cycles(package_graph(graph)) == [["data", "peft"]]
