"""Start and stop a local Mooncake store: a ``mooncake_master`` (with its embedded HTTP metadata
server) and a ``mooncake_client`` segment holder, on free 127.0.0.1 ports.

Used by ``hicache-draft mooncake up``, the pytest fixture ``mooncake_service``, the benchmark and
any test that needs a real store. Every wait is bounded; processes are stopped by pid (SIGTERM,
then SIGKILL after a bound). Logs go to files in a work directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

HOST = "127.0.0.1"
READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 5.0


class ServiceError(RuntimeError):
    """A Mooncake process failed to start; the message names the process, its log and the tail."""


def mooncake_binary(name: str) -> Path:
    """Path of a binary shipped inside the installed ``mooncake`` package (found without importing it)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise ServiceError(
            "the 'mooncake' package is not installed; install 'hicache-draft-mooncake[cpu]' "
            "(CPU machines, needs Debian's libibverbs1) or 'hicache-draft-mooncake[cuda]'"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / name
        if path.is_file():
            return path
    raise ServiceError(f"the installed 'mooncake' package ships no {name!r} binary")


def free_ports(n: int, host: str = HOST) -> list[int]:
    """``n`` distinct ports that are free on ``host`` right now."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_open(port: int, host: str = HOST, timeout: float = 0.2) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def mooncake_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a Mooncake process on loopback (``MC_TCP_BIND_ADDRESS=127.0.0.1``, quiet logs)."""
    env = dict(os.environ if base is None else base)
    env["MC_TCP_BIND_ADDRESS"] = HOST
    env.setdefault("MC_LOG_LEVEL", "WARNING")
    return env


@dataclass
class ManagedProcess:
    """One started process, its log file, and how to stop it by pid."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes] = field(repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, nbytes: int = 2000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-nbytes:].decode(errors="replace")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM by pid, SIGKILL if still alive after ``timeout_s``; always reaps it."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
                os.kill(self.pid, signal.SIGCONT)  # a stopped (frozen) process only sees SIGTERM once resumed
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                self.popen.wait(timeout=timeout_s)
        self.log_file.close()

    def freeze(self) -> None:
        """SIGSTOP by pid: the process keeps its ports (the kernel still accepts connections) but
        answers nothing (failure tests). Returns once the kernel reports it stopped (bounded)."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                return
            if state in ("T", "t"):
                return
            time.sleep(0.01)

    def thaw(self) -> None:
        """SIGCONT by pid."""
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL by pid (failure tests)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.popen.wait(timeout=STOP_TIMEOUT_S)


_DUPLICATE_NAME = re.compile(r"PUT (http://\S+) http=400 body: Duplicate rpc_meta key not allowed")


def stale_name(log: str, metadata_server: str) -> str | None:
    """The metadata URL a holder's log says it could not claim because a dead holder's name holds
    it (the last such line), if that URL is on ``metadata_server``; else None."""
    found = _DUPLICATE_NAME.findall(log)
    if not found or not found[-1].startswith(metadata_server + "?"):
        return None
    return found[-1]


def remove_name(url: str) -> bool:
    """DELETE one name from the metadata server (bounded); whether it is gone."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="DELETE"), timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _start(name: str, argv: list[str], workdir: Path, env: dict[str, str]) -> ManagedProcess:
    log_path = workdir / f"{name}.log"
    log_file = open(log_path, "ab")  # noqa: SIM115 (closed by ManagedProcess.stop)
    popen = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    return ManagedProcess(name, popen, log_path, log_file)


def _wait_listening(proc: ManagedProcess, ports: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if not proc.alive():
            raise ServiceError(
                f"{proc.name} exited with code {proc.popen.returncode} before listening; "
                f"log {proc.log_path}:\n{proc.log_tail()}"
            )
        if all(port_open(p) for p in ports):
            return
        if time.monotonic() > deadline:
            raise ServiceError(
                f"{proc.name} (pid {proc.pid}) did not listen on 127.0.0.1 port(s) {ports} within "
                f"{timeout_s:.0f}s; log {proc.log_path}:\n{proc.log_tail()}"
            )
        time.sleep(0.05)


@dataclass
class MooncakeService:
    """A local master plus segment holder. Build with :meth:`start`; stop with :meth:`stop`.

    ``rpc_port``/``http_port``/``metrics_port``: the master's; ``client_port``: the segment
    holder's service port (what a shared-memory client connects to).
    """

    workdir: Path
    rpc_port: int
    http_port: int
    metrics_port: int
    client_port: int
    segment_size: int
    lease_ttl_ms: int = 500
    client_ttl_s: int | None = None
    master: ManagedProcess | None = None
    holder: ManagedProcess | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    # -- addresses -------------------------------------------------------------------------
    @property
    def master_address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{HOST}:{self.http_port}/metadata"

    @property
    def holder_address(self) -> str:
        return f"{HOST}:{self.client_port}"

    def backend_options(self, shm: bool = False) -> dict[str, object]:
        """``[backend_options]`` for the ``mooncake`` backend against this store."""
        opts: dict[str, object] = {
            "master_server_address": self.master_address,
            "metadata_server": self.metadata_server,
            "local_hostname": HOST,
            "protocol": "tcp",
        }
        if shm:
            opts["shm_client_address"] = self.holder_address
        return opts

    # -- lifecycle -------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        workdir: str | os.PathLike[str] | None = None,
        segment_size: int = 1 << 30,
        lease_ttl_ms: int = 500,
        timeout_s: float = READY_TIMEOUT_S,
        client_ttl_s: int | None = None,
    ) -> MooncakeService:
        """Start master then holder on free ports, and wait (bounded) until both listen.

        ``client_ttl_s``: the master's ``--client_ttl`` (default 10 s): how long a dead holder's
        segment stays mounted (puts placed on it fail with TRANSFER_FAIL until then)."""
        tmp = None
        if workdir is None:
            tmp = tempfile.TemporaryDirectory(prefix="hicache-draft-mooncake-")
            workdir = tmp.name
        rpc, http, metrics, client = free_ports(4)
        svc = cls(Path(workdir), rpc, http, metrics, client, segment_size, lease_ttl_ms, client_ttl_s, _tmp=tmp)
        svc.workdir.mkdir(parents=True, exist_ok=True)
        try:
            svc.start_master(timeout_s)
            svc.start_holder(timeout_s)
        except BaseException:
            svc.stop()
            raise
        return svc

    def start_master(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """(Re)start the master on this service's ports."""
        argv = [
            str(mooncake_binary("mooncake_master")),
            f"--rpc_port={self.rpc_port}",
            f"--rpc_address={HOST}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={HOST}",
            f"--http_metadata_server_port={self.http_port}",
            f"--metrics_host={HOST}",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            "--logtostderr=true",
        ]
        if self.client_ttl_s is not None:
            argv.append(f"--client_ttl={self.client_ttl_s}")
        self.master = _start("mooncake_master", argv, self.workdir, mooncake_env())
        _wait_listening(self.master, [self.rpc_port, self.http_port], timeout_s)

    def start_holder(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """(Re)start the ``mooncake_client`` segment holder.

        A holder that was killed (SIGKILL: it never took its name back) leaves its transfer
        engine's address in the metadata server, and a new holder whose engine happens to get the
        same port then refuses to start ("Duplicate rpc_meta key not allowed"). That name is stale
        (the port is the new holder's now), so it is removed and the start tried again, at most
        twice (seen once in CI: the restart of a killed holder failed that way)."""
        argv = [
            str(mooncake_binary("mooncake_client")),
            f"--host={HOST}",
            f"--port={self.client_port}",
            f"--global_segment_size={self.segment_size}",
            "--local_buffer_size=0",
            f"--master_server_address={self.master_address}",
            f"--metadata_server={self.metadata_server}",
            "--protocol=tcp",
            "--logtostderr=true",
        ]
        for attempt in range(3):
            self.holder = _start("mooncake_client", argv, self.workdir, mooncake_env())
            try:
                _wait_listening(self.holder, [self.client_port], timeout_s)
                return
            except ServiceError:
                stale = None if self.holder.alive() else stale_name(self.holder.log_tail(), self.metadata_server)
                if stale is None or attempt == 2 or not remove_name(stale):
                    raise
                self.holder.stop()  # exited: reaped, its log closed

    def stop(self) -> None:
        """Stop the holder, then the master, by pid. Idempotent."""
        for proc in (self.holder, self.master):
            if proc is not None:
                proc.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> MooncakeService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_service(**kwargs: object) -> Iterator[MooncakeService]:
    """``with running_service() as svc:`` a started store, stopped on exit."""
    svc = MooncakeService.start(**kwargs)  # type: ignore[arg-type]
    try:
        yield svc
    finally:
        svc.stop()
