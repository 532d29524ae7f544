"""Time-bounded TRL tools: every tool call of a batch gives up after ``rollout.tool_timeout_s``.

TRL calls a synchronous tool inline and waits for an async one with no timeout, so a tool that hangs hangs the run.
:func:`bound_tool_dicts` wraps the batch's tool dicts TRL built (``_sync_tool_dicts`` / ``_async_tool_dicts``: the
standalone tools and each rollout's environment methods) so that a call past the bound raises ``TimeoutError``, which
TRL reports to the model as it reports a failing tool (``{"error": ...}``, ``tools/failure_frequency``). A synchronous
tool is called in a thread of its own so that it can be bounded; one past the bound cannot be interrupted and is left
running in the background.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any


def bounded_tool(fn: Any, name: str, timeout: float) -> Any:
    """``fn`` that gives up after ``timeout`` s with a TimeoutError (which TRL turns into a tool error message)."""
    why = f"tool {name!r} did not return within {timeout:g} s (rollout.tool_timeout_s)"
    if inspect.iscoroutinefunction(fn):

        async def call_async(**kwargs: Any) -> Any:
            try:
                return await asyncio.wait_for(fn(**kwargs), timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(why) from None

        call_async.mrl_bounded = True  # type: ignore[attr-defined]
        return call_async

    def call(**kwargs: Any) -> Any:
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn(**kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                box["error"] = exc

        thread = threading.Thread(target=run, name=f"mrl-tool-{name}", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(why + "; its thread is left running")
        if "error" in box:
            raise box["error"]
        return box["value"]

    call.mrl_bounded = True  # type: ignore[attr-defined]
    return call


def bound_tool_dicts(host: Any, timeout: float) -> None:
    """Bound every tool of the batch TRL is about to run (``_sync_tool_dicts`` / ``_async_tool_dicts``, built per
    batch from the standalone tools and each rollout's environment methods); ``timeout`` 0: leave them as they are."""
    if timeout <= 0:
        return
    for attr in ("_sync_tool_dicts", "_async_tool_dicts"):
        dicts = getattr(host, attr, None) or []
        setattr(
            host,
            attr,
            [
                {k: f if getattr(f, "mrl_bounded", False) else bounded_tool(f, k, timeout) for k, f in d.items()}
                for d in dicts
            ],
        )


__all__ = ["bound_tool_dicts", "bounded_tool"]
