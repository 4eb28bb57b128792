"""A checkpoint from elsewhere cannot run code: a pickle planted in any file of a checkpoint folder stops every
command that loads it, exit 2, naming the file and what it tried to load, before the planted code runs and
before anything is written. Checkpoints bridge and Megatron-LM write still load.

Each planted pickle would ``touch`` a marker file; the runs are `bridge` forks (tests/conftest.py) that stop
during setup, so they are short.
"""

from __future__ import annotations

import argparse
import io
import pickle
import shutil
import signal
from pathlib import Path

import pytest

from tests.conftest import bridge
from tests.unit.test_safe_pickle import TRUST, Planted

pytestmark = pytest.mark.slow

TINY = ["recipe=tiny", "train.eval_iters=0"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A tiny model saved at iteration 2 ("base"), and LoRA adapters trained on it to iteration 2 ("adapters")."""
    root = tmp_path_factory.mktemp("saved")
    base, adapters = root / "base", root / "adapters"
    first = bridge("pretrain", *TINY, "train.train_iters=2", f"checkpoint.save={base}")
    assert first.returncode == 0, first.stderr[-3000:]
    second = bridge("pretrain", *TINY, "peft=lora", "train.train_iters=2", f"checkpoint.pretrained_checkpoint={base}",
                    f"checkpoint.save={adapters}")
    assert second.returncode == 0, second.stderr[-3000:]
    return {"base": base, "adapters": adapters}


def plant_metadata(ckpt: Path, marker: Path) -> tuple[Path, str]:
    (ckpt / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    return ckpt / ".metadata", ""


def plant_common(ckpt: Path, marker: Path) -> tuple[Path, str]:
    import torch

    common = torch.load(ckpt / "common.pt", weights_only=False)
    torch.save({**common, "args": Planted(marker)}, ckpt / "common.pt")
    return ckpt / "common.pt", ""


def plant_shard_item(ckpt: Path, marker: Path) -> tuple[Path, str]:
    """Append a pickle to a shard and point the RNG-state item of .metadata (itself unchanged otherwise) at it:
    the item torch unpickles with weights_only=False."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn.startswith("rng_state/"))
    assert isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata)
    payload = io.BytesIO()
    torch.save([Planted(marker)], payload)
    shard = ckpt / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    metadata.storage_data[index] = _StorageInfo(info.relative_path, offset, len(payload.getvalue()))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    return shard, f" (its item {index.fqn})"


PLANTS = {".metadata": plant_metadata, "common.pt": plant_common, "a shard item": plant_shard_item}


def commands(base: Path, adapters: Path, out: Path) -> dict[str, tuple[list[str], str, Path]]:
    """name: (bridge arguments, which checkpoint is planted, what must not be written)."""
    return {
        "pretrain checkpoint.load": (["pretrain", *TINY, f"checkpoint.load={base}", f"checkpoint.save={out}"],
                                     "base", out),
        "pretrain resume": (["pretrain", *TINY, "train.train_iters=4", f"checkpoint.save={base}"], "base",
                            base / "iter_0000004"),
        "pretrain checkpoint.pretrained_checkpoint": (
            ["pretrain", *TINY, f"checkpoint.pretrained_checkpoint={base}", f"checkpoint.save={out}"], "base", out),
        "pretrain peft=lora resume": (["pretrain", *TINY, "peft=lora", "train.train_iters=4",
                                       f"checkpoint.save={adapters}"], "adapters", adapters / "iter_0000004"),
        "eval": (["eval", "recipe=tiny", f"checkpoint.load={base}", "--output", str(out)], "base", out),
        "peft merge (adapters)": (["peft", "merge", str(adapters), str(out), "recipe=tiny", "--base", str(base)],
                                  "adapters", out),
        "peft merge (base)": (["peft", "merge", str(adapters), str(out), "recipe=tiny", "--base", str(base)],
                              "base", out),
        "convert-ckpt export-hf": (["convert-ckpt", "export-hf", str(base), str(out)], "base", out),
    }


def written(path: Path) -> list[Path]:
    """The files at ``path``, under it, or under its staging folder (a run may make an empty save folder)."""
    return [f for p in (path, path.with_name(path.name + ".incomplete")) for f in ([p] if p.is_file() else p.rglob("*"))
            if f.is_file()]


@pytest.mark.parametrize("plant", PLANTS)
def test_a_planted_pickle_stops_every_command_before_it_runs(saved, plant, tmp_path):
    for case, name in enumerate(commands(Path("base"), Path("adapters"), Path("out"))):
        folder = tmp_path / f"case{case}"  # (a command's name holds '=', which no override value may)
        base, adapters = (shutil.copytree(saved[k], folder / k) for k in ("base", "adapters"))
        out, marker = folder / "out", folder / "MARKER"
        args, planted_in, unwritten = commands(base, adapters, out)[name]
        ckpt = next((base if planted_in == "base" else adapters).glob("iter_*"))
        file, item = PLANTS[plant](ckpt, marker)

        result = bridge(*args, timeout=300)
        assert result.returncode == 2, \
            f"{name}: exit {result.returncode}\n{result.stdout[-1500:]}\n{result.stderr[-3000:]}"
        assert not marker.exists(), f"{name}: the planted command ran"
        assert f"error: {file}{item}: refused to unpickle posix.system, which no checkpoint holds" in result.stderr, \
            f"{name}: {result.stderr[-2000:]}"
        assert f"run again with {TRUST}=1" in result.stderr and "Traceback" not in result.stderr, name
        assert written(unwritten) == [], name


def megatron_lm_common(common: dict) -> dict:
    """``common`` as Megatron-LM's save_checkpoint writes it: its arguments (a Namespace of dtypes, enums, paths
    and a signal, with the data position) in place of bridge's train state."""
    import torch
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    args = argparse.Namespace(
        consumed_train_samples=common["train_state"]["consumed_train_samples"], consumed_valid_samples=0,
        params_dtype=torch.float32, main_grads_dtype=torch.float32, attention_backend=AttnBackend.auto,
        model_type=ModelType.encoder_or_decoder, exit_signal=signal.SIGTERM, save=Path("/checkpoints/run"),
        data_path=["1.0", "/data/text_document"], rampup_batch_size=None, lr=3e-4)
    return {"args": args, "checkpoint_version": 3.0, "iteration": common["iteration"],
            "optimizer": common["optimizer"], "opt_param_scheduler": common["opt_param_scheduler"],
            "num_floating_point_operations_so_far": common["num_floating_point_operations_so_far"]}


def test_bridge_and_megatron_lm_checkpoints_still_load(saved, tmp_path):
    import torch

    megatron_lm = shutil.copytree(saved["base"], tmp_path / "megatron_lm")
    ckpt = megatron_lm / "iter_0000002"
    common = torch.load(ckpt / "common.pt", weights_only=False)
    torch.save(megatron_lm_common(common), ckpt / "common.pt")
    (ckpt / "run_config.yaml").unlink()
    consumed = common["train_state"]["consumed_train_samples"]

    for root in (saved["base"], megatron_lm):
        result = bridge("pretrain", *TINY, "train.train_iters=3", f"checkpoint.load={root}",
                        "scheduler.override_opt_param_scheduler=true")
        assert result.returncode == 0, f"{root}: {result.stderr[-3000:]}"
        assert f"loaded checkpoint {root}/iter_0000002 (checkpoint.load; iteration 2): resuming at iteration 2, " \
               f"consumed samples {consumed}" in result.stdout


def test_a_trusted_checkpoint_loads_unchecked(saved, tmp_path):
    """The variable lets through what the check refuses (here a class no checkpoint holds, which runs nothing)."""
    import datetime

    base = shutil.copytree(saved["base"], tmp_path / "base")
    file = base / "iter_0000002" / ".metadata"
    metadata = pickle.loads(file.read_bytes())
    metadata.saved_on = datetime.date(2026, 1, 1)
    file.write_bytes(pickle.dumps(metadata))
    args = ["eval", "recipe=tiny", f"checkpoint.load={base}", "train.eval_iters=1"]

    refused = bridge(*args)
    assert refused.returncode == 2 and f"{file}: refused to unpickle datetime.date" in refused.stderr, \
        refused.stderr[-2000:]
    trusted = bridge(*args, env={TRUST: "1"})
    assert trusted.returncode == 0, trusted.stderr[-3000:]
