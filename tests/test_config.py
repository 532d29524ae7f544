"""Configuration loading: bundled YAML files, typed sections, clear errors naming key and valid values."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mrl_plugins.config import (
    MODES,
    MrlConfig,
    PluginsConfig,
    TrainConfig,
    apply_env_overrides,
    bundled_configs,
    load_config,
    load_yaml,
    resolve_config_path,
)
from mrl_plugins.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ("upstream", "colocate", "disaggregated", "hybrid", "compare_small", "compare_tools", "vllm")


# --------------------------------------------------------------------------- bundled files


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_configs_load(name):
    path = resolve_config_path(name)
    assert path.name == f"{name}.yaml"
    assert path.read_bytes() == (REPO_ROOT / "configs" / f"{name}.yaml").read_bytes()  # editable or installed copy
    cfg = load_config(path)
    assert isinstance(cfg, MrlConfig)
    assert cfg.mode in MODES
    raw = load_yaml(path)
    assert cfg.plugins.as_dict() == {**PluginsConfig().as_dict(), **(raw.get("plugins") or {})}
    if "mode" in raw:
        assert cfg.mode == raw["mode"]
    for section in ("rollout", "weight_sync", "comm", "train"):
        for key, value in (raw.get(section) or {}).items():
            assert getattr(getattr(cfg, section), key) == value, f"{section}.{key}"


def test_bundled_set_and_upstream_contents():
    assert set(BUNDLED) <= set(bundled_configs())
    cfg = load_config("upstream")
    assert cfg.plugins.as_dict() == {"rollout": "upstream", "weight_sync": "upstream", "comm": "upstream"}
    assert load_config("hybrid").mode == "hybrid"
    assert load_config("disaggregated").mode == "disaggregated"


def test_resolve_config_path():
    bundled = bundled_configs()["colocate"]
    assert bundled.read_bytes() == (REPO_ROOT / "configs" / "colocate.yaml").read_bytes()
    assert resolve_config_path("colocate") == bundled
    assert resolve_config_path("colocate.yaml") == bundled
    assert (
        resolve_config_path("configs/colocate.yaml").read_text() == (REPO_ROOT / "configs/colocate.yaml").read_text()
    )
    with pytest.raises(ConfigError, match=r"config file 'nosuch' not found; bundled configs: .*'colocate'"):
        resolve_config_path("nosuch")
    with pytest.raises(ConfigError, match="not found"):
        resolve_config_path("/some/where/colocate.yaml")  # a real path is never swapped for the bundled one


def test_user_file_preferred_over_bundled(tmp_path, monkeypatch):
    (tmp_path / "colocate.yaml").write_text("mode: hybrid\n")
    monkeypatch.chdir(tmp_path)
    assert load_config("colocate.yaml").mode == "hybrid"
    assert load_config(tmp_path / "colocate.yaml").mode == "hybrid"


# --------------------------------------------------------------------------- inputs


def test_input_kinds(tmp_path):
    default = load_config(None)
    assert default == MrlConfig()
    assert default.plugins.as_dict() == {"rollout": "mrl", "weight_sync": "mrl", "comm": "mrl"}
    assert isinstance(default.train, TrainConfig)
    from_dict = load_config({"mode": "hybrid", "rollout": {"workers": 2}})
    assert from_dict.mode == "hybrid" and from_dict.rollout.workers == 2
    path = tmp_path / "c.yaml"
    path.write_text("mode: disaggregated\ncomm:\n  codec: raw\n")
    assert load_config(path).comm.codec == "raw"
    assert load_config(str(path)).mode == "disaggregated"
    obj = MrlConfig(mode="hybrid")
    loaded = load_config(obj)  # validated and copied: what a run resolves into it stays out of the caller's
    assert loaded == obj and loaded is not obj and loaded.rollout is not obj.rollout
    given = MrlConfig()
    given.device, given.train = " CPU ", {"device": "CPU"}  # changed after it was built
    assert (load_config(given).device, load_config(given).train.device) == ("cpu", "cpu")
    assert (given.device, given.train) == (" CPU ", {"device": "CPU"})  # not even made canonical in place
    with pytest.raises(ConfigError, match="expected a YAML path, a dict or an MrlConfig, got int"):
        load_config(3)


def test_config_object_is_validated():
    with pytest.raises(ConfigError, match="mode: 'cluster'"):
        load_config(MrlConfig(mode="cluster"))


def test_empty_file_means_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    assert load_config(path) == MrlConfig()


def test_round_trip_through_dict():
    cfg = load_config("colocate")
    data = dataclasses.asdict(cfg)
    assert load_config(data) == cfg


def test_float_fields_accept_ints():
    cfg = load_config({"train": {"learning_rate": 1}})
    assert cfg.train.learning_rate == 1.0 and isinstance(cfg.train.learning_rate, float)


# --------------------------------------------------------------------------- errors


def test_unknown_top_level_key():
    with pytest.raises(ConfigError) as err:
        load_config({"pluggins": {}})
    msg = str(err.value)
    assert "'pluggins'" in msg
    for key in ("plugins", "disable", "mode", "timeout_s", "checksums", "rollout", "weight_sync", "comm", "train"):
        assert f"'{key}'" in msg, key


@pytest.mark.parametrize(
    ("data", "key", "valid"),
    [
        ({"rollout": {"foo": 1}}, "rollout", "max_staleness"),
        ({"comm": {"foo": 1}}, "comm", "codec"),
        ({"weight_sync": {"foo": 1}}, "weight_sync", "transport"),
        ({"train": {"foo": 1}}, "train", "steps"),
        ({"plugins": {"foo": "mrl"}}, "plugins", "rollout"),
    ],
)
def test_unknown_nested_key(data, key, valid):
    with pytest.raises(ConfigError) as err:
        load_config(data)
    msg = str(err.value)
    assert msg.startswith(f"unknown {key} key 'foo'; valid keys: ") and f"'{valid}'" in msg  # the section named once


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"mode": "cluster"}, r"^mode: 'cluster' invalid; valid: 'colocate', 'disaggregated' or 'hybrid'$"),
        ({"train": {"device": "tpu"}}, r"^train\.device: 'tpu'.*'auto', 'cpu', 'cuda', 'cuda:N', 'npu' or 'npu:N'"),
        ({"train": {"device": "cuda:x"}}, r"^train\.device: 'cuda:x'"),
        ({"train": {"device": "cpu:3"}}, r"^train\.device: 'cpu:3'"),
        ({"rollout": {"max_staleness": -1}}, r"^rollout\.max_staleness: must be >= 0, got -1$"),
        ({"train": {"trainer": "ppo"}}, r"^train\.trainer: 'ppo' invalid; valid: 'grpo' or 'rloo'$"),
        ({"rollout": {"placement": "x"}}, r"^rollout\.placement: 'x' invalid; valid: 'auto' or 'fixed'$"),
        ({"rollout": {"engine_threads": 0}}, r"^rollout\.engine_threads: must be >= 1, got 0$"),
        ({"rollout": {"memory_headroom": 5.0}}, r"^rollout\.memory_headroom: must be in \[0, 4\], got 5\.0$"),
        ({"comm": {"slot_bytes": 10}}, r"^comm\.slot_bytes: must be >= 4096, got 10$"),
    ],
)
def test_bad_enum_values_name_valid_values(data, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(data)


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"mode": 5}, r"^mode: expected str, got 5"),
        ({"checksums": "no"}, r"^checksums: expected bool, got 'no'"),
        ({"timeout_s": 0.5}, r"^timeout_s: must be >= 1, got 0\.5"),
        ({"disable": "mrl"}, r"^disable: expected list, got 'mrl'"),
        ({"disable": ["mrl", 3]}, r"^disable: expected list"),
        ({"train": {"steps": "10"}}, r"^train\.steps: expected int, got '10'"),
        ({"train": {"steps": True}}, r"^train\.steps: expected int, got True"),
        ({"rollout": {"workers": 1.5}}, r"^rollout\.workers: expected int, got 1\.5"),
        ({"plugins": {"rollout": 3}}, r"^plugins\.rollout: expected str, got 3"),
        ({"rollout": 5}, r"^rollout: expected a mapping, got int"),
        ({"comm": []}, r"^comm: expected a mapping, got list"),
        ({"train": [1]}, r"^train: expected a mapping, got list"),
        ({"train": {"steps": 0}}, r"^train\.steps: must be >= 1"),
    ],
)
def test_wrong_types(data, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(data)


def test_non_mapping_top_level(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- mode\n- colocate\n")
    with pytest.raises(ConfigError, match=r"list\.yaml: the top level must be a mapping, got list"):
        load_config(path)
    with pytest.raises(ConfigError, match="expected a mapping at the top level, got list"):
        MrlConfig.from_dict(["mode"])


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("mode: colocate\nrollout:\n  workers: [1, 2\n  max_staleness: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert str(path) in msg and "malformed YAML" in msg
    assert "line 4" in msg
    assert "\n" not in msg


def test_tab_indentation_is_malformed(tmp_path):
    path = tmp_path / "tabs.yaml"
    path.write_text("rollout:\n\tworkers: 1\n")
    with pytest.raises(ConfigError, match=r"tabs\.yaml: line 2 malformed YAML"):
        load_config(path)


# --------------------------------------------------------------------------- environment


def test_env_overrides():
    cfg = MrlConfig.from_dict({"disable": ["a"]})
    out = apply_env_overrides(cfg, {"MRL_DISABLED_PLUGINS": " b, a ,,c", "MRL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert out.disable == ["a", "b", "c"]
    assert out.autoload is False
    assert cfg.disable == ["a"] and cfg.autoload is True  # the input is never modified
    assert apply_env_overrides(cfg, {}) == cfg
    for value, expected in (("true", False), ("yes", False), ("0", True), ("", True)):
        assert apply_env_overrides(MrlConfig(), {"MRL_DISABLE_PLUGIN_AUTOLOAD": value}).autoload is expected


def test_env_overrides_from_process_env(monkeypatch):
    monkeypatch.setenv("MRL_DISABLED_PLUGINS", "mrl.comm")
    monkeypatch.delenv("MRL_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    assert apply_env_overrides(MrlConfig()).disable == ["mrl.comm"]


def test_every_field_has_help_or_says_why_it_is_none():
    from mrl_plugins.comm.config import CommConfig
    from mrl_plugins.config_fields import is_internal
    from mrl_plugins.rollout.config import RolloutConfig
    from mrl_plugins.weight_sync.config import WeightSyncConfig

    for cls in (MrlConfig, PluginsConfig, TrainConfig, RolloutConfig, WeightSyncConfig, CommConfig):
        for f in dataclasses.fields(cls):
            text = f.metadata.get("internal") if is_internal(f) else f.metadata.get("help")
            assert text, f"{cls.__name__}.{f.name} has no help (or, internal, no why)"


def test_config_object_sections_are_validated():
    from mrl_plugins.rollout.config import RolloutConfig

    with pytest.raises(ConfigError, match=r"rollout\.placement: 'eager' invalid"):
        load_config(MrlConfig(rollout=RolloutConfig(placement="eager")))
    with pytest.raises(ConfigError, match=r"train\.trainer: 'ppo'"):
        load_config(MrlConfig(train=TrainConfig(trainer="ppo")))
    with pytest.raises(ConfigError, match=r"plugins\.comm: expected str"):
        load_config(MrlConfig(plugins=PluginsConfig(comm=None)))


def test_config_object_accepts_section_dicts():
    cfg = MrlConfig(rollout={"workers": 3}, plugins={"comm": "upstream"}, train={"steps": 2})
    assert cfg.rollout.workers == 3 and cfg.rollout.pipeline == "async" and cfg.rollout.timeout_s == 120
    assert cfg.plugins.comm == "upstream" and cfg.plugins.rollout == "mrl"
    assert cfg.train.steps == 2
    with pytest.raises(ConfigError, match=r"^unknown rollout key 'bogus'"):
        MrlConfig(rollout={"bogus": 1})


def test_top_level_parser_covers_every_field():
    non_default = {
        "plugins": {"rollout": "upstream"},
        "disable": ["x"],
        "autoload": False,
        "mode": "hybrid",
        "device": "cpu",
        "timeout_s": 30.0,
        "checksums": False,
        "train": {"steps": 3},
        "log_metrics": False,
        "rollout": {"workers": 2},
        "weight_sync": {"transport": "directory", "directory": "/tmp/w"},
        "comm": {"codec": "raw"},
    }
    assert set(non_default) == {f.name for f in dataclasses.fields(MrlConfig)}
    cfg = load_config(non_default)
    assert dataclasses.asdict(cfg) != dataclasses.asdict(MrlConfig())
    for key, value in non_default.items():
        got = getattr(cfg, key)
        if dataclasses.is_dataclass(got):
            for k, v in value.items():
                assert getattr(got, k) == v, f"{key}.{k}"
        else:
            assert got == value, key


def test_removed_key_is_one_error_naming_the_removal():
    """``comm.prefetch`` did nothing and was removed: a config that still sets it is told so, not 'unknown key'."""
    from mrl_plugins.config import load_config

    with pytest.raises(ConfigError, match=r"^comm\.prefetch was removed: .*rollout\.max_staleness >= 1"):
        load_config({"comm": {"prefetch": 2}})


# --------------------------------------------------------------------------- what a user sets, what follows from it

#: the user's keys outside train.* (docs/config.md lists these and no other)
USER_KEYS = 35


def test_a_user_sets_about_thirty_keys_and_docs_list_exactly_those():
    from benchmarks.config_docs import _sections, user_fields

    keys = []
    for key, cls, _ in _sections():
        if key in ("", "plugins", "rollout", "weight_sync", "comm"):
            nested = {"plugins", "rollout", "weight_sync", "comm", "train"}
            keys += [f"{key}.{f.name}" if key else f.name for f in user_fields(cls) if key or f.name not in nested]
    assert len(keys) == USER_KEYS, keys
    doc = (REPO_ROOT / "docs" / "config.md").read_text()
    for key in keys:
        assert f"| `{key}` |" in doc, key
    for hidden in ("rollout.timeout_s", "comm.ring_slots", "rollout.local_warmup", "weight_sync.chunk_bytes"):
        assert f"| `{hidden}` |" not in doc


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (
            {"rollout": {"timeout_s": 5}},
            r"^rollout\.timeout_s is not a setting \(since 2026-12-04\): the top-level timeout_s",
        ),
        ({"rollout": {"start_timeout_s": 5}}, r"^rollout\.start_timeout_s is not a setting.*1\.5 x timeout_s"),
        ({"comm": {"heartbeat_timeout_s": 9}}, r"^comm\.heartbeat_timeout_s is not a setting.*min\(timeout_s, 5 s\)"),
        ({"comm": {"ring_slots": 2}}, r"^comm\.ring_slots is not a setting"),
        ({"comm": {"checksum": "none"}}, r"^comm\.checksum is not a setting.*checksums"),
        ({"weight_sync": {"verify_checksum": False}}, r"^weight_sync\.verify_checksum is not a setting.*checksums"),
        ({"rollout": {"local_warmup": False}}, r"^rollout\.local_warmup is not a setting.*trainer's own model"),
        (
            {"rollout": {"trainer_threads": 2}},
            r"^rollout\.trainer_threads is not a setting.*one torch thread per core",
        ),
        ({"autoload": False}, r"^autoload is not a setting.*MRL_DISABLE_PLUGIN_AUTOLOAD=1"),
        ({"device": "cpu"}, r"^device is not a setting.*trainer is on.*train\.device"),
        ({"rollout": {"launcher": "ray"}}, r"^rollout\.launcher was removed.*rollout\.ray_address"),
        ({"rollout": {"pipeline": "sync"}}, r"^rollout\.pipeline is not a setting.*max_staleness: 0 takes turns"),
        ({"rollout": {"stale_policy": "keep"}}, r"^rollout\.stale_policy is not a setting.*max_staleness: null"),
        ({"ports": {"a": 1}}, r"^ports was removed.*mrl doctor --ports"),
    ],
)
def test_a_key_that_is_no_setting_any_more_is_one_error_naming_what_decides_it(user_config, data, says):
    with pytest.raises(ConfigError, match=says):
        load_config(data)


def test_the_tests_and_benchmarks_may_set_internal_values(monkeypatch):
    monkeypatch.setenv("MRL_ALLOW_INTERNAL_KEYS", "1")
    cfg = load_config({"timeout_s": 30, "rollout": {"timeout_s": 5, "local_warmup": False}, "comm": {"ring_slots": 2}})
    assert (cfg.rollout.timeout_s, cfg.rollout.local_warmup, cfg.comm.ring_slots) == (5, False, 2)
    assert cfg.weight_sync.timeout_s == 30  # what is not set is still derived
    with pytest.raises(ConfigError, match="rollout.launcher was removed"):  # removed keys stay errors
        load_config({"rollout": {"launcher": "ray"}})


def test_one_timeout_and_the_transports_follow_from_the_deployment(user_config):
    cfg = load_config({"timeout_s": 40})
    assert cfg.rollout.timeout_s == cfg.weight_sync.timeout_s == cfg.comm.send_timeout_s == 40
    assert cfg.comm.receive_timeout_s == 40 and cfg.rollout.start_timeout_s == 60  # a start: 1.5 x
    assert cfg.comm.heartbeat_timeout_s == 5  # a peer on this host: dead after min(T, 5 s)
    assert (cfg.weight_sync.transport, cfg.comm.transport, cfg.comm.host) == ("shm", "shm", "127.0.0.1")
    assert cfg.rollout.lend_cores is True and cfg.rollout.trainer_threads == 1
    assert cfg.device == "auto"  # the trainer's device, set by enable(); train.device is where mrl run puts the model
    assert cfg.rollout.start_timeout_s == 60 and load_config({}).rollout.start_timeout_s == 180
    from mrl_plugins.manager import get_plugin_manager

    # vLLM's own start (declared on its registration, applied when the plugin manager looks the engine up)
    assert get_plugin_manager({"rollout": {"engine": "vllm"}}).config.rollout.start_timeout_s == 300
    remote = load_config({"timeout_s": 40, "rollout": {"remote_workers": 1, "rendezvous": "10.0.0.7:29500"}})
    assert (remote.weight_sync.transport, remote.comm.transport) == ("broadcast", "torch_distributed")
    assert remote.comm.host == "10.0.0.7" and remote.comm.heartbeat_timeout_s == 40  # across hosts: T
    shared = load_config({"rollout": {"remote_workers": 1}, "weight_sync": {"directory": "/shared/w"}})
    assert shared.weight_sync.transport == "directory"
    explicit = load_config({"weight_sync": {"transport": "per_param"}, "comm": {"transport": "queue"}})
    assert (explicit.weight_sync.transport, explicit.comm.transport) == ("per_param", "queue")
    off = load_config({"checksums": False, "rollout": {"trainer_cores": [0, 1]}, "train": {"device": "cpu"}})
    assert off.weight_sync.verify_checksum is False and off.comm.checksum == "none"
    assert off.rollout.trainer_threads == 2 and off.device == "auto" and off.train.device == "cpu"


def test_max_staleness_is_the_pipeline(user_config):
    turns, ahead, keep = (load_config({"rollout": {"max_staleness": v}}).rollout for v in (0, 2, None))
    assert (turns.pipeline, turns.stale_policy) == ("sync", "drop")
    assert (ahead.pipeline, ahead.stale_policy, ahead.staleness_bound) == ("async", "drop", 2.0)
    assert (keep.pipeline, keep.stale_policy, keep.staleness_bound) == ("async", "keep", float("inf"))


def test_every_bundled_config_loads_as_a_users_config(user_config):
    from mrl_plugins.config import bundled_configs

    for name in bundled_configs():
        load_config(name)


# --------------------------------------------------------------------------- review fixes (one rule each)


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"timeout_s": float("inf")}, "timeout_s"),
        ({"rollout": {"tool_timeout_s": float("nan")}}, r"rollout\.tool_timeout_s"),
        ({"train": {"learning_rate": float("-inf")}}, r"train\.learning_rate"),
        ({"rollout": {"memory_headroom": float("nan")}}, r"rollout\.memory_headroom"),
    ],
)
def test_every_float_is_finite(data, key):
    with pytest.raises(ConfigError, match=rf"^{key}: must be a finite number, got -?(inf|nan)"):
        load_config(data)


def test_a_config_object_with_an_infinite_timeout_is_refused():
    with pytest.raises(ConfigError, match=r"^timeout_s: must be a finite number, got inf"):
        MrlConfig(timeout_s=float("inf"))


def test_derivation_is_the_same_whatever_form_the_sections_come_in():
    from mrl_plugins.comm.config import CommConfig
    from mrl_plugins.rollout.config import RolloutConfig

    objects = load_config(MrlConfig(timeout_s=10, checksums=False, rollout=RolloutConfig(), comm=CommConfig()))
    mappings = load_config({"timeout_s": 10, "checksums": False})
    for cfg in (objects, mappings):
        assert (cfg.rollout.timeout_s, cfg.rollout.start_timeout_s) == (10, 15)
        assert (cfg.comm.send_timeout_s, cfg.comm.receive_timeout_s, cfg.comm.checksum) == (10, 10, "none")
        assert (cfg.weight_sync.timeout_s, cfg.weight_sync.verify_checksum) == (10, False)
    assert objects == mappings
    # what code set on a section object stays set; the rest is derived
    kept = MrlConfig(timeout_s=10, comm=CommConfig(ring_slots=1, send_timeout_s=3.0))
    assert (kept.comm.ring_slots, kept.comm.send_timeout_s, kept.comm.receive_timeout_s) == (1, 3.0, 10)


def test_unknown_key_lists_only_what_a_user_may_set(user_config):
    with pytest.raises(ConfigError) as err:
        load_config({"comm": {"slot_byts": 5}})
    assert str(err.value) == "unknown comm key 'slot_byts'; valid keys: 'codec', 'slot_bytes' or 'transport'"
    with pytest.raises(
        ConfigError, match=r"^unknown rollout\.engine_budget key 'strm'; valid keys: .*'stream_priority'"
    ):
        load_config({"rollout": {"engine_budget": {"strm": "high"}}})
    with pytest.raises(
        ConfigError, match=r"^rollout\.engine_budget\.stream_priority: 'x' invalid; valid: 'high', 'low' or 'normal'$"
    ):
        load_config({"rollout": {"engine_budget": {"stream_priority": "x"}}})
    with pytest.raises(ConfigError, match=r"^weight_sync\.staging: 'x' invalid; valid: 'device' or 'host'$"):
        load_config({"weight_sync": {"staging": "x"}})


@pytest.mark.parametrize(
    ("rollout", "says"),
    [
        ({"trainer_cores": [-1]}, r"^rollout\.trainer_cores: \[-1\] invalid; a list of distinct CPU core ids >= 0"),
        ({"trainer_cores": [0, 0]}, r"^rollout\.trainer_cores: \[0, 0\] invalid"),
        ({"engine_cores": [1, 1]}, r"^rollout\.engine_cores: \[1, 1\] invalid"),
    ],
)
def test_core_lists_are_distinct_core_ids(rollout, says):
    with pytest.raises(ConfigError, match=says):
        load_config({"rollout": rollout})


def test_core_lists_are_checked_against_the_process_cores():
    from mrl_plugins.rollout.config import RolloutConfig

    with pytest.raises(ConfigError, match=r"^rollout\.trainer_cores: cores \[7\] are not cores this process may use"):
        RolloutConfig(trainer_cores=[7]).check_placement("colocate", "cpu", [0, 1])
    with pytest.raises(ConfigError, match=r"^rollout\.engine_cores: cores \[5\]"):
        RolloutConfig(engine_cores=[5]).check_placement("colocate", "cpu", [0, 1])
    with pytest.raises(ConfigError, match=r"^rollout\.trainer_cores: \[0, 1\] are all the cores.*leave at least one"):
        RolloutConfig(trainer_cores=[0, 1]).check_placement("colocate", "cpu", [0, 1])
    RolloutConfig(trainer_cores=[0, 1], oversubscribe=True).check_placement("colocate", "cpu", [0, 1])
    RolloutConfig(trainer_cores=[0, 1], workers=0).check_placement("colocate", "cpu", [0, 1])  # no workers
    RolloutConfig(trainer_cores=[1]).check_placement("colocate", "cpu", [0, 1])
    with pytest.raises(ConfigError, match=r"^rollout\.engine_threads: 4 torch threads per worker, but each of the 1 .*"
                       r"gets 1 CPU core\(s\).*lower rollout\.engine_threads to 1"):  # fmt: skip
        RolloutConfig(engine_threads=4).check_placement("colocate", "cpu", [0, 1])
    RolloutConfig(engine_threads=2).check_placement("colocate", "cpu", [0, 1, 2])  # 2 cores for its 1 worker
    RolloutConfig(engine_threads=4, oversubscribe=True).check_placement("colocate", "cpu", [0, 1])


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({"rollout": {"rebalance": True, "workers": 2}}, r"^rollout\.rebalance: .*got mode: colocate, workers: 2"),
        (
            {"mode": "hybrid", "rollout": {"rebalance": True, "workers": 1}},
            r"^rollout\.rebalance: .*got mode: hybrid, workers: 1",
        ),
        ({"rollout": {"ref_logps": "engine", "workers": 0}}, r"^rollout\.ref_logps: 'engine' needs rollout workers"),
        (  # a key nothing would read is refused, not ignored
            {"mode": "colocate", "rollout": {"workers": 2, "colocated_workers": 1}},
            r"^rollout\.colocated_workers: read in mode 'hybrid' only \(mode is 'colocate'\)",
        ),
        (
            {"weight_sync": {"directory": "/tmp/w"}},
            r"^weight_sync\.directory: read by weight_sync\.transport 'directory' only \(this run's is 'shm'; 'auto'",
        ),
        (
            {"rollout": {"rendezvous": "10.0.0.1:29500"}},
            r"^rollout\.rendezvous: '10\.0\.0\.1:29500' is where the trainer listens for remote workers, and "
            r"rollout\.remote_workers is 0",
        ),
    ],
)
def test_refusals_that_need_only_the_config_come_with_the_config(data, says):
    with pytest.raises(ConfigError, match=says):
        load_config(data)
    load_config({"mode": "hybrid", "rollout": {"rebalance": True, "workers": 2, "colocated_workers": 1}})
    load_config({"rollout": {"ref_logps": "engine", "workers": 0, "remote_workers": 1}})
    load_config({"rollout": {"rendezvous": "10.0.0.1:29500", "remote_workers": 1}})
    remote = load_config({"weight_sync": {"directory": "/tmp/w"}, "rollout": {"workers": 0, "remote_workers": 1}})
    assert remote.weight_sync.transport == "directory"
    load_config({"weight_sync": {"directory": "/tmp/w", "transport": "directory"}})


# --------------------------------------------------------------------------- declared rules (one format)


def test_every_choice_and_bound_is_declared_and_checked_for_objects_built_in_code():
    """A section object built in code meets the same declared rules (metadata) as a mapping, in the same words."""
    from mrl_plugins.comm.config import CommConfig
    from mrl_plugins.rollout.config import RolloutConfig
    from mrl_plugins.weight_sync.config import WeightSyncConfig

    cases = [
        (RolloutConfig(start_method="thread"), r"^rollout\.start_method: 'thread' invalid; valid: 'auto', 'fork' or"),
        (RolloutConfig(local_warmup="x"), r"^rollout\.local_warmup: 'x' invalid; valid: True, False, 'auto'$"),
        (RolloutConfig(placement_margin=1.0), r"^rollout\.placement_margin: must be in \[0, 1\), got 1\.0$"),
        (RolloutConfig(workers=-1), r"^rollout\.workers: must be >= 0, got -1$"),
        (WeightSyncConfig(chunk_bytes=8), r"^weight_sync\.chunk_bytes: must be >= 64, got 8$"),
        (WeightSyncConfig(keep_versions=True), r"^weight_sync\.keep_versions: expected int, got True$"),
        (CommConfig(checksum="md5"), r"^comm\.checksum: 'md5' invalid; valid: 'crc32c', 'none' or 'xxh3'$"),
        (CommConfig(start_timeout_s=0), r"^comm\.start_timeout_s: must be > 0, got 0$"),
    ]
    for section, says in cases:
        with pytest.raises(ConfigError, match=says):
            section.validate()
    with pytest.raises(ConfigError, match=r"^train\.threads: must be >= 0, got -1$"):
        load_config(MrlConfig(train=TrainConfig(threads=-1)))


def test_a_device_spec_has_one_rule_everywhere():
    """train.device follows the rule of ``mrl doctor --device`` and ``get_device`` (case and blanks aside), and is
    kept in the one spelling the code compares (run.py tests ``train.device in ("auto", "cpu")``)."""
    assert load_config({"train": {"device": " CPU"}}).train.device == "cpu"
    assert load_config({"train": {"device": "CUDA:1"}}).train.device == "cuda:1"
    assert load_config(MrlConfig(train=TrainConfig(device="Npu"))).train.device == "npu"
    with pytest.raises(ConfigError, match=r"^train\.device: 'cuda:-1' is not a device; valid forms: .*'npu:N'"):
        load_config({"train": {"device": "cuda:-1"}})


def test_the_documented_presets_are_the_presets():
    from mrl_plugins.demo.models import PRESETS

    help_text = next(f for f in dataclasses.fields(TrainConfig) if f.name == "model").metadata["help"]
    assert all(f"'{name}'" in help_text for name in PRESETS), help_text


def test_a_config_built_again_keeps_what_was_set_and_derives_the_rest(monkeypatch):
    """enable() and the env overrides copy a loaded config; building one again from its sections (dataclasses.replace)
    keeps every value that was given, even one equal to its standalone default, and derives the rest again."""
    import dataclasses

    from mrl_plugins.comm.config import CommConfig
    from mrl_plugins.rollout.config import RolloutConfig

    monkeypatch.setenv("MRL_ALLOW_INTERNAL_KEYS", "1")
    given = {"weight_sync": {"timeout_s": 120.0, "verify_checksum": True}, "comm": {"checksum": "xxh3"}}
    cfg = load_config({"timeout_s": 300, "checksums": False, **given})
    again = dataclasses.replace(cfg, mode="colocate")
    monkeypatch.setenv("MRL_DISABLED_PLUGINS", "upstream")
    for c in (cfg, again, apply_env_overrides(cfg)):
        assert (c.weight_sync.timeout_s, c.weight_sync.verify_checksum, c.comm.checksum) == (120.0, True, "xxh3")
        assert c.comm.send_timeout_s == c.rollout.timeout_s == 300.0  # derived from the top level
    retimed = dataclasses.replace(cfg, timeout_s=50.0)
    assert retimed.comm.send_timeout_s == retimed.rollout.timeout_s == 50.0 and retimed.weight_sync.timeout_s == 120
    remote = {"remote_workers": 1, "rendezvous": "10.77.0.1:0"}
    remote = load_config({"rollout": remote, "comm": {"host": "127.0.0.1"}})
    assert dataclasses.replace(remote, mode="colocate").comm.host == "127.0.0.1"
    fresh = MrlConfig(timeout_s=300, comm=CommConfig(send_timeout_s=120.0), rollout=RolloutConfig())
    assert (fresh.comm.send_timeout_s, fresh.comm.receive_timeout_s, fresh.rollout.timeout_s) == (120.0, 300.0, 300.0)
