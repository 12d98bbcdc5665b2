"""A real `qspec serve` process on loopback for the server tests and bench.serve's test."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m qspec.cli serve` on a free loopback port, up once /health answers."""

    def __init__(self, *args: str, log_path=None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, "-m", "qspec.cli", "serve", "--port", str(self.port), *args],
                                     stdout=self.log, stderr=self.log, env=dict(os.environ))
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"qspec serve exited with {self.proc.returncode}: {self.log_text()}")
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("qspec serve did not answer /health within 180 s")

    def log_text(self) -> str:
        return open(self.log_path).read() if self.log_path else ""

    def request(self, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 60):
        """(status, headers, parsed JSON or raw text)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body)
            conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            raw = r.read().decode()
            try:
                data = json.loads(raw)
            except json.JSONDecodeError:
                data = raw
            return r.status, r.headers, data  # case-insensitive header names
        finally:
            conn.close()

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()
        return self.proc.returncode
