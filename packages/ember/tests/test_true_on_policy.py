"""`rollout.true_on_policy`: the embedded engine's log-probs are the trainer's, bit for bit.

Both sides are the real thing: megatron-core's model in a `MegatronWorker` (its old log-probs
from `prepare`, in micro-batches of 3 right-padded samples) and the transformers model exported
from it, served by `HFEngine` (decode steps of left-padded rows, batches that shrink as rows
stop). With the batch-invariant kernels (`ember_core.exact`) on both sides every sampled token's
log-prob agrees exactly; with the engine's ordinary kernels it does not, which is what the mode
is for. Then the config refusals (`ember.config.check_true_on_policy`).
"""

from __future__ import annotations

import pytest
import torch

from ember.config import load_config

TEMPERATURE = 0.8
WIDE = {"hidden_size": 288, "ffn_hidden_size": 320, "moe_ffn_hidden_size": 256}
"""A preset@wide: every weight at least `exact.PACK_MIN_INPUTS` wide, so that fp32 products go
through oneDNN's packed kernel on both sides, the trainer's fused QKV and gate/up weights
against the engine's separate ones (the tiny presets, 64 and 96 wide, take MKL's)."""
PROMPT_LENGTHS = (3, 7, 12, 19, 26)
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def distributed():
    """A single-process group for megatron-core; left as found (other modules may hold one)."""
    import torch.distributed as dist

    from ember_megatron_backend.parallel import destroy_distributed, init_distributed

    torch.set_num_threads(2)
    owned = not dist.is_initialized()
    init_distributed()
    yield
    if owned:
        destroy_distributed()


@pytest.fixture(scope="module")
def trainers(distributed, tmp_path_factory):
    """(model preset, dtype) -> the true-on-policy worker and its export, built once each."""
    from ember_core.config import AlgorithmConfig, SamplingConfig
    from ember_megatron_backend.config import BackendConfig, OptimizerConfig
    from ember_megatron_backend.weights import export_hf_checkpoint
    from ember_megatron_backend.worker import MegatronWorker

    built = {}

    def get(preset: str, dtype: str):
        if (preset, dtype) not in built:
            name, _, wide = preset.partition("@")
            config = BackendConfig(
                model=name,
                dtype=dtype,
                # Weights far from uniform: log-probs spread over several nats, not all ~log(V).
                model_overrides={"init_method_std": 0.1, **(WIDE if wide else {})},
                optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0),
                micro_batch_size=3,  # batches unlike the engine's: 10 samples as 3+3+3+1
            )
            sampling = SamplingConfig(
                temperature=TEMPERATURE, n_samples_per_prompt=2, true_on_policy=True
            )
            worker = MegatronWorker(config, AlgorithmConfig(), sampling)
            path = tmp_path_factory.mktemp(f"{preset}-{dtype}")
            export_hf_checkpoint(worker.actor, config.model_config(), path)
            built[preset, dtype] = worker, path
        return built[preset, dtype]

    return get


def _engine(path, dtype: str, *, true_on_policy: bool):
    from transformers import AutoModelForCausalLM

    from ember_rollout.hf_engine import HFEngine

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return HFEngine(model=model.eval(), true_on_policy=true_on_policy)


def _rollouts(engine, *, experts: bool = False):
    """Two samples of each of five prompts of different lengths, as `Sample`s; with the
    experts the engine routed each position to where `experts` (R3's request)."""
    from ember_core.types import Sample
    from ember_rollout.engine import GenerateRequest, SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    requests = [
        GenerateRequest(
            input_ids=prompt,
            sampling=SamplingParams(
                temperature=TEMPERATURE, max_new_tokens=NEW_TOKENS, seed=2 * p + copy
            ),
            name=f"prompt{p}.{copy}",
            fields={"return_routed_experts": True} if experts else {},
        )
        for p, prompt in enumerate(prompts)
        for copy in range(2)
    ]
    outputs = engine.generate_sync(requests)
    return [
        Sample(
            tokens=request.input_ids + out.output_ids,
            response_length=len(out.output_ids),
            index=i,
            group_index=i // 2,
            reward=0.5,
            rollout_log_probs=out.output_log_probs,
            rollout_routed_experts=out.routed_experts,
        )
        for i, (request, out) in enumerate(zip(requests, outputs, strict=True))
    ]


def _differences(worker, samples) -> tuple[int, int, float]:
    """(tokens whose log-probs differ, tokens, largest |difference|): engine against trainer."""
    trained = worker.prepare(0, samples).log_probs
    differ = total = 0
    largest = 0.0
    for sample, log_probs in zip(samples, trained, strict=True):
        rollout = torch.tensor(sample.rollout_log_probs, dtype=log_probs.dtype)
        assert rollout.shape == log_probs.shape
        differ += int((rollout != log_probs).sum())
        total += rollout.numel()
        largest = max(largest, float((rollout - log_probs).abs().max()))
    return differ, total, largest


@pytest.mark.slow  # ~5 s a case on 2 shared cores: a worker, an export and 24 decode steps
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "preset",
    [
        "tiny-llama",
        "tiny-dense",
        "tiny-moe",
        "tiny-qwen2-moe",
        "tiny-mixtral",
        "tiny-deepseek-v3",
        "tiny-glm4-moe",
        "tiny-llama@wide",
        "tiny-moe@wide",
    ],
)
def test_the_engines_log_probs_are_the_trainers_bit_for_bit(trainers, preset, dtype):
    worker, path = trainers(preset, dtype)
    samples = _rollouts(_engine(path, dtype, true_on_policy=True))
    # Not a vacuous comparison: real responses, sampled (the two copies of a prompt part ways),
    # with log-probs that are not all one number.
    assert all(s.response_length >= 1 for s in samples)
    assert sum(s.response_length for s in samples) >= 5 * NEW_TOKENS
    assert any(a.tokens != b.tokens for a, b in zip(samples[::2], samples[1::2], strict=True))
    assert len({lp for s in samples for lp in s.rollout_log_probs}) > 20
    differ, total, largest = _differences(worker, samples)
    assert differ == 0, f"{differ} of {total} log-probs differ, by up to {largest}"


@pytest.mark.slow  # as above
@pytest.mark.parametrize(
    ("preset", "dtype", "scheme", "targets"),
    [
        ("tiny-moe", "float32", "fp8_block", "linear"),
        ("tiny-moe", "bfloat16", "int4_w4a16", "linear"),
        ("tiny-moe@wide", "float32", "fp8_block", "linear"),
        ("tiny-mixtral", "float32", "int4_w4a16", "experts"),
        ("tiny-deepseek-v3", "bfloat16", "fp8_block", "experts"),
    ],
)
def test_quantized_rollout_with_qat_is_the_trainers_bit_for_bit(
    distributed, tmp_path, preset, dtype, scheme, targets
):
    """`engine.quantization` with `train.qat` in the mode: the engine serves the weights (and
    under fp8_block quantizes the inputs) the trainer fake-quantizes, both through the mode's
    kernels; without the mode the engine's FP8 decode parts from its own prefill
    (docs/low-precision.md)."""
    from transformers import AutoModelForCausalLM

    from ember_core.config import AlgorithmConfig, SamplingConfig
    from ember_core.quant import QuantSpec
    from ember_megatron_backend.config import BackendConfig
    from ember_megatron_backend.weights import export_hf_checkpoint
    from ember_megatron_backend.worker import MegatronWorker
    from ember_rollout.hf_engine import HFEngine
    from ember_rollout.quantized import QuantLinear

    spec = QuantSpec(scheme, 32, targets)
    name, _, wide = preset.partition("@")
    config = BackendConfig(
        model=name,
        dtype=dtype,
        qat=True,
        model_overrides={"init_method_std": 0.1, **(WIDE if wide else {})},
        micro_batch_size=3,
    )
    sampling = SamplingConfig(temperature=TEMPERATURE, n_samples_per_prompt=2, true_on_policy=True)
    worker = MegatronWorker(
        config,
        AlgorithmConfig(),
        sampling,
        quantization=spec,
        qat_scale_dtype=getattr(torch, dtype),
    )
    export_hf_checkpoint(worker.actor, config.model_config(), tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=getattr(torch, dtype))
    engine = HFEngine(model=model.eval(), true_on_policy=True, quantization=spec)
    assert sum(isinstance(m, QuantLinear) for m in engine.model.modules()) > 0
    samples = _rollouts(engine)
    assert sum(s.response_length for s in samples) >= 5 * NEW_TOKENS
    assert len({lp for s in samples for lp in s.rollout_log_probs}) > 20
    differ, total, largest = _differences(worker, samples)
    assert differ == 0, f"{differ} of {total} log-probs differ, by up to {largest}"


MOE_PRESETS = ["tiny-moe", "tiny-qwen2-moe", "tiny-mixtral", "tiny-deepseek-v3", "tiny-glm4-moe"]


@pytest.mark.slow  # as above
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_under_r3_the_trainer_replays_the_engines_experts_and_still_agrees_bit_for_bit(
    distributed, tmp_path, preset, dtype
):
    """R3 on: the trainer's forward replays the experts the engine recorded while sampling
    (megatron-core's RouterReplay, weighed by `exact.route_weights`); they are the experts its
    own routing picks, and the log-probs are the engine's bit for bit."""
    from dataclasses import dataclass, field

    from ember_core.config import AlgorithmConfig, CIConfig, SamplingConfig
    from ember_core.plugins import EmberPlugins
    from ember_megatron_backend.config import BackendConfig, OptimizerConfig
    from ember_megatron_backend.weights import export_hf_checkpoint
    from ember_megatron_backend.worker import MegatronWorker
    from ember_r3_routing import R3RoutingConfig
    from ember_r3_routing import plugin as r3_plugin

    @dataclass(kw_only=True, slots=True)
    class RunConfig:  # the parts of a run config the plugin reads
        train: BackendConfig
        algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
        plugins: list[str] = field(default_factory=lambda: ["r3_routing"])
        ci: CIConfig = field(default_factory=CIConfig)

    config = BackendConfig(
        model=preset,
        dtype=dtype,
        model_overrides={"init_method_std": 0.1},
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0),
        micro_batch_size=3,
    )
    plugins = EmberPlugins()
    plugins.register(r3_plugin, "r3_routing")
    try:
        plugins.configure(RunConfig(train=config), {"r3_routing": R3RoutingConfig()})
        sampling = SamplingConfig(
            temperature=TEMPERATURE, n_samples_per_prompt=2, true_on_policy=True
        )
        worker = MegatronWorker(config, AlgorithmConfig(), sampling, plugins)
        export_hf_checkpoint(worker.actor, config.model_config(), tmp_path)
        samples = _rollouts(_engine(tmp_path, dtype, true_on_policy=True), experts=True)
        assert all(s.rollout_routed_experts is not None for s in samples)
        batch = worker.prepare(0, samples)
        metrics = worker.log_rollout_data(0, batch)
        assert metrics["rollout/replay_agreement"] == 1.0  # the forward replayed them
        assert metrics["rollout/routing_agreement"] == 1.0  # and would have chosen them
        differ = sum(
            int((torch.tensor(s.rollout_log_probs, dtype=lp.dtype) != lp).sum())
            for s, lp in zip(samples, batch.log_probs, strict=True)
        )
        assert differ == 0
    finally:
        plugins.unregister("r3_routing")
        r3_plugin._config = None
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_router_replay_instances()


@pytest.mark.slow  # as above, and a training step
def test_after_a_training_step_the_engine_given_the_new_weights_still_agrees_bit_for_bit(
    distributed, tmp_path
):
    """The trainer's packed weights follow its optimizer (which may write without bumping the
    weights' version counters), and the engine's follow a weight load: after one step both
    compute with the new weights, and still alike."""
    from ember_core.config import AlgorithmConfig, SamplingConfig
    from ember_megatron_backend.config import BackendConfig, OptimizerConfig
    from ember_megatron_backend.weights import export_hf_checkpoint
    from ember_megatron_backend.worker import MegatronWorker

    config = BackendConfig(
        model="tiny-moe",
        model_overrides={"init_method_std": 0.1},
        optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0),
        micro_batch_size=3,
        num_steps_per_rollout=2,
    )
    sampling = SamplingConfig(temperature=TEMPERATURE, n_samples_per_prompt=2, true_on_policy=True)
    worker = MegatronWorker(config, AlgorithmConfig(), sampling)
    export_hf_checkpoint(worker.actor, config.model_config(), tmp_path / "before")
    engine = _engine(tmp_path / "before", "float32", true_on_policy=True)
    samples = _rollouts(engine)
    for sample in samples:  # each group's two answers rewarded apart: advantages, a step
        sample.reward = float(sample.index % 2)
    before = worker.prepare(0, samples)
    steps = worker.train(0, before)
    # The second step's forward runs on the weights the first one wrote: its log-probs are no
    # longer the old ones (with stale packings they would be, and ppo_kl exactly 0).
    assert steps[0]["train/ppo_kl"] == 0.0 and steps[1]["train/ppo_kl"] != 0.0
    after = worker.prepare(1, samples).log_probs
    assert all(not torch.equal(a, b) for a, b in zip(after, before.log_probs, strict=True))
    # The new weights into the same engine, as a push loads them (in place).
    export_hf_checkpoint(worker.actor, config.model_config(), tmp_path / "after")
    from transformers import AutoModelForCausalLM

    new = AutoModelForCausalLM.from_pretrained(tmp_path / "after", dtype=torch.float32)
    with torch.no_grad():
        for param, value in zip(engine.model.parameters(), new.parameters(), strict=True):
            param.copy_(value)
    samples = _rollouts(engine)
    differ, total, largest = _differences(worker, samples)
    assert differ == 0, f"{differ} of {total} log-probs differ, by up to {largest}"


@pytest.mark.slow  # as above
def test_with_the_engines_ordinary_kernels_the_log_probs_are_not_the_trainers(trainers):
    """The planted fault: the engine left on its ordinary kernels (the trainer still exact).
    Close, as the same model in fp32 is, but not the same bits, so the exact check above would
    fail; this is also what shows that check can fail."""
    worker, path = trainers("tiny-llama", "float32")
    samples = _rollouts(_engine(path, "float32", true_on_policy=False))
    differ, total, largest = _differences(worker, samples)
    assert differ > 0, f"all {total} log-probs agree without the exact kernels"
    # fp32 rounding through 2 layers and a 256-way softmax: differences of a few ulps of ~1-10.
    assert largest < 1e-4


# -- config --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["engine.kind=sglang"], ["engine.kind=sglang"]),
        (["engine.hf.dtype=bfloat16"], ["engine.hf.dtype=bfloat16", "train.dtype=float32"]),
        (
            # vocab 18: the default's 17 would fail TP's divisibility rule before this one.
            ["train.parallel.tensor_parallel=2", "train.model_overrides.vocab_size=18"],
            ["train.parallel.tensor_parallel=2"],
        ),
        (["train.parallel.pipeline_parallel=2"], ["train.parallel.pipeline_parallel=2"]),
    ],
    ids=["sglang", "dtypes-differ", "tensor-parallel", "pipeline-parallel"],
)
def test_true_on_policy_refuses_settings_the_two_sides_cannot_match_in(overrides, named):
    base = ["train.model=tiny-dense", "rollout.true_on_policy=true"]
    # The same settings load without the mode: the refusal is the mode's.
    load_config("default", overrides=[*base[:1], *overrides])
    with pytest.raises(ValueError) as info:
        load_config("default", overrides=[*base, *overrides])
    message = str(info.value)
    assert message.startswith("rollout.true_on_policy=true with "), message
    for key in named:
        assert key in message, message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("preset", "dtype"),
    [("tiny-dense", "float32"), ("tiny-llama", "bfloat16"), ("tiny-moe", "bfloat16")],
)
def test_a_model_with_one_dtype_on_both_sides_loads(preset, dtype):
    config, _ = load_config(
        "default",
        overrides=[
            "rollout.true_on_policy=true",
            f"train.model={preset}",
            f"train.dtype={dtype}",
            f"engine.hf.dtype={dtype}",
        ],
    )
    assert config.rollout.true_on_policy is True
    assert (config.train.model, config.train.dtype, config.engine.hf.dtype) == (
        preset,
        dtype,
        dtype,
    )
