"""Training checkpoints: resume reproduces the uninterrupted run; bad checkpoints fail clearly."""

from __future__ import annotations

import fractions

import pytest
import torch
from megatron_samples import algorithm, backend, make_samples, sampling

from ember_megatron_backend import checkpoint
from ember_megatron_backend.model import ModelConfig, build_model
from ember_megatron_backend.worker import MegatronWorker

ALGORITHM = {"advantage_estimator": "ppo", "use_kl_loss": True, "kl_loss_coef": 0.1}


@pytest.fixture(scope="module")
def saved(dist_env, tmp_path_factory):
    """A run saved after rollout 0, and its rollout 1 continued without interruption."""
    root = tmp_path_factory.mktemp("ckpt") / "train"
    worker = MegatronWorker(backend(), algorithm(**ALGORITHM), sampling())
    worker.train(0, worker.prepare(0, make_samples(seed=0)))
    directory = worker.save_checkpoint(root)
    actor = {
        k: v.clone()
        for k, v in worker.actor.module.state_dict().items()
        if isinstance(v, torch.Tensor)  # linear layers also hold an empty `_extra_state`
    }
    batch = worker.prepare(1, make_samples(seed=1))
    continued = (worker.log_rollout_data(1, batch), worker.train(1, batch))
    return root, directory, actor, continued


def test_resume_reproduces_the_next_steps(saved):
    root, directory, _, (want_rollout, want_steps) = saved
    assert directory == root / "iter_0000002"
    assert (root / checkpoint.LATEST).read_text().strip() == "iter_0000002"
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", "latest"]
    # Another seed: everything the run depends on must come from the checkpoint.
    worker = MegatronWorker(backend(seed=99), algorithm(**ALGORITHM), sampling())
    worker.load_checkpoint(root)
    assert (worker.rollout_id, worker.accumulated_step) == (0, 2)
    batch = worker.prepare(1, make_samples(seed=1))
    assert worker.log_rollout_data(1, batch) == want_rollout
    assert worker.train(1, batch) == want_steps
    assert worker.accumulated_step == 4


def test_reference_from_an_ember_checkpoint(saved):
    root, _, actor, _ = saved
    worker = MegatronWorker(backend(ref_load=str(root)), algorithm(**ALGORITHM), sampling())
    ref = worker.ref.state_dict()
    assert all(torch.equal(ref[k], v) for k, v in actor.items())
    assert not torch.equal(
        worker.actor.module.embedding.word_embeddings.weight,
        ref["embedding.word_embeddings.weight"],
    )


def test_saving_again_replaces_atomically(dist_env, tmp_path):
    worker = MegatronWorker(backend(), algorithm(), sampling())
    (tmp_path / ".iter_0000000.tmp").mkdir()  # debris of a crashed save
    worker.save_checkpoint(tmp_path)
    worker.save_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000000", "latest"]
    worker.load_checkpoint(tmp_path / "iter_0000000")  # a checkpoint directory works too


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_broken_checkpoints_name_the_path(saved, tmp_path):
    root, *_ = saved
    worker = MegatronWorker(backend(), algorithm(**ALGORITHM), sampling())
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        worker.load_checkpoint(tmp_path)

    truncated = _copy(root, tmp_path / "truncated")
    rank_file = truncated / "iter_0000002" / "rank_00000.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:1000])
    with pytest.raises(ValueError, match=f"{rank_file}.*corrupt or partially written"):
        worker.load_checkpoint(truncated)

    # weights_only: a file holding an arbitrary pickled object is refused, not executed.
    foreign = _copy(root, tmp_path / "foreign")
    rank_file = foreign / "iter_0000002" / "rank_00000.pt"
    torch.save({"models": fractions.Fraction(1, 3)}, rank_file)
    with pytest.raises(ValueError, match=str(rank_file)):
        worker.load_checkpoint(foreign)

    partial = _copy(root, tmp_path / "partial")
    (partial / "iter_0000002" / checkpoint.META).unlink()
    with pytest.raises(ValueError, match=r"latest names checkpoint 'iter_0000002'.*incomplete"):
        worker.load_checkpoint(partial)

    missing = _copy(root, tmp_path / "missing")
    (missing / "iter_0000002" / "rank_00000.pt").unlink()
    with pytest.raises(ValueError, match="rank_00000.pt is missing"):
        worker.load_checkpoint(missing)


def test_another_architecture_is_refused(saved):
    root, directory, *_ = saved
    other = MegatronWorker(
        backend(model_overrides={"num_layers": 2, "init_method_std": 0.5}),
        algorithm(**ALGORITHM),
        sampling(),
    )
    with pytest.raises(ValueError, match=r"model.num_layers=4, this run has model.num_layers=2"):
        other.load_checkpoint(root)
    # Below the metadata check, the weights themselves are compared parameter by parameter.
    meta = checkpoint.read_meta(directory)
    narrow = build_model(ModelConfig.preset("tiny-moe").replace(hidden_size=32), seed=0)
    with pytest.raises(ValueError, match=r"parameter embedding.word_embeddings.weight has shape "
                       r"\[256, 64\] in the checkpoint but \[256, 32\]"):  # fmt: skip
        checkpoint.load_model_weights(
            narrow, root, role="actor", expect={k: meta[k] for k in ("parallel", "model")}
        )
