"""Imports only go down the layers (docs/architecture.md): read statically from every module, function-level imports too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "bridge_cli"

LAYERS = {
    "runtime": 0,  # devices, process groups, megatron-core's CPU patches, collectives
    "models": 1,  # model providers, layer specs, attention
    "config": 2,  # the schema (it reads the model provider's fields), composition, recipes
    "data": 3, "checkpoint": 3, "logging": 3, "peft": 3,
    "convert": 4, "training": 4,
    "cli": 5,
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


def test_the_check_sees_an_upward_import(tmp_path):
    """The test above can fail: a runtime module importing training is caught."""
    module = tmp_path / "probe.py"
    module.write_text("def f():\n    from bridge_cli.training.state import GlobalState\n")
    assert imports_of(module) == ["bridge_cli.training.state"]
    assert LAYERS["training"] > LAYERS["runtime"]
