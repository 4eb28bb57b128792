"""The loop's checkpoint hooks, called directly: checkpoint_and_decide_exit and save_checkpoint_and_time.

`python -m tests.integration.test_checkpoint_loop DIR` sets up the tiny model once and calls the
hooks for one scenario after another, printing `RESULT {json}` after each; the tests read those.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from tests.conftest import python

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("loop")
    result = python("-m", "tests.integration.test_checkpoint_loop", str(root))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    found = {}
    for line in result.stdout.splitlines():
        if line.startswith("RESULT "):
            item = json.loads(line[len("RESULT "):])
            found[item["scenario"]] = item
    return found


def test_checkpoint_and_decide_exit(results):
    expect = {  # scenario: (stop the loop?, persistent folders, non-persistent folders, saves printed)
        "nothing due": (False, [], [], 0),
        "save_interval": (False, ["iter_0000010"], [], 1),
        "non_persistent_save_interval": (False, ["iter_0000010"], ["iter_0000009"], 1),
        "exit_interval": (True, ["iter_0000010", "iter_0000011"], ["iter_0000009"], 1),
        "exit_interval at a save_interval step saves once": (True, ["iter_0000010", "iter_0000011", "iter_0000020"],
                                                             ["iter_0000009"], 1),
        "exit_duration_in_mins": (True, ["iter_0000010", "iter_0000011", "iter_0000020", "iter_0000021"],
                                  ["iter_0000009"], 1),
        "exit signal": (True, ["iter_0000010", "iter_0000011", "iter_0000020", "iter_0000021", "iter_0000022"],
                        ["iter_0000009"], 1),
        "no checkpoint.save": (True, ["iter_0000010", "iter_0000011", "iter_0000020", "iter_0000021", "iter_0000022"],
                               ["iter_0000009"], 0),
    }
    for scenario, (stop, persistent, non_persistent, saves) in expect.items():
        got = results[scenario]
        assert (got["exit"], got["persistent"], got["non_persistent"], got["saves"]) == \
            (stop, persistent, non_persistent, saves), scenario
    assert results["exit signal"]["printed"][-1] == "exiting at iteration 22: received SIGTERM"
    assert results["exit_duration_in_mins"]["printed"][-1] == "exiting at iteration 21: train.exit_duration_in_mins=1 reached"


def test_save_checkpoint_and_time(results):
    got = results["save_checkpoint_and_time"]
    assert re.fullmatch(r"checkpoint .*/iter_0000030 saved in \d+\.\d\d s", got["printed"][0])
    assert got["tracker"] == "30"
    assert got["common"] == {"iteration": 30, "num_floating_point_operations_so_far": 1.5e15,
                             "consumed_train_samples": 240}
    got = results["save_checkpoint_and_time non-persistent"]
    assert re.fullmatch(r"non-persistent checkpoint .*/non_persistent/iter_0000031 saved in \d+\.\d\d s", got["printed"][0])
    assert got["non_persistent"] == ["iter_0000031"] and got["tracker"] == "30"


def _worker(root: Path) -> None:
    """Set up the tiny model once, then call the hooks scenario by scenario."""
    import contextlib
    import io
    import time

    from megatron.core.dist_checkpointing import load_common_state_dict

    from bridge_cli.config.compose import compose
    from bridge_cli.runtime.distributed import destroy_distributed
    from bridge_cli.training.config import ConfigContainer
    from bridge_cli.training.setup import setup
    from bridge_cli.training.state import GlobalState
    from bridge_cli.training.train import ExitSignal, checkpoint_and_decide_exit, save_checkpoint_and_time

    cfg = ConfigContainer.from_yaml_dict(compose("tiny", ["train.train_iters=100", "train.eval_iters=0",
                                                          f"checkpoint.save={root}"]))
    cfg.validate()
    state = GlobalState(cfg=cfg)
    out = setup(state, checkpointing_context={})
    ckpt, train = cfg.checkpoint, cfg.train

    def folders(path: Path) -> list[str]:
        return sorted(p.name for p in path.glob("iter_*")) if path.is_dir() else []

    def report(scenario: str, step: int, call, extra=dict) -> None:
        state.train_state.step = step
        state.train_state.consumed_train_samples = step * train.global_batch_size
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            stop = call()
        lines = printed.getvalue().splitlines()
        tracker = root / "latest_checkpointed_iteration.txt"
        print("RESULT " + json.dumps({
            "scenario": scenario, "exit": stop, "printed": lines,
            "saves": sum(" saved in " in line for line in lines),
            "persistent": folders(root), "non_persistent": folders(root / "non_persistent"),
            "tracker": tracker.read_text() if tracker.exists() else None, **extra(),
        }), flush=True)

    def decide() -> bool:
        return checkpoint_and_decide_exit(state, out.model, out.optimizer, out.scheduler,
                                          state.train_state.floating_point_operations_so_far,
                                          out.checkpointing_context, out.train_data_iterator)

    ckpt.save_interval = 10
    report("nothing due", 7, decide)
    report("save_interval", 10, decide)
    ckpt.non_persistent_save_interval, ckpt.non_persistent_ckpt_type = 3, "global"
    report("non_persistent_save_interval", 9, decide)
    ckpt.non_persistent_save_interval = None
    train.exit_interval = 11
    report("exit_interval", 11, decide)
    train.exit_interval = 20
    report("exit_interval at a save_interval step saves once", 20, decide)
    train.exit_interval, train.exit_duration_in_mins = None, 1
    state.start_time = time.time() - 61
    report("exit_duration_in_mins", 21, decide)
    train.exit_duration_in_mins = None
    state.signal_handler = ExitSignal(signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    report("exit signal", 22, decide)
    state.signal_handler.restore()
    state.signal_handler = None
    ckpt.save, train.exit_interval = None, 23
    report("no checkpoint.save", 23, decide)

    ckpt.save = str(root)

    def save(non_persistent: bool):
        return lambda: save_checkpoint_and_time(state, out.model, out.optimizer, out.scheduler, 1.5e15,
                                                out.checkpointing_context, non_persistent_ckpt=non_persistent,
                                                train_data_iterator=out.train_data_iterator)

    def common() -> dict:
        saved = load_common_state_dict(str(root / "iter_0000030"))
        return {"common": {"iteration": saved["iteration"],
                           "num_floating_point_operations_so_far": saved["num_floating_point_operations_so_far"],
                           "consumed_train_samples": saved["train_state"]["consumed_train_samples"]}}

    report("save_checkpoint_and_time", 30, save(False), common)
    report("save_checkpoint_and_time non-persistent", 31, save(True))
    destroy_distributed()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
