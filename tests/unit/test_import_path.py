"""What `bridge pretrain` imports on its way to the first step: nothing a run of its config does not use.

Each module named here cost a launch time it did not need (docs/performance.md, "launch to first step"):
loggers megatron-core imports for its own writers, libraries and modules of features the run has off (inductor's
compiler in a run that compiles nothing), and Hydra once the composed config is kept from an earlier launch of the
same command.
"""

from __future__ import annotations

import sys

import pytest

from tests.conftest import run

COMMAND = ("pretrain", "recipe=tiny", "train.train_iters=1", "logger.log_interval=1",
           "train.eval_iters=0")

NEVER = {
    "wandb", "tensorboard", "mlflow", "comet_ml",  # loggers: logger.* leaves them off
    "transformers", "matplotlib", "scipy", "pandas", "sklearn", "datasets",  # no feature of this run uses them
}
"""Top-level packages a one-iteration `tiny` run on the CPU never imports."""

NOT_USED = ("torch._inductor.compile_fx", "torch._inductor.lowering", "torch._inductor.select_algorithm",
            "bridge_cli.convert.families")
"""Modules of features `tiny` has off: inductor's compiler, which megatron-core's fused kernels imported as they were
decorated (`tiny` calls none of them and compiles nothing: about 1 s of a 4 s launch on the 2-core CPU), and the
Hugging Face families, for runs from or exporting to a Hugging Face folder."""


# `bridge pretrain ...` as `python -m bridge_cli` runs it, then the names in sys.modules as the process exits
# (python -X importtime would also list the imports megatron-core tries and bridge refuses it)
LAUNCH = """
import atexit, runpy, sys
listing = sys.argv[1]
atexit.register(lambda: open(listing, "w").write("\\n".join(sorted(sys.modules))))
sys.argv = ["bridge", *sys.argv[2:]]
runpy.run_module("bridge_cli", run_name="__main__", alter_sys=True)
"""


def launch(tmp_path) -> set[str]:
    """The modules a fresh `bridge pretrain` process (not a fork of the test's server, which has imported for
    every command) has imported by its exit."""
    modules = tmp_path / "modules.txt"
    result = run(sys.executable, "-c", LAUNCH, str(modules), *COMMAND, hand_off=False, timeout=600,
                 env={"XDG_CACHE_HOME": str(tmp_path / "cache"), "BRIDGE_CONFIG_CACHE": "on"})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "iteration 1/1" in result.stdout, result.stdout[-3000:]
    return set(modules.read_text().split())


@pytest.mark.slow  # two fresh launches, 8 s on 2 cores
def test_pretrain_imports_nothing_it_does_not_use(tmp_path):
    first = launch(tmp_path)
    assert "megatron.core" in first and "bridge_cli.training.train" in first  # the list is read right
    found = sorted(m for m in first if m.split(".")[0] in NEVER or m == "torch.utils.tensorboard")
    assert not found, f"`bridge pretrain recipe=tiny` imports {found}: import them where the feature is on"
    unused = sorted(set(NOT_USED) & first)
    assert not unused, f"`bridge pretrain recipe=tiny` imports {unused}: import them where the feature is on"
    assert "hydra" in first  # the first launch composes

    second = launch(tmp_path)  # the same command again: its composed config is kept
    hydra = sorted(m for m in second if m.split(".")[0] == "hydra")
    assert not hydra, f"a launch whose composed config is kept imports {hydra[:5]}"
