"""The README's benchmarks at tiny sizes: `tools/bench_logprobs.py` and `tools/bench_rollout.py`
run end to end, and each side of each comparison does the work the script says it does."""

from __future__ import annotations

import pytest
import torch
from tools_loader import load_tool

bench_logprobs = load_tool("bench_logprobs")
bench_rollout = load_tool("bench_rollout")


@pytest.mark.parametrize("pass_", bench_logprobs.PASSES)
def test_logprob_sides_do_the_same_work_with_the_same_results(pass_, monkeypatch):
    args = bench_logprobs.parse_args(["--rows", "48", "--vocab", "40", "--samples", "3"])
    logits_TV, tokens_T, total_lengths, response_lengths = bench_logprobs.make_batch(args)
    head = bench_logprobs.PolicyHead(bench_logprobs.TEMPERATURE, chunk_bytes=8 * 40 * 5)
    normalised = []  # rows of every torch.log_softmax call, out= form included (both sides)
    log_softmax = torch.log_softmax

    def counting_log_softmax(input, *args, **kwargs):
        normalised.append(input.shape[0])
        return log_softmax(input, *args, **kwargs)

    monkeypatch.setattr(torch, "log_softmax", counting_log_softmax)
    results, rows = {}, {}
    for variant in bench_logprobs.VARIANTS:
        normalised.clear()
        results[variant] = bench_logprobs.run_once(
            variant, pass_, head, logits_TV, tokens_T, total_lengths, response_lengths
        )
        rows[variant] = sum(normalised)
    # Both sides normalise exactly the response rows, no other row (the chunked one in chunks).
    assert rows == {"naive": sum(response_lengths), "chunked": sum(response_lengths)}
    (naive_lp, naive_h, naive_grad), (lp, h, grad) = results["naive"], results["chunked"]
    assert [t.shape[0] for t in naive_lp] == response_lengths
    torch.testing.assert_close(torch.cat(lp), torch.cat(naive_lp), rtol=1e-5, atol=1e-5)
    if pass_ == "forward":
        assert naive_h == h == [] and naive_grad is None and grad is None
    else:
        torch.testing.assert_close(torch.cat(h), torch.cat(naive_h), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, naive_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # runs the benchmark: about 9 s
def test_bench_logprobs_prints_medians_and_ratios(capsys):
    # [T, V] is 1 MiB, the chunked side's scratch 64 KiB: both far above a page.
    argv = ["--rows", "256", "--vocab", "1024", "--samples", "2", "--reps", "3"]
    summary = bench_logprobs.main([*argv, "--threads", "1", "--chunk-bytes", str(64 * 1024)])
    out = capsys.readouterr().out
    assert list(summary) == ["forward", "fwd+bwd"]
    response_rows = sum(bench_logprobs.packed_lengths(bench_logprobs.parse_args(argv))[1])
    for pass_, row in summary.items():
        assert row["naive_time"] > 0 and row["chunked_time"] > 0 and row["time_ratio"] > 0
        # The naive side holds at least its [R, V] log-softmax; the chunked one far less.
        assert row["naive_extra"] >= response_rows * 1024 * 4
        assert row["memory_ratio"] < 1.0
        assert f"{pass_} chunked/naive: time {row['time_ratio']:.3f}x" in out
    assert summary["forward"]["memory_ratio"] < 0.25
    assert "median of 3 repetitions" in out and "forward targets:" in out


@pytest.mark.slow  # imports transformers and builds the tiny model
def test_generate_baseline_returns_the_sampled_tokens_log_probs():
    from ember_rollout.config import HFEngineConfig
    from ember_rollout.hf_engine import HFEngine
    from ember_rollout.token_sampling import filtered_log_probs

    args = bench_rollout.parse_args(
        ["--prompts", "3", "--new-tokens", "5", "--batch-size", "2", "--top-p", "0.8"]
    )
    engine = HFEngine(HFEngineConfig(dtype="float32", num_threads=1))
    engine.load()
    model = engine.model
    prompts = bench_rollout.make_prompts(args)
    assert len({len(p) for p in prompts}) > 1  # mixed lengths: the batches are left-padded
    torch.manual_seed(0)
    completions = bench_rollout.hf_generate(model, prompts, args)
    assert len(completions) == 3
    with torch.inference_mode():
        for prompt, (tokens, log_probs) in zip(prompts, completions, strict=True):
            assert len(tokens) == len(log_probs) == 5
            # Unpadded, uncached forward of the whole sequence: the rows predicting the response.
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0]
            expected = filtered_log_probs(logits[len(prompt) - 1 : -1], 1.0, -1, 0.8)
            expected = expected.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(log_probs), expected, rtol=0, atol=1e-4)
    sampling = bench_rollout.check_same_sampling(model, prompts, args)
    assert sampling["max_abs_diff"] <= 1e-4 and sampling["rows"] == 3 * 5
    assert sampling["boundary_rows"] < sampling["rows"]


@pytest.mark.parametrize(
    ("probs", "top_p", "ambiguous"),
    [
        ([0.4, 0.3, 0.3], 0.5, [False, True, True]),  # the cut falls inside a tie
        ([0.4, 0.3, 0.3], 0.8, [False, False, False]),  # the whole tie is kept
        ([0.6, 0.3, 0.1], 0.8, [False, False, False]),  # kept, kept, dropped
        ([0.6, 0.4, 0.0], 0.6, [False, True, False]),  # mass before token 1 equals top_p
    ],
)
def test_top_p_ambiguous_marks_only_ties_and_rounding_at_the_cut(probs, top_p, ambiguous):
    logits = torch.tensor([probs]).clamp(min=1e-30).log()
    marked = bench_rollout.top_p_ambiguous(logits, 1.0, top_p)
    assert marked[0].tolist() == ambiguous


@pytest.mark.slow
def test_bench_rollout_reports_both_sides_median(capsys):
    argv = ["--prompts", "3", "--new-tokens", "4", "--reps", "2", "--threads", "1"]
    result = bench_rollout.main([*argv, "--dtype", "float32", "--top-p", "0.9"])
    out = capsys.readouterr().out
    assert len(result["ember_runs_tokens_per_s"]) == len(result["generate_runs_tokens_per_s"]) == 2
    assert result["ember_tokens_per_s"] > 0 and result["generate_tokens_per_s"] > 0
    assert result["sampling_max_abs_diff"] <= 1e-4
    assert f"Ember / generate() within a repetition: median {result['ratio']:.2f}x" in out
    assert "12 tokens" in out
