"""Run the ``kvblocks`` command line in a new process, as a user would (tracebacks included).

Every run is a process of its own, started afresh and gone when it exits: nothing of one
run survives into the next (the tier tests' restarts are real). What the runs do not
repeat is the interpreter's start-up: each is forked from a parent process (one per pytest
worker, started on first use) that has imported torch and kvblocks' command line once and
done nothing else, and runs ``python -m kvblocks.cli ARGV`` as ``python`` would, from
``runpy`` to the interpreter's own exit (``atexit`` handlers, non-daemon threads joined,
streams flushed, an uncaught exception's traceback and status 1). torch's import is most
of a short run's CPU time (about 2 of 3 s), and the tier tests run the CLI some twenty times.

A forked child keeps its parent's string-hash secret (CPython draws it at start-up), which
would hide a value that depends on it from a test that writes in one run and reads in the
next (a real restart draws another). So there are two parents, started with different
``PYTHONHASHSEED`` values, and the runs alternate between them: consecutive runs never
share a hash secret.

A parent forks only while its only threads besides the main one are the BLAS pool that
importing numpy starts (OpenBLAS stops it in its own ``pthread_atfork`` handler): a fork of
a process with any other thread could inherit a lock that thread held. Otherwise, or on
any failure to start it, every run is a plain ``subprocess.run``, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
from typing import NoReturn

TIMEOUT_S = 120

# The forking parent. Its loop forks one child per request line (argv, cwd, output files)
# and answers with the child's pid, then its exit status. The child leaves the loop and
# runs the command line as the main module, so the interpreter exits it as it exits any
# ``python -m``.
_PARENT = r"""
import json, os, runpy, sys
def threads():
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1
import numpy  # noqa: F401
pool = threads()  # OpenBLAS' workers, which its own pthread_atfork handler stops for a fork
import torch  # noqa: F401  (the import the children share)
import kvblocks.cli, kvblocks.cli.generate, kvblocks.engine  # noqa: F401, E401
ready = pool > 0 and threads() == pool
print(json.dumps({"ready": ready, "threads": threads(), "blas": pool}), flush=True)
if not ready:
    sys.exit(0)
while True:
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        break
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                        (1, request["stdout"], os.O_WRONLY | os.O_TRUNC),
                        (2, request["stderr"], os.O_WRONLY | os.O_TRUNC)):
    target = os.open(path, flags)
    os.dup2(target, fd)
    os.close(target)
sys.argv = ["-m", *request["argv"]]
sys.path[0] = os.getcwd()  # what ``python -m`` puts first
runpy.run_module("kvblocks.cli", run_name="__main__", alter_sys=True)
"""


class _Forker:
    """A forking parent of this process, started on first use with its own hash seed."""

    def __init__(self, hash_seed: int) -> None:
        self.hash_seed = hash_seed
        self.proc: subprocess.Popen[str] | None = None
        self.usable = True
        self.lock = threading.Lock()

    def _start(self) -> subprocess.Popen[str] | None:
        if self.proc is not None or not self.usable:
            return self.proc
        proc = subprocess.Popen(
            [sys.executable, "-c", _PARENT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": str(self.hash_seed)},
        )
        assert proc.stdout is not None
        hello = proc.stdout.readline()
        try:
            ready = bool(json.loads(hello)["ready"])
        except (ValueError, KeyError, TypeError):
            ready = False
        if not ready:
            proc.kill()
            proc.wait()
            self.usable = False
            return None
        self.proc = proc
        atexit.register(self.close)
        return proc

    def close(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # it has exited already
                self.proc.stdin.close()
            self.proc.wait(timeout=30)
            self.proc = None

    def _reply(self, proc: subprocess.Popen[str], key: str) -> int:
        """The parent's next answer; a parent that died (its pipe closed) is not used again
        and the test fails saying so, rather than on an empty JSON document."""
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            self._dead(proc)
        return int(json.loads(line)[key])

    def _dead(self, proc: subprocess.Popen[str]) -> NoReturn:
        self.proc, self.usable = None, False
        raise RuntimeError(f"the CLI's forking parent exited (status {proc.wait()})")

    def run(self, argv: list[str]) -> subprocess.CompletedProcess[str] | None:
        """``argv`` run in a forked child; ``None`` when no parent could be started."""
        with self.lock:
            proc = self._start()
            if proc is None:
                return None
            assert proc.stdin is not None and proc.stdout is not None
            with tempfile.TemporaryDirectory() as tmp:
                out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
                for path in (out, err):
                    open(path, "w").close()
                request = {
                    "argv": argv,
                    "cwd": os.getcwd(),
                    "env": dict(os.environ),
                    "stdout": out,
                    "stderr": err,
                }
                try:
                    proc.stdin.write(json.dumps(request) + "\n")
                    proc.stdin.flush()
                except BrokenPipeError:
                    self._dead(proc)
                pid = self._reply(proc, "pid")
                expired = threading.Event()

                def kill(pid: int = pid) -> None:
                    expired.set()
                    os.kill(pid, signal.SIGKILL)

                timer = threading.Timer(TIMEOUT_S, kill)
                timer.start()
                try:
                    returncode = self._reply(proc, "returncode")
                finally:
                    timer.cancel()
                with open(out) as f_out, open(err) as f_err:
                    stdout, stderr = f_out.read(), f_err.read()
            if expired.is_set():
                raise subprocess.TimeoutExpired(argv, TIMEOUT_S, stdout, stderr)
            return subprocess.CompletedProcess(argv, returncode, stdout, stderr)


_FIRST_SEED = random.SystemRandom().randrange(1, 2**31)
_FORKERS = (_Forker(_FIRST_SEED), _Forker(_FIRST_SEED + 1))
_runs = itertools.count()


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m kvblocks.cli ARGV`` in a new process, output captured as text."""
    done = _FORKERS[next(_runs) % 2].run(list(argv))
    if done is not None:
        return done
    return subprocess.run(
        [sys.executable, "-m", "kvblocks.cli", *argv],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
