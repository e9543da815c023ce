"""Ray placement: a run's GPU layout as placement groups, made before any actor starts.

Each role that uses GPUs gets one Ray placement group whose bundles hold whole GPUs:

- `train`: one bundle per GPU of the training ranks, each rank in a bundle of its own (ranks
  never share a GPU: NCCL refuses two ranks of one group on one device, `RaySection` says so
  before any of this runs; a single rank may take a share of its GPU).
- `rollout`: one bundle of N GPUs per engine with `ray.gpus_per_engine` N >= 1 (a bundle never
  spans nodes, so an engine's SGLang server sees all its GPUs on one node); shares below 1 are
  packed `floor(1 / share)` engines to a bundle (embedded engines and attached SGLang servers:
  two launched SGLang servers on one GPU are refused, `_check_packed_servers` says why).
- `colocated` (`ray.colocate` with GPUs on both sides) replaces the two: one bundle per GPU,
  and training rank i and engine i each take their share of bundle i.

An actor is created with `num_gpus` equal to its share and a `PlacementGroupSchedulingStrategy`
naming its bundle, so Ray hands it GPUs of that bundle (its `CUDA_VISIBLE_DEVICES`), and no code
guesses device numbers. Ember picks every bundle's node itself and pins it with the node-id
label, so the layout is known before Ray grants it and an impossible one fails with the
arithmetic, before any placement group or actor exists:

- nodes in order: the driver's node first, then the others by address and id;
- bundles of more than one GPU (whole-GPU engines) first, largest first, each on the node it
  leaves with the fewest free GPUs (ties: the later node), so they do not split nodes that
  single GPUs could fill;
- then the one-GPU bundles, training before rollout, each on the first node with a free GPU.

So training fills the driver's node from rank 0 upward (rank 0 writes checkpoints and the
initial weights there), and an engine that needs a whole node gets another one.

CPU roles (`gpus_per_rank` or `gpus_per_engine` 0) get no placement group and are created as
before: `num_cpus=0, num_gpus=0`, placed wherever Ray likes (on a local Ray, this machine). Ray
refuses bundles that reserve nothing (placement_group.py `_validate_bundles`), so a CPU bundle
would have to reserve CPUs; CPU actors reserve none on purpose, because training and rollout
alternate and share the cores through `ray.threads_per_actor`, and reserving them would make
a small machine refuse the default run. A CPU-only run therefore creates no placement group.

The rollout manager generates nothing and needs no GPU: it runs on the driver's node (it reads
the prompt file the driver's config names), reserving nothing.

The colocated memory hand-off (`MemoryHandoff`) is at the end of this module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ember import calls
from ember.layout import (  # noqa: F401  (the layout's names, as placement's callers know them)
    COLOCATED,
    MEMORY_SAVER_FLAG,
    ROLLOUT,
    TRAIN,
    Layout,
    RunConfig,
    Slot,
    _gpus,
    colocated_on_gpu,
    plan_layout,
)

logger = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"
"""The label every Ray node carries with its id (ray/util/placement_group.py)."""


# --------------------------------------------------------------------------------------------
# Nodes: which node holds which bundle
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Node:
    """A Ray node as placement sees it."""

    node_id: str
    """Ray's hex node id."""
    address: str
    """The node's IP address (`NodeManagerAddress`): where its processes listen."""
    gpus: int
    """GPUs the node has in all."""

    def __str__(self) -> str:
        return f"{self.address} ({self.node_id[:8]}): {self.gpus}"


def cluster_nodes() -> list[Node]:
    """The connected cluster's alive nodes, the driver's first, then by address and id."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    nodes = [
        Node(n["NodeID"], n["NodeManagerAddress"], int(n["Resources"].get("GPU", 0)))
        for n in ray.nodes()
        if n.get("Alive", False)
    ]
    return sorted(nodes, key=lambda n: (n.node_id != here, n.address, n.node_id))


def assign_nodes(layout: Layout, nodes: Sequence[Node]) -> dict[str, list[Node]]:
    """The node of every bundle (see the module docstring for the rule), per group.

    Raises:
        ValueError: The layout does not fit the nodes; the message has the layout's arithmetic
            and every node's GPUs.
    """
    need, have = layout.gpus, sum(n.gpus for n in nodes)
    listing = ", ".join(str(n) for n in nodes) or "no nodes"
    summary = f"{'; '.join(layout.arithmetic)}; the cluster has {have} ({listing})"
    if need > have:
        raise ValueError(f"the layout needs {_gpus(need)} but the cluster has fewer: {summary}")
    free = [n.gpus for n in nodes]
    placed: dict[str, list[Node | None]] = {g: [None] * len(b) for g, b in layout.bundles.items()}
    order = [(g, i, size) for g, b in layout.bundles.items() for i, size in enumerate(b)]
    big = sorted((x for x in order if x[2] > 1), key=lambda x: -x[2])
    small = [x for x in order if x[2] == 1]
    small.sort(key=lambda x: x[0] != TRAIN)  # stable: training first, in rank order
    for group, index, size in big:
        fits = [k for k in range(len(nodes)) if free[k] >= size]
        if not fits:
            largest = max(free, default=0)
            raise ValueError(
                f"bundle {index} of {group} needs {_gpus(size)} on one node, but no node has "
                f"that many free (at most {largest} after the larger bundles): {summary}"
            )
        k = min(fits, key=lambda k: (free[k] - size, -k))
        free[k] -= size
        placed[group][index] = nodes[k]
    for group, index, _ in small:
        k = next(k for k in range(len(nodes)) if free[k] >= 1)  # total GPUs suffice
        free[k] -= 1
        placed[group][index] = nodes[k]
    return {g: [n for n in found if n is not None] for g, found in placed.items()}


# --------------------------------------------------------------------------------------------
# Placement groups and actor options
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Placement:
    """The placement groups of a run and the Ray options that put each actor in its bundle.

    Build it with `Placement.create(config)` after Ray starts and before any actor; pass
    `train_options(rank)`, `engine_options(index)` and `manager_options()` to `.options(...)`.
    """

    layout: Layout
    nodes: dict[str, list[Node]] = field(default_factory=dict)
    """The node of every bundle, per group."""
    groups: dict[str, Any] = field(default_factory=dict)
    """The Ray placement groups, per group name."""
    driver_node: str | None = None
    """Id of the node the driver runs on."""

    @classmethod
    def create(cls, config: RunConfig, *, timeout_s: float | None = None) -> Placement:
        """Plan the layout, check it against the cluster, create its placement groups and wait
        until Ray grants them. Needs a connected Ray; starts no actor.

        Raises:
            ValueError: The layout is impossible on this cluster (`plan_layout`,
                `assign_nodes`); nothing was created.
            TimeoutError: The cluster did not grant the GPUs within `ray.placement_timeout_s`
                (other jobs hold them); the groups are removed again.
        """
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        layout = plan_layout(config)
        driver_node = ray.get_runtime_context().get_node_id()
        if not layout.bundles:
            return cls(layout=layout, driver_node=driver_node)
        nodes = assign_nodes(layout, cluster_nodes())
        groups = {
            name: placement_group(
                [{"GPU": size} for size in sizes],
                strategy="PACK",
                name=f"ember-{name}",
                bundle_label_selector=[{NODE_ID_LABEL: n.node_id} for n in nodes[name]],
            )
            for name, sizes in layout.bundles.items()
        }
        timeout = config.ray.placement_timeout_s if timeout_s is None else timeout_s
        refs = {name: pg.ready() for name, pg in groups.items()}
        ready, _ = calls.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
        waiting = [name for name, ref in refs.items() if ref not in ready]
        if waiting:
            for pg in groups.values():
                remove_placement_group(pg)
            wanted = "; ".join(
                f"{name}: "
                + ", ".join(
                    f"{_gpus(size)} on {node.address} ({node.node_id[:8]})"
                    for size, node in zip(layout.bundles[name], nodes[name], strict=True)
                )
                for name in waiting
            )
            raise TimeoutError(
                f"the cluster did not grant the GPUs of placement group(s) {waiting} within "
                f"ray.placement_timeout_s={timeout:g}s (other jobs may hold them); waited for "
                f"{wanted}"
            )
        logger.info("placement: %s", "; ".join(layout.arithmetic))
        return cls(layout=layout, nodes=nodes, groups=groups, driver_node=driver_node)

    def _options(self, slot: Slot | None) -> dict[str, Any]:
        if slot is None:
            # CPU actors reserve nothing: training and rollout alternate, and the thread
            # counts share the cores (see the module docstring).
            return {"num_cpus": 0, "num_gpus": 0}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "num_cpus": 0,
            "num_gpus": slot.gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.groups[slot.group], placement_group_bundle_index=slot.bundle
            ),
        }

    def train_options(self, rank: int) -> dict[str, Any]:
        """`.options(...)` of training rank `rank`."""
        return self._options(None if self.layout.train is None else self.layout.train[rank])

    def engine_options(self, index: int) -> dict[str, Any]:
        """`.options(...)` of rollout engine `index`."""
        return self._options(None if self.layout.engines is None else self.layout.engines[index])

    def manager_options(self) -> dict[str, Any]:
        """`.options(...)` of the rollout manager: no GPU, nothing reserved, the driver's node."""
        if self.driver_node is None:  # no Ray: the manager is an object in this process
            return {"num_cpus": 0, "num_gpus": 0}
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return {
            "num_cpus": 0,
            "num_gpus": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(self.driver_node, soft=False),
        }

    def _node(self, slots: list[Slot] | None, index: int) -> Node | None:
        if slots is None:
            return None
        slot = slots[index]
        return self.nodes[slot.group][slot.bundle]

    def train_node(self, rank: int) -> Node | None:
        """The node training rank `rank` runs on; None for CPU ranks (Ray chooses)."""
        return self._node(self.layout.train, rank)

    def engine_node(self, index: int) -> Node | None:
        """The node engine `index` runs on; None for CPU engines (Ray chooses)."""
        return self._node(self.layout.engines, index)

    def rendezvous_host(self) -> str | None:
        """The address the training ranks' TCP store (and a weight-update group that rank 0
        leads) listens on: rank 0's node, known here before rank 0 starts.

        The port must still be chosen on that node, by rank 0 itself (only a process there can
        tell a free one). None for CPU ranks: then rank 0 reports its node's address itself
        (`ray.util.get_node_ip_address()` inside the actor).
        """
        node = self.train_node(0)
        return None if node is None else node.address

    def remove(self) -> None:
        """Remove the placement groups (their actors should be gone first)."""
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups.values():
            remove_placement_group(pg)
        self.groups.clear()


# --------------------------------------------------------------------------------------------
# Colocated memory hand-off (DESIGN section 9)
# --------------------------------------------------------------------------------------------


class MemoryHandoff:
    """Who holds the shared GPUs of a colocated run, and when.

    Actor methods it calls (each a no-op where there is nothing to move):
    engines `release_memory(tags)` / `resume_memory(tags)` (`ember_rollout.engine.Engine`), and
    training ranks `offload(part)` / `reload()` (`ember_megatron_backend.offload`, `part` one
    of "training_state", "weights").

    The driver's iteration with it:

        handoff.to_rollout()          # once, after the engines start: the trainer steps aside
        for each rollout:
            generate
            handoff.to_training()     # engines release everything; the trainer reloads
            prepare, train
            handoff.after_training(push_weights)

    `after_training` orders the exchange so both sides never hold everything at once: the
    trainer drops its optimizer state and gradients, the engines take back their weights' memory,
    the weights are pushed (the trainer's parameters are still on the GPU, as CUDA IPC needs),
    then the trainer moves its parameters out and the engines take back their KV cache and CUDA
    graphs. Disabled (CPU runs, disaggregated GPUs), only `push_weights` runs.
    """

    def __init__(self, engines: Sequence[Any], train_ranks: Sequence[Any], *, enabled: bool):
        self.engines = list(engines)
        self.train_ranks = list(train_ranks)
        self.enabled = enabled

    @classmethod
    def for_run(
        cls, config: RunConfig, engines: Sequence[Any], train_ranks: Sequence[Any]
    ) -> MemoryHandoff:
        return cls(engines, train_ranks, enabled=colocated_on_gpu(config))

    def _engines(self, method: str, tags: list[str] | None) -> None:
        calls.get([getattr(e, method).remote(tags) for e in self.engines])

    def _ranks(self, method: str, *args: Any) -> None:
        calls.get([getattr(t, method).remote(*args) for t in self.train_ranks])

    def to_rollout(self) -> None:
        """The trainer moves everything it holds to CPU memory (before the first rollout)."""
        if self.enabled:
            self._ranks("offload", "training_state")
            self._ranks("offload", "weights")

    def to_training(self) -> None:
        """After a rollout: every engine releases all its GPU memory, then the trainer reloads."""
        if self.enabled:
            self._engines("release_memory", None)
            self._ranks("reload")

    def after_training(self, push_weights: Callable[[], None]) -> None:
        """After training: hand the GPUs back to the engines, pushing the new weights between."""
        if not self.enabled:
            push_weights()
            return
        self._ranks("offload", "training_state")
        self._engines("resume_memory", ["weights"])
        push_weights()
        self._ranks("offload", "weights")
        self._engines("resume_memory", ["kv_cache", "cuda_graph"])
