"""``python -m benchmarks ray``: what Ray's own processes cost on one host -- the same GRPO job with
its worker started locally (``local``), by hand (``manual``), by Ray (``ray``: ``rollout.ray_address``) and by Ray
with its processes apart (``ray_apart``), repetitions interleaved (the order rotates per
repetition).

* ``local``: ``configs/disaggregated.yaml`` as it is: one worker process of the trainer's, on its own core,
  experience and weights through shared memory.
* ``manual``: the same job with its worker as a remote one, started by hand (``mrl worker --connect`` on this
  host, not bound to a core), experience over ``torch_distributed`` and weights through a ``directory``: the
  transports every remote worker needs, without Ray.
* ``ray``: the same remote worker, started by Ray on a one-node cluster this benchmark starts for the purpose
  (``ray start --head`` with the dashboard off, usage statistics off, a 100 MB object store, every core of the
  host) and stops at the end (it kills that cluster's processes, never ``ray stop``, which stops every Ray process on
  the host). ``ray`` vs ``manual`` is the cost of Ray's own processes, ``manual`` vs ``local`` that of the
  cross-host transports.
* ``ray_apart``: ``ray`` with Ray's own processes kept off the rollout worker's core, as on a host with a core to
  spare: a second one-node cluster started under ``taskset -c <first core>``, the actor bound to the next core
  (``rollout.ray_worker_cores``), the trainer to the first (``rollout.trainer_cores``). On 2 cores the trainer
  shares its core with Ray's processes; the worker's is theirs no more.

Per launcher: steps/s of the whole run (the worker's start included: Ray adds placing and starting its actor), of
its second half (``steady_steps_per_s``) and when the worker was first ready.

Ray's processes (gcs_server, raylet, the minimal dashboard, the autoscaler monitor, the log monitor, the dashboard
and runtime-env agents, idle workers: everything of that cluster but the rollout actor) are measured idle, for
``--idle-s`` seconds after the cluster started and before any run (CPU seconds per process from ``/proc/<pid>/stat``,
their share of one core, their resident memory), and during each ``ray`` run: their CPU seconds and share of the
run, the cores they may run on (``sched_getaffinity``), and, sampled every 50 ms, how often a thread of theirs was
runnable on a core where a thread of the trainer or of the rollout actor was runnable too (``contended_share``:
Ray taking the cores of the trainer or the worker; apart: ``contended_share_actor``, ``contended_share_trainer``,
and ``contended_share_actor_on_its_cores``: the actor's while it ran on its own cores, after its start on the
raylet's).
The host load before and during every run comes with it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

LAUNCHERS = ("local", "manual", "ray", "ray_apart")
SAMPLE_S = 0.05
OBJECT_STORE_BYTES = 100 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) of process ``pid`` so far, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _name(proc: Any) -> str:
    """A short name of one of the cluster's processes (``raylet``, ``gcs_server``, ``ray::DashboardAgent``...)."""
    try:
        cmd = proc.cmdline()
    except Exception:  # noqa: BLE001 - gone
        return "?"
    if not cmd:
        return "?"
    if cmd[0].startswith("ray::"):
        return cmd[0].split()[0]
    for part in cmd[:3]:
        base = os.path.basename(part)
        if base.endswith(".py") or base in ("raylet", "gcs_server"):
            return base.removesuffix(".py")
    return os.path.basename(cmd[0])


class BenchCluster:
    """A one-node Ray cluster for the benchmark, in a session folder of its own; its processes are found by that
    folder (the daemons name it on their command lines) and their descendants (agents, workers)."""

    def __init__(self, cpus: int, cores: list[int] | None = None) -> None:
        self.cores = cores
        self.temp = Path(tempfile.mkdtemp(prefix="mrlbench-ray-", dir="/tmp"))
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        env.pop("RAY_ADDRESS", None)
        pin = ["taskset", "-c", ",".join(map(str, cores))] if cores else []
        cmd = [
            *pin,
            str(Path(sys.executable).with_name("ray")),
            "start",
            "--head",
            f"--port={self.port}",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={cpus}",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            f"--temp-dir={self.temp}",
        ]
        t0 = time.monotonic()
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        self.start_s = time.monotonic() - t0
        if got.returncode != 0:
            self.close()
            raise RuntimeError(
                f"python -m benchmarks ray: `ray start --head` failed: {got.stdout[-2000:]}{got.stderr[-2000:]}"
            )

    def processes(self) -> list[Any]:
        """The cluster's processes now (psutil), the rollout actor included."""
        import psutil

        roots = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if str(self.temp) in " ".join(p.info["cmdline"] or []):
                    roots.append(p)
            except psutil.Error:
                continue
        seen = {p.pid: p for p in roots}
        for p in roots:
            try:
                seen.update({c.pid: c for c in p.children(recursive=True)})
            except psutil.Error:
                continue
        return list(seen.values())

    def own(self) -> dict[int, str]:
        """Ray's own processes: pid -> name (the rollout actor is the job's, not Ray's)."""
        out = {p.pid: _name(p) for p in self.processes()}
        return {pid: n for pid, n in out.items() if not n.startswith("ray::RolloutActor")}

    def actor_pids(self) -> list[int]:
        return [p.pid for p in self.processes() if _name(p).startswith("ray::RolloutActor")]

    def close(self) -> None:
        """SIGTERM the cluster's processes, SIGKILL what is left after 10 s, remove its folder."""
        procs = self.processes()
        for p in procs:
            try:
                p.send_signal(signal.SIGTERM)
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001
                try:
                    p.kill()
                except Exception:  # noqa: BLE001
                    pass
        shutil.rmtree(self.temp, ignore_errors=True)


def idle_cost(cluster: BenchCluster, seconds: float) -> dict[str, Any]:
    """Ray's processes over ``seconds`` with nothing running: CPU seconds, share of one core, resident memory."""
    import psutil

    procs = cluster.own()
    before = {pid: _cpu_s(pid) for pid in procs}
    time.sleep(seconds)
    per: dict[str, dict[str, float]] = {}
    rss = 0
    for pid, name in procs.items():
        after = _cpu_s(pid)
        try:
            mem = psutil.Process(pid).memory_info().rss
        except psutil.Error:
            mem = 0
        rss += mem
        cpu = (after - before[pid]) if after is not None and before[pid] is not None else 0.0
        entry = per.setdefault(name, {"cpu_s": 0.0, "rss_mb": 0.0, "n": 0})
        entry["cpu_s"] += cpu
        entry["rss_mb"] += mem / 2**20
        entry["n"] += 1
    total = sum(e["cpu_s"] for e in per.values())
    return {
        "seconds": seconds,
        "cpu_s": total,
        "cpu_share_of_one_core": total / seconds,
        "rss_mb": rss / 2**20,
        "processes": per,
    }


def _runnable_cores(pid: int) -> set[int]:
    from .lend import _runnable_cores as cores

    return cores(pid)


def _most_seen(seen: Counter) -> list[int]:
    return list(seen.most_common(1)[0][0]) if seen else []


class RayWatch:
    """During one ``ray`` run: Ray's processes' CPU seconds, their allowed cores, and samples where a thread of
    theirs was runnable on a core where the trainer's or the rollout actor's was too."""

    def __init__(self, cluster: BenchCluster) -> None:
        self.cluster = cluster
        self.samples = self.contended = self.contended_trainer = 0
        self.actor_samples: Counter = Counter()  # (the actor's cores then, Ray runnable where it was) -> samples
        self.allowed: dict[str, list[int]] = {}
        # per side, how many samples found its processes allowed on each set of cores (the trainer's budget holds
        # while train() runs only: the most frequent set is the one it trained on)
        self.job_cores: dict[str, Counter] = {"trainer": Counter(), "actor": Counter()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mrl-bench-raywatch", daemon=True)
        self._cpu0: dict[int, tuple[str, float]] = {}
        self.cpu_s: dict[str, float] = {}
        self.wall_s = 0.0

    def __enter__(self) -> RayWatch:
        self._t0 = time.monotonic()
        self._cpu0 = {pid: (n, _cpu_s(pid) or 0.0) for pid, n in self.cluster.own().items()}
        for pid, (name, _) in self._cpu0.items():
            try:
                self.allowed[name] = sorted(os.sched_getaffinity(pid))
            except OSError:
                continue
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.wall_s = time.monotonic() - self._t0
        for pid, (name, c0) in self._cpu0.items():
            c1 = _cpu_s(pid)
            self.cpu_s[name] = self.cpu_s.get(name, 0.0) + ((c1 - c0) if c1 is not None else 0.0)

    def _loop(self) -> None:
        import psutil

        me = psutil.Process()
        actors: list[int] = []
        ray_pids = list(self._cpu0)
        while not self._stop.wait(SAMPLE_S):
            if self.samples % 20 == 0:  # the actor appears (and may restart) during the run: looked for once a second
                actors = self.cluster.actor_pids()
            try:
                trainers = {p.pid for p in me.children() if "mrl_plugins.run" in " ".join(p.cmdline())}
            except psutil.Error:
                continue
            side: dict[str, set[int]] = {"trainer": set(), "actor": set()}
            at: dict[str, tuple[int, ...]] = {"trainer": (), "actor": ()}  # the side's allowed cores now
            for name, pids in (("trainer", trainers), ("actor", actors)):
                for pid in pids:
                    side[name] |= _runnable_cores(pid)
                    try:
                        at[name] = tuple(sorted(os.sched_getaffinity(pid)))
                    except OSError:
                        continue
                    self.job_cores[name][at[name]] += 1
            theirs: set[int] = set()
            for pid in ray_pids:
                theirs |= _runnable_cores(pid)
            self.samples += 1
            self.contended += bool((side["trainer"] | side["actor"]) & theirs)
            self.contended_trainer += bool(side["trainer"] & theirs)
            self.actor_samples[(at["actor"], bool(side["actor"] & theirs))] += 1

    def _actor_share(self, on_its_cores: bool) -> float:
        """Samples with Ray runnable where the actor was, over all samples, or over those while the actor ran on
        the cores it was seen on most (its worker's binding; before it, a Ray actor starts on its raylet's)."""
        own = tuple(_most_seen(self.job_cores["actor"]))
        kept = {key: k for key, k in self.actor_samples.items() if not on_its_cores or key[0] == own}
        n = self.samples if not on_its_cores else sum(kept.values())
        return sum(k for (_, hit), k in kept.items() if hit) / n if n else float("nan")

    def as_dict(self) -> dict[str, Any]:
        total = sum(self.cpu_s.values())
        return {
            "cpu_s": total,
            "cpu_share_of_one_core": total / self.wall_s if self.wall_s else float("nan"),
            "cpu_s_by_process": dict(sorted(self.cpu_s.items(), key=lambda kv: -kv[1])),
            "allowed_cores": self.allowed,
            "job_cores_allowed": sorted({c for seen in self.job_cores.values() for cores in seen for c in cores}),
            "trainer_cores_allowed": _most_seen(self.job_cores["trainer"]),
            "actor_cores_allowed": _most_seen(self.job_cores["actor"]),
            "samples": self.samples,
            "contended_samples": self.contended,
            "contended_share": self.contended / self.samples if self.samples else float("nan"),
            "contended_share_actor": self._actor_share(on_its_cores=False),
            "contended_share_actor_on_its_cores": self._actor_share(on_its_cores=True),
            "contended_share_trainer": self.contended_trainer / self.samples if self.samples else float("nan"),
        }


def job_config(launcher: str, *, steps: int, model: str, tmp: Path, cluster: BenchCluster | None, port: int) -> dict:
    """``configs/disaggregated.yaml`` with its worker started by ``launcher`` (module doc)."""
    from mrl_plugins.cli.compare import RunKind, kind_config
    from mrl_plugins.config import load_yaml

    data = kind_config(
        load_yaml("disaggregated"),
        RunKind({"rollout": "mrl", "weight_sync": "mrl", "comm": "mrl"}),
        steps=steps,
        model=model,
    )
    if launcher == "local":
        return data
    rollout = {
        **(data.get("rollout") or {}),
        "workers": 0,
        "remote_workers": 1,
        "rendezvous": f"127.0.0.1:{port}",
        "local_warmup": False,
    }
    if launcher in ("ray", "ray_apart"):
        rollout["ray_address"] = cluster.address if cluster is not None else "auto"
    if launcher == "ray_apart" and cluster is not None and cluster.cores:
        rest = [c for c in sorted(os.sched_getaffinity(0)) if c not in cluster.cores]
        rollout["ray_worker_cores"] = rest[: rollout.get("engine_threads", 1)]
        rollout["trainer_cores"] = list(cluster.cores)
    data["rollout"] = rollout
    # remote workers: experience over torch_distributed on the rendezvous host, weights through the directory
    data["weight_sync"] = {"directory": str(tmp / f"weights-{launcher}-{port}")}
    return data


def _steady(step_times: list[float]) -> float:
    """Steps/s of a run's second half (the worker's start and the first versions left out)."""
    tail = step_times[len(step_times) // 2 :] or step_times
    return 1.0 / statistics.median(tail) if tail and statistics.median(tail) > 0 else float("nan")


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def run_bench(*, launchers: list[str], reps: int, steps: int, model: str, idle_s: float, out: Path) -> dict:
    from mrl_plugins.cli.compare import RunKind

    from .job import run_job

    kind = RunKind({"rollout": "mrl", "weight_sync": "mrl", "comm": "mrl"})
    cores = sorted(os.sched_getaffinity(0))
    clusters: dict[str, BenchCluster] = {}
    result: dict[str, Any] = {"launchers": {}, "steps": steps, "model": model, "reps": reps}
    try:
        if "ray" in launchers:
            clusters["ray"] = BenchCluster(cpus=len(cores))
        if "ray_apart" in launchers:
            if len(cores) < 2:
                raise RuntimeError(
                    "python -m benchmarks ray: the 'ray_apart' launcher needs 2 cores (Ray's and the worker's)"
                )
            clusters["ray_apart"] = BenchCluster(cpus=len(cores), cores=cores[:1])
        cluster = clusters.get("ray") or clusters.get("ray_apart")
        if cluster is not None:
            time.sleep(2.0)  # the agents finish starting
            result["ray_cluster_start_s"] = cluster.start_s
            result["ray_idle"] = idle_cost(cluster, idle_s)
            i = result["ray_idle"]
            print(
                f"ray idle: {i['cpu_share_of_one_core']:.3f} of a core over {idle_s:.0f} s, {i['rss_mb']:.0f} MB "
                f"resident in {sum(int(p['n']) for p in i['processes'].values())} processes",
                flush=True,
            )
        runs: dict[str, list[dict]] = {name: [] for name in launchers}
        for rep in range(reps):
            order = launchers[rep % len(launchers) :] + launchers[: rep % len(launchers)]
            for name in order:
                port = _free_port()
                data = job_config(name, steps=steps, model=model, tmp=out, cluster=clusters.get(name), port=port)
                worker = None
                if name == "manual":  # waits for the trainer's store, which the run opens
                    worker = subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "mrl_plugins.cli.main",
                            "worker",
                            "--connect",
                            f"127.0.0.1:{port}",
                            "--index",
                            "0",
                            "--threads",
                            "1",
                            "--timeout",
                            "600",
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        env=dict(os.environ, OMP_NUM_THREADS="1"),
                    )
                try:
                    if name in clusters:
                        with RayWatch(clusters[name]) as watch:
                            res, load = run_job(data, out, f"{name}-{rep}", kind, steps)
                        extra = {"ray_during_run": watch.as_dict()}
                    else:
                        res, load = run_job(data, out, f"{name}-{rep}", kind, steps)
                        extra = {}
                finally:
                    if worker is not None:
                        try:
                            worker.wait(60)
                        except subprocess.TimeoutExpired:
                            worker.kill()
                            worker.wait(10)
                mrl = res.get("mrl_metrics") or {}
                run = {
                    "steps_per_s": res["steps_per_s"],
                    "steady_steps_per_s": _steady(res.get("step_times") or []),
                    "worker_ready_s": mrl.get("mrl/rollout/worker_ready_s", float("nan")),
                    "final_reward": res["final_reward"],
                    "restarts": mrl.get("mrl/rollout/worker_restarts", 0.0),
                    "host_load": load,
                    **extra,
                }
                runs[name].append(run)
                print(
                    f"  {name:<7} rep {rep}: {run['steps_per_s']:.3f} steps/s ({run['steady_steps_per_s']:.3f} in the "
                    f"second half; worker ready after {run['worker_ready_s']:.1f} s)",
                    flush=True,
                )
        for name, rs in runs.items():
            entry: dict[str, Any] = {
                "steps_per_s": _stats([r["steps_per_s"] for r in rs]),
                "steady_steps_per_s": _stats([r["steady_steps_per_s"] for r in rs]),
                "worker_ready_s": _stats([r["worker_ready_s"] for r in rs]),
                "runs": rs,
            }
            if name in clusters:
                entry["ray_cpu_share_of_one_core_during_run"] = _stats(
                    [r["ray_during_run"]["cpu_share_of_one_core"] for r in rs]
                )
                for key in (
                    "contended_share",
                    "contended_share_actor",
                    "contended_share_actor_on_its_cores",
                    "contended_share_trainer",
                ):
                    entry[key] = _stats([r["ray_during_run"][key] for r in rs])
            result["launchers"][name] = entry
        ratios = {}
        for key in ("steps_per_s", "steady_steps_per_s"):
            med = {n: e[key]["median"] for n, e in result["launchers"].items()}
            for a, b in (
                ("ray", "local"),
                ("ray", "manual"),
                ("manual", "local"),
                ("ray_apart", "ray"),
                ("ray_apart", "local"),
            ):
                if a in med and b in med and med[b]:
                    ratios[f"{a}_vs_{b}_{key}"] = med[a] / med[b]
        result["ratios"] = ratios
    finally:
        left = []
        for made in clusters.values():
            made.close()
            left += [f"{p.pid} {_name(p)}" for p in made.processes()]
        if clusters:
            result["ray_processes_left"] = left
    result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    result["cpus"] = len(os.sched_getaffinity(0))
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks ray",
        description="the same GRPO job with rollout.launcher local, manual, ray and ray_apart (Ray's "
        "processes on the first core, the actor on the next) on this host (interleaved): steps/s, Ray's idle CPU and "
        "memory, Ray's CPU and cores during the runs.",
    )
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--reps", type=int, default=3, help="runs per launcher (default 3), interleaved")
    p.add_argument("--steps", type=int, default=30, help="GRPO steps per run (default 30)")
    p.add_argument("--model", default="small", help="preset (default small)")
    p.add_argument("--launchers", default=",".join(LAUNCHERS), help="which, comma-separated (default all four)")
    p.add_argument("--idle-s", type=float, default=20.0, help="seconds Ray's idle cost is measured (default 20)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 6 steps, 1 rep, 3 s idle")
    return p


def cli(argv: list[str]) -> int:
    ns = parser().parse_args(argv)
    from mrl_plugins.errors import ConfigError

    launchers = [x.strip() for x in ns.launchers.split(",") if x.strip()]
    bad = [x for x in launchers if x not in LAUNCHERS]
    if bad or not launchers:
        raise ConfigError(f"--launchers: {bad or ns.launchers!r} invalid; valid: {', '.join(LAUNCHERS)}")
    if {"ray", "ray_apart"} & set(launchers):
        from mrl_plugins.optional import is_ray_available

        if not is_ray_available():
            raise ConfigError("python -m benchmarks ray: the 'ray' launcher needs Ray: pip install 'mrl-plugins[ray]'")
    if ns.quick:
        ns.reps, ns.steps, ns.model, ns.idle_s = 1, 6, "tiny", 3.0
    print(f"GRPO on '{ns.model}', {ns.steps} steps, launchers {', '.join(launchers)}, {ns.reps} rep(s)", flush=True)
    with tempfile.TemporaryDirectory(prefix="mrl-bench-ray-") as tmp:
        result = run_bench(
            launchers=launchers, reps=ns.reps, steps=ns.steps, model=ns.model, idle_s=ns.idle_s, out=Path(tmp)
        )
    print(
        json.dumps(
            {
                "ratios": result["ratios"],
                "ray_idle": {k: v for k, v in (result.get("ray_idle") or {}).items() if k != "processes"},
            },
            indent=1,
        )
    )
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(cli(sys.argv[1:]))
