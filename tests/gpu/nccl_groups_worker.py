"""Under torchrun on GPUs: bridge's process-group set-up with NCCL settings per group, then each group's settings
as torch's ProcessGroupNCCL holds them, printed as one JSON line per rank. Used by test_gpu_nccl_groups.py."""

from __future__ import annotations

import json
import sys

import torch
from megatron.core import parallel_state as ps

from bridge_cli.runtime.distributed import destroy_distributed, init_distributed


def options(group) -> dict:
    nccl = group._get_backend(torch.device("cuda")).options
    return {"is_high_priority_stream": nccl.is_high_priority_stream, "max_ctas": nccl.config.max_ctas}


if __name__ == "__main__":
    init_distributed("nccl", 5, 1, 1, nccl_settings_path=sys.argv[1], high_priority_stream_groups=["tp"])
    try:
        print(json.dumps({"dp_cp": options(ps.get_data_parallel_group(with_context_parallel=True)),
                          "tp": options(ps.get_tensor_model_parallel_group())}), flush=True)
    finally:
        destroy_distributed()
