"""Test runs only: a `python -m bridge_cli ...` or `bridge ...` interpreter hands its run to the test worker's
fork server (tests/forked_cli.py), which has imported torch, megatron-core and bridge already.

Python imports this module at start-up when its folder is on PYTHONPATH (``ForkedCli.hand_off_env``). The
interpreter stays the process its parent started (torchrun, srun, a shell): it sends the server its argv,
environment, working directory, resource limits, umask and standard streams, forwards the signals it
gets to the fork that runs in its place, and exits with that fork's status. If the server cannot stand
for it, or the command is not bridge, the interpreter carries on as a fresh one.
"""

import os
import sys


BRIDGE_MODULES = ("bridge_cli", "tests.integration.pause_before_publish")
"""What ``-m`` may name: bridge, and bridge with a save held open (for a kill -9 inside it)."""


def _bridge_argv() -> list[str] | None:
    """``sys.orig_argv`` less the interpreter, if it runs bridge (-u is all the options it may have)."""
    argv = sys.orig_argv[1:]
    if argv[:1] == ["-u"]:
        argv = argv[1:]
    if (argv[:1] == ["-m"] and argv[1:2] and argv[1] in BRIDGE_MODULES) or (
            argv and not argv[0].startswith("-") and os.path.basename(argv[0]) == "bridge"):
        return argv
    return None


def _hand_off(path: str, argv: list[str]) -> None:
    import json
    import resource
    import signal
    import socket

    limits = ("RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_AS", "RLIMIT_DATA")  # `ulimit -f`, say
    umask = os.umask(0)
    os.umask(umask)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(path)
    message = {"executable": sys.executable, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd(),
               "limits": {name: resource.getrlimit(getattr(resource, name)) for name in limits}, "umask": umask}
    socket.send_fds(conn, [json.dumps(message).encode()], [0, 1, 2])
    reply = json.loads(conn.recv(1 << 16))
    if "fresh" in reply:
        conn.close()
        return
    pid = reply["pid"]

    def forward(number, _frame):
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass  # it has just ended: its status is on the way

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    data = conn.recv(1 << 16)
    if not data:
        print("error: the tests' fork server went away during this run", file=sys.stderr)
        os._exit(1)
    code = json.loads(data)["exit"]
    if code < 0:  # died of a signal: so does this process
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # (those two have no handler to reset)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


_SOCKET = os.environ.get("BRIDGE_TEST_FORK_SOCKET")  # forked_cli.SOCKET_VARIABLE (no import of tests/ here)
_ARGV = _bridge_argv() if _SOCKET else None
if _ARGV is not None:
    _hand_off(_SOCKET, _ARGV)
