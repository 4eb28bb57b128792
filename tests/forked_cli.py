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

Bridge processes that are not started through a request (torchrun's workers, the `bridge` of a README
command or a Slurm template, the conversion a training run starts, a run a test signals) are real
interpreters that hand their run over at start-up (tests/fork_shim/sitecustomize.py, on the PYTHONPATH
that `ForkedCli.hand_off_env` gives): they send their argv, environment, working directory, resource
limits and standard streams to the server's socket, the server forks the run with those streams, and
the interpreter forwards the signals it gets to that fork and exits with its exit status; if the
interpreter is SIGKILLed, the server SIGKILLs the fork at once. Where the server cannot stand for the
process (its environment differs in a variable read at import, say) the interpreter carries on as a
fresh one.
"""

from __future__ import annotations

import functools
import json
import os
import re
import selectors
import signal
import socket
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
# TORCH_LOGS is read at torch's import; a fork whose value differs sets torch's logging up again (run_as_main).
# FT_* are the sockets ft_launcher gives a worker to reach its rank monitor (runtime/fault_tolerance.py).
RUN_TIME_VARIABLES = re.compile(
    r"(BRIDGE_|MLFLOW_|COMET_|WANDB_|SLURM_|TORCHELASTIC_|FT_).*|RANK|LOCAL_RANK|GROUP_RANK|ROLE_RANK|ROLE_NAME|"
    r"WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_WORLD_SIZE|ROLE_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|OMP_NUM_THREADS|"
    r"CUDA_VISIBLE_DEVICES|PYTHONPATH|PYTEST_CURRENT_TEST|XDG_CACHE_HOME|TORCHINDUCTOR_CACHE_DIR|TORCH_LOGS|"
    # what torchrun's agent adds to a worker's environment, the shell that starts one, the Slurm templates'
    # own variables (scripts/slurm) and the stand-ins for Slurm's commands that a test puts on PATH
    r"TORCH_NCCL_ASYNC_ERROR_HANDLING|NCCL_ASYNC_ERROR_HANDLING|CUDA_DEVICE_MAX_CONNECTIONS|PWD|OLDPWD|SHLVL|_|"
    r"PATH|EXIT_MINUTES|GPUS_PER_NODE|LOG_DIR|PYTHON|RDZV_PORT|REQUEUED|"
    # megatron-core sets these when it builds a model (so the conversion a training run starts inherits them)
    # and reads them when it builds one
    r"NVTE_FLASH_ATTN|NVTE_FUSED_ATTN|NVTE_UNFUSED_ATTN")
SOCKET_VARIABLE = "BRIDGE_TEST_FORK_SOCKET"
SHIM = Path(__file__).resolve().parent / "fork_shim"


def import_time_differences(env: dict[str, str], base: dict[str, str]) -> list[str]:
    """The variables that keep a fork of a process started with ``base`` from standing for one started with
    ``env``: those whose values differ, less the ones read only at run time."""
    return sorted(key for key in set(env) | set(base)
                  if env.get(key) != base.get(key) and not RUN_TIME_VARIABLES.fullmatch(key))


class ForkedCli:
    """The test side: one server per test process, started at the first run, restarted if it dies.

    ``env`` is the server's environment: the one runs get, less their own variables."""

    def __init__(self, env: dict[str, str]) -> None:
        self._server: subprocess.Popen | None = None
        self._env = env
        self._folder = tempfile.TemporaryDirectory(prefix="forked-cli-")
        self._socket = os.path.join(self._folder.name, "socket")

    def hand_off_env(self) -> dict[str, str]:
        """What a process's environment needs for its interpreter to hand the run to the server (none
        where runs cannot be forks)."""
        if not self.can_fork([self._env]):
            return {}
        if self._server is None or self._server.poll() is not None:
            self._start()
        path = self._env.get("PYTHONPATH")
        return {SOCKET_VARIABLE: self._socket, "PYTHONPATH": os.pathsep.join([str(SHIM), *([path] if path else [])])}

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
        return not any(import_time_differences(env, self._env) for env in envs)

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
        if os.path.exists(self._socket):
            os.unlink(self._socket)  # a server that died left it
        self._server = subprocess.Popen([sys.executable, "-m", "tests.forked_cli"], cwd=REPO, text=True,
                                        env={**self._env, SOCKET_VARIABLE: self._socket},
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        if self._server.stdout.readline() != "ready\n":
            raise RuntimeError(f"the forked-CLI server did not start (exit {self._server.wait()})")

    def close(self) -> None:
        """Stop the server (it holds no run: each request waits for its children)."""
        if self._server is not None and self._server.poll() is None:
            self._server.kill()
            self._server.wait()
        self._folder.cleanup()


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

    import_megatron_core()  # as every command imports it: fused kernels compiled at their first call
    # what training and conversion runs import on their way (Hydra, checkpoints, models, data, the HF importer,
    # inductor for the runs that compile)
    import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401 - the point of this process
    import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

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

    server = Server(reply)
    print("ready", file=reply, flush=True)
    server.loop()


class Server:
    """One loop over the test's requests (stdin) and the handed-over processes (the socket)."""

    def __init__(self, reply) -> None:
        self.reply = reply
        self.env = dict(os.environ)
        self.selector = selectors.DefaultSelector()
        self.selector.register(sys.stdin, selectors.EVENT_READ)
        self.listener = None
        if os.environ.get(SOCKET_VARIABLE):
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self.listener.bind(os.environ[SOCKET_VARIABLE])
            self.listener.listen(64)
            self.selector.register(self.listener, selectors.EVENT_READ)
        self.request: dict | None = None  # the test's request being served: its children, exit codes, deadline
        self.handed: dict[int, socket.socket] = {}  # each handed-over run's fork -> its interpreter's connection

    def loop(self) -> None:
        while True:
            for key, _ in self.selector.select(timeout=0.01):
                if key.fileobj is self.listener:
                    self.take_over(self.listener.accept()[0])
                elif key.fileobj is sys.stdin:
                    line = sys.stdin.readline()
                    if not line:
                        return
                    self.start(json.loads(line))
                elif not key.fileobj.recv(1):  # the interpreter is gone (kill -9): so goes its run, now
                    _kill_group(key.data, signal.SIGKILL)
                    os.waitpid(key.data, 0)  # before any later run starts: a zombie would still hold its lock
                    self.selector.unregister(key.fileobj)
                    self.handed.pop(key.data).close()
            self.reap()

    def start(self, request: dict) -> None:
        """Start every process of the test's ``request``; ``reap`` replies once all have ended."""
        sys.stdout.flush()
        sys.stderr.flush()
        children = [self.fork(lambda proc=proc: _child_of_request(proc, request, self.env))
                    for proc in request["procs"]]
        self.request = {"children": children, "codes": {}, "deadline": time.monotonic() + request["timeout"]}

    def take_over(self, conn: socket.socket) -> None:
        """Fork the run of the interpreter at the other end of ``conn``, or tell it to carry on itself."""
        conn.settimeout(30)  # it sends as soon as it connects; one that died in between must not stop the loop
        try:
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        except OSError:
            conn.close()
            return
        handed = json.loads(message)
        reason = self.cannot_stand_for(handed)
        if reason or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            conn.send(json.dumps({"fresh": reason or "no standard streams"}).encode())
            conn.close()
            return
        pid = self.fork(lambda: _child_of_hand_off(handed, fds, self.env))
        for fd in fds:
            os.close(fd)
        conn.send(json.dumps({"pid": pid}).encode())
        self.handed[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def cannot_stand_for(self, handed: dict) -> str | None:
        if os.path.realpath(handed["executable"]) != os.path.realpath(sys.executable):
            return f"another interpreter ({handed['executable']})"
        differ = import_time_differences(handed["env"], self.env)
        return f"its environment differs in {', '.join(differ)}" if differ else None

    def fork(self, child) -> int:
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            os.setpgid(0, 0)
            self.selector.close()
            for conn in [self.listener, *self.handed.values()]:
                if conn is not None:
                    conn.close()
            code = child()
        except BaseException:  # noqa: BLE001 - the child must never return into the server's loop
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)

    def reap(self) -> None:
        for pid in list(self.handed):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                conn = self.handed.pop(pid)
                self.selector.unregister(conn)
                try:
                    conn.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass  # the interpreter died as its run ended
                conn.close()
        if self.request is None:
            return
        children, codes = self.request["children"], self.request["codes"]
        _collect(children, codes)
        if any(code != 0 for code in codes.values()) and len(codes) < len(children):
            stop(children, codes, signal.SIGTERM, grace=5.0)  # as torchrun does when one rank fails
        if len(codes) == len(children):
            results = [codes[pid] for pid in children]
            code = results[0] if len(results) == 1 else int(any(results))  # torchrun's own exit code
            self._answer({"returncode": code})
        elif time.monotonic() > self.request["deadline"]:
            stop(children, codes, signal.SIGKILL, grace=5.0)
            self._answer({"timed_out": True})

    def _answer(self, reply: dict) -> None:
        self.request = None
        print(json.dumps(reply), file=self.reply, flush=True)


def _collect(children: list[int], codes: dict[int, int]) -> None:
    for pid in children:
        if pid not in codes:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)


def stop(children: list[int], codes: dict[int, int], sig: int, grace: float) -> None:
    """Signal each child still running (and its process group), then reap; SIGKILL what outlives ``grace``."""
    for pid in children:
        if pid not in codes:
            _kill_group(pid, sig)
    deadline = time.monotonic() + grace
    while True:
        _collect(children, codes)
        if len(codes) == len(children):
            return
        if time.monotonic() > deadline:
            for other in children:
                if other not in codes:
                    _kill_group(other, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.01)


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _child_of_request(proc: dict, request: dict, server_env: dict[str, str]) -> int:
    """A process of the test's request: /dev/null as stdin, the request's output files."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    stdio = [os.open(os.devnull, os.O_RDONLY), os.open(request["stdout"], flags, 0o644),
             os.open(request["stderr"], flags, 0o644)]
    return run_as_main(proc["argv"], proc["env"], request["cwd"], stdio, server_env)


def _child_of_hand_off(handed: dict, stdio: list[int], server_env: dict[str, str]) -> int:
    """A handed-over run: the interpreter's standard streams, resource limits and umask."""
    import resource

    for name, limits in handed["limits"].items():
        if resource.getrlimit(getattr(resource, name)) != tuple(limits):
            resource.setrlimit(getattr(resource, name), tuple(limits))
    os.umask(handed["umask"])
    return run_as_main(handed["argv"], handed["env"], handed["cwd"], stdio, server_env)


def run_as_main(argv: list[str], env: dict[str, str], cwd: str, stdio: list[int], server_env: dict[str, str]) -> int:
    """What `python ARGV` does after its imports, in this forked process."""
    import atexit
    import runpy
    import threading
    import traceback

    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:
        # OpenMP read the variable when this interpreter loaded it; set what it would have read.
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if env.get("TORCH_LOGS") != server_env.get("TORCH_LOGS"):
        import torch._logging._internal

        torch._logging._internal._init_logs()  # what torch's import does with the variable
    # as the interpreter starts: the working directory (-m) or the script's folder first, then PYTHONPATH
    sys.path[0] = os.getcwd() if argv[0] == "-m" else os.path.dirname(os.path.abspath(argv[0]))
    if env.get("PYTHONPATH", "") != server_env.get("PYTHONPATH", ""):
        sys.path[1:1] = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
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
