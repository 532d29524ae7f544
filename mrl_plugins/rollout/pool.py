"""Rollout worker processes: each hosts an engine with its own cores/device, pulls weights through the
weight-sync stage and returns experience through the comm stage.

Trainer side: :class:`WorkerPool` submits requests (prompt ids, small: a plain queue), collects the
answers as comm frames, detects dead workers (exit code, or no answer within ``rollout.timeout_s``)
and restarts them when ``rollout.restart_workers`` allows. Worker side: :func:`worker_main`.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import queue
import time
import traceback
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from mrl_plugins.comm.base import ChannelClosedError
from mrl_plugins.errors import MrlError, StageTimeoutError
from mrl_plugins.hookspecs import RolloutResult, StageContext, SwitchReport

log = logging.getLogger("mrl_plugins.rollout")

REQ_STOP = None


class WorkerDiedError(MrlError):
    """A rollout worker process exited or stopped answering."""


@dataclass
class WorkerSpec:
    """Everything a spawned worker needs (picklable)."""

    index: int
    config: Any  # MrlConfig
    model_config: dict
    model_class: str
    sampling: Any  # SamplingParams
    engine_factory: Any
    weight_handle: Any
    comm_handle: Any
    cores: list[int] | None
    threads: int
    env: dict = field(default_factory=dict)
    device: str = "cpu"
    seed: int = 0
    direct_weights: bool = False  # upstream weight sync: load into live params, no staging
    log_level: int = logging.WARNING  # the trainer's level for "mrl_plugins" (version-switch lines at INFO)


class DirectLoader:
    """Upstream weight loading: fetch a new version straight into the live parameters (no staging)."""

    def __init__(self, model: Any, transport_receiver: Any, model_id: str = "policy") -> None:
        self.model = model
        self.tr = transport_receiver
        self.model_id = model_id
        self.version = -1
        self._pending_from = -1
        self._bytes = 0

    def poll(self, timeout: float) -> int | None:
        latest = self.tr.latest_version()
        if latest is None or latest <= self.version:
            return None
        start = time.perf_counter()
        self._bytes = self.tr.fetch_into(latest, dict(self.model.named_parameters()), timeout)
        self._pending_from, self.version = self.version, latest
        self._seconds = time.perf_counter() - start
        return latest

    def switch(self, timeout: float | None = None) -> SwitchReport | None:
        if self._pending_from == self.version:
            return None
        rep = SwitchReport(self.model_id, self._pending_from, self.version, self._bytes, self._seconds)
        self._pending_from = self.version
        log.info("switch model_id=%s %d -> %d bytes=%d seconds=%.4f (in place, upstream)", *rep.__dict__.values())
        return rep

    @contextmanager
    def active(self) -> Iterator[Any]:
        yield self.model

    def stats(self) -> dict[str, float]:
        return {"version": self.version}


def _build_model(spec: WorkerSpec) -> Any:
    import transformers

    cls = getattr(transformers, spec.model_class, None) or transformers.AutoModelForCausalLM
    config_cls = transformers.AutoConfig.for_model(spec.model_config["model_type"]).__class__
    config = config_cls.from_dict(spec.model_config)
    model = cls(config) if cls is not transformers.AutoModelForCausalLM else cls.from_config(config)
    return model.eval()


def worker_main(spec: WorkerSpec, requests: Any, errors: Any, parent_pid: int, ready: Any = None) -> None:
    """Entry point of a rollout worker process."""
    os.environ.update(spec.env)
    pkg_log = logging.getLogger("mrl_plugins")
    if spec.log_level <= logging.INFO and not pkg_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[mrl worker {spec.index}] %(message)s"))
        pkg_log.addHandler(handler)
        pkg_log.setLevel(spec.log_level)
    try:
        import torch

        from mrl_plugins.manager import get_plugin_manager

        if spec.cores:
            os.sched_setaffinity(0, spec.cores)
        torch.set_num_threads(spec.threads)
        pm = get_plugin_manager(spec.config)
        ctx = StageContext(config=spec.config)
        model = _build_model(spec)
        receiver_end = spec.weight_handle.attach()
        if spec.direct_weights:
            receiver = DirectLoader(model, receiver_end)
        else:
            from mrl_plugins.weight_sync.receiver import DoubleBufferedReceiver

            receiver = DoubleBufferedReceiver(model, receiver_end, staging=spec.config.weight_sync.staging)
        ctx.resources["weight_sync.receiver"] = receiver
        ctx.resources["comm.producer"] = spec.comm_handle.attach()
        engine = spec.engine_factory(
            model, None, params=spec.sampling, device=spec.device, seed=spec.seed + spec.index
        )
        if ready is not None:
            ready.set()  # model built, weights and experience paths attached
        timeout = spec.config.rollout.timeout_s
        while True:
            if os.getppid() != parent_pid:
                return  # trainer died: exit instead of lingering
            try:
                req = requests.get(timeout=0.5)
            except queue.Empty:
                _pull_weights(pm, ctx, timeout)
                continue
            if req is REQ_STOP:
                return
            req_id, chunk, prompts, num_generations, model_id, min_version = req
            deadline = time.monotonic() + timeout
            _pull_weights(pm, ctx, timeout)
            while receiver.version < min_version:
                if time.monotonic() > deadline:
                    raise StageTimeoutError(
                        f"worker {spec.index}: weight version {min_version} not received within {timeout:.0f} s "
                        f"(have {receiver.version})"
                    )
                time.sleep(0.002)
                _pull_weights(pm, ctx, timeout)
            t0 = time.perf_counter()
            with receiver.active():
                version = receiver.version
                out = engine.generate(prompts, num_generations)
            gen_s = time.perf_counter() - t0
            lengths = torch.tensor([len(c) for c in out.completion_ids], dtype=torch.int64)
            flat_ids = torch.tensor(list(itertools.chain.from_iterable(out.completion_ids)), dtype=torch.int64)
            flat_lp = torch.tensor(list(itertools.chain.from_iterable(out.logprobs)), dtype=torch.float32)
            batch = {"completion_ids": flat_ids, "lengths": lengths, "logprobs": flat_lp}
            meta = {
                "model_id": model_id,
                "version": int(version),
                "seq": int(req_id),
                "chunk": int(chunk),
                "worker": spec.index,
                "gen_us": int(gen_s * 1e6),
            }
            pm.comm_send(ctx=ctx, batch=batch, meta=meta, timeout=timeout)
    except BaseException as exc:  # noqa: BLE001 - report to the trainer, then exit non-zero
        try:
            errors.put((spec.index, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"), timeout=2)
        except Exception:  # noqa: BLE001
            pass
        raise SystemExit(3) from None


def _pull_weights(pm: Any, ctx: StageContext, timeout: float) -> None:
    staged = pm.weight_sync_receive(ctx=ctx, model_id="policy", timeout=timeout)
    if staged is not None:
        pm.weight_sync_switch(ctx=ctx, model_id="policy")  # the receiver logs one line per switch


@dataclass
class _Ticket:
    req_id: int
    prompts: list[list[int]]
    num_generations: int
    model_id: str
    chunks: dict[int, tuple[int, list[list[int]]]]  # chunk -> (worker, prompts)
    submitted: float
    results: dict[int, Any] = field(default_factory=dict)


class WorkerPool:
    """Trainer-side handle on the rollout workers."""

    def __init__(
        self,
        pm: Any,
        ctx: StageContext,
        model: Any,
        sampling: Any,
        *,
        placements: list[dict],
        engine_factory: Any,
        seed: int = 0,
    ) -> None:
        from mrl_plugins.upstream import UPSTREAM_COMM_TRANSPORT, UPSTREAM_WEIGHT_TRANSPORT

        cfg = ctx.config
        self.pm, self.ctx, self.cfg = pm, ctx, cfg
        self.n = len(placements)
        self.run_id = f"mrl{os.getpid()}{uuid.uuid4().hex[:6]}"
        self._mp = mp.get_context("spawn")
        self._ids = itertools.count(1)
        self._tickets: dict[int, _Ticket] = {}
        self._abandoned: set[int] = set()
        self._draining: set[int] = set()
        self._stash: dict[tuple[int, int], Any] = {}
        self._restarts = 0
        self._closed = False
        comm_name = UPSTREAM_COMM_TRANSPORT if pm.is_upstream("comm") else cfg.comm.transport
        ws_name = UPSTREAM_WEIGHT_TRANSPORT if pm.is_upstream("weight_sync") else cfg.weight_sync.transport
        comm_factory = pm.backend("mrl_comm_register_transports", comm_name).factory
        ws_factory = pm.backend("mrl_weight_sync_register_transports", ws_name).factory
        self.consumer = comm_factory(cfg.comm, n_producers=self.n, run_id=self.run_id)
        ctx.resources["comm.consumer"] = self.consumer
        self.sender = ws_factory(cfg.weight_sync, model_id="policy", run_id=self.run_id)
        ctx.resources["weight_sync.sender"] = self.sender
        self._errors = self._mp.Queue()
        self._ready: list[Any] = []
        self._specs = []
        self._requests = []
        self._procs: list[Any] = []
        for i, place in enumerate(placements):
            spec = WorkerSpec(
                index=i,
                config=cfg,
                model_config=model.config.to_dict(),
                model_class=type(model).__name__,
                sampling=sampling,
                engine_factory=engine_factory,
                weight_handle=self.sender.receiver_handle(),
                comm_handle=self.consumer.producer_handle(i),
                cores=place.get("cores"),
                threads=place.get("threads", cfg.rollout.engine_threads),
                env=place.get("env", {}),
                device=place.get("device", "cpu"),
                seed=seed,
                direct_weights=pm.is_upstream("weight_sync"),
                log_level=logging.getLogger("mrl_plugins").getEffectiveLevel(),
            )
            self._specs.append(spec)
            self._requests.append(self._mp.Queue())
            self._procs.append(None)
            self._start(i)

    # ------------------------------------------------------------------ processes
    def _start(self, i: int) -> None:
        proc = self._mp.Process(
            target=worker_main,
            args=(self._specs[i], self._requests[i], self._errors, os.getpid(), self._new_ready(i)),
            name=f"mrl-rollout-{i}",
            daemon=True,
        )
        with _main_not_reimported():
            proc.start()
        self._procs[i] = proc
        log.info("rollout worker %d started (pid %d, cores %s)", i, proc.pid, self._specs[i].cores)

    def _fresh_queue(self, i: int) -> None:
        """A restarted worker gets a new request queue: one killed inside ``Queue.get()`` keeps the old queue's
        reader lock forever, and the old queue may hold requests already handed to other workers."""
        old = self._requests[i]
        old.cancel_join_thread()
        old.close()
        self._requests[i] = self._mp.Queue()

    def _new_ready(self, i: int) -> Any:
        event = self._mp.Event()
        if i < len(self._ready):
            self._ready[i] = event
        else:
            self._ready.append(event)
        return event

    @property
    def ready(self) -> bool:
        """Every worker has built its engine and attached its weight and experience paths."""
        return all(e.is_set() for e in self._ready)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p is not None]

    def _check_workers(self) -> None:
        try:
            idx, msg = self._errors.get_nowait()
            raise WorkerDiedError(f"rollout worker {idx} failed: {msg}")
        except queue.Empty:
            pass
        for i, proc in enumerate(self._procs):
            if proc is not None and not proc.is_alive():
                if self._restarts < self.cfg.rollout.restart_workers:
                    self._restarts += 1
                    self.ctx.metrics.add("rollout/worker_restarts", 1) if self.ctx.metrics else None
                    log.warning("rollout worker %d died (exit %s): restarting", i, proc.exitcode)
                    self._fresh_queue(i)
                    self._start(i)
                    self._resubmit_worker(i)
                    continue
                raise WorkerDiedError(
                    f"rollout worker {i} (pid {proc.pid}) died with exit code {proc.exitcode}; "
                    f"set rollout.restart_workers > 0 to restart dead workers"
                )

    def _resubmit_worker(self, i: int) -> None:
        for t in self._tickets.values():
            for chunk, (worker, prompts) in t.chunks.items():
                if worker == i and chunk not in t.results:
                    self._requests[i].put((t.req_id, chunk, prompts, t.num_generations, t.model_id, -1))

    def move_worker(self, i: int, placement: dict, timeout: float | None = None) -> None:
        """Move worker ``i`` to ``placement`` (``cores``/``threads``/``env``/``device``, as the adapter builds
        them) without stopping the service: new requests skip it, its unanswered chunks are handed to the other
        workers first, then it is stopped and restarted in its new place (hybrid mode: shifting capacity between
        the colocated and the dedicated pool). Waits at most ``timeout`` (``rollout.start_timeout_s``)."""
        from mrl_plugins.errors import ConfigError

        if not 0 <= i < self.n:
            raise ConfigError(f"move_worker: no worker {i}; workers are 0..{self.n - 1}")
        if self.n - len(self._draining) < 2:
            raise ConfigError("move_worker: needs another active worker to serve while this one moves")
        timeout = self.cfg.rollout.start_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self._draining.add(i)
        try:
            others = [w for w in range(self.n) if w not in self._draining]
            for t in self._tickets.values():  # drain: its unanswered chunks go to the others
                for chunk, (worker, prompts) in list(t.chunks.items()):
                    if worker == i and chunk not in t.results:
                        w = others[chunk % len(others)]
                        t.chunks[chunk] = (w, prompts)
                        self._requests[w].put((t.req_id, chunk, prompts, t.num_generations, t.model_id, -1))
            proc = self._procs[i]
            self._requests[i].put(REQ_STOP)
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(2)
            self._fresh_queue(i)
            spec = self._specs[i]
            spec.cores = placement.get("cores", spec.cores)
            spec.threads = placement.get("threads", spec.threads)
            spec.env = placement.get("env", spec.env)
            spec.device = placement.get("device", spec.device)
            self._start(i)
            while not self._ready[i].is_set():
                if not self._procs[i].is_alive():
                    self._check_workers()
                if time.monotonic() > deadline:
                    raise StageTimeoutError(f"move_worker: worker {i} not ready within {timeout:.0f} s")
                time.sleep(0.05)
            log.info("rollout worker %d moved to %s", i, placement)
        finally:
            self._draining.discard(i)

    # ------------------------------------------------------------------ requests
    def publish(self, version: int, named_tensors: Any) -> Any:
        return self.pm.weight_sync_publish(
            ctx=self.ctx, model_id="policy", version=version, named_tensors=named_tensors
        )

    def submit(
        self, prompts: list[list[int]], num_generations: int, *, model_id: str = "policy", min_version: int = -1
    ) -> int:
        """Split ``prompts`` over the workers; returns a ticket id for :meth:`collect`."""
        req_id = next(self._ids)
        active = [w for w in range(self.n) if w not in self._draining]
        per = -(-len(prompts) // len(active))
        chunks = {}
        for c, worker in enumerate(active):
            part = [list(p) for p in prompts[c * per : (c + 1) * per]]
            if part:
                chunks[c] = (worker, part)
                self._requests[worker].put((req_id, c, part, num_generations, model_id, min_version))
        self._tickets[req_id] = _Ticket(req_id, prompts, num_generations, model_id, chunks, time.monotonic())
        return req_id

    def discard(self, req_id: int) -> None:
        """Forget ticket ``req_id``: its answers are dropped when they arrive (no waiting)."""
        if self._tickets.pop(req_id, None) is not None:
            self._abandoned.add(req_id)
        for key in [k for k in self._stash if k[0] == req_id]:
            del self._stash[key]

    def collect(self, req_id: int, timeout: float | None = None) -> RolloutResult:
        """Wait for every chunk of ticket ``req_id``; never longer than ``timeout`` (rollout.timeout_s)."""
        ticket = self._tickets[req_id]
        timeout = self.cfg.rollout.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        for key in [k for k in self._stash if k[0] == req_id]:
            ticket.results[key[1]] = self._stash.pop(key)
        while len(ticket.results) < len(ticket.chunks):
            self._check_workers()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StageTimeoutError(
                    f"rollout: no answer for request {req_id} within {timeout:.0f} s (rollout.timeout_s); "
                    f"workers alive: {[p.is_alive() for p in self._procs]}"
                )
            try:
                got = self.pm.comm_receive(ctx=self.ctx, timeout=min(0.5, remaining))
            except (TimeoutError, ChannelClosedError):
                # dead or closed producers: _check_workers() at the top of the loop raises or restarts them
                time.sleep(0.05)
                continue
            meta, batch = _unpack(got)
            entry = (meta, {k: _own(v) for k, v in batch.items()})
            if hasattr(got, "release"):
                got.release()
            key = (int(meta["seq"]), int(meta["chunk"]))
            if key[0] == req_id:
                ticket.results[key[1]] = entry
            elif key[0] in self._tickets:
                self._stash[key] = entry
            elif key[0] in self._abandoned and self.ctx.metrics is not None:
                self.ctx.metrics.add("rollout/discarded_batches", 1)
        del self._tickets[req_id]
        return self._assemble(ticket)

    def _assemble(self, ticket: _Ticket) -> RolloutResult:
        prompt_ids, completion_ids, logprobs, versions, gen_us = [], [], [], [], 0
        for c in sorted(ticket.chunks):
            meta, batch = ticket.results[c]
            versions.append(int(meta["version"]))
            gen_us = max(gen_us, int(meta.get("gen_us", 0)))
            lengths = batch["lengths"].tolist()
            ids = batch["completion_ids"].tolist()
            lps = batch["logprobs"].tolist()
            off = 0
            for n in lengths:
                completion_ids.append(ids[off : off + n])
                logprobs.append(lps[off : off + n])
                off += n
            prompt_ids.extend(p for p in ticket.chunks[c][1] for _ in range(ticket.num_generations))
        return RolloutResult(
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            logprobs=logprobs,
            weight_version=min(versions),
            model_id=ticket.model_id,
            metrics={"generate_s": gen_us / 1e6, "version_spread": max(versions) - min(versions)},
        )

    def stats(self) -> dict[str, float]:
        out = {}
        for name, obj in (("comm", self.consumer), ("weights", self.sender)):
            st = getattr(obj, "stats", None)
            if st is not None:
                out.update({f"{name}/{k}": v for k, v in st().items() if isinstance(v, int | float)})
        return out

    def close(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        for q in self._requests:
            try:
                q.put(REQ_STOP)
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            if proc is None:
                continue
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        for q in [*self._requests, self._errors]:
            q.close()
            q.join_thread()
        for obj in (self.consumer, self.sender):
            with nullcontext():
                try:
                    obj.close(unlink=True)
                except TypeError:
                    obj.close()


@contextmanager
def _main_not_reimported() -> Iterator[None]:
    """Spawned workers need nothing from ``__main__``: do not re-run the user's script in them.

    ``multiprocessing`` spawn re-executes the main script in each child (unless it is guarded by
    ``if __name__ == "__main__"``); a training script that builds a trainer at top level would then
    build it again in every worker. Hiding ``__main__.__file__`` while starting the process skips that.
    """
    import sys

    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        if main is not None and getattr(main, "__spec__", None) is None:
            main.__dict__.pop("__file__", None)
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


def _unpack(got: Any) -> tuple[dict, dict]:
    if hasattr(got, "meta") and hasattr(got, "batch"):
        return dict(got.meta), dict(got.batch)
    meta, batch = got
    return dict(meta), dict(batch)


def _own(value: Any) -> Any:
    """Copy a received field out of the transport's buffer (it is released right after)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.clone()
    return torch.as_tensor(value).clone()
