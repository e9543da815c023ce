"""The example run configs: each loads with the real config loader and the plugins it names, and
its parallel layout adds up (ranks, model-parallel groups, GPUs, batch split, memory per GPU).

Placeholder paths (`/path/to/...`) are replaced by directories under tmp_path; a checkpoint
placeholder gets the config.json published with that model, which is all loading reads.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ember.config import EXAMPLES_DIR, load_config
from ember.layout import in_process
from ember_megatron_backend.weights import hf_shapes
from ember_rollout.sglang_engine import SGLangEngine

PLACEHOLDER = "/path/to/"

CHECKPOINTS: dict[str, dict[str, Any]] = {
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}
"""config.json of the checkpoints the examples name."""


_SMOLLM2 = {
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "rms_norm_eps": 9.999999747378752e-06,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "vocab_size": 49152,
}
LOCAL_MODELS: dict[str, dict[str, Any]] = {
    "models/smollm2": {
        **_SMOLLM2,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "head_dim": 64,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
    },
    "models/smollm2-moe": {
        **_SMOLLM2,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "head_dim": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
}
"""config.json of the directories the real-model examples read, as `ember import-gguf smollm2`
and `ember upcycle --experts 4 --top-k 2` write them (README: "A real model"); a fresh clone
has none of them."""


EXAMPLES = sorted(p.stem for p in EXAMPLES_DIR.glob("*.yaml"))
"""Every run config under examples/; a name ending in `_<N>gpu` is laid out for N GPUs, any
other for the CPU."""

GPU_MEMORY_GB = {
    "moe_r3_1gpu": 141,
    "qwen3_30b_a3b_r3_16gpu": 141,
}
"""Memory of each GPU the GPU examples are sized for."""

HEADROOM = 0.8
"""Share of a GPU's memory the training state may take; activations need the rest."""


def materialise(node: Any, root: Path) -> Any:
    """`node` with placeholder paths moved under `root`; checkpoint directories get config.json."""
    if isinstance(node, dict):
        return {k: materialise(v, root) for k, v in node.items()}
    if isinstance(node, list):
        return [materialise(v, root) for v in node]
    if isinstance(node, str) and node in LOCAL_MODELS:
        target = root / node
        target.mkdir(parents=True, exist_ok=True)
        (target / "config.json").write_text(json.dumps(LOCAL_MODELS[node]))
        return str(target)
    if isinstance(node, str) and node.startswith(PLACEHOLDER):
        target = root / node.removeprefix(PLACEHOLDER)
        if target.name in CHECKPOINTS:
            target.mkdir(parents=True, exist_ok=True)
            (target / "config.json").write_text(json.dumps(CHECKPOINTS[target.name]))
        return str(target)
    return node


def training_params_per_gpu(config: Any) -> float:
    """Parameters one training rank holds: the dense part split by TP, the experts by EP x ETP."""
    model, parallel = config.train.model_config(), config.train.parallel
    tp = parallel.tensor_parallel
    etp = parallel.expert_tensor_parallel or tp
    shapes = hf_shapes(model)
    expert = sum(math.prod(s) for name, s in shapes.items() if ".mlp.experts." in name)
    dense = sum(math.prod(s) for s in shapes.values()) - expert
    return dense / tp + expert / (parallel.expert_parallel * etp)


def training_bytes_per_gpu(config: Any) -> float:
    """Weights, gradients and optimizer state of one training rank, and its frozen reference.

    bf16 weights with megatron-core's optimizer: 2 (weight) + 4 (fp32 gradient buffer) + 4 (fp32
    master weight) + 8 (Adam moments) = 18 bytes per parameter; fp32 weights: 16. The reference
    holds weights only; a PPO critic is trained like the actor.
    """
    train, algorithm = config.train, config.algorithm
    weight = 2 if train.dtype == "bfloat16" else 4
    trained = 18 if train.dtype == "bfloat16" else 16
    per_param = trained
    if algorithm.use_kl_loss or algorithm.kl_coef > 0 or train.ref_load is not None:
        per_param += weight
    if algorithm.advantage_estimator == "ppo":
        per_param += trained
    return training_params_per_gpu(config) * per_param


def load_example(name: str, root: Path) -> tuple[dict[str, Any], Any, Any]:
    """The example's YAML, and its config and plugins from `load_config`."""
    raw = yaml.safe_load((EXAMPLES_DIR / f"{name}.yaml").read_text())
    config, plugins = load_config(materialise(raw, root))
    return raw, config, plugins


def gpus_of(name: str) -> int:
    match = re.search(r"_(\d+)gpu$", name)
    return int(match[1]) if match else 0


def test_every_gpu_example_states_its_gpu_memory():
    assert {n for n in EXAMPLES if gpus_of(n)} == set(GPU_MEMORY_GB)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_loads_and_its_layout_adds_up(name, tmp_path):
    gpus, memory = gpus_of(name), GPU_MEMORY_GB.get(name)
    raw, config, plugins = load_example(name, tmp_path)
    assert plugins.enabled == raw.get("plugins", [])
    ray, train, parallel = config.ray, config.train, config.train.parallel
    model = train.model_config()

    # The model-parallel groups tile the training world, and every shard is whole.
    ranks = ray.data_parallel
    tp, ep = parallel.tensor_parallel, parallel.expert_parallel
    etp = parallel.expert_tensor_parallel or tp
    assert parallel.pipeline_parallel == parallel.context_parallel == 1  # what the worker runs
    assert ranks % tp == 0 and ranks % (etp * ep) == 0
    assert model.num_attention_heads % tp == 0 and model.num_query_groups % tp == 0
    assert model.vocab_size % tp == 0
    if model.is_moe:
        assert model.num_experts % ep == 0 and model.moe_ffn_hidden_size % etp == 0
    else:
        assert ep == 1

    # The rollout splits into whole prompt groups per rank, and evenly into the rank's steps.
    rollout = config.rollout
    assert rollout.rollout_batch_size % ranks == 0
    per_rank = rollout.rollout_batch_size // ranks * rollout.n_samples_per_prompt
    assert per_rank % train.num_steps_per_rollout == 0

    # GPUs: as many as the name says, each training rank on (a share of) one device.
    train_gpus, rollout_gpus = ranks * ray.gpus_per_rank, ray.num_engines * ray.gpus_per_engine
    assert train_gpus + rollout_gpus == gpus
    assert ray.gpus_per_rank <= 1
    if gpus and ray.colocate:
        assert ray.gpus_per_rank + ray.gpus_per_engine <= 1  # shares of the same devices
    elif gpus:
        assert ray.gpus_per_rank == 1 and ray.gpus_per_engine == int(ray.gpus_per_engine)
    # Where the roles live: the example's ray.enabled holds for its layout (in_process refuses
    # what cannot run in one process), and Ray, which grants the GPUs, runs a GPU example's.
    local, _ = in_process(config)
    assert not (gpus and local)

    # The engine uses the devices its actor gets and starts from the trainer's weights.
    engine = config.engine
    if engine.kind == "hf":
        assert (engine.hf.device == "cpu") == (ray.gpus_per_engine == 0)
    else:
        sglang = engine.sglang
        assert sglang.tp_size * sglang.num_servers == ray.gpus_per_engine
        assert sglang.model_path == train.hf_load and config.data.tokenizer_path is not None
        command = SGLangEngine.from_config(engine, plugins=plugins).server_command(30000)
        assert command[command.index("--tp-size") + 1] == str(sglang.tp_size)
        if "r3_routing" in plugins.enabled:
            assert "--enable-return-routed-experts" in command

    # R3 checks the engine's experts against the model being trained (0: read from `train`).
    if "r3_routing" in plugins.enabled:
        section = config.plugin_sections["r3_routing"]
        shape = (section.num_layers, section.num_experts, section.topk)
        wanted = (model.num_layers, model.num_experts, model.moe_router_topk)
        assert all(value in (0, want) for value, want in zip(shape, wanted, strict=True))
        assert plugins.rollout_request_fields(engine.kind).get("return_routed_experts") is True

    if memory is not None:
        needed = training_bytes_per_gpu(config) / 1e9
        assert needed < HEADROOM * memory, f"{needed:.0f} GB per training GPU"


def test_qwen3_30b_a3b_figures(tmp_path):
    """The figures the 16-GPU example states, from the published shape by hand."""
    _, config, _ = load_example("qwen3_30b_a3b_r3_16gpu", tmp_path)
    layers, hidden, experts, ffn, vocab = 48, 2048, 128, 768, 151936
    attention = hidden * 32 * 128 * 2 + hidden * 4 * 128 * 2  # q and o; k and v
    norms = 2 * hidden + 2 * 128
    dense = 2 * vocab * hidden + layers * (attention + experts * hidden + norms) + hidden
    expert = layers * experts * 3 * hidden * ffn
    assert round((dense + expert) / 1e9, 1) == 30.5
    per_gpu = dense + expert / 8
    assert training_params_per_gpu(config) == per_gpu
    assert round(per_gpu / 1e9, 1) == 5.2
    assert round(per_gpu * 18 / 1e9) == 93 and round(per_gpu * 2 / 1e9) == 10
    assert round(training_bytes_per_gpu(config) / 1e9) == 103
    assert round((dense + expert) * 2 / 1e9) == 61  # the bf16 weights SGLang serves


SHAPE_FROM_CHECKPOINT = [
    n
    for n in EXAMPLES
    if (yaml.safe_load((EXAMPLES_DIR / f"{n}.yaml").read_text()).get("train") or {}).get("hf_load")
]
"""The examples that read their model's shape from `train.hf_load`."""


@pytest.mark.parametrize("name", SHAPE_FROM_CHECKPOINT)
def test_an_example_whose_checkpoint_is_not_there_names_train_hf_load(name, tmp_path, monkeypatch):
    """Loaded as shipped where its checkpoint is not (a placeholder path, or a model not
    imported yet), an example stops at one line naming `train.hf_load` and the path, whoever
    reads the shape first: the r3_routing plugin while the config loads, or the trainer later.
    Never at transformers' hub lookup, which takes a missing path for a repo id."""
    monkeypatch.chdir(tmp_path)  # relative checkpoint paths (models/...) are not there
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = yaml.safe_load((EXAMPLES_DIR / f"{name}.yaml").read_text())["train"]["hf_load"]
    try:
        config, _ = load_config(str(EXAMPLES_DIR / f"{name}.yaml"))
    except ValueError as exc:
        message = str(exc)
    else:
        with pytest.raises(ValueError) as raised:
            config.train.model_config()
        message = str(raised.value)
    assert message == f"train.hf_load={path!r}: no such directory"


def test_a_checkpoint_directory_without_config_json_is_named(tmp_path, monkeypatch):
    from ember_megatron_backend.config import BackendConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^train.hf_load='empty': no config.json there \("):
        BackendConfig(hf_load="empty").model_config()
