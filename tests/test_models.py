"""Presets built in code: saved with ``save_pretrained`` (or :func:`save_preset`), they reload through
``AutoTokenizer`` / ``AutoModelForCausalLM`` to the same tokenization, decoding, rewards and logits."""

from __future__ import annotations

import json
import os

import pytest

from tests.marks import require_trl

pytestmark = require_trl

TEXTS = ["a b a c", "a", "p o n a a", "b c d", "a a a a a a a a"]


def _reload(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_saved_preset_reloads_with_auto_classes_and_scores_the_same(tmp_path, name):
    import torch

    from mrl_plugins.demo.models import WORDS, build_model, count_reward

    model, tok = build_model(name, seed=3)
    model.save_pretrained(tmp_path)  # the plain transformers way, as a user would
    tok.save_pretrained(tmp_path)
    model2, tok2 = _reload(tmp_path)

    assert type(model2) is type(model)
    assert tok2.get_vocab() == tok.get_vocab()
    assert (tok2.pad_token, tok2.eos_token, tok2.padding_side) == (tok.pad_token, tok.eos_token, "left")
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert tok2(text)["input_ids"] == ids
        assert tok2.decode(ids) == tok.decode(ids) == text
    # completions as the trainer decodes them: token ids the policy sampled, eos/pad included
    g = torch.Generator().manual_seed(0)
    sampled = torch.randint(0, len(tok), (16, 12), generator=g).tolist()
    first = tok.batch_decode(sampled, skip_special_tokens=True)
    again = tok2.batch_decode(sampled, skip_special_tokens=True)
    assert again == first
    assert count_reward(again) == count_reward(first)
    assert count_reward(tok2.batch_decode([tok("a b a c")["input_ids"]])) == [0.5]
    assert any(r > 0 for r in count_reward(again))  # 'a' is 1 of len(WORDS) words: some completion has one
    assert all(w in tok2.decode(tok2(" ".join(WORDS))["input_ids"]).split() for w in WORDS)

    batch = tok(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, model2(**batch).logits)


def test_save_preset_names_the_model_after_its_folder_and_reuses_only_the_same_model(tmp_path):
    import torch

    from mrl_plugins.demo.models import FINGERPRINT_FILE, build_model, save_preset

    folder = tmp_path / "preset-tiny"
    model, tok = build_model("tiny", seed=0)
    assert save_preset(model, tok, folder) == str(folder)
    assert model.name_or_path == model.config._name_or_path == str(folder)
    stamp = json.loads((folder / FINGERPRINT_FILE).read_text())["sha256"]
    mtime = os.stat(folder / "model.safetensors").st_mtime_ns

    same, tok_same = build_model("tiny", seed=0)
    save_preset(same, tok_same, folder)  # the same weights: the folder is reused as it is
    assert os.stat(folder / "model.safetensors").st_mtime_ns == mtime

    other, tok_other = build_model("tiny", seed=1)  # a stale folder (other weights) is replaced
    save_preset(other, tok_other, folder)
    assert json.loads((folder / FINGERPRINT_FILE).read_text())["sha256"] != stamp
    reloaded, _ = _reload(folder)
    sd = reloaded.state_dict()
    assert all(torch.equal(t, sd[n]) for n, t in other.state_dict().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["preset-tiny"]  # no temporary folders left


@pytest.mark.slow
def test_trainer_of_a_preset_carries_the_folder_name_and_the_folder_trains(tmp_path):
    """``mrl run``'s trainer: ``model.name_or_path`` (what TRL reads) is the saved preset folder, and that folder
    given back as ``train.model`` builds a trainer whose tokenizer decodes like the preset's."""
    from mrl_plugins.demo.models import count_reward
    from mrl_plugins.run import build_trainer

    cfg = {"train": {"model": "tiny", "steps": 1, "output_dir": str(tmp_path / "out")}}
    trainer = build_trainer(cfg_obj(cfg), enable_plugins=False)
    folder = trainer.model.name_or_path
    assert folder and folder == trainer.model.config._name_or_path
    assert os.path.isfile(os.path.join(folder, "config.json"))

    again = build_trainer(cfg_obj({"train": {**cfg["train"], "model": folder}}), enable_plugins=False)
    ids = trainer.processing_class("a b a c d")["input_ids"]
    text = again.processing_class.decode(ids)
    assert text == trainer.processing_class.decode(ids) == "a b a c d"
    assert count_reward([text]) == [0.4]


@pytest.mark.slow
def test_presets_train_without_activation_checkpointing_unless_asked(tmp_path):
    """TRL checkpoints activations by default; the embedded job's presets (a few MB) train without it, baseline and
    plugins alike. A user's own setting wins, and a checkpoint folder keeps TRL's default."""
    from mrl_plugins.run import build_trainer, checkpointing_arg

    train = {"model": "tiny", "steps": 1, "output_dir": str(tmp_path / "out")}
    plain = build_trainer(cfg_obj({"train": train}), enable_plugins=False)
    asked = {**train, "trl_args": {checkpointing_arg(): True}}  # activation_ (transformers >= 5.20) or gradient_
    on = build_trainer(cfg_obj({"train": asked}), enable_plugins=False)
    for trainer in (plain, on):
        trainer.train()  # the Trainer turns checkpointing on in the model when training starts
    assert plain.args.gradient_checkpointing is False and not plain.model.is_gradient_checkpointing
    assert on.args.gradient_checkpointing is True and on.model.is_gradient_checkpointing
    folder = build_trainer(cfg_obj({"train": {**train, "model": plain.model.name_or_path}}), enable_plugins=False)
    assert folder.args.gradient_checkpointing is True  # TRL 1.16's GRPOConfig default


def cfg_obj(data):
    from mrl_plugins.config import load_config

    return load_config(data)
