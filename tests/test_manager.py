"""The plugin manager on real pluggy, real built-in plugins and real entry points (dist-info on ``sys.path``)."""

from __future__ import annotations

import sys

import pytest

from mrl_plugins.config import MrlConfig
from mrl_plugins.errors import ConfigError, PluginError
from mrl_plugins.hookspecs import (
    STAGES,
    Capabilities,
    CommCodec,
    RolloutEngine,
    StageContext,
    StagePlugin,
    WeightTransport,
    hookimpl,
)

UPSTREAM = {"plugins": {"rollout": "upstream", "weight_sync": "upstream", "comm": "upstream"}}
#: the base of a third party's comm selection: TRL's own rollout leaves nothing for another comm to carry
OWN_ROLLOUT = {"rollout": "mrl", "weight_sync": "upstream", "comm": "upstream"}
BUILTIN_STAGES = {
    "upstream": ("rollout", "weight_sync", "comm"),
    "mrl.rollout": ("rollout",),
    "mrl.weight_sync": ("weight_sync",),
    "mrl.comm": ("comm",),
}


# --------------------------------------------------------------------------- helpers


def _names(mgr) -> set[str]:
    return {name for name, plugin in mgr.pm.list_name_plugin() if plugin is not None}


def _infos(mgr) -> dict:
    return {row.name: row for row in mgr.plugin_infos() if not row.blocked}


FAKEPLUG = """
    import collections

    from mrl_plugins.hookspecs import Capabilities, StagePlugin, hookimpl

    CALLS = []
    CAPS = Capabilities(in_process=True)


    class Got:
        def __init__(self, meta, batch):
            self.meta, self.batch = meta, batch

        def release(self):
            pass


    class Channel:
        capabilities = CAPS

        def __init__(self):
            self.items = collections.deque()

        def producer_handle(self, index):
            return self

        def send(self, batch, meta, timeout=None):
            self.items.append((dict(meta), dict(batch)))
            return len(batch)

        def receive(self, timeout=None):
            return Got(*self.items.popleft())

        def stats(self):
            return {"queued": len(self.items)}

        def close(self):
            CALLS.append("close")


    class FakeComm:
        def capabilities(self, ctx):
            CALLS.append("capabilities")
            return CAPS

        def open_consumer(self, ctx, run_id, producers):
            CALLS.append(("consumer", run_id, producers))
            return Channel()

        def open_producer(self, ctx, handle, index):
            CALLS.append(("producer", index))
            return handle


    class _FakePlug:
        @hookimpl
        def mrl_comm_register_stages(self):
            return [StagePlugin("fakeplug", FakeComm)]


    plugin = _FakePlug()
"""


class CommHooks:
    """A comm stage whose ends are never opened: it answers ``capabilities`` with ``caps`` (what selection tests probe
    with ``mgr.capabilities``) and the open methods with ``None``."""

    caps = Capabilities(cross_host=True)

    def capabilities(self, ctx):
        return self.caps

    def open_consumer(self, ctx, run_id, producers):
        return None

    def open_producer(self, ctx, handle, index):
        return None


def provides_comm(name, stage):
    """A plugin object registering ``stage`` (a comm stage object) as the comm plugin ``name``."""

    class Provider:
        @hookimpl
        def mrl_comm_register_stages(self):
            return [StagePlugin(name, lambda: stage)]

    return Provider()


UPSTREAM_COMM = Capabilities(rejoinable=True)  # the queue transport's

BOOM = """
    raise RuntimeError("boom_mod must never be imported while blocked")
"""


# --------------------------------------------------------------------------- built-ins and selection


def test_builtins_listed_with_their_stages(fresh_pm):
    infos = _infos(fresh_pm())
    for name, stages in BUILTIN_STAGES.items():
        assert name in infos, f"built-in {name!r} missing from {sorted(infos)}"
        assert infos[name].stages == stages
        assert infos[name].source == "builtin"


def test_selecting_mrl_finds_each_builtin_stage_plugin(fresh_pm):
    from mrl_plugins.comm.plugin import CommPlugin
    from mrl_plugins.hookspecs import STAGE_HOOKS

    mgr = fresh_pm()
    assert mgr.selected == {"rollout": "mrl", "weight_sync": "mrl", "comm": "mrl"}
    assert isinstance(mgr.registry(STAGE_HOOKS["comm"])["mrl"].factory(), CommPlugin)
    infos = _infos(mgr)
    assert infos["mrl.comm"].active_for == ("comm",)
    assert infos["upstream"].active_for == ()


def test_upstream_selected_everywhere(fresh_pm):
    mgr = fresh_pm(UPSTREAM)
    assert mgr.selected == {stage: "upstream" for stage in STAGES}
    assert all(mgr.is_upstream(s) for s in STAGES)
    infos = _infos(mgr)
    assert infos["upstream"].active_for == STAGES
    assert infos["mrl.rollout"].active_for == ()


def test_mixed_selection(fresh_pm):
    mgr = fresh_pm({"plugins": {"rollout": "mrl", "weight_sync": "upstream", "comm": "mrl"}})
    assert mgr.selected == {"rollout": "mrl", "weight_sync": "upstream", "comm": "mrl"}
    assert not mgr.is_upstream("rollout") and mgr.is_upstream("weight_sync")


def test_unknown_plugin_names_valid_choices(fresh_pm):
    with pytest.raises(PluginError) as err:
        fresh_pm({"plugins": {"rollout": "nosuch"}})
    msg = str(err.value)
    assert "nosuch" in msg and "plugins.rollout" in msg
    assert "'mrl'" in msg and "'upstream'" in msg


def test_plugin_that_does_not_provide_the_stage(fresh_pm):
    with pytest.raises(PluginError, match=r"plugins\.comm: unknown plugin 'mrl\.rollout'.*'mrl' or 'upstream'"):
        fresh_pm({"plugins": {"comm": "mrl.rollout"}})
    with pytest.raises(PluginError, match=r"plugins\.rollout: unknown plugin 'x'"):
        fresh_pm({"plugins": {"rollout": "x"}}, plugins=[("x", provides_comm("x", CommHooks()))])


def test_unknown_stage(fresh_pm):
    mgr = fresh_pm(UPSTREAM)
    with pytest.raises(PluginError, match=r"unknown stage 'bogus'.*'comm', 'rollout' or 'weight_sync'"):
        mgr.select({"bogus": "mrl", **UPSTREAM["plugins"]})
    assert mgr.selected == {stage: "upstream" for stage in STAGES}  # nothing half-applied
    with pytest.raises(ConfigError, match="unknown plugins key 'bogus'"):
        fresh_pm({"plugins": {"bogus": "mrl"}})


def test_stage_call_before_select_is_an_error(fresh_pm):
    mgr = fresh_pm(select=False)
    with pytest.raises(PluginError, match="no plugin selected for stage 'comm'"):
        mgr.comm_open_consumer(ctx=StageContext(config=mgr.config), run_id="r", producers=1)


# --------------------------------------------------------------------------- blocking


def test_blocked_via_config(fresh_pm):
    with pytest.raises(PluginError, match=r"plugins\.rollout: 'upstream' is blocked"):
        fresh_pm({"disable": ["upstream"], "plugins": {"rollout": "upstream"}})
    mgr = fresh_pm({"disable": ["upstream"]})
    assert "upstream" not in _names(mgr)
    assert [r.name for r in mgr.plugin_infos() if r.blocked] == ["upstream"]


def test_blocked_via_env(fresh_pm, monkeypatch):
    monkeypatch.setenv("MRL_DISABLED_PLUGINS", "upstream, mrl.comm")
    with pytest.raises(PluginError, match=r"plugins\.comm: 'mrl' is blocked"):
        fresh_pm()
    mgr = fresh_pm(select=False)
    assert _names(mgr) == {"mrl.rollout", "mrl.weight_sync"}


def test_a_blocked_third_party_stage_is_named_as_unasked(fresh_pm, install_dist):
    """A blocked plugin registers nothing, so the manager cannot know its stage names: the error lists what was
    blocked beside the available names."""
    install_dist("acmedist", {"acme": "acme_mod:plugin"}, {"acme_mod": BOOM})  # blocked: never imported
    with pytest.raises(PluginError, match=r"plugins\.comm: unknown plugin 'zmq'.*\(blocked, so not asked: acme\)"):
        fresh_pm({**UPSTREAM, "plugins": {**OWN_ROLLOUT, "comm": "zmq"}}, disable=["acme"])


def test_blocked_via_argument(fresh_pm):
    with pytest.raises(PluginError, match="'upstream' is blocked"):
        fresh_pm(UPSTREAM, disable=["upstream"])


def test_blocking_mrl_blocks_every_mrl_stage_plugin(fresh_pm):
    with pytest.raises(PluginError, match=r"plugins\.rollout: 'mrl' is blocked"):
        fresh_pm(disable=["mrl"])
    mgr = fresh_pm(UPSTREAM, disable=["mrl"])
    assert _names(mgr) == {"upstream"}
    assert mgr.selected == {stage: "upstream" for stage in STAGES}


def test_block_prefix_matches_dotted_names_only(fresh_pm):
    class Other:
        @hookimpl
        def mrl_configure(self, config):
            pass

    mgr = fresh_pm(UPSTREAM, disable=["mrl"], plugins=[("mrlx", Other())])
    assert "mrlx" in _names(mgr)


def test_config_object_not_modified_by_env(fresh_pm, monkeypatch):
    cfg = MrlConfig.from_dict(UPSTREAM)
    monkeypatch.setenv("MRL_DISABLED_PLUGINS", "mrl")
    monkeypatch.setenv("MRL_DISABLE_PLUGIN_AUTOLOAD", "1")
    mgr = fresh_pm(cfg)
    assert "mrl.comm" not in _names(mgr)
    assert mgr.config.disable == ["mrl"] and mgr.config.autoload is False
    assert cfg.disable == [] and cfg.autoload is True


# --------------------------------------------------------------------------- entry points


def test_blocked_entry_point_is_never_imported(fresh_pm, install_dist):
    install_dist("boomdist", {"boom": "boom_mod:plugin"}, {"boom_mod": BOOM})
    mgr = fresh_pm(UPSTREAM, disable=["boom"])
    assert "boom" not in _names(mgr)
    assert "boom_mod" not in sys.modules
    with pytest.raises(PluginError, match=r"entry point 'boom' \(boom_mod:plugin\) failed to load"):
        fresh_pm(UPSTREAM)


def test_blocked_entry_point_via_env_is_never_imported(fresh_pm, install_dist, monkeypatch):
    install_dist("boomdist", {"boom": "boom_mod:plugin"}, {"boom_mod": BOOM})
    monkeypatch.setenv("MRL_DISABLED_PLUGINS", "boom")
    fresh_pm(UPSTREAM)
    assert "boom_mod" not in sys.modules


def test_autoload_off_loads_no_entry_points(fresh_pm, install_dist, monkeypatch):
    install_dist("boomdist", {"boom": "boom_mod:plugin"}, {"boom_mod": BOOM})
    fresh_pm({**UPSTREAM, "autoload": False})
    fresh_pm(UPSTREAM, autoload=False)
    monkeypatch.setenv("MRL_DISABLE_PLUGIN_AUTOLOAD", "1")
    mgr = fresh_pm(UPSTREAM)
    assert mgr.config.autoload is False
    assert "boom_mod" not in sys.modules


def test_third_party_plugin_selected_for_comm(fresh_pm, install_dist):
    install_dist("fakeplug", {"fakeplug": "fakeplug_mod:plugin"}, {"fakeplug_mod": FAKEPLUG})
    mgr = fresh_pm({"plugins": {**OWN_ROLLOUT, "comm": "fakeplug"}})
    fake = sys.modules["fakeplug_mod"]
    infos = _infos(mgr)
    assert infos["fakeplug"].source == "entrypoint"
    assert infos["fakeplug"].stages == ("comm",)
    assert infos["fakeplug"].active_for == ("comm",)
    ctx = StageContext(config=mgr.config)
    assert mgr.capabilities("comm") is fake.CAPS
    consumer = mgr.comm_open_consumer(ctx=ctx, run_id="r1", producers=1)
    producer = mgr.comm_open_producer(ctx=ctx, handle=consumer.producer_handle(0), index=0)
    assert producer.send({"a": 2}, {"seq": 0}) == 1
    got = consumer.receive(1.0)
    assert (got.meta, got.batch) == ({"seq": 0}, {"a": 2})
    assert fake.CALLS == ["capabilities", ("consumer", "r1", 1), ("producer", 0)]
    assert ctx.plugins is mgr  # the manager hands itself to the stage (registrations, other stages' ends)


def test_third_party_plugin_not_selected_is_not_called(fresh_pm, install_dist):
    install_dist("fakeplug", {"fakeplug": "fakeplug_mod:plugin"}, {"fakeplug_mod": FAKEPLUG})
    mgr = fresh_pm(UPSTREAM)
    fake = sys.modules["fakeplug_mod"]
    assert "fakeplug" in _names(mgr)
    assert mgr.capabilities("comm") == UPSTREAM_COMM
    assert fake.CALLS == []


def test_entry_point_class_is_instantiated(fresh_pm, install_dist):
    source = """
        from mrl_plugins.hookspecs import Capabilities, StagePlugin, hookimpl

        class Comm:
            def capabilities(self, ctx):
                return Capabilities(zero_copy=True, cross_host=True)

            def open_consumer(self, ctx, run_id, producers):
                return None

            def open_producer(self, ctx, handle, index):
                return None

        class Plug:
            @hookimpl
            def mrl_comm_register_stages(self):
                return [StagePlugin("classplug", Comm)]
    """
    install_dist("classplug", {"classplug": "classplug_mod:Plug"}, {"classplug_mod": source})
    mgr = fresh_pm({"plugins": {**OWN_ROLLOUT, "comm": "classplug"}})
    assert mgr.capabilities("comm") == Capabilities(zero_copy=True, cross_host=True)


def test_entry_point_named_like_a_builtin_is_an_error(fresh_pm, install_dist):
    install_dist("fakeplug", {"upstream": "fakeplug_mod:plugin"}, {"fakeplug_mod": FAKEPLUG})
    with pytest.raises(PluginError, match="entry point 'upstream'.*clashes with the builtin plugin"):
        fresh_pm(UPSTREAM)


# --------------------------------------------------------------------------- selection calls the selected object


def test_only_the_selected_stage_object_answers(fresh_pm):
    class Second(CommHooks):
        calls = 0

        def capabilities(self, ctx):
            Second.calls += 1
            return self.caps

    mgr = fresh_pm(UPSTREAM, plugins=[("second", provides_comm("second", Second()))])
    assert mgr.capabilities("comm") == UPSTREAM_COMM
    assert Second.calls == 0
    mgr.select({**OWN_ROLLOUT, "comm": "second"})
    assert mgr.capabilities("comm") == CommHooks.caps
    assert Second.calls == 1
    assert _infos(mgr)["second"].stages == ("comm",) and _infos(mgr)["second"].active_for == ("comm",)


def test_weight_sync_routed_to_selected_plugin(fresh_pm):
    """upstream: an in-process copy is loaded in place; mrl: a shm sender and a double-buffered receiver."""
    import torch

    from mrl_plugins.upstream import InPlaceReceiver, InPlaceSender
    from mrl_plugins.weight_sync.receiver import DoubleBufferedReceiver

    model = torch.nn.Linear(2, 2)
    for selection, sender_cls, receiver_cls in (
        (UPSTREAM, InPlaceSender, InPlaceReceiver),
        ({"plugins": {**UPSTREAM["plugins"], "rollout": "mrl", "weight_sync": "mrl"}}, None, DoubleBufferedReceiver),
    ):
        mgr = fresh_pm(selection)
        ctx = StageContext(config=mgr.config)
        sender = mgr.weight_sync_open_sender(ctx=ctx, model_id="policy", run_id="t", receivers=1, same_process=True)
        receiver = mgr.weight_sync_open_receiver(
            ctx=ctx, model=model, handle=sender.receiver_handle(), model_id="policy"
        )
        try:
            assert sender_cls is None or isinstance(sender, sender_cls)
            assert isinstance(receiver, receiver_cls)
            sender.publish(1, [(n, torch.full_like(p, 3.0)) for n, p in model.named_parameters()])
            assert receiver.poll(5.0) == 1 and receiver.switch(5.0).to_version == 1 and receiver.version == 1
            assert all(bool((p == 3.0).all()) for p in model.parameters())
        finally:
            receiver.close()
            sender.close()


def test_unanswered_stage_method_is_one_error_naming_method_and_plugin(fresh_pm):
    """A selected stage whose open method returns None (or an object that is not the stage's end) fails with one
    PluginError naming the method and the plugin, not a TypeError later."""
    mgr = fresh_pm({"plugins": {**OWN_ROLLOUT, "comm": "half"}}, plugins=[("h", provides_comm("half", CommHooks()))])
    ctx = StageContext(config=mgr.config)
    with pytest.raises(
        PluginError, match=r"comm plugin 'half': open_consumer returned None, expected ExperienceConsumer"
    ):
        mgr.comm_open_consumer(ctx=ctx, run_id="r", producers=1)

    class Wrong(CommHooks):
        def open_consumer(self, ctx, run_id, producers):
            return object()

    mgr = fresh_pm({"plugins": {**OWN_ROLLOUT, "comm": "wrong"}}, plugins=[("w", provides_comm("wrong", Wrong()))])
    with pytest.raises(
        PluginError,
        match=r"plugin 'wrong': open_consumer returned a object, which is not an? "
        r"ExperienceConsumer \(missing: capabilities, close, producer_handle, receive, stats",
    ):
        mgr.comm_open_consumer(ctx=ctx, run_id="r", producers=1)


def test_plugin_missing_a_stage_method_cannot_be_selected(fresh_pm):
    class OnlyConsumer:
        def open_consumer(self, ctx, run_id, producers):
            return None

    with pytest.raises(
        PluginError,
        match=r"plugins\.comm: plugin 'only' does not implement 'capabilities' or 'open_producer'; its object "
        r"is a CommStage",
    ):
        fresh_pm(
            {"plugins": {**OWN_ROLLOUT, "comm": "only"}},
            plugins=[("o", provides_comm("only", OnlyConsumer()))],
        )


def test_a_stage_that_fails_to_build_is_one_error_naming_it(fresh_pm):
    def broken():
        raise RuntimeError("no such device")

    class Provider:
        @hookimpl
        def mrl_comm_register_stages(self):
            return [StagePlugin("flaky", broken)]

    mgr = fresh_pm(UPSTREAM, plugins=[("flakyplug", Provider())])
    with pytest.raises(
        PluginError, match=r"plugins\.comm: plugin 'flaky' \(from 'flakyplug'\) failed to build: RuntimeError: no such"
    ):
        mgr.select({**OWN_ROLLOUT, "comm": "flaky"})
    assert mgr.selected == {stage: "upstream" for stage in STAGES}  # nothing half-applied


def test_stage_methods_are_checked_when_selected_not_at_the_first_call(fresh_pm):
    """A method that is an attribute, or one whose parameters are not the protocol's, is refused at selection with one
    error naming it (pluggy used to check hook signatures; the manager checks the stage's now)."""

    class CapsAttribute(CommHooks):
        capabilities = Capabilities()  # the ends carry this attribute; the stage answers a call

    class Renamed(CommHooks):
        def open_consumer(self, ctx, run_id, n_producers):
            return None

    for obj, message in (
        (CapsAttribute(), r"plugins\.comm: plugin 'bad' does not implement 'capabilities'"),
        (
            Renamed(),
            r"plugins\.comm: plugin 'bad': open_consumer cannot be called as open_consumer\(ctx, run_id, prod",
        ),
    ):
        mgr = fresh_pm(UPSTREAM, plugins=[("b", provides_comm("bad", obj))])
        with pytest.raises(PluginError, match=message):
            mgr.select({**OWN_ROLLOUT, "comm": "bad"})
        assert mgr.selected == {stage: "upstream" for stage in STAGES}


def test_backend_keys_are_checked_only_for_the_mrl_stages(fresh_pm):
    """With the built-in comm stage blocked and a third party's selected, comm.transport (which only ``mrl`` reads)
    is not looked up; the mrl stages' keys still are."""
    mgr = fresh_pm(
        {"plugins": {"comm": "mine"}}, disable=["mrl.comm"], plugins=[("m", provides_comm("mine", CommHooks()))]
    )
    assert mgr.selected == {"rollout": "mrl", "weight_sync": "mrl", "comm": "mine"}
    with pytest.raises(ConfigError, match=r"weight_sync\.transport: unknown weight-sync transport 'rdma'"):
        fresh_pm(
            {"plugins": {"comm": "mine"}, "weight_sync": {"transport": "rdma"}},
            plugins=[("m", provides_comm("mine", CommHooks()))],
        )


def test_a_stage_plugin_name_from_two_plugins_names_both(fresh_pm):
    with pytest.raises(PluginError, match=r"comm plugin 'upstream' is registered by both 'upstream' and 'mine'"):
        fresh_pm(UPSTREAM, plugins=[("mine", provides_comm("upstream", CommHooks()))])


# --------------------------------------------------------------------------- registrations


def _transports(*names):
    class Provider:
        @hookimpl
        def mrl_weight_sync_register_transports(self):
            return [WeightTransport(name=n, factory=dict) for n in names]

    return Provider()


def test_duplicate_registration_names_both_plugins(fresh_pm):
    with pytest.raises(PluginError) as err:
        fresh_pm(plugins=[("alpha", _transports("rdma")), ("beta", _transports("rdma"))])
    msg = str(err.value)
    assert "'rdma'" in msg and "'alpha'" in msg and "'beta'" in msg


def test_duplicate_of_builtin_registration(fresh_pm):
    with pytest.raises(PluginError, match=r"weight-sync transport 'shm' is registered by both 'mrl\.weight_sync'"):
        fresh_pm(plugins=[("mine", _transports("shm"))])


def test_registration_of_wrong_type(fresh_pm):
    class WrongItems:
        @hookimpl
        def mrl_rollout_register_engines(self):
            return ["transformers2"]

    class NotIterable:
        @hookimpl
        def mrl_rollout_register_engines(self):
            return RolloutEngine(name="single", factory=dict)

    class WrongClass:
        @hookimpl
        def mrl_comm_register_codecs(self):
            return [WeightTransport(name="zip", factory=dict)]

    for plugin, hook, expected in (
        (WrongItems(), "mrl_rollout_register_engines", "returned a str, expected RolloutEngine"),
        (NotIterable(), "mrl_rollout_register_engines", "returned RolloutEngine, expected an iterable"),
        (WrongClass(), "mrl_comm_register_codecs", "returned a WeightTransport, expected CommCodec"),
    ):
        mgr = fresh_pm(UPSTREAM, plugins=[("bad", plugin)])
        with pytest.raises(PluginError, match=f"plugin 'bad': {hook} {expected}"):
            mgr.registry(hook)


def test_third_party_backend_selectable_by_name(fresh_pm):
    mgr = fresh_pm({"weight_sync": {"transport": "rdma"}}, plugins=[("rdmaplug", _transports("rdma"))])
    assert mgr.backend("mrl_weight_sync_register_transports", "rdma").name == "rdma"
    assert {"shm", "rdma"} <= set(mgr.registry("mrl_weight_sync_register_transports"))


def test_unknown_backend_names_valid_choices(fresh_pm):
    with pytest.raises(ConfigError, match=r"weight_sync\.transport: unknown weight-sync transport 'rdma'.*'shm'"):
        fresh_pm({"weight_sync": {"transport": "rdma"}})
    with pytest.raises(ConfigError, match=r"comm\.codec.*'zip'.*'bf16', 'fp16' or 'raw'"):
        fresh_pm({"comm": {"codec": "zip"}})
    with pytest.raises(ConfigError, match=r"rollout\.engine: unknown rollout engine 'nosuch'.*'transformers'"):
        fresh_pm({"rollout": {"engine": "nosuch"}})


def test_backends_of_upstream_stages_not_required(fresh_pm):
    """TRL's own path ignores backend keys: with ``mrl`` blocked an all-upstream config still builds."""
    mgr = fresh_pm(UPSTREAM, disable=["mrl"])
    assert mgr.registry("mrl_comm_register_codecs") == {}


def test_registration_object_validation():
    with pytest.raises(ValueError, match="registration name"):
        CommCodec(name="bad name!", factory=dict)
    with pytest.raises(TypeError, match="factory must be callable"):
        CommCodec(name="ok", factory=3)


# --------------------------------------------------------------------------- hook validation and lifecycle


def test_unknown_mrl_hook_fails_check_pending(fresh_pm):
    class Typo:
        @hookimpl
        def mrl_comm_register_stage(self):
            return []

    with pytest.raises(PluginError, match=r"plugin 'typo' implements an unknown hook.*mrl_comm_register_stage\b"):
        fresh_pm(UPSTREAM, plugins=[("typo", Typo())])


def test_a_plugin_written_for_the_removed_stage_hooks_is_told_what_replaced_them(fresh_pm):
    class OldStyle:
        @hookimpl
        def mrl_comm_open_consumer(self, ctx, run_id, producers):
            return None

    with pytest.raises(
        PluginError, match=r"plugin 'old' implements an unknown hook.*mrl_comm_open_consumer.*mrl_comm_register_stages"
    ):
        fresh_pm(UPSTREAM, plugins=[("old", OldStyle())])


def test_hook_with_unknown_argument_is_plugin_error(fresh_pm):
    class ExtraArg:
        @hookimpl
        def mrl_comm_register_codecs(self, compression):
            return []

    with pytest.raises(PluginError, match=r"plugin 'extra'.*compression"):
        fresh_pm(UPSTREAM, plugins=[("extra", ExtraArg())])


def test_keyword_only_hook_parameters_rejected(fresh_pm):
    """pluggy passes hook arguments positionally: a ``*``-only signature would fail on the first call."""

    class KwOnly:
        @hookimpl
        def mrl_shutdown(self, *, ctx, reason):
            return None

    with pytest.raises(PluginError, match=r"plugin 'kw': hook mrl_shutdown declares keyword-only"):
        fresh_pm(UPSTREAM, plugins=[("kw", KwOnly())])


def test_duplicate_plugin_name(fresh_pm):
    mgr = fresh_pm(UPSTREAM)
    with pytest.raises(PluginError, match="'upstream' is registered twice"):
        mgr.register(object(), "upstream")


def test_configure_is_historic(fresh_pm):
    class Late:
        config = None

        @hookimpl
        def mrl_configure(self, config):
            Late.config = config

    mgr = fresh_pm({**UPSTREAM, "mode": "hybrid"})
    assert isinstance(mgr.config, MrlConfig) and mgr.config.mode == "hybrid"
    late = Late()
    mgr.register(late, "late")
    assert Late.config is mgr.config


def test_shutdown_reaches_every_plugin(fresh_pm):
    seen = []

    class Closer:
        @hookimpl
        def mrl_shutdown(self, ctx, reason):
            seen.append(reason)

    mgr = fresh_pm(UPSTREAM, plugins=[("closer", Closer())])
    mgr.shutdown(StageContext(config=mgr.config), reason="error")
    assert seen == ["error"]


def test_fresh_managers_are_independent(fresh_pm):
    class Extra(CommHooks):
        caps = Capabilities(zero_copy=True)

    first = fresh_pm(UPSTREAM, plugins=[("extra", provides_comm("extra", Extra()))])
    second = fresh_pm(UPSTREAM)
    assert first is not second and first.pm is not second.pm
    assert "extra" in _names(first) and "extra" not in _names(second)
    first.register(_transports("late"), "late")
    assert "late" not in _names(second)
    first.select({**OWN_ROLLOUT, "comm": "extra"})
    assert second.selected["comm"] == "upstream"
    assert first.capabilities("comm") == Extra.caps and second.capabilities("comm") == UPSTREAM_COMM


# --------------------------------------------------------------------------- changes after construction


class Second(CommHooks):
    """A second comm stage, registered late (as the plugin ``second``)."""


def test_late_provider_does_not_take_over_selected_stage(fresh_pm):
    mgr = fresh_pm(UPSTREAM)
    first = mgr.capabilities("comm")
    mgr.register(provides_comm("second", Second()), "second")
    assert mgr.capabilities("comm") == first == UPSTREAM_COMM
    mgr.select({**OWN_ROLLOUT, "comm": "second"})
    assert mgr.capabilities("comm") == Second.caps


def test_late_registration_appears_in_registry(fresh_pm):
    mgr = fresh_pm(UPSTREAM)
    assert "rdma" not in mgr.registry("mrl_weight_sync_register_transports")
    mgr.register(_transports("rdma"), "rdmaplug")
    assert "rdma" in mgr.registry("mrl_weight_sync_register_transports")


def test_blocking_a_selected_plugin_unselects_its_stage(fresh_pm):
    mgr = fresh_pm(UPSTREAM, plugins=[("second", provides_comm("second", Second()))])
    mgr.select({**OWN_ROLLOUT, "comm": "second"})
    assert mgr.capabilities("comm") == Second.caps
    mgr.block(["second"])
    assert "second" not in _names(mgr) and "comm" not in mgr.selected
    assert mgr.selected == {"rollout": "mrl", "weight_sync": "upstream"}  # the other stages keep theirs
    with pytest.raises(PluginError, match="no plugin selected for stage 'comm'"):
        mgr.capabilities("comm")
    mgr = fresh_pm()
    mgr.block(["upstream"])  # provides every stage, selected for none
    assert mgr.selected == {stage: "mrl" for stage in STAGES}


def test_select_needs_every_stage(fresh_pm):
    mgr = fresh_pm(UPSTREAM)
    with pytest.raises(PluginError, match=r"missing stage 'rollout'.*'comm', 'rollout' or 'weight_sync'"):
        mgr.select({"comm": "upstream", "weight_sync": "upstream"})
    assert mgr.selected == {stage: "upstream" for stage in STAGES}


def test_shutdown_reaches_every_plugin_when_one_raises(fresh_pm):
    seen = []

    class Broken:
        @hookimpl
        def mrl_shutdown(self, ctx, reason):
            seen.append("broken")
            raise RuntimeError("broken shutdown")

    class Fine:
        @hookimpl
        def mrl_shutdown(self, ctx, reason):
            seen.append("fine")

    # pluggy calls the last registered first: Broken runs before Fine
    mgr = fresh_pm(UPSTREAM, plugins=[("fine", Fine()), ("broken", Broken())])
    with pytest.raises(PluginError, match=r"mrl_shutdown failed in plugin 'broken': RuntimeError: broken shutdown"):
        mgr.shutdown(StageContext(config=mgr.config), reason="normal")
    assert sorted(seen) == ["broken", "fine"]


@pytest.mark.parametrize("name", ["", "Zip", "bad name", "zïp", "a/b", "-x"])
def test_registration_names_are_lowercase_identifiers(name):
    with pytest.raises(ValueError, match=r"registration name must be"):
        CommCodec(name=name, factory=dict)


# --------------------------------------------------------------------------- the hook contract


def _hookspecs() -> dict:
    import inspect

    from mrl_plugins.hookspecs import PROJECT_NAME, spec

    return {
        name: fn
        for name, fn in vars(spec).items()
        if name.startswith("mrl_") and inspect.isfunction(fn) and hasattr(fn, f"{PROJECT_NAME}_spec")
    }


def test_hookspec_names_and_kinds():
    from mrl_plugins.hookspecs import PROJECT_NAME, REGISTRATION_HOOKS, STAGE_HOOKS

    specs = _hookspecs()
    lifecycle = {"mrl_configure", "mrl_shutdown"}
    assert set(specs) == lifecycle | set(REGISTRATION_HOOKS) | {"mrl_weight_sync_map_name"}
    assert getattr(specs["mrl_weight_sync_map_name"], f"{PROJECT_NAME}_spec")["firstresult"] is True
    assert set(STAGE_HOOKS.values()) <= set(REGISTRATION_HOOKS)
    for hook, (stage, _cls, _what, key) in REGISTRATION_HOOKS.items():
        assert hook.startswith(f"mrl_{stage}_register_")
        assert key == f"plugins.{stage}" if hook == STAGE_HOOKS[stage] else key.startswith(f"{stage}.")
    assert getattr(specs["mrl_configure"], f"{PROJECT_NAME}_spec")["historic"] is True


def test_hookspecs_are_documented():
    import inspect

    for name, fn in _hookspecs().items():
        doc = inspect.getdoc(fn) or ""
        sig = inspect.signature(fn)
        missing = [p for p in sig.parameters if f":param {p}:" not in doc]
        assert not missing, f"{name}: parameters {missing} not documented"
        assert "Example::" in doc and f"def {name}(" in doc, f"{name}: no example"
        assert "Called" in doc, f"{name}: does not say when it is called"
        if sig.return_annotation not in ("None", None):
            assert ":return:" in doc, f"{name}: return value not documented"
        example_args = doc.split(f"def {name}(", 1)[1].split(")", 1)[0]
        assert [a.strip() for a in example_args.split(",") if a.strip()] == list(sig.parameters), name


def test_name_map_hook_is_asked_by_every_plugin_in_order_and_cached(fresh_pm):
    from mrl_plugins.hookspecs import hookimpl

    assert fresh_pm(UPSTREAM).weight_sync_name_map("policy") is None  # nobody implements it: no per-name calls
    asked: list[tuple[str, str]] = []

    class RefOnly:
        @hookimpl
        def mrl_weight_sync_map_name(self, model_id, name):
            asked.append((model_id, name))
            return f"ref.{name}" if model_id == "ref" else None

    class Policy:
        @hookimpl
        def mrl_weight_sync_map_name(self, model_id, name):
            return name.removeprefix("trainer.") if model_id == "policy" else None

    mgr = fresh_pm(UPSTREAM, plugins=[("policy_names", Policy()), ("ref_names", RefOnly())])
    policy, ref = mgr.weight_sync_name_map("policy"), mgr.weight_sync_name_map("ref")
    assert policy("trainer.a.weight") == "a.weight" and policy("b") == "b"
    assert ref("w") == "ref.w" and ref("w") == "ref.w"
    assert asked.count(("ref", "w")) == 1  # answers are cached per name


def test_disable_argument_as_string(fresh_pm):
    mgr = fresh_pm(UPSTREAM, disable="mrl.comm, mrl.rollout")
    assert _names(mgr) == {"upstream", "mrl.weight_sync"}
    mgr = fresh_pm(UPSTREAM, disable="mrl")
    assert _names(mgr) == {"upstream"}


def test_same_object_under_two_names(fresh_pm):
    tracer = _transports("rdma")
    mgr = fresh_pm(UPSTREAM, plugins=[("tracer", tracer)])
    with pytest.raises(PluginError, match="plugin 'tracer2'.*already registered"):
        mgr.register(tracer, "tracer2")


# --------------------------------------------------------------------------- names checked where the manager is built


def test_a_disable_name_that_blocks_nothing_is_refused_by_every_entry_point(fresh_pm, monkeypatch):
    """``enable()``, ``mrl run`` and ``mrl plugins`` build their manager here: a misspelt name is one error."""
    with pytest.raises(ConfigError, match=r"^disable: unknown plugin 'mrll'; valid: .*'mrl.comm'.*'upstream'"):
        fresh_pm({"disable": ["mrll"]})
    with pytest.raises(ConfigError, match=r"^--disable: unknown plugin 'mrl.comms'"):
        fresh_pm(disable=["mrl.comms"])
    monkeypatch.setenv("MRL_DISABLED_PLUGINS", "upstrem")
    with pytest.raises(ConfigError, match=r"^MRL_DISABLED_PLUGINS: unknown plugin 'upstrem'"):
        fresh_pm()
    monkeypatch.delenv("MRL_DISABLED_PLUGINS")
    mgr = fresh_pm(UPSTREAM, disable=["mrl", "mine"], plugins=[("mine", provides_comm("mine", CommHooks()))])
    assert _names(mgr) == {"upstream"}  # a prefix, and a plugin given here, are names that block


def test_selection_refuses_another_comm_or_weight_sync_beside_trl_rollout(fresh_pm):
    for stage in ("weight_sync", "comm"):
        with pytest.raises(ConfigError, match=rf"^plugins\.{stage}: 'mrl' needs a separate inference copy"):
            fresh_pm({"plugins": {**UPSTREAM["plugins"], stage: "mrl"}})
    mgr = fresh_pm(UPSTREAM)
    with pytest.raises(ConfigError, match=r"^plugins\.comm: 'mrl' needs a separate inference copy"):
        mgr.select({**UPSTREAM["plugins"], "comm": "mrl"})
    assert mgr.selected == {stage: "upstream" for stage in STAGES}  # nothing half-applied


def test_a_workers_manager_does_not_check_disable_names_again():
    """A misspelt disable name is refused where the run starts; a worker's host (remote, other plugins installed)
    builds its manager through factory without that check."""
    from mrl_plugins.errors import ConfigError
    from mrl_plugins.manager import get_plugin_manager

    with pytest.raises(ConfigError, match="acme_vendor"):
        get_plugin_manager({"disable": ["acme_vendor"]})
    pm = get_plugin_manager({})
    worker = pm.factory({"disable": ["acme_vendor"]})
    assert worker.selected["rollout"] == "mrl"
