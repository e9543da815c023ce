"""The README's benchmarks at tiny sizes: `tools/bench_logprobs.py` and `tools/bench_rollout.py`
run end to end, and each side of each comparison does the work the script says it does."""

from __future__ import annotations

import re

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
    for side in ("ember", "ember_plain", "generate"):
        assert len(result[f"{side}_runs_tokens_per_s"]) == 2
        assert result[f"{side}_tokens_per_s"] > 0
    assert result["packed_layers"] == 0  # the tiny model's weights are below packing's size
    assert result["sampling_max_abs_diff"] <= 1e-4
    assert f"Ember / generate() within a repetition: median {result['ratio']:.2f}x" in out
    packed = f"packed / plain linears within a repetition: median {result['packed_ratio']:.2f}x"
    assert packed in out
    assert "12 tokens" in out


def test_bench_e2e_reports_each_phase_and_the_engines_rollout_phase_from_its_own_runs(
    monkeypatch, capsys
):
    """bench_e2e's report from given runs' records (`measure` is the `ember train` process,
    which test_bench_smoke.py runs for real): each phase row shows its own metric, the first
    iteration apart from the mean, and the engines row compares the in-turn runs' rollout
    phases, 2 engines over 1."""
    bench_e2e = load_tool("bench_e2e")
    runs = []

    def measure(config, rollouts, overrides):
        runs.append(overrides)
        engines = [o for o in overrides if o.startswith("ray.num_engines=")]
        # The rollout phase of each run its own: 1.2 s in-turn, 3.0 s / 6.0 s with 2 / 1 engines.
        rollout = {(): 1.2, ("ray.num_engines=2",): 3.0, ("ray.num_engines=1",): 6.0}
        records = []
        for i in range(rollouts):
            warm = 100.0 if i == 0 else 0.0  # the first iteration, left out of every mean
            records.append(
                {
                    "perf/rollout_time": rollout[tuple(engines)] + warm,
                    "perf/log_probs_time": 0.4 + warm,
                    "perf/train_time": 2.0 + warm,
                    "perf/weight_push_time": 0.2 + warm,
                    "perf/iteration_time": 4.0 + warm,
                    "perf/rollout_time_s": 1.0,
                    "rollout/num_samples": 16,
                    "rollout/response_len_mean": 5.0,
                    "rollout/rewards": 0.5,
                }
            )
        return records

    monkeypatch.setattr(bench_e2e, "measure", measure)
    monkeypatch.setattr("sys.argv", ["bench_e2e.py", "--rollouts", "3", "--rows", "phases,engines"])
    bench_e2e.main()
    out = capsys.readouterr().out
    rows = {
        "rollout \\(waited\\)": r"1\.200\s+30\.0%\s+101\.200",
        "ref \\+ old log-probs": r"0\.400\s+10\.0%\s+100\.400",
        "training": r"2\.000\s+50\.0%\s+102\.000",
        "weight push": r"0\.200\s+5\.0%\s+100\.200",
        "iteration": r"4\.000\s+100%\s+104\.000",
    }
    for label, figures in rows.items():
        assert re.search(rf"^{label}\s+{figures}$", out, flags=re.M), (label, out)
    header = "default: 2 iterations measured (after 1 warm-up), 16 samples and 80 response tokens"
    assert re.search(rf"^{re.escape(header)} per iteration$", out, flags=re.M), out
    assert "rollout generation: 80 response tokens/s" in out  # 16 x 5 tokens in 1.0 s
    assert "end to end: 20 response tokens/s, 0.25 iterations/s" in out  # 80 tokens in 4.0 s
    assert (
        "rollout phase, 2 engines x 1 thread vs 1 engine x 2 threads: 3.000 vs 6.000 s/iter "
        "-> 0.50x (target <= 0.8: met)"
    ) in out
    # Every run takes rollout and training in turn; the engines runs differ only in the split.
    assert all("rollout.async=false" in overrides for overrides in runs), runs
    assert [sorted(o for o in overrides if o != "rollout.async=false") for overrides in runs] == [
        [],
        ["engine.hf.num_threads=2", "ray.num_engines=1"],
        ["engine.hf.num_threads=1", "ray.num_engines=2"],
    ]


def test_bench_e2e_staleness_row_averages_every_k_over_the_same_iterations(monkeypatch, capsys):
    """The staleness row runs k = 0 once and every k >= 1 in turn and with partial rollouts,
    all with the given engines. Every mean leaves out iterations 0 .. max k (the first one
    generated the k rollouts the next k train on), the same for every row, so a row with a
    larger k does not gain by dropping more of the slow early iterations; each is divided by
    k = 0's, beside the trainer's share, the wait and the response tokens per iteration."""
    bench_e2e = load_tool("bench_e2e")
    runs = []

    def measure(config, rollouts, overrides):
        runs.append(overrides)
        k = int(next(o for o in overrides if o.startswith("rollout.max_staleness=")).split("=")[1])
        partial = "rollout.partial_rollouts=true" in overrides
        steady = 4.0 - k * 0.5 - (0.25 if partial else 0.0)
        return [
            {
                # iteration 0 waits for k + 1 rollouts; 1 .. k train on them at once; early
                # iterations are slower in every run (9.0), whatever k
                "perf/iteration_time": 50.0
                if i == 0
                else 0.1
                if i <= k
                else 9.0
                if i < 3
                else steady,
                "perf/train_time": 1.5,
                "perf/rollout_time": 0.5,
                "rollout/response_len_mean": 10.0 + k,
                "rollout/num_samples": 4,
                "rollout/staleness": float(min(i, k)),
                "rollout/rewards": 0.25,
            }
            for i in range(rollouts)
        ]

    monkeypatch.setattr(bench_e2e, "measure", measure)
    argv = ["bench_e2e.py", "--rollouts", "6", "--rows", "staleness", "--staleness", "0,2"]
    monkeypatch.setattr("sys.argv", argv)
    bench_e2e.main()
    out = capsys.readouterr().out
    assert "means over iterations 3 .. 5 (the same for every k)" in out
    row = r"^\s+{}\s+{}\s+{}\s+{}\s+1\.500\s+0\.500\s+{}\s+{}\s+0\.250$"
    for cells in [
        ("0", "no", r"4\.000", r"1\.00", "40", r"0\.00"),
        ("2", "no", r"3\.000", r"0\.75", "48", r"2\.00"),
        ("2", "yes", r"2\.750", r"0\.69", "48", r"2\.00"),
    ]:
        assert re.search(row.format(*cells), out, re.M), out
    assert [o[:3] for o in runs] == [
        ["rollout.max_staleness=0", "rollout.partial_rollouts=false", "ray.num_engines=2"],
        ["rollout.max_staleness=2", "rollout.partial_rollouts=false", "ray.num_engines=2"],
        ["rollout.max_staleness=2", "rollout.partial_rollouts=true", "ray.num_engines=2"],
    ]


def test_bench_output_layer_times_both_sides_and_they_agree(tmp_path, capsys):
    bench = load_tool("bench_output_layer")
    argv = ["--checkpoint", str(tmp_path / "none"), "--samples", "3", "--prompt", "6",
            "--response", "4", "--repeats", "1"]  # fmt: skip
    summary = bench.main(argv)
    out = capsys.readouterr().out
    assert "model: tiny-moe preset" in out  # no config.json there
    # Every position: 3 x 10 tokens; the windows: 3 x (4 + 1).
    assert re.search(r"^every position\s+30\s+\d+\.\d{3}$", out, re.M), out
    assert re.search(r"^the response windows\s+15\s+\d+\.\d{3}$", out, re.M), out
    assert re.search(r"^response windows vs every position: \d+\.\d\dx the time$", out, re.M)
    assert summary["every_s"] > 0 and summary["windows_s"] > 0
    assert summary["max_log_prob_diff"] < 1e-5
