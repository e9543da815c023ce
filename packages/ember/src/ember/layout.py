"""A run's GPU layout, from the config alone: which role gets which GPUs (placement groups'
bundles), the layout rules that span sections, and whether the run needs Ray at all.

Nothing here imports Ray or the config module: the config checks a layout with `plan_layout`
while it loads, and `ember.placement` turns a layout into Ray placement groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

RunConfig = Any
"""An `ember.config.RunConfig` (not imported: the config module imports this one)."""

TRAIN, ROLLOUT, COLOCATED = "train", "rollout", "colocated"
"""Placement group names: one per role, or one shared by both."""
MEMORY_SAVER_FLAG = "--enable-memory-saver"
"""SGLang's launch flag without which /release_memory_occupation frees nothing (sglang 0.5.23
utils/torch_memory_saver_adapter.py: the no-op adapter)."""

# --------------------------------------------------------------------------------------------
# The layout: arithmetic from the config alone
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one actor goes: a bundle of a placement group and the GPUs it takes there."""

    group: str
    bundle: int
    gpus: float


@dataclass(frozen=True, slots=True)
class Layout:
    """A run's GPU layout before any cluster is looked at."""

    bundles: dict[str, list[int]]
    """GPUs of each bundle, per placement group name; no entry for a role on CPU."""
    train: list[Slot] | None
    """Slot of each training rank; None: the ranks run on CPU."""
    engines: list[Slot] | None
    """Slot of each engine; None: the engines run on CPU."""
    arithmetic: list[str]
    """How each role's GPUs are counted, one line per role (error messages quote it)."""

    @property
    def gpus(self) -> int:
        """GPUs the whole layout holds."""
        return sum(sum(b) for b in self.bundles.values())


def _per_gpu(share: float) -> int:
    """Actors of this GPU share that fit on one GPU."""
    return max(1, math.floor(1 / share + 1e-9))


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _shared(count: int, share: float, group: str) -> tuple[list[int], list[Slot]]:
    """One-GPU bundles for `count` actors of `share` <= 1 each, packed as tightly as fits."""
    per = _per_gpu(share)
    bundles = [1] * math.ceil(count / per)
    return bundles, [Slot(group, i // per, share) for i in range(count)]


def plan_layout(config: RunConfig) -> Layout:
    """The placement groups and slots the config's `ray` section asks for.

    The single-field rules (a rank takes at most one GPU, an engine a share or whole GPUs,
    colocated shares fit in one GPU) are `RaySection`'s own checks; this adds the rules that
    involve other sections.

    Raises:
        ValueError: A colocated GPU layout that cannot work as configured (one-step-off-policy
            rollouts, or launched SGLang servers without the memory saver), launched SGLang
            servers whose GPU count differs from the engine's, or two launched SGLang servers
            packed onto one GPU; names the keys.
    """
    ray_cfg = config.ray
    dp, gpr = ray_cfg.data_parallel, ray_cfg.gpus_per_rank
    ne, gpe = ray_cfg.num_engines, ray_cfg.gpus_per_engine
    bundles: dict[str, list[int]] = {}
    train = engines = None
    arithmetic: list[str] = []
    _check_engine_gpus(config)
    _check_packed_servers(config)
    if ray_cfg.colocate and gpr > 0 and gpe > 0:
        _check_colocated(config)
        n = max(dp, ne)
        bundles[COLOCATED] = [1] * n
        train = [Slot(COLOCATED, i, gpr) for i in range(dp)]
        engines = [Slot(COLOCATED, j, gpe) for j in range(ne)]
        arithmetic.append(
            f"colocated: rank i (ray.gpus_per_rank {gpr:g}) and engine i (ray.gpus_per_engine "
            f"{gpe:g}) share GPU i, max(ray.data_parallel {dp}, ray.num_engines {ne}) = "
            f"{_gpus(n)}"
        )
        return Layout(bundles=bundles, train=train, engines=engines, arithmetic=arithmetic)
    # Half a run (run.rollout_only, run.train_from_rollouts) holds no GPU for the other half.
    if config.run.rollout_only:
        gpr = 0
    if config.run.train_from_rollouts is not None:
        gpe = 0
    if gpr > 0:
        bundles[TRAIN], train = _shared(dp, gpr, TRAIN)
        packed = f", {_per_gpu(gpr)} ranks per GPU" if gpr < 1 else ""
        arithmetic.append(
            f"training: ray.data_parallel {dp} x ray.gpus_per_rank {gpr:g}{packed} = "
            f"{_gpus(len(bundles[TRAIN]))}"
        )
    if gpe >= 1:
        bundles[ROLLOUT] = [int(gpe)] * ne
        engines = [Slot(ROLLOUT, j, gpe) for j in range(ne)]
        arithmetic.append(
            f"rollout: ray.num_engines {ne} x ray.gpus_per_engine {gpe:g} = {_gpus(int(gpe) * ne)}"
            + (f", {int(gpe)} on one node per engine" if gpe > 1 else "")
        )
    elif gpe > 0:
        bundles[ROLLOUT], engines = _shared(ne, gpe, ROLLOUT)
        arithmetic.append(
            f"rollout: ray.num_engines {ne} x ray.gpus_per_engine {gpe:g}, {_per_gpu(gpe)} "
            f"engines per GPU = {_gpus(len(bundles[ROLLOUT]))}"
        )
    return Layout(bundles=bundles, train=train, engines=engines, arithmetic=arithmetic)


def _check_engine_gpus(config: RunConfig) -> None:
    engine, gpe = config.engine, config.ray.gpus_per_engine
    if engine.kind != "sglang" or engine.sglang.urls or gpe == 0:
        return
    sglang = engine.sglang
    used = sglang.tp_size * sglang.num_servers
    if used != max(gpe, 1):
        raise ValueError(
            f"engine.sglang.tp_size {sglang.tp_size} x engine.sglang.num_servers "
            f"{sglang.num_servers} = {_gpus(used)} per engine, but ray.gpus_per_engine="
            f"{gpe:g} gives each engine {'a share of one GPU' if gpe < 1 else _gpus(int(gpe))}; "
            "launched servers must use exactly the engine's GPUs"
        )


def _check_packed_servers(config: RunConfig) -> None:
    """Refuse two or more launched SGLang servers on one GPU (`colocate: false`, shares of 0.5
    or less).

    Neither the memory nor the weight group can work there:
    - sglang 0.5.23 sizes a server's KV pool as the GPU memory free after its own weights load
      minus `(1 - mem_fraction_static)` of the memory free before they did
      (mem_cache/kv_cache_configurator.py 3007 and 3038; the "before" is read at
      distributed/bootstrap.py 207). Servers started together each read the whole GPU as
      "before", so the first pool takes all but that reserve and the next server finds less
      free than its own reserve: "Loaded weights leave no GPU memory for the KV cache"
      (3043-3059), whatever fraction each is given (or a tiny pool, if it measured before
      the first pool was made).
    - with the trainer on GPUs the weights travel over NCCL, with consecutive ranks of one
      communicator for these servers; NCCL 2.30.7 refuses two ranks on one GPU (src/init.cc
      1057: "Multiple Ranks are using the same GPU/Partition", unless
      NCCL_MULTI_RANK_GPU_ENABLE=1).
    """
    engine, ray_cfg = config.engine, config.ray
    gpe, ne = ray_cfg.gpus_per_engine, ray_cfg.num_engines
    if engine.kind != "sglang" or engine.sglang.urls or not 0 < gpe < 1 or colocated_on_gpu(config):
        return
    per_gpu = min(_per_gpu(gpe), ne)
    if per_gpu >= 2:
        raise ValueError(
            f"ray.gpus_per_engine={gpe:g}: with ray.colocate=false it puts {per_gpu} of the "
            f"ray.num_engines={ne} launched SGLang servers on one GPU, which cannot run (sglang "
            "sizes each server's KV pool from the GPU memory free before the others loaded, so "
            "the next finds none, and NCCL refuses two ranks of the weight group on one GPU); "
            "give each engine a GPU (ray.gpus_per_engine=1, or a share above 0.5), or attach "
            "servers you started (engine.sglang.urls)"
        )


def _check_colocated(config: RunConfig) -> None:
    if config.rollout.async_:
        raise ValueError(
            "rollout.async=true with ray.colocate=true on GPUs: one-step-off-policy generates "
            "while the trainer trains, but colocated engines hand their GPU memory to the "
            "trainer during training; set ray.colocate=false (engines on GPUs of their own)"
        )
    engine = config.engine
    if engine.kind == "sglang" and not engine.sglang.urls:
        if MEMORY_SAVER_FLAG not in engine.sglang.server_args:
            raise ValueError(
                f"engine.sglang.server_args={engine.sglang.server_args!r}: colocated SGLang "
                f"servers need {MEMORY_SAVER_FLAG} to free their GPU memory while the trainer "
                f"trains; add it (sglang's [sglang] extra installs torch-memory-saver for it)"
            )


def colocated_on_gpu(config: RunConfig) -> bool:
    """Whether training and rollout share GPUs, so memory must change hands around training."""
    ray_cfg = config.ray
    return ray_cfg.colocate and ray_cfg.gpus_per_rank > 0 and ray_cfg.gpus_per_engine > 0


def needs_ray(config: Any) -> str | None:
    """What in the config needs processes of their own (None: nothing does): several training
    ranks or engines, SGLang servers, GPUs, a Ray address to join."""
    ray_cfg = config.ray
    if ray_cfg.address is not None:
        return f"ray.address={ray_cfg.address!r} joins a cluster"
    if ray_cfg.data_parallel > 1:
        return f"ray.data_parallel={ray_cfg.data_parallel}: each training rank is a process"
    if ray_cfg.num_engines > 1:
        return f"ray.num_engines={ray_cfg.num_engines}: each engine is a process"
    if config.engine.kind != "hf":
        return f"engine.kind={config.engine.kind!r} runs servers that Ray places and watches"
    if ray_cfg.gpus_per_rank > 0 or ray_cfg.gpus_per_engine > 0:
        return "the run asks for GPUs (ray.gpus_per_rank, ray.gpus_per_engine), which Ray grants"
    return None


def in_process(config: Any) -> tuple[bool, str]:
    """Whether the run's roles all live in this process, and why: `ray.enabled`, with auto
    resolved to in-process when nothing in the run needs Ray (`needs_ray`).

    Raises:
        ValueError: `ray.enabled=false` for a run that needs processes of its own.
    """
    enabled = config.ray.enabled
    needs = needs_ray(config)
    if enabled == "auto":
        if needs:
            return False, f"ray.enabled=auto, and {needs}"
        return True, "ray.enabled=auto: one training rank, one embedded engine, no GPUs"
    if enabled:
        return False, "ray.enabled=true"
    if needs:
        raise ValueError(f"ray.enabled=false: {needs}; set ray.enabled=true (or auto)")
    return True, "ray.enabled=false"
