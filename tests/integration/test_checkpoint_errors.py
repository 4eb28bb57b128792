"""A checkpoint that cannot be used stops `bridge pretrain` with its path and the mismatch named, exit 2; --resume auto|never.

Each case is a `bridge` run (a fork, see tests/conftest.py python()); each fails during setup, so they are short.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import bridge

pytestmark = pytest.mark.slow

TINY = ["recipe=tiny", "train.eval_iters=0"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """iter_0000002 and iter_0000004 of a 6-iteration tiny run stopped at 4 (copy it before damaging it)."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    result = bridge("pretrain", *TINY, "train.train_iters=6", f"checkpoint.save={root}", "checkpoint.save_interval=2",
                    "train.exit_interval=4")
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def copy(saved: Path, tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(saved, target)
    return target


def test_unusable_checkpoints_fail_clearly(saved, tmp_path):
    truncated = copy(saved, tmp_path, "truncated")
    shard = sorted((truncated / "iter_0000004").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    unfinished = copy(saved, tmp_path, "unfinished")
    (unfinished / "iter_0000004" / "metadata.json").unlink()
    legacy = tmp_path / "legacy"
    (legacy / "iter_0000100" / "mp_rank_00").mkdir(parents=True)
    (legacy / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"\0")
    (legacy / "latest_checkpointed_iteration.txt").write_text("100")
    foreign = tmp_path / "hf"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    (foreign / "model.safetensors").write_bytes(b"\0")
    other = tmp_path / "other"
    other.mkdir()
    (other / "pytorch_model.bin").write_bytes(b"\0")
    empty = tmp_path / "empty"
    empty.mkdir()

    cases = {  # name: (extra args, what the error must say)
        "truncated shard": ([f"checkpoint.load={truncated}"], [str(shard), "truncated shard"]),
        "missing metadata.json": ([f"checkpoint.load={unfinished}"],
                                  [f"{unfinished}/iter_0000004 is not a complete torch_dist checkpoint: "
                                   "metadata.json missing"]),
        "other model shape": ([f"checkpoint.load={saved}", "model.hidden_size=256"],
                              [f"{saved}/iter_0000004 does not match this model",
                               "linear_proj.weight has shape (2, 128, 128) in the checkpoint and (2, 256, 256) in this model",
                               "The checkpoint was saved with model.hidden_size=128 (this run: 256)"]),
        "missing ckpt_step": ([f"checkpoint.load={saved}", "checkpoint.ckpt_step=3"],
                              ["checkpoint.ckpt_step=3: there is no iter_0000003", "Available iterations: 2, 4"]),
        "other schedule": ([f"checkpoint.load={saved}", "train.train_iters=10"],
                           [f"{saved}/iter_0000004: the learning-rate schedule differs",
                            "scheduler.override_opt_param_scheduler=true"]),
        "legacy torch format": ([f"checkpoint.load={legacy}"], [f"{legacy}/iter_0000100", "legacy `torch` format"]),
        "Hugging Face folder": ([f"checkpoint.load={foreign}"],
                                [f"{foreign} is a Hugging Face model folder",
                                 f"bridge convert-ckpt import-hf {foreign} OUT_DIR"]),
        "not a checkpoint": ([f"checkpoint.load={other}"],
                             [f"{other} is not a bridge/Megatron checkpoint directory", "pytorch_model.bin"]),
        "exit_on_missing_checkpoint": ([f"checkpoint.load={empty}", "checkpoint.exit_on_missing_checkpoint=true"],
                                       [f"checkpoint.load={empty}: no checkpoint there"]),
        "async_save on the CPU": ([f"checkpoint.save={empty}", "checkpoint.async_save=true"],
                                  ["checkpoint.async_save=true needs CUDA", "checkpoint.async_save=false"]),
    }
    for name, (args, _) in cases.items():
        proc = bridge("pretrain", *TINY, *args, timeout=300)
        out, err = proc.stdout, proc.stderr
        assert proc.returncode == 2, f"{name}: exit {proc.returncode}\n{out[-1500:]}\n{err[-3000:]}"
        assert "Traceback" not in err, f"{name}: {err[-3000:]}"
        for fragment in cases[name][1]:
            assert fragment in err, f"{name}: {fragment!r} not in {err[-2000:]}"


def test_resume_auto_and_never(saved, tmp_path):
    auto_root, never_root = copy(saved, tmp_path, "auto"), copy(saved, tmp_path, "never")
    auto = bridge("pretrain", *TINY, f"checkpoint.save={auto_root}", "train.train_iters=6", "logger.log_interval=1",
                  timeout=300)
    assert auto.returncode == 0, auto.stderr[-3000:]
    out = auto.stdout
    assert f"loaded checkpoint {auto_root}/iter_0000004" in out and "iteration 5/6" in out and "iteration 4/6" not in out
    never = bridge("pretrain", *TINY, f"checkpoint.save={never_root}", "train.train_iters=2", "logger.log_interval=1",
                   "--resume", "never", timeout=300)
    assert never.returncode == 0, never.stderr[-3000:]
    assert "loaded checkpoint" not in never.stdout and "iteration 1/2" in never.stdout
