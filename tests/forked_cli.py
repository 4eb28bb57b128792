"""A process that imports torch, megatron-core and bridge_cli once, then forks one child per Python run.

A `bridge` process spends about 4 of its first 4.5 s on the CPU machine importing torch and
megatron-core; the suite starts a few hundred of them, and of its own worker scripts. Here each run
is a fork of an interpreter that has done those imports, and composed one recipe (Hydra's plugin
scan), and nothing else (no tensor op, no thread pool, no process group), so the child starts where
a fresh `python ARGV` would be after its imports: it gets the run's argv (`-m MODULE ...` or
`SCRIPT ...`), environment (PYTHONPATH's entries put on sys.path as the interpreter would),
working directory, /dev/null as stdin and its own output files, runs the module or script as
`__main__`, and exits through the interpreter's exit steps (threads joined, atexit handlers run,
streams flushed) with the exit code Python would give. Several children started by one request
form a torchrun-style world: torchrun's environment variables per rank, one thread each unless the
caller set OMP_NUM_THREADS, and, as torchrun does, the others are stopped as soon as one fails.

Only a run whose environment differs from the server's in variables read while it runs (never at
import) can be a fork (`ForkedCli.can_fork`); the caller starts any other as a fresh process, and
so every run where a GPU is visible or BRIDGE_TEST_FRESH_PROCESSES=1 is set. The server reads one
JSON request per line on stdin and writes one JSON reply per line.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# What bridge and the libraries it imports at run time (not at import) read from the environment,
# PYTHONPATH (which the child applies itself), and pytest's name of the test being run, which nothing
# reads. CUDA_VISIBLE_DEVICES is read when CUDA starts, which never happens in the server (no run
# forks where a GPU is visible); XDG_CACHE_HOME and TORCHINDUCTOR_CACHE_DIR when something compiles.
RUN_TIME_VARIABLES = re.compile(
    r"(BRIDGE_|MLFLOW_|COMET_|WANDB_|SLURM_|TORCHELASTIC_).*|RANK|LOCAL_RANK|GROUP_RANK|ROLE_RANK|ROLE_NAME|"
    r"WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_WORLD_SIZE|ROLE_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|OMP_NUM_THREADS|"
    r"CUDA_VISIBLE_DEVICES|PYTHONPATH|PYTEST_CURRENT_TEST|XDG_CACHE_HOME|TORCHINDUCTOR_CACHE_DIR")


class ForkedCli:
    """The test side: one server per test process, started at the first run, restarted if it dies.

    ``env`` is the server's environment: the one runs get, less their own variables."""

    def __init__(self, env: dict[str, str]) -> None:
        self._server: subprocess.Popen | None = None
        self._env = env

    def runs(self, command: list[str], argv: list[str], envs: list[dict[str, str]], timeout: float,
             cwd: Path) -> subprocess.CompletedProcess:
        """Run `python ARGV` once per environment in ``envs`` (one per rank for torchrun); ``command`` is
        what a fresh process would have run, for the result."""
        with tempfile.TemporaryDirectory(prefix="forked-cli-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            request = {"procs": [{"argv": argv, "env": env} for env in envs], "cwd": str(cwd),
                       "stdout": str(out), "stderr": str(err), "timeout": timeout}
            reply = self._ask(request)
            stdout, stderr = (path.read_text(errors="replace") if path.exists() else "" for path in (out, err))
        if reply.get("timed_out"):
            raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(command, reply["returncode"], stdout, stderr)

    def can_fork(self, envs: list[dict[str, str]]) -> bool:
        if os.environ.get("BRIDGE_TEST_FRESH_PROCESSES") == "1" or _gpu_visible():
            return False
        return all(RUN_TIME_VARIABLES.fullmatch(key)
                   for env in envs for key in set(env) | set(self._env) if env.get(key) != self._env.get(key))

    def _ask(self, request: dict) -> dict:
        if self._server is None or self._server.poll() is not None:
            self._start()
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        line = self._server.stdout.readline()
        if not line:
            raise RuntimeError(f"the forked-CLI server died (exit {self._server.wait()})")
        return json.loads(line)

    def _start(self) -> None:
        self._server = subprocess.Popen([sys.executable, "-m", "tests.forked_cli"], cwd=REPO, env=self._env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        if self._server.stdout.readline() != "ready\n":
            raise RuntimeError(f"the forked-CLI server did not start (exit {self._server.wait()})")

    def close(self) -> None:
        """Stop the server (it holds no run: each request waits for its children)."""
        if self._server is not None and self._server.poll() is None:
            self._server.kill()
            self._server.wait()


@functools.cache
def _gpu_visible() -> bool:
    """Where a GPU is visible the runs start fresh: CUDA, once its driver is initialised, does not
    survive a fork, and megatron-core's import may initialise it."""
    import torch

    return torch.cuda.is_available()


def main() -> None:
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints of the imports below go where the caller's stderr goes, not into replies
    from bridge_cli.runtime.mcore_import import import_megatron_core

    import_megatron_core()  # as a training run imports it: fused kernels bound to torch.compile
    # what training and conversion runs import on their way (Hydra, checkpoints, models, data, the HF importer)
    import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401 - the point of this process
    import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401

    import bridge_cli.checkpoint.load  # noqa: F401
    import bridge_cli.checkpoint.save  # noqa: F401
    import bridge_cli.cli.app  # noqa: F401
    import bridge_cli.convert.hf_import  # noqa: F401
    import bridge_cli.data.builders  # noqa: F401
    import bridge_cli.logging.reports  # noqa: F401
    import bridge_cli.models.gpt_model  # noqa: F401
    import bridge_cli.runtime.distributed  # noqa: F401
    import bridge_cli.training.pretrain  # noqa: F401
    from bridge_cli.config.compose import compose

    compose("tiny", [])  # Hydra's first compose imports its plugins and scans for more: once, here

    print("ready", file=reply, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        print(json.dumps(serve(request)), file=reply, flush=True)


def serve(request: dict) -> dict:
    """Start every process of ``request``, wait for all, stop the rest when one fails or time runs out."""
    sys.stdout.flush()
    sys.stderr.flush()
    children = [fork(proc, request) for proc in request["procs"]]
    deadline = time.monotonic() + request["timeout"]
    codes: dict[int, int] = {}
    while len(codes) < len(children):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0:
                stop(children, codes, signal.SIGTERM, grace=5.0)
            continue
        if time.monotonic() > deadline:
            stop(children, codes, signal.SIGKILL, grace=5.0)
            return {"timed_out": True}
        time.sleep(0.01)
    results = [codes[pid] for pid in children]
    if len(results) == 1:
        return {"returncode": results[0]}
    return {"returncode": 0 if all(code == 0 for code in results) else 1}  # torchrun's own exit code


def stop(children: list[int], codes: dict[int, int], sig: int, grace: float) -> None:
    """Signal each child still running (and its process group), then reap; SIGKILL what outlives ``grace``."""
    for pid in children:
        if pid not in codes:
            _kill_group(pid, sig)
    deadline = time.monotonic() + grace
    while len(codes) < len(children):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
        elif time.monotonic() > deadline:
            for other in children:
                if other not in codes:
                    _kill_group(other, signal.SIGKILL)
            deadline = float("inf")
        else:
            time.sleep(0.01)


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def fork(proc: dict, request: dict) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setpgid(0, 0)
        code = run_child(proc, request)
    except BaseException:  # noqa: BLE001 - the child must never return into the server's loop
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def run_child(proc: dict, request: dict) -> int:
    """What `python ARGV` does after its imports, in this forked process."""
    import atexit
    import runpy
    import threading
    import traceback

    devnull = os.open(os.devnull, os.O_RDONLY)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    os.dup2(devnull, 0)
    os.dup2(os.open(request["stdout"], flags, 0o644), 1)
    os.dup2(os.open(request["stderr"], flags, 0o644), 2)
    os.chdir(request["cwd"])
    server_path = os.environ.get("PYTHONPATH", "")
    os.environ.clear()
    os.environ.update(proc["env"])
    if "OMP_NUM_THREADS" in proc["env"]:
        # OpenMP read the variable when this interpreter loaded it; set what it would have read.
        import torch

        torch.set_num_threads(int(proc["env"]["OMP_NUM_THREADS"]))
    argv = proc["argv"]
    # as the interpreter starts: the working directory (-m) or the script's folder first, then PYTHONPATH
    sys.path[0] = os.getcwd() if argv[0] == "-m" else os.path.dirname(os.path.abspath(argv[0]))
    if os.environ.get("PYTHONPATH", "") != server_path:
        sys.path[1:1] = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = ["-m", *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


if __name__ == "__main__":
    main()
