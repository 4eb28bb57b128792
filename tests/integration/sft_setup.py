"""Shared by the fine-tuning and evaluation tests: a byte-level tiny checkpoint and a small SFT data set."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from tests.conftest import bridge

TINY = ["recipe=tiny", "tokenizer=byte_level"]
VALIDATION_AT_20 = re.compile(r"^validation at iteration 20 \| lm loss ([0-9.]+) ", re.M)


def pretrained_base(root: Path) -> tuple[Path, str]:
    """`bridge pretrain` of the tiny model with the byte-level tokenizer, 20 iterations, validation at 20;
    run once per test session (the folder is shared) and returns (checkpoint folder, its output)."""
    save, log = root / "base", root / "base.log"
    if not log.is_file():
        result = bridge("pretrain", *TINY, "train.train_iters=20", "train.eval_interval=20", f"checkpoint.save={save}")
        assert result.returncode == 0, result.stderr[-3000:]
        log.write_text(result.stdout)
    return save, log.read_text()


def write_sft_data(root: Path) -> Path:
    """Each answer is a fixed function of its prompt: the word's letters reversed, upper-cased."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 5))) for _ in range(12)]
    root.mkdir(parents=True, exist_ok=True)
    for name, count in (("training", 96), ("validation", 16), ("test", 16)):
        with open(root / f"{name}.jsonl", "w") as f:
            for _ in range(count):
                word = rng.choice(words)
                f.write(json.dumps({"input": f"flip {word} =", "output": f" {word[::-1].upper()}"}) + "\n")
    return root
