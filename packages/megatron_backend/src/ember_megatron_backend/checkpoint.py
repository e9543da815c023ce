"""Training checkpoints: models, optimizers, RNG and step counters, written atomically.

Layout of a checkpoint root (every rank must see the same filesystem)::

    <root>/latest                  the tag of the newest complete checkpoint, updated last
    <root>/iter_0000012/meta.json  format, counters, parallel layout, model shape, roles
    <root>/iter_0000012/rank_00000.pt   one file per global rank: its model shards (every
                                        role), optimizer states and RNG states

A checkpoint is written into ``<root>/.iter_0000012.tmp`` and renamed into place once every
rank's file and the metadata are on disk; ``latest`` is replaced (write aside, ``os.replace``)
only after that, so a crash leaves the previous checkpoint current. Files are read with
``torch.load(..., weights_only=True)`` only. Data-parallel replicas write identical model files
(simple and layout-checked; a resharding format such as megatron-core's dist_checkpointing
would write each shard once, and is not needed at the scales this runs at yet).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ember_megatron_backend import comm
from ember_megatron_backend.optimizer import ModelOptimizer

__all__ = [
    "FORMAT",
    "LATEST",
    "META",
    "checkpoint_tag",
    "load_checkpoint",
    "load_model_weights",
    "read_meta",
    "resolve_checkpoint",
    "save_checkpoint",
]

FORMAT = 1
"""Version of the layout above."""
LATEST = "latest"
META = "meta.json"


def checkpoint_tag(accumulated_step: int) -> str:
    """Directory name of the checkpoint taken after `accumulated_step` optimizer steps."""
    return f"iter_{accumulated_step:07d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        comm.barrier()


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module"):
        model = model.module
    return model


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entries to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(staging: Path, final: Path) -> None:
    """Publish a fully written `staging` directory as `final`, replacing any old one.

    The old directory is renamed aside before the new one takes its name and removed only
    after, so a crash at any moment leaves a complete directory: the old one (at `final` or
    `.<name>.old`) or the new one. Callers fsync the parent once their last rename is done.
    """
    fsync_path(staging)
    if final.exists():
        retired = final.with_name(f".{final.name}.old")
        shutil.rmtree(retired, ignore_errors=True)
        final.rename(retired)
        staging.rename(final)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        staging.rename(final)


def _write(obj: Any, path: Path) -> None:
    partial = path.with_name(path.name + ".partial")
    torch.save(obj, partial)
    with open(partial, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(partial, path)


def _read(path: Path) -> Any:
    if not path.is_file():
        raise ValueError(f"checkpoint file {path} is missing: the checkpoint is incomplete")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated or foreign files
        raise ValueError(
            f"checkpoint file {path} cannot be read (corrupt or partially written?): {exc}"
        ) from exc


# --- RNG ------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This process's random states: Python, torch CPU, CUDA and megatron-core's named streams."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore `rng_state()` output."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --- save -----------------------------------------------------------------------------------------


def save_checkpoint(
    root: str | os.PathLike[str],
    *,
    tag: str,
    models: dict[str, Any],
    optimizers: dict[str, ModelOptimizer],
    meta: dict[str, Any],
    host_view: Callable[[Any], Any] | None = None,
) -> Path:
    """Write one checkpoint under `root` (collective: every rank calls it with the same args).

    Args:
        root: Checkpoint root; created if needed.
        tag: Name of the checkpoint directory (``checkpoint_tag``); an existing one is replaced.
        models: Models by role (possibly DDP-wrapped); this rank's shards are saved.
        optimizers: Optimizers by role.
        meta: JSON-serialisable metadata (counters, layout, model shape), written by rank 0.
        host_view: Maps the payload to what is written, for a trainer whose device memory is
            offloaded (`ember_megatron_backend.offload.TrainerOffload.host_view`): its tensors
            have no bytes on the device, their contents are in host memory.

    Returns:
        The checkpoint directory.
    """
    root = Path(root)
    final, staging = root / tag, root / f".{tag}.tmp"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    _barrier()
    payload = {
        "models": {role: _unwrap(m).state_dict() for role, m in models.items()},
        "optimizers": {role: opt.state_dict() for role, opt in optimizers.items()},
        "rng": rng_state(),
    }
    if host_view is not None:
        payload = host_view(payload)
    _write(payload, staging / f"rank_{_rank():05d}.pt")
    _barrier()
    if _rank() == 0:
        meta = {**meta, "format": FORMAT, "tag": tag, "world_size": _world()}
        (staging / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
        replace_dir(staging, final)
        marker = root / f".{LATEST}.tmp"
        marker.write_text(tag + "\n")
        os.replace(marker, root / LATEST)
        fsync_path(root)
    _barrier()
    return final


# --- load -----------------------------------------------------------------------------------------


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory `path` means: itself if it holds meta.json, else the one its
    ``latest`` marker names.

    Raises:
        FileNotFoundError: `path` is neither a checkpoint nor a checkpoint root.
        ValueError: ``latest`` names a missing or incomplete checkpoint.
    """
    path = Path(path)
    if (path / META).is_file():
        return path
    marker = path / LATEST
    if not marker.is_file():
        raise FileNotFoundError(
            f"{path} is not an Ember checkpoint: it has neither {META} nor a {LATEST} marker"
        )
    tag = marker.read_text().strip()
    target = path / tag
    if not tag or not (target / META).is_file():
        raise ValueError(
            f"{marker} names checkpoint {tag!r}, but {target} is missing or incomplete (no {META})"
        )
    return target


def read_meta(directory: Path) -> dict[str, Any]:
    """The metadata of a checkpoint directory.

    Raises:
        ValueError: naming the file when it is unreadable or of another format.
    """
    path = directory / META
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"checkpoint metadata {path} cannot be read: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(f"{path}: checkpoint format {found!r}, expected {FORMAT}")
    return meta


def _check_meta(directory: Path, meta: dict[str, Any], expect: dict[str, Any]) -> None:
    if meta.get("world_size") != _world():
        raise ValueError(
            f"checkpoint {directory} was written by {meta.get('world_size')} ranks, this run has "
            f"{_world()}; resume with the same number of ranks"
        )
    expect = json.loads(json.dumps(expect))  # as the metadata file holds it (tuples as lists)
    for key, ours in expect.items():
        saved = meta.get(key)
        if not isinstance(ours, dict):
            if saved != ours:
                raise ValueError(f"checkpoint {directory} has {key}={saved!r}, this run {ours!r}")
            continue
        saved = saved if isinstance(saved, dict) else {}
        for field in sorted(set(saved) | set(ours)):
            if saved.get(field) != ours.get(field):
                raise ValueError(
                    f"checkpoint {directory} has {key}.{field}={saved.get(field)!r}, this run "
                    f"has {key}.{field}={ours.get(field)!r}: it is another {key} layout"
                )


def _load_model(model: Any, saved: dict[str, Any], file: Path, role: str) -> None:
    module = _unwrap(model)
    ours = module.state_dict()
    for name, tensor in ours.items():
        if name not in saved:
            raise ValueError(f"{file}: the {role} checkpoint lacks parameter {name}")
        other = saved[name]
        if isinstance(tensor, torch.Tensor) and tuple(other.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{file}: {role} parameter {name} has shape {list(other.shape)} in the checkpoint "
                f"but {list(tensor.shape)} in the model: it is another architecture"
            )
    extra = sorted(set(saved) - set(ours))
    if extra:
        raise ValueError(f"{file}: the {role} checkpoint has parameter {extra[0]} the model lacks")
    module.load_state_dict(saved, strict=True)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    models: dict[str, Any],
    optimizers: dict[str, ModelOptimizer],
    expect: dict[str, Any],
) -> dict[str, Any]:
    """Load the checkpoint `path` resolves to into `models` and `optimizers`, and restore RNG.

    Args:
        path: A checkpoint root (its ``latest`` is used) or a checkpoint directory.
        models: Models by role; every role must be in the checkpoint.
        optimizers: Optimizers by role.
        expect: Metadata entries that must equal the checkpoint's (``{"parallel": {...},
            "model": {...}, "dtype": ...}``); dict entries are compared field by field.

    Returns:
        The checkpoint's metadata (counters included).

    Raises:
        FileNotFoundError, ValueError: naming the path for a missing, partial, corrupt or
            mismatched checkpoint.
    """
    directory = resolve_checkpoint(path)
    meta = read_meta(directory)
    _check_meta(directory, meta, expect)
    file = directory / f"rank_{_rank():05d}.pt"
    payload = _read(file)
    for role, model in models.items():
        if role not in payload.get("models", {}):
            raise ValueError(f"{file} holds no {role} model (roles: {sorted(payload['models'])})")
        _load_model(model, payload["models"][role], file, role)
    for role, optimizer in optimizers.items():
        if role not in payload.get("optimizers", {}):
            raise ValueError(f"{file} holds no {role} optimizer state")
        optimizer.load_state_dict(payload["optimizers"][role])
    set_rng_state(payload["rng"])
    return meta


def load_model_weights(
    model: Any, path: str | os.PathLike[str], *, role: str, expect: dict[str, Any]
) -> None:
    """Load only the `role` weights of a checkpoint into `model` (e.g. a reference from an
    actor checkpoint); same layout checks as ``load_checkpoint``."""
    directory = resolve_checkpoint(path)
    _check_meta(directory, read_meta(directory), expect)
    file = directory / f"rank_{_rank():05d}.pt"
    saved = _read(file).get("models", {})
    if role not in saved:
        raise ValueError(f"{file} holds no {role} model (roles: {sorted(saved)})")
    _load_model(model, saved[role], file, role)
