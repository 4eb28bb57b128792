"""write_checkpoint(), in this process: what a save leaves behind besides its folder."""

import psutil
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async

from bridge_cli.checkpoint.save import write_checkpoint


def test_a_first_save_starts_no_fresh_interpreter_and_loads_back(one_process, tmp_path, monkeypatch):
    monkeypatch.setattr(filesystem_async, "_results_queue", None)  # as in a process that never saved
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    weight = torch.arange(12.0).reshape(3, 4)
    path, request = write_checkpoint(tmp_path, 1, {"w": ShardedTensor.from_rank_offsets("w", weight, replica_id=0)},
                                     {"model": {"num_layers": 1}}, content_metadata={})
    assert request is None and (path / "run_config.yaml").is_file()
    # megatron-core's own choice, a spawned manager, would be a second interpreter importing torch
    started = [" ".join(child.cmdline()) for child in psutil.Process().children(recursive=True)
               if child.pid not in before]
    assert not any("spawn_main" in command for command in started), started
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4), replica_id=0)},
                                     str(path))
    assert torch.equal(loaded["w"], weight)
