"""Every MoE family the hf engine serves: routed experts as dispatched, model info, weights.

The families' tiny models come from `ember_rollout.families`; conftest's `family_checkpoint`
exports one per family and `family_engine` serves it through `model_path`, as the trainer's
export is served. Routing is checked against an independent float64 recomputation of each
family's rule from the router weights and the hidden states entering the router.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from test_hf_engine import PROMPTS, requests

from ember_rollout.config import HFEngineConfig
from ember_rollout.engine import GenerateRequest, SamplingParams
from ember_rollout.families import (
    FAMILIES,
    build_family_model,
    config_moe_layers,
    config_num_experts,
)
from ember_rollout.hf_engine import HFEngine
from ember_rollout.models import (
    check_update_names,
    find_routers,
    iter_checkpoint,
    load_hf_weights,
)
from ember_rollout.routing import ExpertCapture, decode_routed_experts, replay_routing
from ember_rollout.sglang_launch import model_info_from_dir

NUM_LAYERS, NUM_EXPERTS, TOPK = 3, 8, 2
GROUPED = {"deepseek_v3", "glm4_moe"}
"""Families routing by sigmoid score plus expert bias, limited to the best groups."""
MOE_LAYERS = {"deepseek_v3": (1, 2), "glm4_moe": (1, 2)}
"""MoE layers of the tiny models where not every layer is one (first_k_dense_replace=1)."""
EXPERTS_FIELD = {
    # Hub checkpoints of Qwen3-MoE say num_experts; transformers 5.19 maps that attribute to
    # num_local_experts and writes the latter.
    "qwen3_moe": "num_local_experts",
    "deepseek_v3": "n_routed_experts",
    "glm4_moe": "n_routed_experts",
    "qwen2_moe": "num_experts",
    "mixtral": "num_local_experts",
}
"""The config.json field each family names its routed experts with (transformers 5.19)."""


# -- the routing rules, written from the families' descriptions -------------------------------


def reference_choice(model_type, config, gate, hidden_TH):
    """Experts [T, k] that `model_type`'s rule picks, best first, and each choice's margin [T].

    Softmax families: the k largest softmax probabilities (ranked, and margins taken, on the
    logits). DeepSeek-V3 / GLM-4.5: scores s = sigmoid(logits); choice scores c = s + bias;
    each of n_group groups is scored by the sum of its two largest c; experts outside the
    topk_group best groups are excluded; the k largest remaining c. The margin is the smallest
    gap that decided the choice (k-th vs next expert, and for groups the last kept vs the first
    dropped group), in float64.
    """
    logits = hidden_TH.double() @ gate.weight.double().T  # [T, E]
    tokens, experts = logits.shape
    margin = torch.full((tokens,), float("inf"), dtype=torch.float64)
    if model_type in GROUPED:
        choice = torch.sigmoid(logits) + gate.e_score_correction_bias.double()
        groups, keep = config.n_group, config.topk_group
        per_group = choice.reshape(tokens, groups, experts // groups)
        group_score = per_group.sort(dim=-1, descending=True).values[..., :2].sum(dim=-1)
        ranked = group_score.sort(dim=-1, descending=True)
        if keep < groups:
            margin = ranked.values[:, keep - 1] - ranked.values[:, keep]
        allowed = torch.zeros(tokens, groups, dtype=torch.bool)
        allowed.scatter_(1, ranked.indices[:, :keep], True)
        choice = choice.masked_fill(~allowed.repeat_interleave(experts // groups, dim=1), -1e9)
    else:  # softmax is monotonic: the largest probabilities are the largest logits
        choice = logits
    ranked = choice.sort(dim=-1, descending=True, stable=True)
    k = config.num_experts_per_tok
    margin = torch.minimum(margin, ranked.values[:, k - 1] - ranked.values[:, k])
    return ranked.indices[:, :k], margin


def router_inputs(model, tokens):
    """{layer: hidden states [T, H] entering its router} of one no-cache forward of `tokens`.

    Routers are found by transformers 5's module names (`model.layers[i].mlp.gate` next to
    `mlp.experts`), not by the engine's code.
    """
    seen, handles = {}, []

    def keep(layer):
        def hook(module, args, output):
            seen[layer] = args[0].reshape(-1, args[0].shape[-1])

        return hook

    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "experts"):
            handles.append(layer.mlp.gate.register_forward_hook(keep(i)))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens]), use_cache=False)
    finally:
        for hook in handles:
            hook.remove()
    return seen


def check_against_rule(model_type, model, tokens, experts, min_margin=0.0):
    """Assert `experts` [len(tokens), layers, k] are the rule's choice at every position whose
    margin exceeds `min_margin`; returns how many (position, layer) pairs were compared and how
    many of them differ from the plain top-k of the router logits."""
    config = model.config
    inputs = router_inputs(model, tokens)
    assert tuple(inputs) == MOE_LAYERS.get(model_type, tuple(range(NUM_LAYERS)))
    compared = naive_differs = 0
    for layer in range(NUM_LAYERS):
        got = experts[:, layer].long()
        if layer not in inputs:
            assert not got.any(), f"dense layer {layer} must report zeros"
            continue
        gate = model.model.layers[layer].mlp.gate
        expected, margin = reference_choice(model_type, config, gate, inputs[layer])
        clear = margin > min_margin
        if model_type in GROUPED:  # chosen with torch.topk(sorted=False): compare sets
            got, expected = got.sort(dim=-1).values, expected.sort(dim=-1).values
        assert torch.equal(got[clear], expected[clear]), (layer, got[clear], expected[clear])
        compared += int(clear.sum())
        naive = torch.topk(inputs[layer].double() @ gate.weight.double().T, TOPK).indices
        naive_differs += int((naive.sort(-1).values != got.sort(-1).values).any(-1).sum())
    return compared, naive_differs


# -- the engine on each family -----------------------------------------------------------------


def test_model_info_reads_each_family_config(family_engine, family_checkpoint):
    model_type, path = family_checkpoint
    info = family_engine.model_info
    moe = MOE_LAYERS.get(model_type, tuple(range(NUM_LAYERS)))
    assert (info.num_layers, info.num_experts, info.topk, info.moe_layers) == (
        NUM_LAYERS,
        NUM_EXPERTS,
        TOPK,
        moe,
    )
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [FAMILIES[model_type].architecture]
    fields = {"num_experts", "num_local_experts", "n_routed_experts"}
    assert {f for f in fields if f in config} == {EXPERTS_FIELD[model_type]}
    assert config_moe_layers(config) == moe
    for field in fields:  # any of the names, as other writers use them
        renamed = {k: v for k, v in config.items() if k not in fields} | {field: NUM_EXPERTS}
        assert config_num_experts(renamed) == NUM_EXPERTS
    sglang = model_info_from_dir(path)
    assert (sglang.num_layers, sglang.num_experts, sglang.topk, sglang.moe_layers) == (
        NUM_LAYERS,
        NUM_EXPERTS,
        TOPK,
        moe,
    )


def test_routed_experts_are_the_family_rule_for_every_forwarded_position(
    family_engine, family_checkpoint
):
    model_type, _ = family_checkpoint
    outputs = family_engine.generate_sync(requests(routed=True, max_new_tokens=10, seed=4))
    compared = naive_differs = 0
    for ids, out in zip(PROMPTS, outputs, strict=True):
        tokens = ids + out.output_ids
        experts = out.routed_experts
        assert experts.dtype == torch.int32
        assert experts.shape == (len(tokens) - 1, NUM_LAYERS, TOPK)
        decoded = decode_routed_experts(
            out.meta_info["routed_experts"],
            num_tokens=len(tokens),
            num_layers=NUM_LAYERS,
            topk=TOPK,
            where=out.meta_info["id"],
        )
        assert torch.equal(decoded, experts)
        # Prefill and decode steps ran batched and cached; the rule runs on one plain forward.
        counts = check_against_rule(model_type, family_engine.model, tokens[:-1], experts)
        compared += counts[0]
        naive_differs += counts[1]
    assert compared > 0
    if model_type in GROUPED:
        # The bias and the group limit matter here: the top-k of the router logits (what a hook
        # on the router would take) is wrong for many positions.
        assert naive_differs > compared // 4, (naive_differs, compared)
    else:
        assert naive_differs == 0


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_bf16_engine_records_what_it_dispatched(model_type):
    """bf16 routes differently from fp32 near ties; the recorded experts are bf16's own.

    The engine's uncached path records one plain bf16 forward of each sample; the reference
    takes the router inputs of that same forward to float64, and only choices decided by less
    than bf16 rounding of the logits (a margin under 0.004) are left out.
    """
    model = build_family_model(model_type, seed=5, dtype=torch.bfloat16)
    engine = HFEngine(HFEngineConfig(dtype="bfloat16"), model=model)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # kept fp32, as from_pretrained keeps it
            assert buffer.dtype == torch.float32
    outputs = engine.generate_uncached(requests(routed=True, max_new_tokens=8, seed=2)[:2])
    compared = total = 0
    for ids, out in zip(PROMPTS[:2], outputs, strict=True):
        tokens = ids + out.output_ids
        experts = out.routed_experts
        assert experts.shape == (len(tokens) - 1, NUM_LAYERS, TOPK)
        compared += check_against_rule(model_type, model, tokens[:-1], experts, 0.004)[0]
        total += (len(tokens) - 1) * len(MOE_LAYERS.get(model_type, range(NUM_LAYERS)))
    assert compared >= total * 3 // 4, (compared, total)


# -- replaying recorded experts (row 3 of `ember certify` under R3) ---------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_replaying_experts_dispatches_them_and_the_engines_own_choice_changes_nothing(
    model_type, dtype
):
    """`replay_routing` with the experts the model records gives its own forward bit for bit;
    with other experts, those are what every MoE layer dispatches to. (That it weighs them as
    megatron-core's replay does is checked against the trainer in the R3 plugin's tests.)"""
    model = build_family_model(model_type, seed=3, dtype=dtype)
    sites = find_routers(model)
    capture = ExpertCapture([(s.layer, s.experts) for s in sites], NUM_LAYERS, TOPK)
    tokens = torch.tensor([PROMPTS[0] + PROMPTS[1]])
    positions = tokens.shape[1]
    moe = list(MOE_LAYERS.get(model_type, range(NUM_LAYERS)))
    with torch.no_grad():
        natural = model(input_ids=tokens).logits
        recorded = capture.pop(1, positions)[0]
        with replay_routing(model, recorded):
            replayed = model(input_ids=tokens).logits
        assert torch.equal(capture.pop(1, positions)[0], recorded)
        shifted = recorded.clone()
        shifted[:, moe] = (shifted[:, moe] + 1) % NUM_EXPERTS
        with replay_routing(model, shifted.to(torch.uint8)):
            moved = model(input_ids=tokens).logits
        dispatched = capture.pop(1, positions)[0]
        after = model(input_ids=tokens).logits  # the hooks are gone
    capture.close()
    assert torch.equal(replayed, natural)
    assert torch.equal(dispatched[:, moe], shifted[:, moe])
    assert (moved - natural).abs().max() > 1e-3
    assert torch.equal(after, natural)


@pytest.mark.parametrize(
    ("shape", "high", "message"),
    [
        (
            (5, NUM_LAYERS + 1, TOPK),
            NUM_EXPERTS,
            r"\[positions, num_layers=3, topk=2\], got \(5, 4, 2\)",
        ),
        ((5, NUM_LAYERS, TOPK), NUM_EXPERTS + 1, r"ids in \[\d+, 8\], outside \[0, 8\)"),
        (
            (4, NUM_LAYERS, TOPK),
            NUM_EXPERTS,
            "the forward routes 5 positions, the experts to replay cover 4",
        ),
    ],
    ids=["layers", "ids", "positions"],
)
def test_experts_that_do_not_fit_the_replay_are_refused(shape, high, message):
    model = build_family_model("qwen3_moe", seed=3)
    experts = torch.full(shape, high - 1, dtype=torch.int32)
    experts[..., 0] = 0
    with pytest.raises(ValueError, match=message), torch.no_grad():
        with replay_routing(model, experts):
            model(input_ids=torch.tensor([PROMPTS[3][:5]]))


def test_replay_names_the_families_it_knows():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=32,
        )
    )
    with pytest.raises(
        ValueError, match="routing replay knows the routers of qwen3_moe, .*model_type is 'llama'"
    ):
        with replay_routing(model, torch.zeros(3, 1, 2, dtype=torch.int32)):
            pass


# -- weights in each family's checkpoint names -------------------------------------------------

CHECKPOINT_NAMES = {
    "qwen3_moe": [
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.experts.7.gate_proj.weight",
        "model.layers.1.mlp.experts.7.up_proj.weight",
        "model.layers.1.mlp.experts.7.down_proj.weight",
        "model.layers.1.self_attn.q_norm.weight",
    ],
    "deepseek_v3": [
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.mlp.experts.7.gate_proj.weight",
        "model.layers.1.mlp.experts.7.up_proj.weight",
        "model.layers.1.mlp.experts.7.down_proj.weight",
        "model.layers.1.mlp.shared_experts.gate_proj.weight",
        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.1.self_attn.q_a_layernorm.weight",
    ],
    "glm4_moe": [
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.mlp.experts.7.gate_proj.weight",
        "model.layers.1.mlp.experts.7.up_proj.weight",
        "model.layers.1.mlp.experts.7.down_proj.weight",
        "model.layers.1.mlp.shared_experts.down_proj.weight",
        "model.layers.1.self_attn.q_proj.bias",
        "model.layers.1.self_attn.k_norm.weight",
    ],
    "qwen2_moe": [
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.experts.7.gate_proj.weight",
        "model.layers.1.mlp.experts.7.up_proj.weight",
        "model.layers.1.mlp.experts.7.down_proj.weight",
        "model.layers.1.mlp.shared_expert.up_proj.weight",
        "model.layers.1.mlp.shared_expert_gate.weight",
        "model.layers.1.self_attn.k_proj.bias",
    ],
    "mixtral": [
        "model.layers.1.block_sparse_moe.gate.weight",
        "model.layers.1.block_sparse_moe.experts.7.w1.weight",
        "model.layers.1.block_sparse_moe.experts.7.w3.weight",
        "model.layers.1.block_sparse_moe.experts.7.w2.weight",
    ],
}
"""Names transformers 5.19's `save_pretrained` writes, as SGLang reads them (a sample each)."""


def test_checkpoint_names_load_into_a_differently_initialised_model(family_checkpoint):
    from transformers import AutoModelForCausalLM

    model_type, path = family_checkpoint
    named = list(iter_checkpoint(path))
    names = {name for name, _ in named}
    assert set(CHECKPOINT_NAMES[model_type]) <= names
    assert not any(name.endswith(("gate_up_proj", "experts.down_proj")) for name in names)
    if model_type == "mixtral":
        assert not any(".mlp." in name for name in names)

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    other = build_family_model(model_type, seed=11)
    ids = torch.tensor([[12, 5, 3, 16, 4, 4, 9, 1]])
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        assert not torch.allclose(other(input_ids=ids).logits, expected)
        check_update_names(other, [name for name, _ in named])  # complete, nothing unknown
        assert load_hf_weights(other, named) == len(named)
        assert torch.equal(other(input_ids=ids).logits, expected)
    assert other.state_dict().keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key


def test_engine_update_from_checkpoint_names_switches_policy_and_routing(
    family_engine, family_checkpoint
):
    model_type, path = family_checkpoint
    engine = HFEngine(HFEngineConfig(dtype="float32"), model=build_family_model(model_type, seed=9))
    request = GenerateRequest(
        input_ids=[12, 4, 5, 16],
        sampling=SamplingParams(max_new_tokens=6, seed=1, ignore_eos=True),
        fields={"return_routed_experts": True},
    )
    before = engine.generate_sync([request])[0]
    asyncio.run(engine.update_weights_from_tensors(iter_checkpoint(path), weight_version="7"))
    got, expected = engine.generate_sync([request])[0], family_engine.generate_sync([request])[0]
    assert before.output_log_probs != expected.output_log_probs
    assert got.output_ids == expected.output_ids
    # Same weights, but not the same computation: the updated engine holds tensors written in
    # place into a model built another way, and the CPU GEMMs block differently by layout and
    # processor (AVX2 and AVX-512 machines differed by 2.4e-7 on a log-prob of -3.04). fp32
    # over a few tiny layers: a few ulps of the log-prob's scale, far below the gap between
    # the two policies (`before`) that the test tells apart.
    torch.testing.assert_close(
        torch.tensor(got.output_log_probs), torch.tensor(expected.output_log_probs),
        rtol=1e-5, atol=1e-5,
    )  # fmt: skip
    gap = (torch.tensor(before.output_log_probs) - torch.tensor(expected.output_log_probs)).abs()
    assert gap.max() > 1e-2
    assert torch.equal(got.routed_experts, expected.routed_experts)
    assert got.meta_info["weight_version"] == "7"


@pytest.fixture(scope="module")
def mixtral():
    return build_family_model("mixtral", seed=0)


def test_mixtral_names_fill_the_fused_halves(mixtral):
    gate_up = mixtral.state_dict()["model.layers.2.mlp.experts.gate_up_proj"]
    before = gate_up.clone()
    width = gate_up.shape[1] // 2
    up, down = torch.full((width, 64), 0.5), torch.full((64, width), -0.25)
    load_hf_weights(
        mixtral,
        [
            ("model.layers.2.block_sparse_moe.experts.3.w3.weight", up),
            ("model.layers.2.block_sparse_moe.experts.3.w2.weight", down),
            ("model.layers.2.block_sparse_moe.gate.weight", torch.ones(NUM_EXPERTS, 64)),
        ],
    )
    assert torch.equal(gate_up[3, width:], up)  # w3 is up: the second half
    assert torch.equal(gate_up[3, :width], before[3, :width])
    assert torch.equal(mixtral.state_dict()["model.layers.2.mlp.experts.down_proj"][3], down)
    assert mixtral.state_dict()["model.layers.2.mlp.gate.weight"].eq(1).all()


def test_names_of_another_family_or_a_missing_tensor_are_refused(mixtral):
    for name in (
        "model.layers.0.mlp.experts.1.gate_proj.weight",
        "model.layers.0.mlp.experts.1.w1.weight",
    ):
        with pytest.raises(ValueError, match=f"'{name}' matches no parameter"):
            load_hf_weights(mixtral, [(name, torch.zeros(32, 64))])
    qwen2 = build_family_model("qwen2_moe")
    name = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
    with pytest.raises(ValueError, match=f"'{name}' matches no parameter"):
        load_hf_weights(qwen2, [(name, torch.zeros(32, 64))])
    with pytest.raises(ValueError, match=f"{name} match no parameter of the engine's model"):
        check_update_names(qwen2, [name], partial=True)

    full = [
        n.replace(".mlp.", ".block_sparse_moe.") for n in mixtral.state_dict() if "experts" not in n
    ]
    for layer in range(NUM_LAYERS):
        for e in range(NUM_EXPERTS):
            full += [
                f"model.layers.{layer}.block_sparse_moe.experts.{e}.w{w}.weight" for w in "123"
            ]
    check_update_names(mixtral, full)
    without = [n for n in full if n != "model.layers.2.block_sparse_moe.experts.5.w3.weight"]
    with pytest.raises(
        ValueError, match=r"leaves out model.layers.2.block_sparse_moe.experts.5.w3.weight:"
    ):
        check_update_names(mixtral, without)

    deepseek = build_family_model("deepseek_v3")
    names = [n for n in deepseek.state_dict() if "mlp.experts." not in n]
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    with pytest.raises(ValueError, match=r"leaves out .*model.layers.1.mlp.experts.0.gate_proj"):
        check_update_names(deepseek, names)
    experts = [
        f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight"
        for layer in (1, 2)
        for e in range(NUM_EXPERTS)
        for p in ("gate", "up", "down")
    ]
    check_update_names(deepseek, names + experts)
    # Routing depends on the bias: an update that leaves it out is incomplete.
    with pytest.raises(ValueError, match=f"leaves out {bias}:"):
        check_update_names(deepseek, [n for n in names if n != bias] + experts)
