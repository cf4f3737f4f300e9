"""A fleet on one machine: N `numba-vllm serve` replicas behind vLLM's router, started and stopped as one.

    numba-vllm fleet --gpus 0,1 -- --model DIR --backend cuda      # one replica per GPU
    numba-vllm fleet --replicas 2 -- --model DIR --backend numpy   # two CPU processes

Replica i is `numba-vllm serve SERVE_ARGS --host 127.0.0.1 --port WORKER_PORT+i`, with
`CUDA_VISIBLE_DEVICES` set to the i-th of `--gpus` when given. Once every replica answers
`GET /health` with 200, the router starts (`vllm-router`, the `fleet` extra) with their URLs, a
prefix-aware policy (`cache_aware` by default: requests sharing a prefix go to the replica that
served it, unless the load is uneven) and its health checks on `/health`; clients talk to the router
only, with the same OpenAI API. The fleet is up when the router's `/readiness` answers 200.

Children run in their own sessions, so a Ctrl-C in the terminal reaches the fleet alone, which then
stops them in order: the replicas first (SIGTERM: each stops admitting, turns `/health` to 503 and
finishes what runs, as `serve` does), then the router, which went on relaying their last answers.
A second Ctrl-C or SIGTERM kills everything at once. A replica that dies while the fleet runs is
reported and left dead (the router routes around it); the fleet ends when its router does. Every
child's output is copied to the fleet's stderr, each line prefixed with `[replica i]` or `[router]`
(or to `--log-dir/replica-i.log` and `router.log`).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

ROUTER_MODULE = "vllm_router"  # PyPI: vllm-router, the `fleet` extra
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "consistent_hash")
OWN_SERVE_OPTIONS = ("--host", "--port")  # the fleet sets these for each replica


class FleetError(RuntimeError):
    """The fleet could not start: a replica or the router exited or did not become ready in time."""


@dataclass
class FleetSpec:
    """What to start. `serve_args` are `numba-vllm serve` options, minus --host and --port."""

    serve_args: Sequence[str]
    replicas: int = 1
    gpus: Sequence[str] | None = None  # CUDA_VISIBLE_DEVICES of each replica; its length is the replica count
    host: str = "127.0.0.1"  # the router's address (0.0.0.0: every interface); replicas listen on loopback
    port: int = 8000  # the router's port
    worker_port: int | None = None  # replica i listens on worker_port + i; default port + 1
    metrics_port: int | None = None  # the router's own Prometheus metrics; default: after the last replica's
    policy: str = "cache_aware"
    health_check_interval: int = 5  # seconds between the router's checks of each replica's /health
    router_args: Sequence[str] = ()  # more vllm-router options
    log_dir: Path | None = None  # None: children's output to this process's stderr, line-prefixed

    def __post_init__(self):
        if self.gpus is not None:
            self.gpus = [g.strip() for g in self.gpus]
            if not self.gpus or any(not g for g in self.gpus):
                raise ValueError(f"--gpus must list GPU ids separated by commas, got {','.join(self.gpus)!r}")
            self.replicas = len(self.gpus)
        if self.replicas < 1:
            raise ValueError(f"a fleet needs at least one replica, got {self.replicas}")
        for arg in self.serve_args:
            if arg.split("=", 1)[0] in OWN_SERVE_OPTIONS:
                raise ValueError(f"the fleet sets each replica's {arg.split('=', 1)[0]}: use --host/--port/--worker-port")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; one of {', '.join(POLICIES)}")
        if self.worker_port is None:
            self.worker_port = self.port + 1
        if self.metrics_port is None:
            self.metrics_port = self.worker_ports[-1] + 1
        ports = {self.port, self.metrics_port, *self.worker_ports}
        if len(ports) != self.replicas + 2 or max(ports) > 65535:
            raise ValueError(
                f"ports clash or exceed 65535: router {self.port}, replicas {self.worker_ports}, "
                f"router metrics {self.metrics_port}"
            )

    @property
    def worker_ports(self) -> list[int]:
        return [self.worker_port + i for i in range(self.replicas)]

    @property
    def worker_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.worker_ports]

    @property
    def url(self) -> str:
        """Where clients reach the router (loopback when it listens on every interface)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    def replica_env(self, i: int) -> dict[str, str]:
        """What replica i's environment adds to the fleet's: its GPU, when --gpus is given."""
        return {} if self.gpus is None else {"CUDA_VISIBLE_DEVICES": self.gpus[i]}

    def replica_command(self, i: int) -> list[str]:
        port = str(self.worker_ports[i])
        return [sys.executable, "-m", "numba_vllm.cli", "serve", *self.serve_args, "--host", "127.0.0.1", "--port", port]

    def router_command(self) -> list[str]:
        return [
            sys.executable, "-m", f"{ROUTER_MODULE}.launch_router",
            "--worker-urls", *self.worker_urls,
            "--host", self.host, "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            "--policy", self.policy,
            "--health-check-endpoint", "/health",
            "--health-check-interval-secs", str(self.health_check_interval),
            # A replica that fails twice in a row (gone, or draining: 503) is out of rotation for 5 s:
            # the router's retries of a request then go to another replica, instead of all to the
            # one its prefix points at until the health checks notice.
            "--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "5",
            *self.router_args,
        ]  # fmt: skip


class Child:
    """One child process, its output copied line by line (prefixed) by a thread."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log: IO[str] | None):
        self.name = name
        self.log = log
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, text=True, errors="replace", bufsize=1,
        )  # fmt: skip
        self._copier = threading.Thread(target=self._copy, name=f"fleet-{name}", daemon=True)
        self._copier.start()

    def _copy(self) -> None:
        for line in self.process.stdout:
            if self.log is not None:
                self.log.write(line)
                self.log.flush()
            else:
                sys.stderr.write(f"[{self.name}] {line}")

    def running(self) -> bool:
        return self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.running():
            try:
                self.process.send_signal(sig)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self._copier.join(5)
        if self.log is not None:
            self.log.close()


class Fleet:
    """Start with `start()`, block with `wait()`, end with `stop()` (idempotent)."""

    def __init__(self, spec: FleetSpec):
        self.spec = spec
        self.replicas: list[Child] = []
        self.router: Child | None = None
        self.stopping = threading.Event()  # set by a signal: start-up and wait() return early
        self._reported: set[int] = set()  # replicas whose death was reported

    # ---- starting ---------------------------------------------------------------------------------
    def start(self, timeout: float = 600.0) -> None:
        """Start the replicas, wait until each is healthy, start the router and wait until it is ready
        (or until `stopping` is set). On failure everything started is stopped and FleetError says why."""
        if importlib.util.find_spec(ROUTER_MODULE) is None:
            raise FleetError("the fleet's router is the vllm-router package: pip install 'numba-vllm[fleet]'")
        spec = self.spec
        deadline = time.monotonic() + timeout
        env = dict(os.environ, PYTHONUNBUFFERED="1")  # children's lines arrive as written
        try:
            for i in range(spec.replicas):
                command, replica_env = spec.replica_command(i), env | spec.replica_env(i)
                self.replicas.append(Child(f"replica {i}", command, replica_env, self._log(f"replica-{i}")))
            for child, url in zip(self.replicas, spec.worker_urls, strict=True):
                self._wait_ready(child, url + "/health", deadline)
            self.router = Child("router", spec.router_command(), env, self._log("router"))
            self._wait_ready(self.router, spec.url + "/readiness", deadline)
        except BaseException:
            self.stop(grace=5.0)
            raise

    def _log(self, name: str) -> IO[str] | None:
        if self.spec.log_dir is None:
            return None
        Path(self.spec.log_dir).mkdir(parents=True, exist_ok=True)
        return open(Path(self.spec.log_dir) / f"{name}.log", "a", encoding="utf-8")  # closed by Child.close

    def _wait_ready(self, child: Child, url: str, deadline: float) -> None:
        while True:
            if not child.running():
                raise FleetError(f"{child.name} exited with status {child.process.returncode} before it was ready")
            # Ready first: once the URL answers, clients may already use it (a signal sent after their
            # first answer is a normal stop, not one during start-up).
            if http_status(url) == 200:
                return
            if self.stopping.is_set():
                raise FleetError("stopped while starting")
            if time.monotonic() > deadline:
                raise FleetError(f"{child.name} was not ready ({url}) in time")
            self.stopping.wait(0.25)

    # ---- running ----------------------------------------------------------------------------------
    def poll(self) -> bool:
        """Report replicas that died since the last call; False once the router has exited."""
        for i, child in enumerate(self.replicas):
            if not child.running() and i not in self._reported:
                self._reported.add(i)
                print(f"fleet: replica {i} exited with status {child.process.returncode}; the router routes around it",
                      file=sys.stderr)  # fmt: skip
        return self.router is not None and self.router.running()

    def wait(self) -> None:
        """Block until `stopping` is set or the router exits."""
        while self.poll() and not self.stopping.wait(0.5):
            pass

    # ---- stopping ---------------------------------------------------------------------------------
    def stop(self, grace: float = 60.0) -> None:
        """Replicas first (SIGTERM: they drain), then the router; what is left after `grace` seconds
        for each group is killed."""
        self._terminate(self.replicas, grace)
        if self.router is not None:
            self._terminate([self.router], min(grace, 10.0))
        for child in [*self.replicas, *([self.router] if self.router else [])]:
            child.close()

    def kill(self) -> None:
        """SIGKILL every child now."""
        for child in [*self.replicas, *([self.router] if self.router else [])]:
            child.signal(signal.SIGKILL)

    @staticmethod
    def _terminate(children: list[Child], grace: float) -> None:
        for child in children:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in children:
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.signal(signal.SIGKILL)
                child.process.wait()


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The status of GET `url`, or None if nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return None


def run_fleet(spec: FleetSpec, start_timeout: float = 600.0, stop_grace: float = 60.0) -> int:
    """Start the fleet, serve until SIGINT/SIGTERM (or until the router exits), stop it. Returns the
    exit status: 0 after a signal, 1 if the router exited by itself, 130 for a signal during start-up.
    FleetError if it could not start."""
    fleet = Fleet(spec)

    def on_signal(sig, frame) -> None:
        if fleet.stopping.is_set():  # the second one: no more waiting
            fleet.kill()
            return
        print("fleet: stopping (again to kill at once)", file=sys.stderr)
        fleet.stopping.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            fleet.start(start_timeout)
        except FleetError:
            if fleet.stopping.is_set():
                return 130
            raise
        print(
            f"fleet: {spec.replicas} replica(s) on {', '.join(spec.worker_urls)} behind vllm-router "
            f"({spec.policy}) on {spec.url}; Ctrl-C stops all",
            file=sys.stderr,
        )
        fleet.wait()
        if fleet.stopping.is_set():
            return 0
        print(f"fleet: the router exited with status {fleet.router.process.returncode}; stopping", file=sys.stderr)
        return 1
    finally:
        fleet.stop(stop_grace)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
