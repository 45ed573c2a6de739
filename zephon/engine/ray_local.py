"""A Ray head on this machine, in a session of its own: for the tests, the benchmarks, and for trying the
Ray runners on one machine before pointing them at a real cluster.

:class:`LocalRayCluster` runs ``ray start --head --block`` as a child in a new session, on free ports,
with its own temporary directory, and stops it by its process group. It never runs ``ray stop``: that
command kills every Ray process of the machine, other people's clusters included.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping


PORT_CLASH = "is trying to use a port number"  # Ray's refusal when two of its components share a port


def free_port() -> int:
    """A TCP port nobody listens on right now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections at ``host:port`` (refused or silent: False)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def ray_command() -> list[str]:
    """Ray's command line run by this interpreter (``python -m ray.scripts.scripts``, what the ``ray``
    script runs). Not a ``ray`` found on ``PATH``: that may belong to another Python (a virtual environment's
    python run without activating it), and Ray refuses a driver whose Python differs from the head's."""
    return [sys.executable, "-m", "ray.scripts.scripts"]


class LocalRayCluster:
    """``ray start --head`` with ``num_cpus`` logical CPUs on 127.0.0.1; ``address`` is for ``address=``.

    ``env`` adds to the head's environment, which its workers inherit (e.g. ``PYTHONPATH`` so that
    they import the functions of a test module). Use as a context manager, or ``start()``/``stop()``.
    """

    def __init__(self, num_cpus: int = 2, object_store_mb: int = 256, env: Mapping[str, str] | None = None) -> None:
        self.num_cpus, self.object_store_mb = num_cpus, object_store_mb
        self.env = dict(env or {})
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        # short: Ray puts Unix sockets under it, and a socket path has at most 107 bytes
        self.temp_dir = tempfile.mkdtemp(prefix="zr", dir="/tmp")
        self.log_path = Path(self.temp_dir) / "head.log"
        self.started_in_s = 0.0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0, attempts: int = 3) -> "LocalRayCluster":
        """Start the head and wait until it accepts drivers. Ray refuses to start when two of its components
        were given the same port, and it picks some ports itself: a clash with the kernel's picks below
        is rare but real, so the head is started again on other ports (up to ``attempts`` times)."""
        for attempt in range(attempts):
            try:
                return self._start_once(timeout_s)
            except RuntimeError as exc:
                if attempt + 1 == attempts or PORT_CLASH not in str(exc):
                    raise
                self.kill()  # whatever of that attempt's process group is left
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start_once(self, timeout_s: float) -> "LocalRayCluster":
        # the ports Ray would otherwise take at fixed defaults (10001, 52365, ...) are free ones, so that two
        # heads (two tests', or another user's) never fight over them. (Not the dashboard agent's gRPC port:
        # Ray picks that one itself, and the metrics exporter fails to connect when it is given.)
        flags = ("--ray-client-server-port", "--dashboard-agent-listen-port", "--runtime-env-agent-port",
                 "--metrics-export-port", "--node-manager-port", "--object-manager-port")
        taken = {self.port}
        ports = {}
        for flag in flags:  # distinct: the kernel may hand out a port again once it is closed
            port = free_port()
            while port in taken:
                port = free_port()
            taken.add(port)
            ports[flag] = port
        cmd = [*ray_command(), "start", "--head", "--block", f"--port={self.port}", f"--num-cpus={self.num_cpus}",
               "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={self.temp_dir}",
               f"--object-store-memory={self.object_store_mb << 20}"] + [f"{k}={v}" for k, v in ports.items()]
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **self.env}
        env.pop("RAY_ADDRESS", None)  # `ray start --head` must not try to join another cluster
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        # the head is in a session of its own, so it would outlive a program that fails before stop()
        atexit.unregister(self.stop)  # once, whatever the attempts
        atexit.register(self.stop)
        deadline = t0 + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`ray start --head` exited with code {self.proc.returncode}:\n{self.log_tail()}")
            if b"Ray runtime started" in self.log_path.read_bytes() and port_open("127.0.0.1", self.port):
                self.started_in_s = time.perf_counter() - t0
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the local Ray head did not start within {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL every process of the head's session at once: the cluster is lost, as when its node dies."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)  # type: ignore[union-attr]
            return True
        except ProcessLookupError:
            return False

    def _disconnect(self) -> None:
        """Close this process's Ray connection if it is to this head: a driver left connected to a stopped
        head waits for it at exit (and Ray's client logs that it will end the process)."""
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            return
        try:
            gcs = ray.get_runtime_context().gcs_address or ""
        except Exception:  # noqa: BLE001 - a half-closed connection: leave it to Ray
            return
        if gcs.rpartition(":")[2] == str(self.port):
            from .ray_executor import disconnect

            disconnect()

    def stop(self, timeout_s: float = 20.0) -> None:
        """Disconnect this process from the head, stop the head (``ray start --block`` stops what it
        started on SIGTERM), then SIGKILL whatever of its process group is left; remove its temporary
        directory."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self._disconnect()
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    pass
            deadline = time.monotonic() + 5
            while self._group_alive() and time.monotonic() < deadline:
                time.sleep(0.2)
            if self._group_alive():
                self.kill()
            if self.proc.poll() is None:
                self.proc.wait(timeout=10)
            self.proc = None
            atexit.unregister(self.stop)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "LocalRayCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
