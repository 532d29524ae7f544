"""The ``MRL_PLUGINS`` start-up hook's class patching (mrl_plugins._autoenable) on plain classes standing in for
TRL's trainers: which ``__init__`` enables a trainer, and when none does. TRL's own classes:
tests/test_trl_adapter.py::test_env_variable_switches_plugins_on_at_startup."""

from __future__ import annotations

import pytest

from mrl_plugins import _autoenable


@pytest.fixture
def enabled(monkeypatch):
    """The trainers enable_from_env was called with, in order, each with its ``steps`` as they were then."""
    import mrl_plugins.adapters.trl as trl_adapter

    calls: list = []
    monkeypatch.setattr(
        trl_adapter, "enable_from_env", lambda trainer: calls.append((trainer, list(getattr(trainer, "steps", []))))
    )
    monkeypatch.setenv("MRL_PLUGINS", "colocate")
    return calls


def test_every_subclass_is_enabled_once_after_its_own_init(enabled):
    class Trainer:  # stands in for GRPOTrainer
        def __init__(self):
            self.steps = ["base"]

    class Before(Trainer):  # defined before the hook was installed
        def __init__(self):
            super().__init__()
            self.steps.append("before")

    _autoenable.patch_trainer_class(Trainer)
    _autoenable.patch_trainer_class(Trainer)  # idempotent

    class After(Trainer):
        def __init__(self):
            super().__init__()
            self.steps.append("after")

    class NoInit(After):  # its __init__ is After's
        pass

    class Deeper(NoInit):
        def __init__(self):
            super().__init__()
            self.steps.append("deeper")

    expected = {
        Trainer: ["base"],
        Before: ["base", "before"],
        After: ["base", "after"],
        NoInit: ["base", "after"],
        Deeper: ["base", "after", "deeper"],
    }
    for cls, steps in expected.items():
        enabled.clear()
        t = cls()
        assert enabled == [(t, steps)], cls.__name__  # once, after the whole object was built


def test_a_subclass_keeps_its_own_init_subclass(enabled):
    class Trainer:
        registry: list = []

        def __init_subclass__(cls, tag: str = "", **kwargs):
            super().__init_subclass__(**kwargs)
            Trainer.registry.append((cls.__name__, tag))

        def __init__(self):
            pass

    _autoenable.patch_trainer_class(Trainer)

    class Tagged(Trainer, tag="x"):
        def __init__(self):
            super().__init__()

    assert Trainer.registry == [("Tagged", "x")]
    t = Tagged()
    assert enabled == [(t, [])]


def test_nothing_is_enabled_without_the_variable_or_while_suppressed(enabled, monkeypatch):
    class Trainer:
        def __init__(self):
            pass

    _autoenable.patch_trainer_class(Trainer)
    with _autoenable.suppressed():  # mrl run builds its trainer and enables it with its own config
        Trainer()
    assert enabled == []
    Trainer()
    assert len(enabled) == 1
    monkeypatch.delenv("MRL_PLUGINS")
    Trainer()
    assert len(enabled) == 1
