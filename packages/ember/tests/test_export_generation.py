"""An exported model (`hf_init`, `ember convert`) loads in transformers as is and stops at EOS."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch

from ember_megatron_backend.model import PRESETS
from ember_rollout.tokenizer import save_tokenizer_for_model, toy_tokenizer

EOS = toy_tokenizer().eos_token_id


@pytest.fixture(scope="module")
def distributed():
    """A single-process group for the export; left as found (other modules may hold one)."""
    import torch.distributed as dist

    from ember_megatron_backend.parallel import destroy_distributed, init_distributed

    owned = not dist.is_initialized()
    init_distributed()
    yield
    if owned:
        destroy_distributed()


def _export(path, *, eos_only: bool = False, preset: str = "tiny-moe"):
    """The trainer's export of a tiny model over the toy vocabulary.

    Args:
        preset: The model preset (one per family).
        eos_only: Zero the output layer, so every logit ties and greedy decoding picks id 0,
            the toy EOS: a model that emits EOS first.
    """
    from ember_megatron_backend.model import ModelConfig, build_model
    from ember_megatron_backend.weights import export_hf_checkpoint

    cfg = ModelConfig.preset(preset).replace(vocab_size=len(toy_tokenizer()))
    model = build_model(cfg, seed=0)
    if eos_only:
        with torch.no_grad():
            model.output_layer.weight.zero_()
    return export_hf_checkpoint(model, cfg, path)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _load_capturing(path):
    """from_pretrained with every transformers log record (INFO and up) and warning captured."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    handler = _Records()
    hf_logger = logging.getLogger("transformers")
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_info()
    hf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = AutoModelForCausalLM.from_pretrained(path)
    finally:
        hf_logger.removeHandler(handler)
        hf_logging.set_verbosity(level)
    return model, [r.getMessage() for r in handler.records], [str(w.message) for w in caught]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_export_loads_without_rewriting_its_generation_config(distributed, tmp_path, preset):
    """Every family's export stops at the tokenizer's EOS, not at its config class's default
    (DeepSeek-V3's is 1 and Mixtral's 2: a toy unknown token and the digit 0)."""
    path = _export(tmp_path / "hf", preset=preset)
    save_tokenizer_for_model(None, path)  # what the driver does for hf_init
    config = json.loads((path / "config.json").read_text())
    assert config["eos_token_id"] == EOS and config["pad_token_id"] == EOS
    assert config["bos_token_id"] is None  # the toy tokenizer has none
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == EOS
    model, messages, caught = _load_capturing(path)
    assert caught == []
    notices = [m for m in messages if "not found" in m or "created from the model config" in m]
    assert notices == []  # transformers used the files as written
    assert model.generation_config.eos_token_id == EOS
    assert model.config.eos_token_id == EOS


def test_the_check_sees_what_an_export_without_token_ids_does(distributed, tmp_path):
    """The capture above is able to fail: a bare export draws transformers' notice."""
    path = _export(tmp_path / "hf")
    model, messages, _ = _load_capturing(path)
    assert any("Generation config file not found" in m for m in messages)
    assert model.generation_config.eos_token_id is None


def test_generation_stops_at_eos(distributed, tmp_path):
    path = _export(tmp_path / "hf", eos_only=True)
    prompt = torch.tensor([[3, 4, 5]])
    bare, _, _ = _load_capturing(path)
    out = bare.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6)
    assert out[0, 3:].tolist() == [EOS] * 6  # without the token ids EOS does not stop it
    save_tokenizer_for_model(None, path)
    model, _, _ = _load_capturing(path)
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6)
    assert out[0, 3:].tolist() == [EOS]  # EOS came first, and generation stopped there


def test_ember_convert_saves_the_shape_directory_tokenizer_with_token_ids(distributed, tmp_path):
    from ember.convert import _copy_tokenizer

    shape = tmp_path / "shape"
    toy_tokenizer().save_pretrained(shape)
    out = _export(tmp_path / "out")
    _copy_tokenizer(shape, out)  # what `ember convert megatron-to-hf --model DIR` does last
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == EOS
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == EOS
    _, messages, caught = _load_capturing(out)
    assert caught == [] and not [m for m in messages if "not found" in m]
