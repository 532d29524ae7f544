"""The TRL members mrl-plugins touches are listed in one table (adapters/trl_members.py), checked at enable()."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.marks import require_trl

ROOT = Path(__file__).resolve().parents[1]
#: the modules that touch a TRL trainer
USERS = [*(ROOT / "adapters").glob("*.py"), *(ROOT / "mrl_plugins/rollout").glob("*.py"), ROOT / "mrl_plugins/run.py"]
_USE = re.compile(r'(?:state\.patch\(trainer, "|getattr\((?:self\.)?trainer, "|(?<![\w.])(?:self\.)?trainer\.)(\w+)')


def test_every_trainer_member_used_is_in_the_table():
    from mrl_plugins.adapters.trl_members import MEMBERS, OWN

    listed = {m.name for m in MEMBERS} | set(OWN) | {"__dict__"}
    used: dict[str, str] = {}
    for path in USERS:
        if path.name == "trl_members.py":
            continue
        for name in _USE.findall(path.read_text(encoding="utf-8")):
            used.setdefault(name, path.name)
    assert used, "the scan found nothing: the pattern is broken"
    unlisted = {n: where for n, where in used.items() if n not in listed}
    assert not unlisted, f"trainer members used but not in adapters/trl_members.py: {unlisted}"


@require_trl
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_real_trainers_have_every_member_and_a_missing_one_is_named_before_any_change(tmp_path, kind, monkeypatch):
    import mrl_plugins
    from mrl_plugins.adapters.trl_members import check_members, missing_members
    from mrl_plugins.config import load_config
    from mrl_plugins.errors import UnsupportedVersionError
    from mrl_plugins.run import build_trainer

    cfg = load_config({"train": {"model": "tiny", "steps": 1, "trainer": kind, "output_dir": str(tmp_path)}})
    trainer = build_trainer(cfg, enable_plugins=False, output_dir=str(tmp_path))
    assert missing_members(trainer, kind) == []
    # as if a TRL release dropped a method the adapter uses
    owner = next(c for c in type(trainer).__mro__ if "_tokenize_prompts" in vars(c))
    monkeypatch.delattr(owner, "_tokenize_prompts")
    name = type(trainer).__name__
    with pytest.raises(UnsupportedVersionError, match=rf"{name} \(TRL 9\.9\) has no _tokenize_prompts"):
        check_members(trainer, kind, "9.9")
    before = dict(trainer.__dict__)
    with pytest.raises(UnsupportedVersionError, match="has no _tokenize_prompts"):
        mrl_plugins.enable(trainer, "colocate")
    assert trainer.__dict__ == before  # nothing was changed


@require_trl
def test_version_notes_hold_for_the_installed_trl(tmp_path):
    """What the table says differs between TRL 1.14, 1.15 and 1.16 is what the installed TRL has."""
    import inspect
    from importlib.metadata import version

    from packaging.version import Version
    from trl import GRPOTrainer, RLOOTrainer

    from mrl_plugins.adapters.trl_members import MEMBERS, VERSION_NOTES
    from mrl_plugins.config import load_config
    from mrl_plugins.run import build_trainer

    trl = Version(version("trl"))
    assert set(VERSION_NOTES) <= {m.name for m in MEMBERS}
    grpo_turn = inspect.signature(GRPOTrainer._generate_single_turn).parameters
    assert ("num_generations" in grpo_turn) == (trl >= Version("1.14.2"))
    assert "num_generations" not in inspect.signature(RLOOTrainer._generate_single_turn).parameters
    assert hasattr(GRPOTrainer, "_tool_call_loop")
    cfg = load_config({"train": {"model": "tiny", "steps": 1, "output_dir": str(tmp_path)}})
    trainer = build_trainer(cfg, enable_plugins=False, output_dir=str(tmp_path))
    assert hasattr(trainer, "eos_token_ids") == (trl >= Version("1.14.2"))
    gen = inspect.signature(type(trainer)._get_per_token_logps_and_entropies).parameters
    assert list(gen)[:2] == ["self", "model"]
