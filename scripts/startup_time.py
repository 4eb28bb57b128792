"""Start-up time of the `bridge` CLI on this machine: median wall time of each command.

    python scripts/startup_time.py [--repeat 5]

Reports seconds per command and the ratio to a bare `python -c pass`, so numbers from
different machines compare. `--help` and `recipes list` must not import torch or megatron-core.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "bridge --help": [sys.executable, "-m", "bridge_cli", "--help"],
    "bridge recipes list": [sys.executable, "-m", "bridge_cli", "recipes", "list"],
    "bridge config validate recipe=tiny": [sys.executable, "-m", "bridge_cli", "config", "validate", "recipe=tiny"],
    "bridge pretrain recipe=tiny --dry-run": [sys.executable, "-m", "bridge_cli", "pretrain", "recipe=tiny", "--dry-run"],
    "python -c 'import megatron.core'": [sys.executable, "-c", "import megatron.core"],
}


def median_seconds(argv: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    base = median_seconds(COMMANDS["python -c pass"], args.repeat)
    print(f"{'command':<42} {'seconds':>8} {'x python':>9}")
    for name, argv in COMMANDS.items():
        seconds = median_seconds(argv, args.repeat)
        print(f"{name:<42} {seconds:>8.2f} {seconds / base:>9.1f}")


if __name__ == "__main__":
    main()
