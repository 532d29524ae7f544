"""A FAKE ``torch_npu`` module, because no NPU hardware (and no CANN toolkit) exists on the test machines.

It follows the documented torch_npu API that ``mrl_plugins.device`` uses, as found in Ascend/pytorch
(``torch_npu/npu/__init__.py``, ``npu_config.py``, ``memory.py``, ``streams.py``) and the torch_npu API docs:

* ``torch_npu.npu.is_available() / device_count() / current_device() / set_device(i) / synchronize(device)``
* ``torch_npu.npu.Stream(device=None, priority=0)`` with ``stream_id``, ``device_index``, ``device_type``;
  ``Event(enable_timing=False)``; ``stream(s)`` context; ``current_stream(device)`` (outside a ``stream(s)``
  context: the device's default stream, ``stream_id`` 0)
* ``set_per_process_memory_fraction(fraction, device=None)`` (TypeError unless ``float``, ValueError outside 0..1),
  ``memory_allocated``, ``max_memory_allocated``, ``reset_peak_memory_stats``, ``mem_get_info`` -> (free, total)
* core limits (torch_npu >= 2.6.0.post3 / 2.7.1): ``set_device_limit(device, cube_num=-1, vector_num=-1)`` which,
  as in torch_npu, may be called once per process (a second call raises RuntimeError; the wrapper exposes
  ``.called``), ``get_device_limit(device)``, ``set_stream_limit(stream, cube_num=-1, vector_num=-1)`` (asserts a
  ``torch_npu.npu.Stream``), ``reset_stream_limit(stream)``, ``get_stream_limit(stream)``; limits are
  reported as ``{"cube_core_num": n, "vector_core_num": m}``.

Every call is appended to ``module.calls`` as ``(name, args...)`` so tests can check what reached "torch_npu".
:func:`install` puts the fake into ``sys.modules`` (and attaches ``torch.npu`` like the real package) through
pytest's ``monkeypatch``, so everything is undone after the test. :func:`install_broken` simulates an installed
torch_npu whose import fails (e.g. CANN missing).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import itertools
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

GIB = 1 << 30
#: Atlas A2 defaults (24 cube cores, 48 vector cores), what get_*_limit reports when nothing is set.
DEFAULT_CUBE = 24
DEFAULT_VECTOR = 48


class _CallOnce:
    """torch_npu's ``_call_once_class``: the wrapped function may run once; later calls raise RuntimeError."""

    def __init__(self, func: Any) -> None:
        self.func = func
        self.called = False
        self.__name__ = func.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.called:
            raise RuntimeError(
                f"Function '{self.__name__}' has already been called, You can only set this interface once."
            )
        self.called = True
        return self.func(*args, **kwargs)


def make_module(
    *,
    device_count: int = 2,
    core_limits: bool = True,
    version: str = "2.7.1",
    total_memory: int = 64 * GIB,
) -> types.ModuleType:
    """Build a fresh fake ``torch_npu`` module (with ``.npu`` namespace and ``.calls`` log)."""
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None, is_package=True)
    mod.__path__ = []  # a package, like the real one
    mod.__version__ = version
    mod.__doc__ = "FAKE torch_npu for tests (no NPU hardware here)."
    calls: list[tuple[Any, ...]] = []
    mod.calls = calls
    npu = types.ModuleType("torch_npu.npu")
    npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu.npu", loader=None, is_package=True)
    mod.npu = npu

    state: dict[str, Any] = {
        "current": 0,
        "allocated": [0] * device_count,
        "peak": [0] * device_count,
        "fraction": {},
        "device_limit": {},
        "stream_limit": {},
    }
    npu._state = state
    stream_ids = itertools.count(1)

    def _index(device: Any) -> int:
        if device is None:
            return state["current"]
        if isinstance(device, int):
            idx = device
        else:
            idx = getattr(device, "index", None)
            idx = state["current"] if idx is None else idx
        if not 0 <= idx < device_count:
            raise AssertionError("Invalid device id")
        return idx

    def is_available() -> bool:
        return device_count > 0

    def _device_count() -> int:
        return device_count

    def current_device() -> int:
        return state["current"]

    def set_device(device: Any) -> None:
        calls.append(("set_device", device))
        state["current"] = _index(device)

    def synchronize(device: Any = None) -> None:
        calls.append(("synchronize", _index(device)))

    class Stream:
        """Fake ``torch_npu.npu.Stream(device=None, priority=0)``."""

        def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
            self.device_index = _index(device)
            self.device_type = 20  # PrivateUse1, as torch reports for torch_npu streams
            self.priority = priority
            if kwargs.get("_default"):  # fake-internal: the device's default stream (id 0), not a user call
                self.stream_id = 0
                return
            self.stream_id = next(stream_ids)
            calls.append(("Stream", self.device_index, priority))

        def synchronize(self) -> None:
            calls.append(("Stream.synchronize", self.stream_id))

        def query(self) -> bool:
            return True

        def wait_event(self, event: Event) -> None:
            calls.append(("Stream.wait_event", self.stream_id))

        def wait_stream(self, stream: Stream) -> None:
            calls.append(("Stream.wait_stream", self.stream_id, stream.stream_id))

        def record_event(self, event: Event | None = None) -> Event:
            event = Event() if event is None else event
            event.record(self)
            return event

    class Event:
        """Fake ``torch_npu.npu.Event(enable_timing=False)`` (records host time)."""

        def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
            self.enable_timing = enable_timing
            self._t: float | None = None

        def record(self, stream: Stream | None = None) -> None:
            self._t = time.perf_counter()
            calls.append(("Event.record", None if stream is None else stream.stream_id))

        def wait(self, stream: Stream | None = None) -> None:
            calls.append(("Event.wait", None if stream is None else stream.stream_id))

        def query(self) -> bool:
            return self._t is not None

        def synchronize(self) -> None:
            calls.append(("Event.synchronize",))

        def elapsed_time(self, end: Event) -> float:
            if not self.enable_timing:
                raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
            return (end._t - self._t) * 1000.0

    state["current_stream"] = None
    state["default_streams"] = {}

    @contextlib.contextmanager
    def stream(s: Stream | None) -> Iterator[None]:
        prev = state["current_stream"]
        if s is not None:
            state["current_stream"] = s
        calls.append(("stream.enter", None if s is None else s.stream_id))
        try:
            yield
        finally:
            state["current_stream"] = prev
            calls.append(("stream.exit", None if s is None else s.stream_id))

    def current_stream(device: Any = None) -> Stream:
        """The stream set by ``stream(s)``, else the device's default stream (as torch_npu returns)."""
        if state["current_stream"] is not None:
            return state["current_stream"]
        idx = _index(device)
        if idx not in state["default_streams"]:
            state["default_streams"][idx] = Stream(idx, _default=True)
        return state["default_streams"][idx]

    def set_per_process_memory_fraction(fraction: Any, device: Any = None) -> None:
        idx = _index(device)
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        state["fraction"][idx] = fraction
        calls.append(("set_per_process_memory_fraction", fraction, idx))

    def memory_allocated(device: Any = None) -> int:
        return state["allocated"][_index(device)]

    def max_memory_allocated(device: Any = None) -> int:
        return state["peak"][_index(device)]

    def reset_peak_memory_stats(device: Any = None) -> None:
        idx = _index(device)
        state["peak"][idx] = state["allocated"][idx]
        calls.append(("reset_peak_memory_stats", idx))

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        idx = _index(device)
        return total_memory - state["allocated"][idx], total_memory

    def _fake_allocate(nbytes: int, device: Any = None) -> None:
        """Test helper (not torch_npu API): pretend the caching allocator handed out/freed ``nbytes``."""
        idx = _index(device)
        state["allocated"][idx] += nbytes
        state["peak"][idx] = max(state["peak"][idx], state["allocated"][idx])

    for fn in (
        is_available,
        current_device,
        set_device,
        synchronize,
        stream,
        current_stream,
        set_per_process_memory_fraction,
        memory_allocated,
        max_memory_allocated,
        reset_peak_memory_stats,
        mem_get_info,
        _fake_allocate,
    ):
        setattr(npu, fn.__name__, fn)
    npu.device_count = _device_count
    npu.Stream = Stream
    npu.Event = Event

    if core_limits:

        def set_device_limit(device: Any, cube_num: int = -1, vector_num: int = -1) -> None:
            if isinstance(device, bool) or not isinstance(device, int):
                raise TypeError(f"device must be an int, but got {type(device).__name__}")
            idx = _index(device)
            calls.append(("set_device_limit", idx, cube_num, vector_num))
            limits = state["device_limit"].setdefault(idx, {})
            if cube_num != -1:
                limits["cube_core_num"] = cube_num
            if vector_num != -1:
                limits["vector_core_num"] = vector_num

        def get_device_limit(device: Any) -> dict[str, int]:
            limits = state["device_limit"].get(_index(device), {})
            return {
                "cube_core_num": limits.get("cube_core_num", DEFAULT_CUBE),
                "vector_core_num": limits.get("vector_core_num", DEFAULT_VECTOR),
            }

        def _check_stream(s: Any) -> None:
            if s is None:
                raise AssertionError("stream cannot be None")
            if not isinstance(s, Stream):
                raise AssertionError(f"stream should be torch_npu.npu.Stream, could not be {type(s)}")

        def set_stream_limit(s: Any, cube_num: int = -1, vector_num: int = -1) -> None:
            _check_stream(s)
            calls.append(("set_stream_limit", s.stream_id, cube_num, vector_num))
            limits = state["stream_limit"].setdefault(s.stream_id, {})
            if cube_num != -1:
                limits["cube_core_num"] = cube_num
            if vector_num != -1:
                limits["vector_core_num"] = vector_num

        def reset_stream_limit(s: Any) -> None:
            _check_stream(s)
            calls.append(("reset_stream_limit", s.stream_id))
            state["stream_limit"].pop(s.stream_id, None)

        def get_stream_limit(s: Any) -> dict[str, int]:
            _check_stream(s)
            base = get_device_limit(s.device_index)
            base.update(state["stream_limit"].get(s.stream_id, {}))
            return base

        npu.set_device_limit = _CallOnce(set_device_limit)
        npu.get_device_limit = get_device_limit
        npu.set_stream_limit = set_stream_limit
        npu.reset_stream_limit = reset_stream_limit
        npu.get_stream_limit = get_stream_limit
    return mod


def install(monkeypatch: Any, **kwargs: Any) -> types.ModuleType:
    """Make ``import torch_npu`` return a fresh fake (undone by ``monkeypatch`` after the test)."""
    import torch

    mod = make_module(**kwargs)
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    monkeypatch.setitem(sys.modules, "torch_npu.npu", mod.npu)
    monkeypatch.setattr(torch, "npu", mod.npu, raising=False)  # torch_npu registers torch.npu
    return mod


def install_broken(monkeypatch: Any, error: BaseException) -> None:
    """Simulate torch_npu installed (found by find_spec) whose import raises ``error``."""
    from mrl_plugins.device import probe

    spec = importlib.machinery.ModuleSpec("torch_npu", loader=None, is_package=True)
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(probe, "_torch_npu_spec", lambda: spec)

    def _fail() -> types.ModuleType:
        raise error

    monkeypatch.setattr(probe, "_import_torch_npu", _fail)
