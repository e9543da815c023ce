"""The roofline tool's counts: matmul parameters per token of a real transformers MoE model,
each phase's FLOPs from a rollout's records, and the table of a run directory."""

from __future__ import annotations

import json

import pytest
import yaml
from tools_loader import load_tool

roofline = load_tool("roofline")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from ember_rollout.config import TinyModelConfig
    from ember_rollout.models import write_tiny_checkpoint

    path = tmp_path_factory.mktemp("model") / "hf_init"
    config = TinyModelConfig(vocab_size=17, hidden_size=32, num_layers=2, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=8)  # fmt: skip
    write_tiny_checkpoint(path, config)
    return path


def test_matmul_parameters_count_the_routed_share_of_the_experts(tiny_moe):
    import transformers

    shape = roofline.model_shape(tiny_moe / "config.json")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_moe)
    embedding = model.get_input_embeddings().weight
    experts = dense = 0
    for name, param in model.named_parameters():
        if param.dim() < 2 or param is embedding:
            continue
        if ".experts." in name:
            experts += param.numel()
        else:
            dense += param.numel()
    tied = model.get_output_embeddings().weight is embedding
    assert experts > 0 and shape["experts"] == 4 and shape["top_k"] == 2
    assert shape["active"] == dense + experts * 2 / 4 + (embedding.numel() if tied else 0)
    assert shape["output"] == model.get_output_embeddings().weight.numel() == 17 * 32
    assert shape["params"] == sum(p.numel() for p in model.parameters())
    assert shape["layers"] == 2 and shape["attention_width"] == 4 * 16


def test_phase_work_follows_the_formulas():
    shape = {"active": 1000, "output": 300, "layers": 2, "attention_width": 8}
    record = {"rollout/num_samples": 4, "rollout/prompt_len_mean": 5.0,
              "rollout/response_len_mean": 3.0, "perf/rollout_gen_tokens": 12.0,
              "perf/rollout_prompt_tokens": 20.0}  # fmt: skip
    attention = 4 * 2 * 8
    work = roofline.phase_work(shape, {"algorithm": {"use_rollout_log_probs": True}}, record)
    # The output layer (300 of the 1000) only at the 12 generated / 3 response positions.
    gen = 2 * 700 * 32 + 2 * 300 * 12 + 4 * attention * (5**2 / 2 + 3 * (5 + 3 / 2))
    trunk = 4 * (2 * 700 * 8 + attention * 8**2 / 2)
    forward = trunk + 4 * 2 * 300 * 3  # a critic's forward has no vocabulary projection
    assert work["generation"] == pytest.approx(gen / 1e9)
    # Groups of two samples of one prompt: each prompt is prefilled once for its group.
    grouped = roofline.phase_work(
        shape,
        {"algorithm": {"use_rollout_log_probs": True}, "rollout": {"n_samples_per_prompt": 2}},
        record,
    )
    shared = 2 * 700 * (10 + 12) + 2 * 300 * 12 + 4 * attention * (5**2 / 4 + 3 * (5 + 3 / 2))
    assert grouped["generation"] == pytest.approx(shared / 1e9)
    # SGLang under partial rollouts runs without its prefix cache: every prompt is prefilled.
    uncached = roofline.phase_work(
        shape,
        {"algorithm": {"use_rollout_log_probs": True}, "engine": {"kind": "sglang"},
         "rollout": {"n_samples_per_prompt": 2, "partial_rollouts": True}},
        record,
    )  # fmt: skip
    assert uncached["generation"] == pytest.approx(gen / 1e9)
    assert work["scoring"] == 0.0  # the engine's log-probs: no scoring forward
    assert work["training"] == pytest.approx(3 * forward / 1e9)
    scored = roofline.phase_work(
        shape, {"algorithm": {"use_rollout_log_probs": False, "use_kl_loss": True}}, record
    )
    assert scored["scoring"] == pytest.approx(2 * forward / 1e9)  # old log-probs + reference
    ppo = roofline.phase_work(shape, {"algorithm": {"advantage_estimator": "ppo"}}, record)
    assert ppo["scoring"] == pytest.approx((forward + trunk) / 1e9)  # old log-probs + values
    assert ppo["training"] == pytest.approx(3 * (forward + trunk) / 1e9)  # actor + critic


def test_the_table_of_a_run_directory(tiny_moe, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "hf_init").mkdir(parents=True)
    for name in ("config.json",):
        (run / "hf_init" / name).write_text((tiny_moe / name).read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"use_rollout_log_probs": True}}))
    records = [
        {"kind": "rollout", "rollout_id": i, "rollout/num_samples": 8.0,
         "rollout/prompt_len_mean": 4.0, "rollout/response_len_mean": 4.0,
         "perf/rollout_gen_time": 0.5, "perf/rollout_gen_tokens": 32.0,
         "perf/rollout_prompt_tokens": 32.0, "perf/log_probs_time": 0.01,
         "perf/train_time": 1.0, "perf/weight_push_time": 0.1, "perf/iteration_time": 1.2}
        for i in range(3)
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    roofline.main([str(run), "--rate", "100"])
    out = capsys.readouterr().out
    assert "fp32 matmul, every core: 100.0 GFLOP/s (given)" in out
    assert "rollouts 1-2" in out
    shape = roofline.model_shape(run / "hf_init" / "config.json")
    train = roofline.phase_work(shape, {"algorithm": {"use_rollout_log_probs": True}},
                                records[0])["training"]  # fmt: skip
    line = next(x for x in out.splitlines() if x.startswith("training"))
    assert line.split()[1:] == ["1.000", f"{train:.2f}", f"{train:.1f}", f"{train / 100:.1%}"]
    assert next(x for x in out.splitlines() if x.startswith("weight push")).split()[2:] == [
        "0.100", "-", "-", "-"
    ]  # fmt: skip
