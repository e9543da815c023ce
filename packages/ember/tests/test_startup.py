"""The start-up timeline (EMBER_STARTUP_TRACE, tools/profile_startup.py) and what start-up
overlaps: the engine's model classes, the end-of-run shutdown."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ember.startup import TRACE_ENV, mark, process_start_time

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools"))

import profile_startup  # noqa: E402


def test_mark_appends_one_line_per_step_only_when_traced(tmp_path, monkeypatch):
    trace = tmp_path / "trace.tsv"
    monkeypatch.delenv(TRACE_ENV, raising=False)
    mark("driver", "untraced")
    assert not trace.exists()
    monkeypatch.setenv(TRACE_ENV, str(trace))
    before = time.time()
    mark("driver", "config loaded")
    mark("rank 0", "model built", when=before - 5.0)
    rows = profile_startup.read_trace(trace)
    assert [(p, s) for _, p, s in rows] == [
        (f"rank 0[{os.getpid()}]", "model built"),  # sorted by time, not by writing order
        (f"driver[{os.getpid()}]", "config loaded"),
    ]
    assert rows[0][0] == pytest.approx(before - 5.0, abs=1e-3)
    assert before - 1e-3 <= rows[1][0] <= time.time()  # written to the millisecond


def test_process_start_time_is_this_process_start():
    started = process_start_time()
    # pytest has been running for a while: its start lies in the past, within the session.
    assert time.time() - 24 * 3600 < started < time.time() - 0.01
    child = subprocess.run(
        [sys.executable, "-c", "import time, ember.startup as s; "
         "print(time.time() - s.process_start_time())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert 0.0 <= float(child.stdout) < 30.0  # the interpreter start and the imports, no more


def test_timeline_shows_time_since_start_and_the_gap_per_process():
    rows = [
        (100.0, "driver[1]", "process started"),
        (104.0, "driver[1]", "config loaded"),
        (105.0, "rank 0[2]", "process started"),
        (109.5, "rank 0[2]", "actor created"),
        (110.0, "driver[1]", "ray.init done"),
    ]
    lines = profile_startup.timeline(rows, start=99.0)
    cells = [line.split(maxsplit=2) for line in lines[1:]]
    assert [c[:2] for c in cells] == [
        ["1.00", "0.00"], ["5.00", "4.00"], ["6.00", "0.00"], ["10.50", "4.50"], ["11.00", "6.00"]
    ]  # fmt: skip
    assert cells[3][2].split() == ["rank", "0", "actor", "created"]


def test_every_family_preloads_its_model_class():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ember_megatron_backend.model import FAMILIES

    # `_import_rollout_libraries` finds a family's class here; a family missing would load it
    # only when the engine starts, after the trainer's export.
    assert all(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(f) for f in FAMILIES)


@pytest.mark.slow  # a fresh process, to see what the import brings in
def test_the_engine_imports_its_familys_modeling_module_before_it_starts():
    code = (
        "import json, sys\n"
        "from ember.actors import _import_rollout_libraries\n"
        "_import_rollout_libraries(embedded_engine=True, model_type='deepseek_v3')\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('transformers.models.')"
        " and m.endswith('.modeling_deepseek_v3'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == [
        "transformers.models.deepseek_v3.modeling_deepseek_v3"
    ]


def _processes_with(marker: str) -> list[str]:
    """Command lines of the live processes whose environment holds `marker`."""
    found = []
    for process in psutil.process_iter():
        try:
            if any(marker in value for value in process.environ().values()):
                found.append(" ".join(process.cmdline()))
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
    return found


@pytest.mark.slow  # the default job for one rollout
@pytest.mark.parametrize("runtime", ["in-process", "ray"])
def test_profile_startup_times_every_process_and_the_run_leaves_none_behind(tmp_path, runtime):
    trace = tmp_path / "trace.tsv"
    run_dir = tmp_path / "run"
    env = {**os.environ, TRACE_ENV: str(trace)}
    # The default job runs in one process (ray.enabled=auto); under Ray each role is a process
    # of Ray's, whose reaping at the end is what the Ray variant checks.
    forced = ["--set", "ray.enabled=true"] if runtime == "ray" else []
    subprocess.run(
        [sys.executable, "-m", "ember.cli", "train", "--set", "run.num_rollouts=1",
         "--set", f"run.dir={run_dir}", *forced],
        env=env, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    # Every process the run started (Ray's, under Ray) inherited the variable: none may outlive
    # the command.
    assert _processes_with(str(trace)) == []
    rows = profile_startup.read_trace(trace)
    steps: dict[str, list[tuple[float, str]]] = {}
    pids: dict[str, set[str]] = {}
    for when, process, step in rows:
        name, _, pid = process.partition("[")
        steps.setdefault(name, []).append((when, step))
        pids.setdefault(name, set()).add(pid)
    order = {name: [s for _, s in seen] for name, seen in steps.items()}
    # Each actor records its process start, its __init__, and its own steps, in that order;
    # under Ray they reach the trace through the environment the local Ray's workers inherit.
    assert order["rank 0"] == ["process started", "actor created",
                               "megatron-core imported, process group joined",
                               "model built"]  # fmt: skip
    assert order["engine"] == ["process started", "actor created", "libraries imported",
                               "model loaded"]  # fmt: skip
    assert order["manager"] == ["process started", "actor created", "libraries imported"]
    driver = order["driver"]
    if runtime == "ray":
        assert driver[:3] == ["process started", "config loaded and checked", "ray.init starts"]
        pairs = [("ray.init done", "actors created"), ("actors shut down", "ray shut down")]
        # A process of its own for each role.
        assert len({pid for name in ("driver", "rank 0", "engine", "manager")
                    for pid in pids[name]}) == 4  # fmt: skip
    else:
        assert driver[:3] == ["process started", "config loaded and checked", "actors created"]
        assert "ray.init starts" not in driver and "ray shut down" not in driver
        pairs = []
        # Every role is an object in the driver's process.
        assert pids["rank 0"] == pids["engine"] == pids["manager"] == pids["driver"]
    for before, after in [
        *pairs,
        ("trainer built", "initial weights exported"),
        ("initial weights exported", "engines started"),
        ("rollout 0 trained", "checkpoint 0 saved"),
    ]:
        assert driver.index(before) < driver.index(after)
    assert "plots written" in driver and (run_dir / "plots" / "reward.png").is_file()
    exported = dict((s, w) for w, s in steps["driver"])["initial weights exported"]
    # The engine loads the model only once the trainer's export is there.
    assert dict((s, w) for w, s in steps["engine"])["model loaded"] >= exported


@pytest.mark.slow  # spawns processes
def test_reap_finds_a_process_tree_waits_for_it_and_kills_what_stays():
    from ember import processes

    tree = subprocess.Popen(["bash", "-c", "sleep 60 & wait"])
    deadline = time.monotonic() + 10
    while not processes.descendants([tree.pid]) and time.monotonic() < deadline:
        time.sleep(0.02)
    (sleeper,) = processes.descendants([tree.pid])  # the background sleep, below bash
    assert processes.children(os.getpid()) >= {tree.pid}
    quick = subprocess.Popen(["sleep", "0.1"])
    started = time.monotonic()
    assert processes.reap([quick.pid], timeout=5.0) == []  # exited by itself: not killed
    quick.wait()
    assert time.monotonic() - started < 5.0
    assert processes.reap([tree.pid, sleeper], timeout=0.2) == sorted([tree.pid, sleeper])
    tree.wait(timeout=5)
    assert not processes.alive(sleeper) and not processes.alive(tree.pid)
