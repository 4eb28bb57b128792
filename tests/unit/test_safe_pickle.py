"""verify.check_files reads every pickle of a checkpoint folder through the allow-list: the formats megatron-core
0.16-0.19 and Megatron-LM write pass, anything naming another class is refused with the file and the class,
before the planted code runs.

The folders are written here with torch's and megatron-core's own writers (no training); the commands that
load such folders are tested in tests/integration/test_untrusted_checkpoints.py.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import random
import signal
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from bridge_cli.checkpoint import verify
from bridge_cli.checkpoint.errors import CheckpointError

TRUST = "BRIDGE_TRUST_CHECKPOINT_PICKLES"


class Planted:
    """Unpickling it runs a shell command (pickle calls os.system)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def archive(obj) -> io.BytesIO:
    """``obj`` as torch.save writes it."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def megatron_lm_common() -> dict:
    """Common state as Megatron-LM saves it: its arguments, RNG states and rerun state."""
    from megatron.core.enums import ModelType
    from megatron.core.rerun_state_machine import RerunMode, RerunState
    from megatron.core.transformer.enums import AttnBackend

    args = argparse.Namespace(params_dtype=torch.bfloat16, main_grads_dtype=torch.float32, exit_signal=signal.SIGTERM,
                              attention_backend=AttnBackend.auto, model_type=ModelType.encoder_or_decoder,
                              save=Path("/checkpoints/run"), kitchen=types.SimpleNamespace(enabled=False),
                              data_path=["1.0", "/data/text"], betas=(0.9, 0.95), skip={1, 2}, rampup_batch_size=None)
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {"model-parallel-rng": torch.ones(4)}}
    return {"args": args, "checkpoint_version": 3.0, "iteration": 7, "rng_state": [rng],
            "rerun_state_machine": {"mode": RerunMode.DISABLED, "state": RerunState.NOT_RUNNING_YET},
            "num_floating_point_operations_so_far": np.float64(1.5e12)}


def write(folder: Path, items: dict) -> Path:
    """A torch_dist folder as megatron-core 0.19 writes it (the common state among the shards), one process."""
    # unflattened, each value is one item, as megatron-core's planner writes a sharded object
    dcp.save({"w": torch.arange(6.0), **items}, checkpoint_id=folder, no_dist=True,
             planner=DefaultSavePlanner(flatten_state_dict=False))
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    return folder


def common_item(common, nested: bool = False) -> dict:
    """The item megatron-core 0.19 stores the common state as, torch.save([common]) (torch's writer saves an object
    so); its loader also takes that archive saved once more, as a BytesIO."""
    return {"common_state/shard_0_1": archive([common]) if nested else [common]}


def test_megatron_lm_common_state_among_the_shards_passes(tmp_path):
    verify.check_files(write(tmp_path / "ckpt", common_item(megatron_lm_common())))
    verify.check_files(write(tmp_path / "nested", common_item(megatron_lm_common(), nested=True)))


@pytest.mark.parametrize("nested", [False, True])
def test_a_pickle_in_a_shard_item_is_refused_before_it_runs(tmp_path, nested):
    marker = tmp_path / "MARKER"
    ckpt = write(tmp_path / "ckpt", common_item({**megatron_lm_common(), "args": Planted(marker)}, nested))

    with pytest.raises(CheckpointError) as refused:
        verify.check_files(ckpt)
    where = f"{ckpt / '__0_0.distcp'} (its item common_state/shard_0_1)" + (", a BytesIO in it" if nested else "")
    assert str(refused.value).startswith(f"{where}: refused to unpickle posix.system, which no checkpoint holds")
    assert f"run again with {TRUST}=1" in str(refused.value)
    assert not marker.exists()


def extra_state(pickled: bytes) -> dict:
    """A layer's Transformer Engine state as megatron-core saves it: a uint8 tensor of pickle.dumps(state)
    (empty without FP8), which Transformer Engine reads back with pickle.loads."""
    data = torch.frombuffer(bytearray(pickled), dtype=torch.uint8) if pickled else torch.empty(0, dtype=torch.uint8)
    return {"decoder.layers.0.self_attention.linear_proj._extra_state/shard_0_1": [data]}


def test_transformer_engine_state_is_read_through_the_allow_list(tmp_path):
    fp8 = {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(16, 3), "extra_fp8_variables": {"num_gemms": 1}}
    common = common_item({"iteration": 1})
    verify.check_files(write(tmp_path / "fp8", {**common, **extra_state(pickle.dumps(fp8))}))
    verify.check_files(write(tmp_path / "bf16", {**common, **extra_state(b"")}))

    marker = tmp_path / "MARKER"
    # protocol 0 has no PROTO opcode in front: what is read must not depend on how a pickle starts
    for protocol in (4, 0):
        ckpt = write(tmp_path / f"protocol{protocol}",
                     {**common, **extra_state(pickle.dumps({"recipe": Planted(marker)}, protocol=protocol))})
        with pytest.raises(CheckpointError, match=r"_extra_state/shard_0_1\), the Transformer Engine state in it: "
                                                  "refused to unpickle posix.system"):
            verify.check_files(ckpt)
    assert not marker.exists()


@pytest.mark.parametrize("planted", ["metadata", "common.pt"])
def test_planted_metadata_and_common_pt_are_refused(tmp_path, planted):
    marker = tmp_path / "MARKER"
    ckpt = write(tmp_path / "ckpt", {})
    if planted == "metadata":
        file = ckpt / ".metadata"
        file.write_bytes(pickle.dumps([1, Planted(marker)]))
    else:
        file = ckpt / "common.pt"
        torch.save({"iteration": 1, "args": Planted(marker)}, file)

    with pytest.raises(CheckpointError, match=f"^{file}: refused to unpickle posix.system"):
        verify.check_files(ckpt)
    assert not marker.exists()


class Scripted(torch.nn.Module):
    def forward(self, x):
        return x + 1


def test_a_torchscript_archive_is_refused(tmp_path):
    """torch.load(weights_only=False), as torch's reader loads a shard item, hands TorchScript to torch.jit.load."""
    ckpt = write(tmp_path / "ckpt", {})
    torch.jit.save(torch.jit.script(Scripted()), ckpt / "common.pt")
    with pytest.raises(CheckpointError, match=f"^{ckpt / 'common.pt'}: refused to unpickle torch.jit.load "
                                              r"\(the file is a TorchScript archive\)"):
        verify.check_files(ckpt)


def test_bytes_decode_only_as_latin1(tmp_path):
    """Pickle protocol 2 writes bytes as _codecs.encode(text, 'latin1'); a codec is looked up by name, so no other."""
    ckpt = write(tmp_path / "ckpt", {})
    assert pickle.loads(pickle.dumps(b"\x00\xff", protocol=2)) == b"\x00\xff"
    torch.save({"state": b"\x00\xff"}, ckpt / "common.pt")
    verify.check_files(ckpt)
    ckpt.joinpath("common.pt").write_bytes(pickle.dumps({"state": b"x"}, protocol=2).replace(b"latin1", b"rot13 "))
    with pytest.raises(CheckpointError, match=r"refused to unpickle _codecs.encode \(with the 'rot13 ' codec\)"):
        verify.check_files(ckpt)


def test_a_damaged_metadata_file_is_named(tmp_path):
    ckpt = write(tmp_path / "ckpt", {})
    (ckpt / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=f"^{ckpt / '.metadata'} cannot be read .*the checkpoint is damaged"):
        verify.check_files(ckpt)


def test_trusting_lets_another_class_through(tmp_path, monkeypatch):
    import datetime

    ckpt = write(tmp_path / "ckpt", {**common_item({"iteration": 1}), "saved_on": datetime.date(2026, 1, 1)})
    with pytest.raises(CheckpointError, match=r"\(its item saved_on\): refused to unpickle datetime.date"):
        verify.check_files(ckpt)
    monkeypatch.setenv(TRUST, "1")
    verify.check_files(ckpt)


@pytest.mark.slow  # megatron-core's async writer starts a process
def test_an_async_save_passes_and_loads(one_process, tmp_path):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from bridge_cli.checkpoint import state_dict
    from bridge_cli.checkpoint.save import write_checkpoint
    from bridge_cli.training.state import TrainState

    weight = torch.arange(12.0).reshape(3, 4)
    sharded = {**state_dict.header(TrainState()), "rng_state": state_dict.rng_sharded_object(is_cuda=False),
               "w": ShardedTensor.from_rank_offsets("w", weight, replica_id=0)}
    path, request = write_checkpoint(tmp_path, 1, sharded, {"model": {}}, content_metadata={}, async_save=True)
    request.execute_sync()

    verify.check_files(path)
    template = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4), replica_id=0),
                "rng_state": state_dict.rng_sharded_object(is_cuda=False)}
    assert torch.equal(dist_checkpointing.load(template, str(path))["w"], weight)
