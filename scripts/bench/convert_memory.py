"""Peak host memory (RSS) of `bridge convert-ckpt import-hf` and `export-hf` on a ~1B-parameter model.

    PYTHONPATH=. python scripts/bench/convert_memory.py [--work /tmp/bridge_convert_memory]

Builds (once, into WORK/hf) a Llama-3.2-1B-shaped model with transformers on the CPU: 16 layers,
hidden 2048, GQA 32/8, vocabulary 128256, tied embeddings, bf16, random weights, 1.24B parameters
(2.47 GB), saved in 1GB shards. Then imports it with the llama1b recipe (bf16 weights) and exports
it back with --max-shard-size 500MB, each under ``/usr/bin/time -v``, and prints each command's
peak memory next to the model's size. Nothing is downloaded; WORK needs about 8 GB of disk.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=4096,
             rope_theta=500000.0, tie_word_embeddings=True)


def build(folder: Path) -> None:
    import torch
    import transformers

    if (folder / "config.json").is_file():
        return
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPE, dtype="bfloat16")
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="1GB")


def peak_memory(*args: str) -> tuple[float, float, str]:
    """(peak RSS of the largest process, peak PSS of the process tree, both in GB; the command) of ``bridge ARGS``.

    megatron-core's checkpoint writer forks worker processes, which share the model's pages with
    the converting process: RSS counts a shared page in every process, PSS splits it, so the sum
    of PSS over the tree (sampled every 0.1 s) is the memory the conversion really takes.
    """
    import tempfile
    import threading
    import time

    import psutil

    log = tempfile.TemporaryFile()
    child = subprocess.Popen([sys.executable, "-m", "bridge_cli", *args], stdout=log, stderr=log,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    peak, done = [0], threading.Event()

    def sample() -> None:
        process = psutil.Process(child.pid)
        while not done.is_set():
            try:
                tree = (process, *process.children(recursive=True))
                peak[0] = max(peak[0], sum(p.memory_full_info().pss for p in tree))
            except psutil.Error:  # a process ended while being read
                pass
            time.sleep(0.1)

    sampler = threading.Thread(target=sample)
    sampler.start()
    _, status, usage = os.wait4(child.pid, 0)  # ru_maxrss: the largest of the process and its descendants
    done.set()
    sampler.join()
    if os.waitstatus_to_exitcode(status) != 0:
        log.seek(0)
        sys.exit(log.read().decode()[-4000:])
    return usage.ru_maxrss / 1e6, peak[0] / 1e9, "bridge " + " ".join(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/bridge_convert_memory"))
    work = parser.parse_args().work
    hf, ckpt, out = work / "hf", work / "mcore", work / "exported"
    build(hf)
    for folder in (ckpt, out):
        shutil.rmtree(folder, ignore_errors=True)
    size = sum(f.stat().st_size for f in hf.glob("*.safetensors")) / 1e9
    print(f"model: {size:.2f} GB of bf16 safetensors in {len(list(hf.glob('*.safetensors')))} files")
    for args in (("convert-ckpt", "import-hf", str(hf), str(ckpt), "--recipe", "llama1b"),
                 ("convert-ckpt", "export-hf", str(ckpt), str(out), "--max-shard-size", "500MB")):
        rss, pss, command = peak_memory(*args)
        print(f"peak RSS {rss:.2f} GB, peak PSS of the process tree {pss:.2f} GB: {command}")


if __name__ == "__main__":
    main()
