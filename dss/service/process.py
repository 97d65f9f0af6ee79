"""Run ``dss serve`` as a child process on a free loopback port (tests, benchmarks, notebooks).

    with ServiceProcess(home) as service:
        key = service.add_key("acme")
        client = dss.connect(service.url, api_key=key)

:meth:`ServiceProcess.start` returns once ``/healthz`` answers; :meth:`stop` sends SIGTERM
(the service finishes in-flight requests and closes the store) and :meth:`kill` sends
SIGKILL. The child's output goes to ``HOME/serve-<port>.log``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx

from dss.service.apikeys import add_key
from dss.service.config import KEYS_FILE_NAME


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServiceProcess:
    """One ``dss serve`` child process on ``home`` (see the module docstring)."""

    def __init__(
        self,
        home: str | os.PathLike[str],
        *,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 30.0,
    ) -> None:
        self.home = Path(home)
        self.args = args
        self.env = env
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = self.home / "serve.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def keys_file(self) -> Path:
        return self.home / KEYS_FILE_NAME

    def add_key(self, tenant_id: str, *, is_admin: bool = False) -> str:
        """A new API key for ``tenant_id`` (a running service accepts it within a second)."""
        return add_key(self.keys_file, tenant_id, is_admin=is_admin)[0]

    def start(self) -> Self:
        """Start the service and wait until it answers ``/healthz``; raises ``RuntimeError`` if it does not."""
        self.home.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # another process may take the free port first
            self.port = free_port()
            self.log_path = self.home / f"serve-{self.port}.log"
            command = [
                sys.executable,
                "-m",
                "dss",
                "serve",
                "--home",
                str(self.home),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *self.args,
            ]
            env = {**os.environ, **(self.env or {})}
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
            if self._wait_healthy():
                return self
            if self.process.poll() is None:
                self.kill()
                break
        raise RuntimeError(f"dss serve did not start; its log:\n{self.log_path.read_text(errors='replace')[-4000:]}")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then wait for the exit status (SIGKILL after ``timeout_s``)."""
        process = self._running()
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()

    def kill(self) -> int:
        """SIGKILL: the process dies at once, whatever it was doing."""
        process = self._running()
        process.kill()
        return process.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.process is not None and self.process.poll() is None:
            self.stop()

    def _running(self) -> subprocess.Popen[bytes]:
        if self.process is None:
            raise RuntimeError("the service was not started")
        return self.process

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout_s
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        return False
