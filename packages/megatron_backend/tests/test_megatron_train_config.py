"""The `train` config section, the LR schedule and the CPU optimizer (clipping, weight decay)."""

from __future__ import annotations

import math

import pytest
import torch
from megatron_samples import algorithm, backend, make_samples, sampling

from ember_core.config import from_dict
from ember_megatron_backend.config import BackendConfig, CriticConfig, OptimizerConfig
from ember_megatron_backend.hf_layout import hf_config
from ember_megatron_backend.model import ModelConfig, build_model
from ember_megatron_backend.optimizer import (
    TorchAdamW,
    build_optimizer,
    learning_rate,
    wrap_ddp,
)
from ember_megatron_backend.parallel import ParallelConfig
from ember_megatron_backend.worker import MegatronWorker


def test_defaults_and_string_overrides():
    assert BackendConfig().model_config() == ModelConfig.preset("tiny-moe")
    cfg = from_dict(
        BackendConfig,
        {
            "model": "tiny-dense",
            "model_overrides": {"num_layers": "3"},
            "optimizer": {"lr": "3e-4", "lr_decay_style": "cosine", "lr_decay_steps": "10"},
            "critic": {"optimizer": {"lr": "1e-5"}},
            "parallel": {"tensor_parallel": "1"},
            "max_tokens_per_micro_batch": "512",
            "dtype": "bfloat16",
        },
        prefix="train",
    )
    assert cfg.optimizer.lr == 3e-4 and cfg.critic.optimizer.lr == 1e-5
    assert cfg.model_config() == ModelConfig.preset("tiny-dense").replace(num_layers=3)
    assert cfg.torch_dtype == torch.bfloat16 and cfg.max_tokens_per_micro_batch == 512


def test_shape_from_hf_load(tmp_path):
    cfg = ModelConfig.preset("tiny-dense")
    hf_config(cfg).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # only the config is read here
    resolved = BackendConfig(hf_load=str(tmp_path)).model_config()
    assert resolved.replace(init_method_std=cfg.init_method_std) == cfg


@pytest.mark.parametrize(
    ("section", "data", "message"),
    [
        (OptimizerConfig, {"lr": 0}, "train.lr=0.0: expected a finite number > 0"),
        (OptimizerConfig, {"min_lr": 1.0}, "train.min_lr=1.0: expected <= lr"),
        (OptimizerConfig, {"lr_decay_style": "linear"}, "train.lr_decay_steps=None"),
        (OptimizerConfig, {"lr_decay_style": "step"}, "train.lr_decay_style: 'step'"),
        (OptimizerConfig, {"adam_beta2": 1.0}, r"train.adam_beta2=1.0: expected a number in"),
        (OptimizerConfig, {"clip_grad": -1}, "train.clip_grad=-1"),
        (BackendConfig, {"model": "huge"}, "train.model='huge': expected a preset name"),
        (BackendConfig, {"model_overrides": {"layers": 2}}, "train.model_overrides.layers"),
        (BackendConfig, {"num_steps_per_rollout": 0}, "train.num_steps_per_rollout=0"),
        (BackendConfig, {"micro_batch_size": 0}, "train.micro_batch_size=0"),
        (
            BackendConfig,
            {"micro_batch_size": 2, "max_tokens_per_micro_batch": 64},
            "train.micro_batch_size=2 and max_tokens_per_micro_batch=64",
        ),
        (BackendConfig, {"dtype": "float16"}, "train.dtype: 'float16' is not one of"),
        (BackendConfig, {"optimizer": {"lr": -1}}, "train.optimizer.lr=-1"),
        (CriticConfig, {"hf_load": ""}, "train.hf_load=''"),
    ],
)
def test_errors_name_the_key(section, data, message):
    with pytest.raises(ValueError, match=message):
        from_dict(section, data, prefix="train")


# SmolLM2's attention (9 query heads of 64 in 3 key/value groups) and vocabulary.
SMOLLM2_HEADS = {
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_query_groups": 3,
    "head_dim": 64,
    "vocab_size": 49152,
}
TP_REFUSED = (
    "train.parallel.tensor_parallel=2 must divide num_attention_heads=9 and num_query_groups=3 "
    "(each tensor-parallel rank holds whole heads)"
)


def test_tensor_parallel_that_splits_heads_is_refused_before_any_build(tmp_path):
    data = {"model": "tiny-llama", "model_overrides": SMOLLM2_HEADS, "parallel": {}}
    data["parallel"]["tensor_parallel"] = 2
    with pytest.raises(ValueError) as err:
        from_dict(BackendConfig, data, prefix="train")
    assert str(err.value) == TP_REFUSED
    data["parallel"]["tensor_parallel"] = 3
    assert from_dict(BackendConfig, data, prefix="train").model_config().num_query_groups == 3

    # The shape of a checkpoint: read from its config.json, when `ember train` checks inputs.
    hf_config(ModelConfig.preset("tiny-llama").replace(**SMOLLM2_HEADS)).save_pretrained(tmp_path)
    from_hf = BackendConfig(hf_load=str(tmp_path), parallel=ParallelConfig(tensor_parallel=2))
    with pytest.raises(ValueError) as err:
        from_hf.check_parallel()
    assert str(err.value) == TP_REFUSED


@pytest.mark.parametrize("family", ["tiny-mixtral", "tiny-moe", "tiny-qwen2-moe", "tiny-glm4-moe"])
def test_a_tied_model_of_a_family_sglang_never_ties_is_refused_for_sglang(family, tmp_path):
    tied = BackendConfig(model=family, model_overrides={"tie_word_embeddings": True})
    name = tied.model_config().family
    with pytest.raises(ValueError) as err:
        tied.check_sglang_ties()
    assert str(err.value).startswith(
        f"train: a {name} model with tie_word_embeddings=true cannot be served by "
        "engine.kind=sglang"
    )
    BackendConfig(model=family).check_sglang_ties()  # untied: SGLang loads its lm_head
    # A checkpoint says it in its config.json.
    hf_config(tied.model_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tie_word_embeddings=true"):
        BackendConfig(hf_load=str(tmp_path)).check_sglang_ties()


def test_families_sglang_ties_are_accepted_tied():
    for preset in ("tiny-llama", "tiny-dense"):  # SGLang's llama and qwen3 share the layer
        cfg = BackendConfig(model=preset)
        assert cfg.model_config().tie_word_embeddings
        cfg.check_sglang_ties()


def test_bad_override_value_names_the_field():
    cfg = BackendConfig(model_overrides={"num_layers": 0})
    with pytest.raises(ValueError, match="model_overrides: model.num_layers must be an int >= 1"):
        cfg.model_config()


def test_learning_rate_schedule():
    warm = OptimizerConfig(lr=1.0, lr_warmup_steps=4)
    assert [learning_rate(s, warm) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    linear = OptimizerConfig(
        lr=1.0, min_lr=0.1, lr_warmup_steps=2, lr_decay_style="linear", lr_decay_steps=6
    )
    got = [learning_rate(s, linear) for s in (0, 1, 2, 4, 6, 10)]
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.55, 0.1, 0.1], abs=1e-12)
    cosine = OptimizerConfig(
        lr=1.0, min_lr=0.1, lr_warmup_steps=2, lr_decay_style="cosine", lr_decay_steps=6
    )
    quarter = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))
    got = [learning_rate(s, cosine) for s in (2, 3, 4, 6, 7)]
    assert got == pytest.approx([1.0, quarter, 0.55, 0.1, 0.1], abs=1e-12)


def test_worker_reports_the_scheduled_lr(dist_env):
    cfg = backend(optimizer=OptimizerConfig(lr=1e-3, lr_warmup_steps=3))
    worker = MegatronWorker(cfg, algorithm(), sampling())
    lrs = []
    for rollout_id in range(2):
        steps = worker.train(rollout_id, worker.prepare(rollout_id, make_samples()))
        lrs += [s["train/lr"] for s in steps]
    assert lrs == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3], abs=1e-15)


def _optimizer(**settings):
    model = wrap_ddp(build_model(ModelConfig.preset("tiny-moe"), seed=0))
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-3, **settings))
    assert isinstance(optimizer, TorchAdamW)
    return model, optimizer


def test_clipping_uses_the_global_norm(dist_env):
    model, optimizer = _optimizer(clip_grad=2.0)
    optimizer.zero_grad()
    params = list(model.parameters())
    for k, p in enumerate(params):
        p.main_grad.fill_(0.01 * (k % 5))
    norm = math.sqrt(sum((0.01 * (k % 5)) ** 2 * p.numel() for k, p in enumerate(params)))
    seen = []
    optimizer.optimizer.step = lambda: seen.append([p.grad.clone() for p in params])
    result = optimizer.step(0)
    assert result.grad_norm == pytest.approx(norm, rel=1e-6) and norm > 2.0
    for k, grad in enumerate(seen[0]):
        expected = torch.full_like(grad, 0.01 * (k % 5) * 2.0 / (norm + 1e-6))
        torch.testing.assert_close(grad, expected, rtol=1e-6, atol=0)
    assert all(p.grad is None for p in params)


def test_weight_decay_skips_norms_and_the_schedule_sets_it(dist_env):
    model, optimizer = _optimizer(weight_decay=0.1, lr_warmup_steps=2)
    optimizer.zero_grad()
    optimizer.step(0)
    groups = optimizer.optimizer.param_groups
    decayed = {id(p) for g in groups if g["weight_decay"] == 0.1 for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in decayed) == (p.dim() > 1), name
    assert all(g["lr"] == 0.5e-3 for g in groups)


def test_a_bf16_model_trains_on_float32_masters_on_cpu_and_resumes_from_them(dist_env):
    def bf16_model(seed: int):
        preset = ModelConfig.preset("tiny-moe")
        return wrap_ddp(build_model(preset, dtype=torch.bfloat16, seed=seed))

    model = bf16_model(0)
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-3))
    params = optimizer.params  # the model's trainable parameters, in the masters' order
    assert isinstance(optimizer, TorchAdamW)
    assert {id(p) for p in params} == {id(p) for p in model.parameters()}
    assert sum(p.dtype == torch.bfloat16 for p in params) > len(params) // 2
    assert all(m.dtype == torch.float32 for m in optimizer.masters)
    for p, m in zip(params, optimizer.masters, strict=True):
        assert torch.equal(m, p.detach().float())
        assert (m is p) == (p.dtype == torch.float32)  # a float32 parameter is its own master
    for step in range(3):
        before = [m.clone() for m in optimizer.masters]
        optimizer.zero_grad()
        for k, p in enumerate(params):
            p.main_grad.fill_(1e-3 * (k % 3 + 1))
        optimizer.step(step)
        # Every master moved (Adam's first steps move each weight by about the learning rate),
        # and the model holds the masters rounded to bfloat16.
        assert all((m - b).abs().max() > 0 for m, b in zip(optimizer.masters, before, strict=True))
        for p, m in zip(params, optimizer.masters, strict=True):
            assert torch.equal(p.detach(), m.to(p.dtype))
    # An update below bfloat16's resolution is kept in the master (no bfloat16 weight moves).
    resolution = [m.to(p.dtype).float() for p, m in zip(params, optimizer.masters, strict=True)]
    masters = [m.clone() for m in optimizer.masters]
    assert any(not torch.equal(m, r) for m, r in zip(masters, resolution, strict=True))
    # A resumed run continues from the same float32 weights, not the rounded ones (a float32
    # parameter comes back with the model's checkpoint, the others' masters with this state).
    state = optimizer.state_dict()
    other = bf16_model(1)
    resumed = build_optimizer(other, OptimizerConfig(lr=1e-3))
    resumed.load_state_dict(state)
    low = [i for i, p in enumerate(resumed.params) if p.dtype == torch.bfloat16]
    assert sorted(state["masters"]) == low
    for i in low:
        assert torch.equal(resumed.masters[i], optimizer.masters[i])
        assert torch.equal(resumed.params[i].detach(), optimizer.params[i].detach())
    # Another dtype's state, or the other implementation's, is refused by name.
    _, fp32 = _optimizer()
    with pytest.raises(ValueError, match="written with another train.dtype"):
        resumed.load_state_dict(fp32.state_dict())
    with pytest.raises(ValueError, match="written by 'megatron'"):
        fp32.load_state_dict({"kind": "megatron", "state": {}})
