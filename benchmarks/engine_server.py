"""Colocated rollout: an inference engine bound to its own cores next to the training process.

:class:`EngineServer` starts a spawned process that

1. applies its compute budget first (``mrl_plugins.device.apply_compute_budget``: CPU core affinity +
   ``torch.set_num_threads``; on NPU/CUDA the same call also sets stream/core limits where available),
2. builds the model (a preset name, a checkpoint folder, or a picklable ``model_factory``) and a
   :class:`~mrl_plugins.rollout.engine.TransformersEngine`,
3. optionally profiles one generation round and reserves ``peak x (1 + headroom)`` of the device's memory
   (:func:`reserve_memory`; on NPU/CUDA through ``Device.set_memory_fraction``, on CPU measured and reported only),
4. serves ``generate`` / ``update_weights`` / ``binding`` requests over a ``multiprocessing`` Pipe.

Every wait on the server has a timeout; a dead server is reported as :class:`~mrl_plugins.errors.StageTimeoutError`
naming its exit code as soon as the death is seen (the reply wait polls the process every 50 ms). An engine
out-of-memory error (``torch.OutOfMemoryError`` or a ``RuntimeError`` whose message says "out of memory") becomes
:class:`EngineOutOfMemoryError` naming the reserved fraction; the server process survives it and keeps serving, and
the training process only sees the exception.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from mrl_plugins.errors import ConfigError, MrlError, StageTimeoutError
from mrl_plugins.rollout.engine import EngineOutput, SamplingParams

__all__ = [
    "EngineOutOfMemoryError",
    "EngineServer",
    "EngineServerError",
    "MemoryReservation",
    "guard_oom",
    "is_out_of_memory",
    "profile_engine_memory",
    "reserve_memory",
]

_POLL_S = 0.05


_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """True for an allocation failure on any backend.

    ``torch.OutOfMemoryError`` (CUDA, and torch_npu's "NPU out of memory"), ``MemoryError``, and the
    ``RuntimeError`` texts of the CPU allocator ("can't allocate memory") and of older torch_npu releases.
    """
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _OOM_TEXT)


class EngineOutOfMemoryError(MrlError, MemoryError):
    """The rollout engine ran out of device memory within its reservation (training is not affected)."""


class EngineServerError(MrlError):
    """The engine server raised an error while serving a request (its type, message and traceback attached)."""


@dataclass(frozen=True)
class MemoryReservation:
    """Memory reserved for one side from a profiling pass: ``reserved_bytes = peak_bytes x (1 + headroom)``.

    ``enforced`` is True where the device's allocator caps the process (NPU/CUDA); on CPU it is recorded and
    reported only.
    """

    device: str
    peak_bytes: int
    headroom: float
    reserved_bytes: int
    total_bytes: int
    fraction: float
    enforced: bool

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for reports and metrics."""
        return asdict(self)

    def describe(self) -> str:
        """One line for error messages."""
        how = "enforced" if self.enforced else "measured, not enforced on CPU"
        return (
            f"reserved fraction {self.fraction:.4f} of {self.device} "
            f"(peak {self.peak_bytes} B x (1 + headroom {self.headroom:g}) = {self.reserved_bytes} B "
            f"of {self.total_bytes} B; {how})"
        )


def reserve_memory(fn: Callable[[], Any], device: Any, headroom: float = 0.2) -> tuple[Any, MemoryReservation]:
    """Run ``fn()`` once on ``device``, measure its peak and reserve ``peak x (1 + headroom)`` of the device.

    The fraction goes to ``device.set_memory_fraction`` (an allocator cap on NPU/CUDA; recorded only on CPU).
    A reservation larger than the device is a ConfigError naming the numbers (never clamped).
    """
    from mrl_plugins.device.memory import measure_peak
    from mrl_plugins.device.memory import reserve_memory as _reserve

    result, prof = measure_peak(fn, device)
    fraction = _reserve(device, prof.peak_bytes, headroom, total_bytes=prof.total_bytes)
    reservation = MemoryReservation(
        device=device.spec,
        peak_bytes=prof.peak_bytes,
        headroom=float(headroom),
        reserved_bytes=int(prof.peak_bytes * (1 + headroom)),
        total_bytes=prof.total_bytes,
        fraction=fraction,
        enforced=device.type != "cpu",
    )
    return result, reservation


def profile_engine_memory(
    engine: Any, prompts: list[list[int]], num_generations: int, device: Any = "cpu", headroom: float = 0.2
) -> MemoryReservation:
    """Profile one ``engine.generate(prompts, num_generations)`` round and reserve memory for it."""
    if isinstance(device, str):
        from mrl_plugins.device import get_device

        device = get_device(device)
    return reserve_memory(lambda: engine.generate(prompts, num_generations), device, headroom)[1]


def _empty_cache(device_type: str) -> None:
    import torch

    backend = getattr(torch, device_type, None)
    if device_type != "cpu" and backend is not None and hasattr(backend, "empty_cache"):
        with contextlib.suppress(Exception):
            backend.empty_cache()


@contextlib.contextmanager
def guard_oom(reservation: MemoryReservation | None, device_type: str = "cpu") -> Iterator[None]:
    """Turn an out-of-memory error inside the block into :class:`EngineOutOfMemoryError` naming the reservation.

    The device cache is emptied so the process can keep serving smaller requests.
    """
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, EngineOutOfMemoryError) or not is_out_of_memory(exc):
            raise
        _empty_cache(device_type)
        where = reservation.describe() if reservation is not None else "no reservation profiled"
        raise EngineOutOfMemoryError(
            f"rollout engine ran out of memory ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            f" with {where}; the request failed, the training side is unaffected. Raise rollout.memory_headroom or "
            "send smaller batches"
        ) from exc


# ----------------------------------------------------------------------------------------------- server process


@dataclass
class _ServerSpec:
    model: str
    model_seed: int
    model_factory: Callable[[], tuple[Any, Any]] | None
    params: SamplingParams
    seed: int | None
    device: str
    cores: list[int] | None
    threads: int | None
    budget: Any  # ComputeBudget | None; replaces cores/threads when given
    headroom: float
    profile_prompts: list[list[int]] | None
    profile_generations: int


def copy_weights(model: Any, state: dict[str, Any]) -> int:
    """Copy a full state dict into ``model`` (torch's ``load_state_dict``: a missing, unknown or misshapen tensor is
    an error naming it); returns the bytes copied."""
    model.load_state_dict(state)
    return sum(t.numel() * t.element_size() for t in state.values())


def _binding() -> dict[str, Any]:
    import torch

    return {"pid": os.getpid(), "affinity": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}


def _serve(conn: Any, spec: _ServerSpec) -> None:
    """Server process main: bind, build, profile, then answer requests until ``close`` or the pipe closes."""
    try:
        from mrl_plugins.device import ComputeBudget, apply_compute_budget, get_device

        device = get_device(spec.device)
        budget = spec.budget if spec.budget is not None else ComputeBudget(cores=spec.cores, threads=spec.threads)
        applied = apply_compute_budget(budget, device)
        import torch

        from mrl_plugins.demo.models import build_model
        from mrl_plugins.rollout.engine import TransformersEngine

        model, tokenizer = (
            spec.model_factory() if spec.model_factory else build_model(spec.model, seed=spec.model_seed)
        )
        engine = TransformersEngine(
            model, tokenizer, device=str(device.torch_device), params=spec.params, seed=spec.seed
        )
        reservation = None
        if spec.profile_prompts:
            with device.stream_context(applied.stream):
                reservation = profile_engine_memory(
                    engine, spec.profile_prompts, spec.profile_generations, device, spec.headroom
                )
        conn.send(
            (
                "ready",
                0,
                {
                    **_binding(),
                    "budget": applied.as_dict(),
                    "reservation": None if reservation is None else reservation.as_dict(),
                },
            )
        )
    except BaseException as exc:  # report start failures instead of dying silently
        with contextlib.suppress(Exception):
            conn.send(("error", 0, (type(exc).__name__, str(exc), traceback.format_exc())))
        return
    while True:
        try:
            op, req_id, payload = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return  # the trainer side went away (or Ctrl-C reached the whole process group)
        if op == "close":
            with contextlib.suppress(Exception):
                conn.send(("ok", req_id, None))
            return
        try:
            if op == "generate":
                prompts, num_generations = payload
                with guard_oom(reservation, device.type), device.stream_context(applied.stream):
                    out = engine.generate(prompts, num_generations)
                reply: Any = (out.prompt_ids, out.completion_ids, out.logprobs)
            elif op == "update_weights":
                reply = copy_weights(engine.model, torch.load(io.BytesIO(payload), weights_only=True))
            elif op == "binding":
                reply = _binding()
            elif op == "sleep":  # test hook: occupy the server for ``payload`` seconds
                time.sleep(float(payload))
                reply = None
            else:
                raise ConfigError(f"engine server: unknown op {op!r}")
            conn.send(("ok", req_id, reply))
        except EngineOutOfMemoryError as exc:
            conn.send(("oom", req_id, str(exc)))
        except Exception as exc:
            conn.send(("error", req_id, (type(exc).__name__, str(exc), traceback.format_exc())))


class EngineServer:
    """A :class:`~mrl_plugins.rollout.engine.TransformersEngine` in its own spawned process, bound to cores/threads.

    :param model: preset name (``tiny``/``small``) or local checkpoint folder, built with ``build_model``.
    :param params: sampling settings.
    :param cores: CPU cores for the engine process (``None``: unchanged).
    :param threads: torch threads of the engine process (``None``: torch's default).
    :param budget: a full :class:`mrl_plugins.device.ComputeBudget` instead of ``cores``/``threads`` (NPU cube/vector
        core limits, stream priority); the engine then runs on the budget's stream.
    :param device: device spec for the engine (``cpu``, ``cuda:0``, ``npu:0``).
    :param seed: the engine's sampling seed.
    :param model_seed: init seed of a preset model.
    :param model_factory: picklable callable returning ``(model, tokenizer)``, used instead of ``model``.
    :param headroom: memory reservation headroom (reservation = profiled peak x (1 + headroom)).
    :param profile_prompts: prompts of the profiling round (``None``: no profiling, no reservation).
    :param profile_generations: generations per prompt in the profiling round.
    :param start_timeout: seconds to wait for the process to start, bind, build and profile.
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        params: SamplingParams,
        cores: list[int] | None = None,
        threads: int | None = None,
        budget: Any = None,
        device: str = "cpu",
        seed: int | None = None,
        model_seed: int = 0,
        model_factory: Callable[[], tuple[Any, Any]] | None = None,
        headroom: float = 0.2,
        profile_prompts: list[list[int]] | None = None,
        profile_generations: int = 1,
        start_timeout: float = 120.0,
    ) -> None:
        params.validate()
        if start_timeout <= 0:
            raise ConfigError(f"start_timeout: must be > 0, got {start_timeout}")
        if not 0 <= headroom <= 4:
            raise ConfigError(f"headroom: must be in [0, 4], got {headroom}")
        if cores is not None and (not cores or not all(isinstance(c, int) and c >= 0 for c in cores)):
            raise ConfigError(f"cores: must be a non-empty list of core ids or None, got {cores!r}")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ConfigError(f"threads: must be an int >= 1 or None, got {threads!r}")
        if budget is not None:
            from mrl_plugins.device import ComputeBudget

            if cores is not None or threads is not None:
                raise ConfigError("EngineServer: give either budget or cores/threads, not both")
            if not isinstance(budget, ComputeBudget):
                raise ConfigError(f"budget: expected mrl_plugins.device.ComputeBudget, got {type(budget).__name__}")
            budget.validate()
        spec = _ServerSpec(
            model, model_seed, model_factory, params, seed, device, None if cores is None else list(cores), threads,
            budget, headroom, profile_prompts, profile_generations,
        )  # fmt: skip
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_serve, args=(child_conn, spec), daemon=True, name="mrl-engine-server")
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self._proc.start()
        self._pid = self._proc.pid
        self.exitcode: int | None = None
        child_conn.close()
        self.info: dict[str, Any] = {}
        try:
            self.info = self._wait_reply(0, start_timeout, "start")
        except BaseException:
            self._terminate()
            raise

    # --------------------------------------------------------------------------------------------- properties
    @property
    def pid(self) -> int | None:
        """The server process id."""
        return self._pid

    @property
    def reservation(self) -> MemoryReservation | None:
        """The memory reservation made at start (``None`` without a profiling round)."""
        res = self.info.get("reservation")
        return None if res is None else MemoryReservation(**res)

    def is_alive(self) -> bool:
        """Whether the server process is running."""
        return self.exitcode is None and self._proc.is_alive()

    # --------------------------------------------------------------------------------------------- requests
    def request(self, prompts: list[list[int]], num_generations: int = 1, timeout: float = 60.0) -> EngineOutput:
        """Generate on the server; StageTimeoutError if it dies or does not answer within ``timeout`` seconds."""
        return EngineOutput(*self._call("generate", ([list(p) for p in prompts], num_generations), timeout))

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], timeout: float = 60.0) -> int:
        """Copy weights into the server's model (serialised with ``torch.save``); returns the bytes copied."""
        import torch

        buf = io.BytesIO()
        torch.save({name: t.detach().cpu() for name, t in named_tensors}, buf)
        return int(self._call("update_weights", buf.getvalue(), timeout))

    def binding(self, timeout: float = 10.0) -> dict[str, Any]:
        """``{pid, affinity, threads}`` as seen inside the server process right now."""
        return self._call("binding", None, timeout)

    def _call(self, op: str, payload: Any, timeout: float) -> Any:
        if timeout <= 0:
            raise ConfigError(f"timeout: must be > 0, got {timeout}")
        with self._lock:
            if self._closed:
                raise StageTimeoutError("engine server is closed")
            req_id = next(self._ids)
            try:
                self._conn.send((op, req_id, payload))
            except (BrokenPipeError, OSError) as exc:
                raise self._dead_error(op) from exc
            return self._wait_reply(req_id, timeout, op)

    def _dead_error(self, op: str) -> StageTimeoutError:
        self._proc.join(timeout=1.0)
        return StageTimeoutError(
            f"engine server (pid {self._pid}) died during {op!r} (exit code {self._proc.exitcode})"
        )

    def _wait_reply(self, req_id: int, timeout: float, op: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                ready = self._conn.poll(max(0.0, min(_POLL_S, remaining)))
            except (EOFError, OSError) as exc:
                raise self._dead_error(op) from exc
            if ready:
                try:
                    kind, rid, body = self._conn.recv()
                except (EOFError, OSError) as exc:
                    raise self._dead_error(op) from exc
                if rid != req_id:
                    continue  # a late reply to a request that timed out earlier
                if kind == "ok" or kind == "ready":
                    return body
                if kind == "oom":
                    raise EngineOutOfMemoryError(body)
                name, msg, tb = body
                raise EngineServerError(f"engine server {op!r} failed: {name}: {msg}\n--- server traceback ---\n{tb}")
            if not self._proc.is_alive():
                raise self._dead_error(op)
            if remaining <= 0:
                raise StageTimeoutError(
                    f"engine server (pid {self._pid}) gave no reply to {op!r} within {timeout:g} s"
                )

    # --------------------------------------------------------------------------------------------- shutdown
    def close(self, timeout: float = 10.0) -> None:
        """Ask the server to stop, join it (``timeout`` s), kill it if it does not stop. Idempotent."""
        if self._closed:
            self._terminate()
            return
        if self._lock.acquire(timeout=timeout):
            try:
                if self._proc.is_alive():
                    with contextlib.suppress(Exception):
                        self._conn.send(("close", -1, None))
            finally:
                self._closed = True
                self._lock.release()
        else:
            self._closed = True  # a request is stuck: fall through to terminate
        self._proc.join(timeout=timeout)
        self._terminate()

    def _terminate(self) -> None:
        self._closed = True
        if self.exitcode is not None:
            return
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=5.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5.0)
        with contextlib.suppress(Exception):
            self._conn.close()
        if self.exitcode is None:
            self.exitcode = self._proc.exitcode
            with contextlib.suppress(Exception):
                self._proc.close()

    def __enter__(self) -> EngineServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
