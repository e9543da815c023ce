"""`ember plot`: PNG curves from metrics.jsonl."""

from __future__ import annotations

import logging

import pytest

from ember.cli import main
from ember.metrics import MetricsLogger, read_metrics
from ember.plot import PlotProcess


def test_metrics_logger_writes_jsonl_and_tensorboard(tmp_path):
    sink = MetricsLogger(tmp_path)
    sink.log("rollout", 0, 0, {"rollout/rewards": 0.25})
    sink.log("train", 0, 0, {"train/loss": 1.5, "train/ppo_kl": 0.0})
    sink.close()
    records = list(read_metrics(tmp_path))
    assert [r["kind"] for r in records] == ["rollout", "train"]
    assert records[0]["rollout/rewards"] == 0.25 and records[1]["train/loss"] == 1.5
    assert any((tmp_path / "tensorboard").iterdir())


def test_torn_last_line_is_skipped(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "rollout", "step": 0}\n{"kind": "ro')
    assert len(list(read_metrics(tmp_path))) == 1


def test_plot_writes_pngs(tmp_path, capsys):
    sink = MetricsLogger(tmp_path, tensorboard=False)
    for i in range(5):
        sink.log("rollout", i, i, {"rollout/rewards": i / 5, "rollout/routing_agreement": 0.97})
        sink.log("train", i, i, {"train/kl_loss": 0.01 * i})
    sink.close()
    assert main(["plot", str(tmp_path)]) == 0
    written = capsys.readouterr().out.split()
    names = sorted(p.rsplit("/", 1)[-1] for p in written)
    assert names == ["curves.png", "kl.png", "reward.png", "routing.png"]
    for path in written:
        with open(path, "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_of_a_directory_without_metrics_is_one_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics file" in capsys.readouterr().err


def _five_rollouts(run_dir):
    sink = MetricsLogger(run_dir, tensorboard=False)
    for i in range(5):
        sink.log("rollout", i, i, {"rollout/rewards": i / 5})
    sink.close()


@pytest.mark.slow  # a child process importing matplotlib
def test_the_plot_process_draws_what_the_run_logged_by_the_time_it_is_told(tmp_path):
    plots = PlotProcess(tmp_path)  # started before the run's metrics exist, as a run starts it
    _five_rollouts(tmp_path)
    plots.draw()
    assert plots.finish()
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["curves.png", "reward.png"]


@pytest.mark.slow
def test_a_run_that_ends_without_draw_leaves_no_plots_and_no_process(tmp_path):
    _five_rollouts(tmp_path)
    plots = PlotProcess(tmp_path)
    assert not plots.finish()  # the run failed: its input closes, the child exits
    assert plots._process.returncode == 0
    assert not (tmp_path / "plots").exists()


@pytest.mark.slow
def test_a_plot_that_fails_is_one_warning_naming_why_and_the_command_to_draw_again(
    tmp_path, caplog
):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "rollout", "rollout_id": 0}\n')
    plots = PlotProcess(tmp_path)
    plots.draw()
    with caplog.at_level(logging.WARNING, logger="ember.plot"):
        assert not plots.finish()
    (record,) = caplog.records
    assert "holds none of the plotted metrics yet" in record.getMessage()
    assert f"`ember plot {tmp_path}` draws the plots again" in record.getMessage()


@pytest.mark.slow
def test_a_plot_process_that_died_is_one_warning_and_the_run_ends_as_it_would(tmp_path, caplog):
    _five_rollouts(tmp_path)
    plots = PlotProcess(tmp_path)
    plots._process.kill()
    plots._process.wait()
    plots.draw()  # into a broken pipe: not an error of the run
    with caplog.at_level(logging.WARNING, logger="ember.plot"):
        assert not plots.finish()
    (record,) = caplog.records
    assert f"`ember plot {tmp_path}` draws the plots again" in record.getMessage()
