"""Ray as the workers' launcher (``rollout.ray_address``) without a cluster: the config's choices and refusals, Ray
never imported at module import, one clear error within seconds where no cluster answers (pool and ``mrl doctor``),
and the launcher's pure decisions (bundles, whether they can be placed, what a silent worker means). The cluster
itself: tests/test_netns_ray.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from mrl_plugins.config import load_config
from mrl_plugins.errors import ConfigError
from mrl_plugins.rollout.ray_launcher import actor_cores, bundle, describe_nodes, judge, placement_problem
from tests.marks import require_ray

RAY = {"workers": 0, "remote_workers": 1, "ray_address": "auto"}
CROSS = {"comm": {"transport": "torch_distributed"}, "weight_sync": {"transport": "directory", "directory": "/tmp/w"}}


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


def test_who_starts_the_workers_follows_from_the_config(monkeypatch):
    from mrl_plugins.rollout import config as rollout_config

    monkeypatch.setattr(rollout_config, "is_ray_available", lambda: True)  # ray_address is checked as with Ray there
    assert load_config({}).rollout.launch == "local"
    assert load_config({"rollout": {"workers": 2}}).rollout.launch == "local"
    assert load_config({"rollout": {"remote_workers": 2}}).rollout.launch == "manual"  # started by hand
    assert load_config({"rollout": {**RAY}, **CROSS}).rollout.launch == "ray"


@pytest.mark.parametrize(
    ("rollout", "match"),
    [
        ({"launcher": "ray"}, r"rollout.launcher was removed .* set rollout.ray_address"),
        ({"ray_address": "auto"}, r"rollout.ray_address: Ray starts the rollout.remote_workers, which is 0"),
        ({"ray_strategy": "SPREAD"}, r"rollout.ray_strategy: only used with rollout.ray_address set"),
        ({**RAY, "ray_address": "ray://head:10001"}, r"Ray Client address, which the launcher does not support"),
        ({**RAY, "ray_address": "head"}, r"rollout.ray_address: expected HOST:PORT"),
        ({**RAY, "ray_strategy": "ROUND_ROBIN"}, r"'PACK', 'SPREAD', 'STRICT_PACK' or 'STRICT_SPREAD'"),
        ({**RAY, "ray_resources": {"GPU": 1}}, r"rollout.ray_resources: 'GPU': a custom resource name"),
        ({**RAY, "ray_resources": {"rollout_host": 0}}, r"rollout.ray_resources: 'rollout_host'"),
        ({"ray_worker_cores": [1]}, r"rollout.ray_worker_cores: only used with rollout.ray_address set"),
        ({**RAY, "ray_worker_cores": [1, 1]}, r"ray_worker_cores: \[1, 1\] invalid; a list of distinct CPU core"),
        ({**RAY, "ray_worker_cores": [-1]}, r"ray_worker_cores: \[-1\] invalid"),
        ({**RAY, "ray_worker_cores": ["1-3"]}, r"ray_worker_cores: \['1-3'\] invalid"),
        ({**RAY, "ray_worker_cores": [3], "engine_threads": 2}, r"at least engine_threads \(2\) of them"),
    ],
)
def test_bad_launcher_settings_are_one_clear_error(rollout, match):
    with pytest.raises(ConfigError, match=match):
        load_config({"rollout": rollout, **CROSS})


def test_each_actor_on_a_node_takes_its_own_slice_of_ray_worker_cores():
    assert actor_cores(None, 2, ["a", "b"]) == [None, None]
    assert actor_cores([4, 5, 6, 7], 2, ["a", "b", "a"]) == [[4, 5], [4, 5], [6, 7]]
    with pytest.raises(ConfigError, match=r"gives 1 actor\(s\) of engine_threads 2 their cores, but Ray placed 2"):
        actor_cores([4, 5, 6], 2, ["a", "a"])


def test_without_ray_the_ray_launcher_is_one_config_error_and_nothing_imports_it():
    """Ray blocked (as if not installed): ``rollout.ray_address`` is refused when the config loads; the package, the
    manager, the CLI entry point and the launcher's own module import without Ray either way."""
    code = (
        "import sys, json\n"
        "sys.modules['ray'] = None\n"  # `import ray` now fails as where it is not installed
        "import mrl_plugins, mrl_plugins.cli.main, mrl_plugins.rollout.ray_launcher, mrl_plugins.cli.doctor_ray\n"
        "from mrl_plugins.config import load_config\n"
        "from mrl_plugins.errors import ConfigError\n"
        "try:\n"
        f"    load_config({{'rollout': {RAY!r}, **{CROSS!r}}})\n"
        "    print(json.dumps('no error'))\n"
        "except ConfigError as exc:\n"
        "    print(json.dumps(str(exc)))\n"
    )
    got = _python(code)
    assert got.returncode == 0, got.stderr
    assert "Ray is not installed here: pip install 'mrl-plugins[ray]'" in json.loads(got.stdout)
    loaded = _python(
        "import sys\nimport mrl_plugins.cli.main, mrl_plugins.rollout.ray_launcher, mrl_plugins.rollout.pool\n"
        "from mrl_plugins.config import load_config\n"
        "load_config({'rollout': {'workers': 0, 'remote_workers': 1}})\n"
        "print('ray' in sys.modules)"
    )
    assert loaded.stdout.strip() == "False", loaded.stderr


def test_bundles_and_whether_the_cluster_can_hold_them():
    assert bundle(2, "cpu") == {"CPU": 2.0}
    assert bundle(1, "cuda") == {"CPU": 1.0, "GPU": 1.0}
    assert bundle(1, "npu", {"rollout_host": 1}) == {"CPU": 1.0, "NPU": 1.0, "rollout_host": 1.0}
    head = {"NodeID": "h", "Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"memory": 1e9}}
    w1 = {"NodeID": "a", "Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 2.0, "GPU": 1.0}}
    w2 = {"NodeID": "b", "Alive": True, "NodeManagerAddress": "10.0.0.3", "Resources": {"CPU": 1.0}}
    gone = {"NodeID": "c", "Alive": False, "NodeManagerAddress": "10.0.0.4", "Resources": {"CPU": 8.0}}
    nodes = [head, w1, w2, gone]
    two = [bundle(1, "cpu")] * 2
    assert placement_problem(two, "PACK", nodes) is None  # both on w1, or one each
    assert placement_problem([bundle(1, "cpu")] * 3, "SPREAD", nodes) is None  # w1 holds two
    assert "fits on no node" in placement_problem([bundle(1, "cpu")] * 4, "PACK", nodes)  # the dead node counts not
    assert placement_problem(two, "STRICT_SPREAD", nodes) is None
    assert "STRICT_SPREAD needs 3 nodes" in placement_problem([bundle(1, "cpu")] * 3, "STRICT_SPREAD", nodes)
    assert placement_problem(two, "STRICT_PACK", nodes) is None  # w1 has 2 CPUs
    assert "no node has {CPU 3}" in placement_problem([bundle(1, "cpu")] * 3, "STRICT_PACK", nodes)
    assert "fits on no node" in placement_problem([bundle(1, "cuda")] * 2, "PACK", nodes)  # one GPU in the cluster
    assert describe_nodes([w1, gone]) == "10.0.0.2 {CPU 2, GPU 1}; 10.0.0.4 {CPU 8} dead"


@pytest.mark.parametrize(
    ("state", "kw", "kind"),
    [
        ("DEAD", {}, "dead"),  # Ray gave up (max_restarts used up or 0): at once
        ("ALIVE", {"silent": 1.0}, "ok"),
        ("ALIVE", {"silent": 31.0}, "silent"),  # up as Ray sees it, no heartbeat: a cut link, a hang
        ("RESTARTING", {"restarting": True, "waiting": 10.0}, "ok"),  # coming back
        ("ALIVE", {"restarting": True, "waiting": 60.0, "silent": 60.0}, "ok"),  # restarted, importing: start time
        ("RESTARTING", {"restarting": True, "waiting": 31.0, "pg_state": "RESCHEDULING"}, "unplaceable"),
        ("RESTARTING", {"restarting": True, "waiting": 31.0, "pg_state": "CREATED"}, "ok"),
        ("RESTARTING", {"restarting": True, "waiting": 181.0, "pg_state": "CREATED"}, "late"),
        ("PENDING_CREATION", {"joined": False, "waiting": 100.0}, "ok"),  # the first start
        ("ALIVE", {"joined": False, "waiting": 181.0}, "late"),
    ],
)
def test_what_a_silent_ray_worker_means(state, kw, kind):
    base = {"restarting": False, "joined": True, "silent": 3.0, "waiting": 0.0, "pg_state": "CREATED"}
    assert judge(state, **{**base, **kw}, timeout_s=30.0, start_timeout_s=180.0) == kind


@require_ray
@pytest.mark.slow
def test_no_cluster_is_one_clear_error_within_seconds_before_anything_opens(tmp_path):
    """A WorkerPool with launcher ray and nobody at ray_address: one ConfigError naming `ray start --head`, in
    seconds (ray.init alone retries for minutes), before its ends are opened (no weight directory made)."""
    port = _closed_port()
    config = {"rollout": {**RAY, "ray_address": f"127.0.0.1:{port}"}, **CROSS}
    config["weight_sync"] = {"transport": "directory", "directory": str(tmp_path / "w")}
    code = (
        "import json, sys, time\n"
        "from tests.pool_helpers import make_pool\n"
        "from mrl_plugins.errors import ConfigError\n"
        "t0 = time.monotonic()\n"
        "try:\n"
        f"    make_pool({config!r}, placements=[])\n"
        "    print(json.dumps(['no error', 0]))\n"
        "except ConfigError as exc:\n"
        "    print(json.dumps([str(exc), time.monotonic() - t0]))\n"
    )
    got = _python(code, timeout=180)
    assert got.returncode == 0, got.stderr[-3000:]
    text, seconds = json.loads(got.stdout.strip().splitlines()[-1])
    assert f"no Ray cluster at rollout.ray_address '127.0.0.1:{port}'" in text and "ray start --head" in text, text
    assert seconds < 20  # the model is built first in the helper; the refusal itself takes under 5 s
    assert not (tmp_path / "w").exists()  # refused before the weight sender opened its directory


@require_ray
def test_doctor_reports_a_missing_cluster(tmp_path):
    path = tmp_path / "ray.yaml"
    config = {"rollout": {**RAY, "ray_address": f"127.0.0.1:{_closed_port()}"}, **CROSS}
    path.write_text(json.dumps(config))
    t0 = time.monotonic()
    got = subprocess.run([sys.executable, "-m", "mrl_plugins.cli.main", "doctor", "--config", str(path)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert got.returncode == 1, got.stdout + got.stderr
    line = next(x for x in got.stdout.splitlines() if "ray cluster" in x)
    assert (
        line.startswith("fail  ray cluster: Ray (rollout.ray_address): no Ray cluster") and "ray start --head" in line
    )
    assert time.monotonic() - t0 < 60
