"""A recipe that would not finish loading, or whose ${...} cannot resolve, is refused naming the file and key."""

from __future__ import annotations

import time


def _error(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return result.output.strip().splitlines()[-1]


def test_nested_aliases_are_refused_quickly(cli, tmp_path):
    # nine levels of ten aliases each: 10**10 values once expanded, a few hundred bytes on disk
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcdefghi", "bcdefghij"):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    recipe = tmp_path / "laughs.yaml"
    recipe.write_text("\n".join(lines) + "\n")
    start = time.monotonic()
    error = _error(cli("pretrain", f"recipe={recipe}", "--dry-run"))
    assert time.monotonic() - start < 10
    assert error.startswith(f"error: {recipe}: its anchors and aliases expand to ") and "more than a recipe" in error


def test_a_recursive_alias_is_refused(cli, tmp_path):
    recipe = tmp_path / "loop.yaml"
    recipe.write_text("a: &a [1, *a]\n")
    assert _error(cli("pretrain", f"recipe={recipe}", "--dry-run")) == (
        f"error: {recipe}: an alias refers to the node that holds it. Remove the recursive alias.")


def test_an_oversized_recipe_is_refused(cli, tmp_path):
    recipe = tmp_path / "big.yaml"
    recipe.write_text("# " + "x" * (1 << 20) + "\n")
    assert "more than a recipe may hold" in _error(cli("pretrain", f"recipe={recipe}", "--dry-run"))


def test_a_missing_interpolation_key_names_the_key_and_recipe(cli, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  train_iters: ${nope}\n")
    error = _error(cli("pretrain", f"recipe={recipe}", "--dry-run"))
    assert error.startswith(f"error: train.train_iters: cannot resolve ${{nope}} (set in recipe {recipe}): "), error


def test_an_unset_environment_variable_names_the_key_and_recipe(cli, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optimizer:\n  lr: ${oc.env:BRIDGE_TEST_UNSET_VARIABLE}\n")
    error = _error(cli("pretrain", f"recipe={recipe}", "--dry-run", env={"BRIDGE_TEST_UNSET_VARIABLE": None}))
    assert error.startswith(f"error: optimizer.lr: cannot resolve ${{oc.env:BRIDGE_TEST_UNSET_VARIABLE}} "
                            f"(set in recipe {recipe}): "), error
    assert "BRIDGE_TEST_UNSET_VARIABLE' not found" in error and "${oc.env:NAME,DEFAULT}" in error


def test_an_interpolation_from_the_command_line_says_so(cli):
    error = _error(cli("pretrain", "recipe=tiny", "train.train_iters=${nope}", "--dry-run"))
    assert error.startswith("error: train.train_iters: cannot resolve ${nope} (set on the command line): "), error
