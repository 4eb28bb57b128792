"""Start-up time of the `bridge` CLI on this machine: median wall time of each command.

    python scripts/startup_time.py [--repeat 5] [--first-step RECIPE [OVERRIDE ...]]

Reports seconds per command and the ratio to a bare `python -c pass`, so numbers from
different machines compare. `--help` and `recipes list` must not import torch or megatron-core.
With ``--first-step``, instead times `bridge pretrain recipe=RECIPE train.train_iters=1` from
launch to its first iteration's log line and to the process's exit, and prints the start-up
breakdown bridge logs (``start-up ...``) and the fastest run (on a shared machine the others waited
for a core). The first run of a command composes its config and keeps it; the others read it back
(bridge_cli/config/compose_cache.py). With ``--imports N`` as well, runs that command once under
``python -X importtime`` and prints the N packages whose modules took longest to import, each with
the module that imported it first.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
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


def first_step_argv(recipe: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "bridge_cli", "pretrain", f"recipe={recipe}", "train.train_iters=1",
            "logger.log_interval=1", "train.eval_iters=0", *overrides]


def first_step(recipe: str, overrides: list[str], repeat: int) -> None:
    argv = first_step_argv(recipe, overrides)
    print(" ".join(argv[1:]))
    print(f"{'run':>4} {'to first step (s)':>18} {'to exit (s)':>12}  breakdown")
    fastest = None
    for run in range(1, repeat + 1):
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        first, breakdown, lines = None, "", []
        for line in proc.stdout:
            lines.append(line)
            if first is None and line.startswith("iteration 1/"):
                first = time.perf_counter() - start
            if "start-up" in line:
                breakdown = line.split("start-up", 1)[1].strip()
        if proc.wait():
            sys.exit(f"{' '.join(argv)} failed:\n{''.join(lines[-30:])}")
        print(f"{run:>4} {first:>18.2f} {time.perf_counter() - start:>12.2f}  {breakdown}")
        fastest = first if fastest is None else min(fastest, first)
    print(f"fastest to first step: {fastest:.2f} s")


def imports(argv: list[str], top: int) -> None:
    """Run ``argv`` once under -X importtime; print the ``top`` packages by their modules' own import time."""
    proc = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    rows = [(int(own), len(indent) // 2, name) for own, indent, name in
            re.findall(r"^import time:\s+(\d+) \|\s+\d+ \|( *)(\S+)$", proc.stderr, re.M)]
    own, importer, open_at = collections.Counter(), {}, {}
    for us, depth, name in reversed(rows):  # parents come after their children: walk back to see them first
        open_at[depth] = name
        package = name.split(".")[0]
        own[package] += us
        parent = open_at.get(depth - 1) if depth else "(the command)"
        if parent is not None and parent.split(".")[0] != package:
            importer[package] = parent  # the earliest such line wins, walking backwards: the first import
    print(f"{'package':<24} {'own import s':>12}  first imported by")
    for package, us in own.most_common(top):
        print(f"{package:<24} {us / 1e6:>12.3f}  {importer[package]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--first-step", nargs="+", metavar=("RECIPE", "OVERRIDE"))
    parser.add_argument("--imports", type=int, metavar="N", help="with --first-step: the N slowest packages to import")
    args = parser.parse_args()
    if args.first_step:
        first_step(args.first_step[0], args.first_step[1:], args.repeat)
        if args.imports:
            imports(first_step_argv(args.first_step[0], args.first_step[1:]), args.imports)
        return
    base = median_seconds(COMMANDS["python -c pass"], args.repeat)
    print(f"{'command':<42} {'seconds':>8} {'x python':>9}")
    for name, argv in COMMANDS.items():
        seconds = median_seconds(argv, args.repeat)
        print(f"{name:<42} {seconds:>8.2f} {seconds / base:>9.1f}")


if __name__ == "__main__":
    main()
