"""Where the engine core runs: a process of its own (`CoreProcess`, what `numba-vllm serve` uses) or a
thread of the server's process (`CoreThread`: tests, and `serve --engine-in-process`).

`CoreProcess` starts a fresh interpreter (multiprocessing's "spawn": nothing of the server's state,
no CUDA context, is inherited), which loads the model, builds the engine, compiles and records the
CUDA graphs, and hands the front end what it needs of the model (`ModelInfo`: config, tokenizer,
lengths) through a pipe; then it runs `EngineCore`'s loop until told to stop. Only that process
imports numba.cuda: the front end tokenizes and detokenizes with the tokenizer alone.

Neither side outlives the other unnoticed:
- the core watches its parent: when the server process is gone (killed, crashed), the core exits at
  once, even in the middle of a step, so no orphan holds the GPU;
- the front end watches the core (`watch`): a core that dies without its last message (killed, a
  segfault) is reported like one that stopped on an error.
The core ignores SIGINT and SIGTERM: Ctrl-C in a terminal reaches the whole process group, and the
server's graceful drain needs the core to go on stepping until the front end says stop.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from numba_vllm.engine.config import EngineConfig
from numba_vllm.engine.llm_engine import LLMEngine
from numba_vllm.errors import KernelError
from numba_vllm.server.core_protocol import CoreAddresses, ModelInfo
from numba_vllm.server.engine_core import EngineCore

logger = logging.getLogger("uvicorn.error")


def model_info(engine: LLMEngine) -> ModelInfo:
    return ModelInfo(
        engine.config, engine.tokenizer, engine.max_model_len, engine.backend, engine.stats(), str(engine.checkpoint.source),
        dict(engine.sampling_defaults),
    )  # fmt: skip


class CoreThread:
    """The core in a daemon thread of this process, around an engine built here."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.addresses = CoreAddresses.new()
        self.info = model_info(engine)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        core = EngineCore(self.engine, self.addresses)
        self._thread = threading.Thread(target=core.run, name="numba-vllm-engine", daemon=True)
        self._thread.start()

    def watch(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[str], None]) -> None:
        """Nothing to watch: a thread's loop always sends its last message."""

    def join(self, timeout: float) -> bool:
        """Wait for the loop to end; whether it has."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    def kill(self) -> None:
        """A thread cannot be killed; it is a daemon, so it does not keep the process alive."""

    def close(self) -> None:
        self.addresses.remove_files()


@dataclass(frozen=True)
class CoreSpec:
    """What the core process loads: `model` and `load_format` as `numba-vllm serve` takes them."""

    model: str | None
    load_format: str  # "auto", or "dummy" (random weights from the model's config)
    engine_config: EngineConfig


class CoreStartError(ValueError):
    """The core process could not load the model or build the engine (one line: why)."""


class CoreProcess:
    """The core in a child process. `start` returns once the model is loaded and the engine ready."""

    def __init__(self, spec: CoreSpec):
        self.spec = spec
        self.addresses = CoreAddresses.new()
        self.info: ModelInfo | None = None
        self.load_seconds = 0.0
        self._process: multiprocessing.process.BaseProcess | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> ModelInfo:
        """Start the process and wait until its engine is ready (raises `CoreStartError` if it cannot be
        built; on Ctrl-C the process is killed and KeyboardInterrupt goes on)."""
        if self._process is not None:
            return self.info
        context = multiprocessing.get_context("spawn")
        receiver, sender = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_core_main, args=(self.spec, self.addresses, sender), name="numba-vllm-engine-core", daemon=True
        )
        try:
            self._process.start()
            sender.close()
            kind, payload, seconds = _await_ready(receiver, self._process)
        except BaseException:
            self.kill()
            raise
        finally:
            receiver.close()
        if kind != "ready":
            self.kill()
            raise CoreStartError(payload)
        self.info, self.load_seconds = payload, seconds
        return self.info

    def watch(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[str], None]) -> None:
        """Call `on_exit(why)` on `loop` when the process ends."""
        sentinel = self._process.sentinel

        def ended() -> None:
            loop.remove_reader(sentinel)
            self._process.join(1)
            on_exit(f"the engine core process exited (exit code {self._process.exitcode})")

        loop.add_reader(sentinel, ended)

    def join(self, timeout: float) -> bool:
        self._process.join(timeout)
        return not self._process.is_alive()

    def kill(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join(5)

    def close(self) -> None:
        self.kill()
        self.addresses.remove_files()


def _await_ready(receiver, process) -> tuple:
    """The child's one message: ("ready", ModelInfo, seconds) or ("error", one line, 0)."""
    while not receiver.poll(0.1):
        if not process.is_alive():
            if receiver.poll(0):  # it said why before it exited
                break
            raise CoreStartError(f"the engine core process exited while starting (exit code {process.exitcode})")
    try:
        return receiver.recv()
    except EOFError:
        raise CoreStartError(f"the engine core process exited while starting (exit code {process.exitcode})") from None


# ---- the child -------------------------------------------------------------------------------------
def _core_main(spec: CoreSpec, addresses: CoreAddresses, sender) -> None:
    """The core process: build the engine, say so, run the loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent(addresses)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     [engine core] %(message)s")
    logging.getLogger("numba").setLevel(logging.WARNING)  # not the driver's every allocation and free
    try:
        engine, seconds = _build_engine(spec)
    except (ValueError, OSError, KernelError) as e:
        sender.send(("error", str(e), 0.0))
        sys.exit(1)
    except BaseException as e:
        sender.send(("error", f"the engine core failed to start: {type(e).__name__}: {e}", 0.0))
        traceback.print_exc()
        sys.exit(1)
    sender.send(("ready", model_info(engine), seconds))
    sender.close()
    EngineCore(engine, addresses).run()


def _build_engine(spec: CoreSpec) -> tuple[LLMEngine, float]:
    """The engine, ready to step (kernels compiled on cuda), and the seconds that took."""
    from numba_vllm.executor.backend import prepare_backend, resolve_backend
    from numba_vllm.loading.checkpoint import load_model

    prepare_backend(spec.engine_config.backend)  # `sim` switches the simulator on before numba.cuda is imported
    resolve_backend(spec.engine_config.backend)  # an unusable backend fails now, before the model loads
    t0 = time.perf_counter()
    engine = LLMEngine(load_model(spec.model, spec.load_format), spec.engine_config, detokenize=False)
    if engine.backend == "cuda":  # compile and record graphs now, not in the first requests
        t1 = time.perf_counter()
        engine.warm_up()
        print(f"kernels compiled and decode graphs recorded in {time.perf_counter() - t1:.1f} s", file=sys.stderr)
    return engine, time.perf_counter() - t0


def _exit_with_parent(addresses: CoreAddresses) -> None:
    """A daemon thread that ends this process as soon as its parent is gone (removing the socket
    files the parent would have)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        print("engine core: the server process is gone; exiting", file=sys.stderr, flush=True)
        addresses.remove_files()
        os._exit(1)

    threading.Thread(target=watch, name="numba-vllm-parent-watch", daemon=True).start()
