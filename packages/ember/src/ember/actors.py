"""The actor classes: one per training rank (a Megatron worker) and one per rollout engine.

Plain classes: `ember.runtimes` makes them Ray actors (`RayRuntime`) or builds them in the
driver's process (`LocalRuntime`); the methods that run beside the default calls name their
concurrency group (`ember.calls.concurrency_group`), which both runtimes honour."""

from __future__ import annotations

import asyncio
import copy
import datetime
import inspect
import logging
import os
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ember import calls
from ember.failures import errors_held_for_start
from ember.quiet import quiet_libraries, verbose
from ember.startup import mark, mark_process_start
from ember_core.certify import Fault, planted
from ember_core.quant import quantize_named
from ember_core.types import Sample

logger = logging.getLogger(__name__)


def _hide_ungranted_gpus() -> None:
    """Show an actor that Ray granted no GPU none at all.

    ray 2.60 sets CUDA_VISIBLE_DEVICES only for actors with GPU ids and leaves it as the node
    started it for the others (_private/utils.py `set_visible_accelerator_ids`, 289-291,
    unless RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO is set), so a rank or engine placed with 0 GPUs
    would see every GPU of its node and pick cuda:0, beside whatever Ray put there. Runs
    before torch initialises CUDA, which reads the variable once. Outside a Ray worker (actor
    classes run in the caller's process) it does nothing: `ray.get_gpu_ids()` would start a
    local Ray there.
    """
    ray = sys.modules.get("ray")  # an actor in the driver's process has no Ray to ask
    if ray is not None and ray.is_initialized() and not ray.get_gpu_ids():
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _prepare_process(threads: int | None) -> None:
    """What every actor process does first: hide the GPUs Ray did not grant, quiet library
    chatter, then size torch's pool. An actor in the driver's process (`ember.calls.LocalActor`)
    leaves all of that to the driver: it is the process's, not the actor's."""
    if calls.in_local_actor():
        return
    _hide_ungranted_gpus()
    quiet_libraries()
    if not verbose():
        # Ray logs an actor's failed __init__ with its traceback from inside the actor; the same
        # error reaches the driver, which prints it as one line (whole with `ember -v`).
        logging.getLogger("ray._raylet").setLevel(logging.CRITICAL)
    if threads:
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def _import_rollout_libraries(*, embedded_engine: bool, model_type: str | None = None) -> None:
    """Import what an engine or the rollout manager needs once the model is there (the
    tokenizer classes; with `embedded_engine`, the model classes too, down to `model_type`'s
    modeling module), so that a freshly created actor spends its import time while the trainer
    builds, not after."""
    from transformers import AutoTokenizer  # noqa: F401

    if embedded_engine:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        import ember_rollout.hf_engine  # noqa: F401

        # The auto class imports a family's modeling module only when it loads a model: about
        # 2.6 s on a 2-core AMD EPYC, which here overlaps the trainer's build.
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type or "")
        if name is not None:
            getattr(transformers, name)


def _actor_key(actor: Any) -> Any:
    """What tells engine actors apart: Ray's actor id (the handle itself for an in-process
    stand-in)."""
    actor_id = getattr(actor, "_actor_id", None)
    return id(actor) if actor_id is None else actor_id.hex()


def _with_last(items: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
    """Each item with whether it is the last (one item of lookahead)."""
    current = next(items, None)
    while current is not None:
        following = next(items, None)
        yield current, following is None
        current = following


def _wait_all(refs: list[Any]) -> None:
    """Wait for every call, raising the first failure as soon as it arrives (the others may be
    blocked on a broadcast that will not come)."""
    pending = list(refs)
    while pending:
        done, pending = calls.wait(pending, num_returns=1)
        calls.get(done)


def _meet(join: Callable[[], Any], others: list[Any]) -> Any:
    """Run `join` (a blocking rendezvous) while the `others` (Ray calls) join it too; returns
    its result once all have joined. A call that fails ends the wait at once with its error
    (`join` would otherwise wait for it until its timeout)."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = join()
        except BaseException as exc:  # handed to the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=run, name="weight-group-join", daemon=True)
    thread.start()
    pending = list(others)
    while pending or thread.is_alive():
        if pending:
            done, pending = calls.wait(pending, num_returns=1, timeout=0.1)
            calls.get(done)
        else:
            thread.join(0.1)
        if "error" in result:
            raise result["error"]
    if "error" in result:
        raise result["error"]
    return result["value"]


DROP_GROUP_WAIT_S = 60.0
"""How long a failed push waits for the engines to destroy its weight group."""


def _drop_weight_group(group: Any, engines: list[Any]) -> None:
    """After a failed broadcast: abort `group` on this rank, then destroy it on every engine.

    Aborting closes this rank's connections, so an engine blocked receiving a bucket fails at
    once (gloo) and its actor takes the next call; then each engine destroys its end. An engine
    that does not answer within `DROP_GROUP_WAIT_S` (an SGLang server blocked in an NCCL
    broadcast, until its watchdog's timeout) is logged and left; its group is never used again.
    """
    group.abort()
    refs = [e.destroy_weights_group.remote(group.name) for e in engines]
    done, late = calls.wait(refs, num_returns=len(refs), timeout=DROP_GROUP_WAIT_S)
    for ref in done:
        try:
            calls.get(ref)
        except Exception as exc:  # the push's own error is the one raised
            logger.warning("engine could not destroy weight group %s: %s", group.name, exc)
    if late:
        logger.warning(
            "%d engine(s) did not destroy weight group %s within %g s",
            len(late),
            group.name,
            DROP_GROUP_WAIT_S,
        )


class TrainRank:
    """One data-parallel training rank: a torch.distributed process holding a Megatron worker.

    Each actor re-reads the resolved config and loads its own plugins: plugin modules live in the
    process that calls their hooks.
    """

    def __init__(
        self,
        config: dict[str, Any],
        *,
        rank: int,
        world_size: int,
        threads: int | None,
    ) -> None:
        mark_process_start(f"rank {rank}", "actor created")
        _prepare_process(threads)
        # The training hooks' INFO lines (the CI checker's audit results) reach the driver's
        # console, which shows what each actor process writes.
        logging.basicConfig(
            level=logging.DEBUG if verbose() else logging.INFO,
            format="%(levelname)s %(name)s: %(message)s",
        )
        from ember.config import load_config

        self.config, self.plugins = load_config(config)
        self.rank = rank
        self.world_size = world_size
        self.worker: Any = None
        self._batch = None
        self._weight_group: Any = None
        self._weight_members: list[Any] = []
        """The engines `_weight_group` was formed with (`_actor_key`)."""
        self._offload: Any = None

    def rendezvous(self) -> str:
        """The init method of the ranks' process group: this actor's node and a port free there.

        The driver asks rank 0 before any rank initialises torch.distributed, because rank 0's
        TCP store listens on the node rank 0 runs on, which need not be the driver's.
        """
        from ember_megatron_backend.parallel import free_port

        host = calls.node_address()
        # torch 2.14 TCPStore: the server on rank 0 listens on every interface of its node.
        port = free_port("0.0.0.0")
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"

    def setup(self, init_method: str) -> int:
        """Join the ranks' process group at `init_method`, then build the Megatron worker.

        Returns:
            This rank's data-parallel rank: the ranks of one model replica (its tensor,
            pipeline and context parallel peers) share it and train on the same samples.
        """
        from ember_megatron_backend.parallel import init_distributed
        from ember_megatron_backend.worker import MegatronWorker

        init_distributed(
            self.config.train.parallel,
            rank=self.rank,
            world_size=self.world_size,
            init_method=init_method,
        )
        mark(f"rank {self.rank}", "megatron-core imported, process group joined")
        from ember.config import served_dtype

        self.worker = MegatronWorker(
            self.config.train,
            self.config.algorithm,
            self.config.rollout,
            self.plugins,
            quantization=self.config.engine.quant_spec(),
            qat_scale_dtype=served_dtype(self.config),
        )
        from megatron.core import parallel_state as ps

        mark(f"rank {self.rank}", "model built")
        return ps.get_data_parallel_rank(with_context_parallel=True)

    def prepare(self, rollout_id: int, samples: list[Sample]) -> dict[str, float]:
        """Score this rank's samples (ref / old log-probs, values, advantages) and log them."""
        self._batch = self.worker.prepare(rollout_id, samples)
        return self.worker.log_rollout_data(rollout_id, self._batch)

    def train(self, rollout_id: int) -> list[dict[str, float]]:
        assert self._batch is not None, "prepare() must run before train()"
        metrics = self.worker.train(rollout_id, self._batch)
        self._batch = None
        return metrics

    # -- weights to the engines (they never pass through the driver) --------------------------

    def _sent_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights a push sends: every one (`ember certify --plant dropped-tensor` leaves
        out the first, to test the check that they arrive)."""
        named = self._engine_weights()
        if planted(Fault.DROPPED_TENSOR):
            next(named, None)
        return named

    def _engine_weights(
        self, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's weights as the engines hold them: under `engine.quantization` quantized
        from the trainer's own weights (as `train.qat` fake-quantizes them), the rest cast to
        the dtype the engine serves (`_wire_dtype` then casts nothing); otherwise cast to
        `dtype` (None: as held)."""
        spec = self.config.engine.quant_spec()
        if spec is None:
            return self.worker.hf_weights(dtype=dtype)
        from ember.config import served_dtype

        return quantize_named(self.worker.hf_weights(), spec, dtype=served_dtype(self.config))

    def log_probs_at(self, samples: list[Sample], ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """The actor's log-probs of `ids[i]` ([R_i, k]) at sample i's response positions, then of
        the other ids together ([R_i, k + 1]), from the full vocabulary at the rollout
        temperature (collective: every rank gets the same samples)."""
        return self.worker.log_probs_at(samples, ids)

    def trace_layers(
        self, rollout_id: int, samples: list[Sample], keep: int
    ) -> tuple[list[dict[tuple[int, str], torch.Tensor]], list[torch.Tensor]]:
        """`MegatronWorker.trace_layers`: the old-log-prob forward of rollout `rollout_id`'s
        samples, every layer of the first `keep` recorded."""
        return self.worker.trace_layers(rollout_id, samples, keep)

    def weights_digests(self, dtype: str | None = None) -> dict[str, tuple[list[int], str]]:
        """The shape and SHA-256 (`tensor_digest`) of each tensor of the actor's weights under
        transformers names, cast to `dtype` (None: as held; quantized weights as pushed);
        collective, and empty on every rank but the weight sender."""
        from ember_megatron_backend.weight_sync import is_weight_sender

        named = self._engine_weights(None if dtype is None else getattr(torch, dtype))
        sender = is_weight_sender()
        digests = {}
        for name, tensor in named:  # every rank walks them: the gathers are collective
            if sender:
                digests[name] = (list(tensor.shape), tensor_digest(tensor))
        return digests

    def _wire_dtype(self) -> torch.dtype | None:
        """The dtype weights travel in: the embedded engine's own (it casts to it anyway), else
        the parameters' (SGLang servers start from the trainer's export, in that dtype); None
        for quantized weights, which `_sent_weights` casts itself."""
        if self.config.engine.quantization is not None:
            return None
        if self.config.engine.kind == "hf":
            return getattr(torch, self.config.engine.hf.dtype)  # "bfloat16", "float32", ...
        return None

    def _join_engines(self, engines: list[Any]) -> Any:
        """Form a weight group with `engines`: this rank hosts the rendezvous on its node and
        takes rank 0, each engine its `weight_group_size` ranks after the previous one's."""
        from ember.config import weight_group_backend
        from ember_megatron_backend.parallel import free_port, uses_gpu
        from ember_megatron_backend.weight_sync import WeightGroup

        sizes = calls.get([e.weight_group_size.remote() for e in engines])
        world = 1 + sum(sizes)
        address = calls.node_address()
        port = free_port("0.0.0.0")
        # From both ends' devices: NCCL only when the servers are on GPUs too.
        backend = weight_group_backend(self.config, trainer_on_gpu=uses_gpu())
        name = f"ember-weights-{uuid.uuid4().hex[:12]}"
        offsets = [1 + sum(sizes[:i]) for i in range(len(engines))]
        joins = [
            e.join_weights_group.remote(address, port, offset, world, name, backend)
            for e, offset in zip(engines, offsets, strict=True)
        ]
        timeout = datetime.timedelta(minutes=self.config.train.parallel.timeout_minutes)
        return _meet(
            lambda: WeightGroup.create(
                master_address=address,
                master_port=port,
                world_size=world,
                group_name=name,
                backend=backend,
                timeout=timeout,
            ),
            joins,
        )

    def send_weights(
        self, engines: list[Any], version: str, one_off: bool = False
    ) -> dict[str, float]:
        """Broadcast the actor's weights to `engines` as weight version `version`; with
        `one_off` (a replacement engine's first load) over a group formed for this push
        alone, which leaves the run's weight group as it is.

        Collective: every rank walks the weights in step (the gathers over TP/EP are
        collective); the sending rank (`is_weight_sender`) packs them into flattened buckets
        of `weights.bucket_mb` and broadcasts each over the weight group it formed with the
        engines on its first call. Per bucket it first tells each engine the names, dtypes and
        shapes (a Ray call that returns once that engine has loaded the bucket), then
        broadcasts; the last bucket carries `version`. The engines must be inside a
        weight-update session (the driver opens and closes it).

        Returns:
            On the sending rank, how much it sent (`bytes`, `buckets`); elsewhere {}.
        """
        from ember_megatron_backend.weight_sync import is_weight_sender

        named = self._sent_weights()
        if not is_weight_sender():
            for _ in named:  # take part in the gathers, send nothing
                pass
            return {}
        if one_off:
            group = self._join_engines(engines)
            sent = self._broadcast(group, engines, version, named)  # drops it if it fails
            _drop_weight_group(group, engines)
            return sent
        members = [_actor_key(e) for e in engines]
        if self._weight_group is not None and members != self._weight_members:
            # An engine was replaced: the old group goes, and its members that are still
            # here leave it (the engines are idle: a push waits for generation, or runs its
            # calls on a thread of their own).
            old, self._weight_group = self._weight_group, None
            _drop_weight_group(old, [e for e in engines if _actor_key(e) in self._weight_members])
        if self._weight_group is None:
            self._weight_group = self._join_engines(engines)
            self._weight_members = members
        return self._broadcast(self._weight_group, engines, version, named)

    def _broadcast(
        self, group: Any, engines: list[Any], version: str, named: Any
    ) -> dict[str, float]:
        """Send the weights `named` over `group` to `engines` (the sending rank's part of
        `send_weights`)."""
        from ember_megatron_backend.weight_sync import bucket_weights

        sent = {"bytes": 0.0, "buckets": 0.0}
        buckets = bucket_weights(
            named, self.config.weights.bucket_bytes, dtype=self._wire_dtype(), device=group.device
        )
        try:
            for bucket, last in _with_last(buckets):
                loaded = [
                    e.update_weights_from_distributed.remote(
                        bucket.names,
                        bucket.dtypes,
                        bucket.shapes,
                        group.name,
                        version if last else None,
                        last,
                    )
                    for e in engines
                ]
                work = group.broadcast(bucket)
                _wait_all(loaded)
                work.wait()
                sent["bytes"] += bucket.nbytes
                sent["buckets"] += 1
        except BaseException:
            # The group may hold a broadcast some members wait in: abort it here, have every
            # engine destroy it, and form a new one on the next push. A gloo Work keeps its
            # group's connections open: the last bucket's, still held here, would leave the
            # engines waiting in their receive past the abort (`WeightGroup.abort`).
            work = None  # noqa: F841
            if self._weight_group is group:
                self._weight_group = None
            _drop_weight_group(group, engines)
            raise
        return sent

    def send_weights_direct(self, engines: list[Any], version: str) -> dict[str, float]:
        """Copy the actor's weights into `engines`, objects in this process, as weight version
        `version`: buckets of `weights.bucket_mb` of the tensors themselves (cast to the
        engine's dtype, which is no copy when it is the trainer's), each loaded by every
        engine before the next is gathered; nothing is serialised. The engines must be inside
        a weight-update session. One rank only: in one process there is no other.

        Returns:
            How much it handed over (`bytes`, `buckets`).
        """
        dtype = self._wire_dtype()
        limit = self.config.weights.bucket_bytes
        sent = {"bytes": 0.0, "buckets": 0.0}

        def buckets() -> Iterator[list[tuple[str, torch.Tensor]]]:
            bucket: list[tuple[str, torch.Tensor]] = []
            size = 0
            for name, tensor in self._sent_weights():
                tensor = tensor.detach().to(dtype) if dtype is not None else tensor.detach()
                if bucket and size + tensor.nbytes > limit:
                    yield bucket
                    bucket, size = [], 0
                bucket.append((name, tensor))
                size += tensor.nbytes
            if bucket:
                yield bucket

        for bucket, last in _with_last(buckets()):
            calls.get(
                [e.update_weights_direct.remote(bucket, version if last else None) for e in engines]
            )
            sent["bytes"] += sum(t.nbytes for _, t in bucket)
            sent["buckets"] += 1
        return sent

    def send_weights_ipc(self, engine: Any | None, version: str) -> dict[str, float]:
        """Hand the actor's weights to the SGLang `engine` on this rank's GPU as CUDA IPC
        handles of flattened buckets, as weight version `version` (None: this rank feeds no
        engine). Collective like `send_weights`; every rank that feeds an engine holds the
        gathered weights. The engine must be inside a weight-update session.

        Returns:
            On a rank that fed an engine, how much it handed over; elsewhere {}.
        """
        from ember_megatron_backend.parallel import device
        from ember_megatron_backend.weight_sync import bucket_weights
        from ember_rollout.sglang_weights import serialize_flattened_bucket

        named = self._sent_weights()
        if engine is None:
            for _ in named:
                pass
            return {}
        copies = calls.get(engine.weight_group_size.remote())
        sent = {"bytes": 0.0, "buckets": 0.0}
        buckets = bucket_weights(named, self.config.weights.bucket_bytes, device=device())
        for bucket, last in _with_last(buckets):
            payloads = [
                serialize_flattened_bucket(bucket.flat, bucket.names, bucket.dtypes, bucket.shapes)
                for _ in range(copies)  # one per server rank: each opens its own handle
            ]
            # The server has loaded the bucket when this returns; the buffer may go.
            calls.get(
                engine.update_weights_from_ipc.remote(payloads, version if last else None, last)
            )
            sent["bytes"] += bucket.nbytes
            sent["buckets"] += 1
        return sent

    # -- colocated memory hand-off (`ember.placement.MemoryHandoff`) -------------------------

    def offload(self, part: str) -> int:
        """Free this rank's GPU memory of `part` (`ember_megatron_backend.offload.PARTS`) for
        the engines on its GPU; returns the bytes freed (0 on CPU, where nothing moves)."""
        if self._offload is None:
            from ember_megatron_backend.offload import TrainerOffload

            self._offload = TrainerOffload(self.worker)
        return self._offload.offload(part)

    def reload(self) -> int:
        """Bring back whatever `offload` freed; returns the bytes restored."""
        return 0 if self._offload is None else self._offload.reload()

    def export_hf(self, path: str, pushed: bool = False) -> None:
        """Write the actor as an HF checkpoint at `path` (collective; rank 0 writes).

        Under `engine.quantization` an export SGLang servers launch from, and any export a disk
        push loads (`pushed`), holds the tensors every push sends (quantized from the trainer's
        own weights, the rest in the served dtype) and SGLang's `quantization_config` in
        config.json. The embedded engine starts from a full-precision export and quantizes it
        itself (`ember_rollout.quantized`).
        """
        spec = self.config.engine.quant_spec()
        if spec is None or not (pushed or self.config.engine.kind == "sglang"):
            self.worker.export_hf(Path(path))
            return
        from ember.config import served_dtype
        from ember_megatron_backend.hf_layout import hf_names
        from ember_rollout.sglang_quant import quantization_config

        names = hf_names(self.worker.model_config)
        self.worker.export_hf(
            Path(path),
            dtype=served_dtype(self.config),
            quantization=spec,
            quantization_config=quantization_config(spec, names),
        )

    def save_tokenizer(self, path: str) -> None:
        """Complete the export at `path` with the run's tokenizer and the token ids the model
        stops at (rank 0, once, before any engine reads `path`)."""
        from ember.config import run_tokenizer_path
        from ember_rollout.tokenizer import save_tokenizer_for_model

        save_tokenizer_for_model(run_tokenizer_path(self.config), path)

    def save(self, path: str) -> None:
        """Write a training checkpoint at `path` (collective). A colocated rank is offloaded
        between `after_training` and the next rollout, when the driver saves: then the
        checkpoint is written from the host copies, without taking GPU memory back from the
        engines (the offloaded tensors themselves have no bytes to write)."""
        offload = self._offload
        host_view = offload.host_view if offload is not None and offload.offloaded else None
        self.worker.save_checkpoint(Path(path), host_view=host_view)

    def load(self, path: str) -> None:
        self.worker.load_checkpoint(Path(path))


def tensor_digest(tensor: torch.Tensor) -> str:
    """A SHA-256 of one tensor's dtype, shape and bytes."""
    import hashlib

    tensor = tensor.detach().cpu().contiguous()
    digest = hashlib.sha256(f"{tensor.dtype}:{tuple(tensor.shape)}".encode())
    digest.update(tensor.reshape(-1).view(torch.uint8).numpy())  # no copy of the bytes
    return digest.hexdigest()


HEALTH_CALLS = "health"
"""The concurrency group of an engine's health calls: a thread of their own, so a probe is
answered while `generate` runs (an engine that cannot answer it is hung)."""


class RolloutEngine:
    """One rollout engine: it generates the prompt groups the `RolloutManager` sends it, and
    nothing else (the prompt stream, rewards and filters live in the manager).

    The engine starts from the trainer's initial weights at `model_path` (the driver's export):
    the embedded model loads them, launched SGLang servers are launched from them whatever
    `engine.sglang.model_path` says, and the model's shape (layers, top-k, context length) is
    read from there. Attached SGLang servers (`engine.sglang.urls`) hold whatever they were
    started with, so the driver loads the initial weights into them before rollout 0. Every
    answer reports the weight version it was generated with (`meta_info.weight_version`); an
    engine that loaded `model_path` itself reports `INITIAL_WEIGHT_VERSION` until the first
    update.

    Its calls run one at a time, so a weight push waits for a running `generate`. With
    `rollout.partial_rollouts` the driver creates a `PartialRolloutEngine` instead, whose weight
    calls run beside `generate` (`engine_actor`).
    """

    @errors_held_for_start
    def __init__(self, config: dict[str, Any], *, model_path: str, threads: int | None) -> None:
        """Read the config and import the engine's libraries; ``start`` loads the model.

        The driver creates engines before the trainer has exported `model_path`, so that their
        imports overlap with the trainer's start-up, and calls ``start`` once it is written.
        """
        mark_process_start("engine", "actor created")
        _prepare_process(threads)
        from ember.config import load_config
        from ember.versions import INITIAL_WEIGHT_VERSION

        self.config, self.plugins = load_config(config)
        engine_config = self.config.engine
        sglang = engine_config.sglang
        if engine_config.kind == "sglang" and sglang.model_path not in (None, model_path):
            logger.info(
                "engine.sglang.model_path=%s is replaced by the trainer's initial weights at %s",
                sglang.model_path,
                model_path,
            )
        engine_config.hf.model_path = model_path
        sglang.model_path = model_path
        if sglang.log_dir is None:  # launched servers log next to the run's other files
            run_dir = Path(self.config.run.dir) if self.config.run.dir else Path(model_path).parent
            sglang.log_dir = str(run_dir / "sglang")
        self.attached = engine_config.kind == "sglang" and bool(sglang.urls)
        if engine_config.kind == "sglang" and not self.attached:
            # sglang 0.5.23 (arg_groups/fields/serving.py) serves version "default" until the
            # first update unless launched with --weight-version.
            if not any(a.split("=", 1)[0] == "--weight-version" for a in sglang.server_args):
                sglang.server_args += ["--weight-version", INITIAL_WEIGHT_VERSION]
        if self.config.data.tokenizer_path is None:
            self.config.data.tokenizer_path = model_path
        self.loop = asyncio.new_event_loop()
        self.partial_rollouts = self.config.rollout.partial_rollouts
        # Partial rollouts: the weight calls run on a thread of their own (`PartialRolloutEngine`)
        # while `generate` waits on another. The embedded engine's weight calls get a loop of
        # their own (one asyncio loop cannot run on two threads at once). The SGLang client's
        # HTTP session belongs to the loop it was made on, so its loop runs on a thread of its
        # own instead, and both kinds of call are sent there (`_run`). Otherwise every call runs
        # on the one loop, one call at a time, and a weight load waits for `generate` to finish.
        self.loop_thread: threading.Thread | None = None
        if self.partial_rollouts and engine_config.kind == "sglang":
            self.loop_thread = threading.Thread(
                target=self.loop.run_forever, name="sglang-client", daemon=True
            )
            self.loop_thread.start()
        separate = self.partial_rollouts and self.loop_thread is None
        self.weight_loop = asyncio.new_event_loop() if separate else self.loop
        self.engine: Any = None
        self.groups: Any = None
        self.launched: Any = None
        """The engine whose servers `launch` started early, until `start` takes it."""
        self.launched_from: str | None = None
        _import_rollout_libraries(
            embedded_engine=engine_config.kind == "hf",
            model_type=self.config.train.model_config().family,
        )
        mark("engine", "libraries imported")

    def _run(self, coro: Any) -> Any:
        """Run `coro` on the engine's loop: sent to its thread when it has one, else run here."""
        if self.loop_thread is not None:
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result()
        return self.loop.run_until_complete(coro)

    def _run_weights(self, coro: Any) -> Any:
        """Run a weight call's `coro` on the loop of weight calls (`weight_loop`)."""
        if self.weight_loop is self.loop:
            return self._run(coro)
        return self.weight_loop.run_until_complete(coro)

    def _build_engine(self, engine_config: Any) -> Any:
        from ember_rollout import build_engine

        engine = build_engine(engine_config, plugins=self.plugins)
        if self.partial_rollouts:  # engines of `PARTIAL_ROLLOUT_ENGINES` only
            engine.partial_rollouts = True
        if self.config.rollout.true_on_policy:  # the embedded engine only (`check_true_on_policy`)
            engine.true_on_policy = True
        return engine

    def launch(self, source: str) -> None:
        """Launch this engine's SGLang servers from `source` now, before the trainer has written
        `model_path`: a checkpoint of the same model (`weight_push.early_launch_source`), so
        that the servers' start-up overlaps the trainer's. `start` waits for them; having not
        loaded `model_path` (`loaded_model_path`), they get the initial weights from the driver
        before rollout 0, as attached servers do."""
        if self.init_error is not None:
            raise self.init_error
        from ember.versions import UNLOADED_WEIGHT_VERSION

        engine_config = copy.deepcopy(self.config.engine)
        sglang = engine_config.sglang
        if source != sglang.model_path:  # not the initial weights until the driver loads them
            args, label = list(sglang.server_args), "--weight-version"
            while label in args:  # the label `__init__` gave (flag and value)
                del args[args.index(label) : args.index(label) + 2]
            args = [a for a in args if not a.startswith(f"{label}=")]
            sglang.server_args = [*args, label, UNLOADED_WEIGHT_VERSION]
        sglang.model_path = source
        engine = self._build_engine(engine_config)
        self.launched, self.launched_from = engine, source  # `shutdown` stops what started
        engine.launch()
        logger.info("SGLang servers launching from %s while the trainer starts", source)

    def start(self) -> None:
        """Start the engine from `model_path` (idempotent): the embedded model loads it, SGLang
        servers launch from it (unless `launch` started them) or are attached."""
        if self.init_error is not None:
            raise self.init_error
        if self.engine is not None:
            return
        from ember.versions import INITIAL_WEIGHT_VERSION
        from ember_rollout import LocalGroups
        from ember_rollout.tokenizer import load_tokenizer

        engine = self.launched or self._build_engine(self.config.engine)
        self.launched = None
        self._run(engine.start())
        if self.config.engine.kind == "hf" and engine.weight_version is None:
            engine.weight_version = INITIAL_WEIGHT_VERSION
        tokenizer = load_tokenizer(self.config.data.tokenizer_path)
        self.engine = engine
        self.groups = LocalGroups(engine, tokenizer, self.plugins)
        mark("engine", "model loaded")

    def generate(self, groups: list[Any]) -> list[list[Sample]]:
        """The samples of each `PromptGroup`, in order; plugins see each sample here."""
        return self._run(self.groups.generate_groups(groups))

    def model_info(self) -> Any:
        """The served model's shape (`ModelInfo`), or None when the engine cannot tell."""
        return self.engine.model_info

    @calls.concurrency_group(HEALTH_CALLS)
    def health(self, timeout_s: float) -> str | None:
        """Why this engine cannot serve, or None: answered on a thread of its own beside
        `generate` (`Engine.probe`: for SGLang, its servers' processes and GET /health, each
        given `timeout_s`, `fault_tolerance.health_check_timeout_s`)."""
        engine = self.engine
        return None if engine is None else engine.probe(timeout_s)

    @calls.concurrency_group(HEALTH_CALLS)
    def process(self) -> tuple[int, str]:
        """This actor's pid and node address, for the errors that name it."""
        return os.getpid(), calls.node_address()

    def weights_digest(self) -> str | None:
        """A SHA-256 over the served weights (the per-tensor digests, in name order), or None
        when the engine cannot read its weights (SGLang servers)."""
        import hashlib

        digests = self.weights_digests()
        if digests is None:
            return None
        return hashlib.sha256(repr(sorted(digests.items())).encode()).hexdigest()

    def weights_digests(
        self, shapes: dict[str, list[int]] | None = None
    ) -> dict[str, str | None] | None:
        """A SHA-256 per served tensor (`tensor_digest`) by checkpoint name: of `shapes`' names
        (None where the model serves no tensor of that name and shape; a per-expert name is a
        view into transformers' fused expert tensor), or of every tensor of the model's state
        dict under its own name. None when the engine cannot read its weights (SGLang
        servers)."""
        from ember_rollout.models import served_tensor

        model = getattr(self.engine, "model", None)
        if model is None:
            return None
        if shapes is None:
            return {name: tensor_digest(t) for name, t in model.state_dict().items()}
        digests: dict[str, str | None] = {}
        for name, shape in shapes.items():
            tensor = served_tensor(model, name, shape)
            digests[name] = None if tensor is None else tensor_digest(tensor)
        return digests

    def prompt_log_probs(self, sequences: list[list[int]]) -> list[list[float]] | None:
        """`Engine.prompt_log_probs` of the engine (None where it has none)."""
        return self._run(self.engine.prompt_log_probs(sequences))

    def top_log_probs(
        self, samples: list[Sample], k: int, temperature: float, *, replay: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per sample, the engine's k most likely token ids ([R, k]) at every response position
        and their log-probs, then the other ids' together ([R, k + 1]), at `temperature`,
        from a forward of the sampled sequence (prefill); None when the engine cannot read its
        model (SGLang servers).

        `replay`: an MoE model's layers compute with the sample's `rollout_routed_experts`
        instead of routing afresh (`routing.replay_routing`), as the trainer's forward does
        under `r3_routing`; a sample without recorded experts routes by itself."""
        import contextlib

        from ember_megatron_backend.forward import with_rest
        from ember_rollout.routing import replay_routing

        model = getattr(self.engine, "model", None)
        if model is None:
            return None
        device = next(model.parameters()).device
        out = []
        with torch.no_grad():
            for sample in samples:
                # The last token predicts nothing: the forward covers the positions the engine
                # forwarded, which are those its recorded experts cover.
                tokens = torch.tensor([sample.tokens[:-1]], device=device)
                experts = sample.rollout_routed_experts if replay else None
                routing = (
                    contextlib.nullcontext() if experts is None else replay_routing(model, experts)
                )
                try:
                    with routing:
                        logits = model(input_ids=tokens).logits[0].float()
                except ValueError as exc:  # experts that do not fit: name the sample
                    raise ValueError(f"sample {sample.index}: {exc}") from None
                start = sample.total_length - sample.response_length - 1
                rows = torch.log_softmax(logits[start:] / temperature, -1)
                ids = rows.topk(min(k, rows.shape[-1]), dim=-1).indices
                out.append((ids.cpu(), with_rest(rows, ids).cpu()))
        return out

    def trace_layers(
        self, sequences: list[tuple[list[int], list[int]]], temperature: float, keep: int
    ) -> tuple[list[dict[tuple[int, str], torch.Tensor]], list[list[float]]] | None:
        """`HFEngine.trace`: (prompt, response) pairs decoded as a rollout decodes them, every
        layer of the first `keep` recorded; None where the engine's model is not in this
        process (SGLang)."""
        trace = getattr(self.engine, "trace", None)
        return None if trace is None else trace(sequences, temperature, keep=keep)

    def loaded_model_path(self) -> bool:
        """Whether the engine loaded `model_path` itself when it started (not an attached
        server's, nor one that `launch` started from another checkpoint)."""
        launched_from = self.launched_from
        return not self.attached and launched_from in (None, self.config.engine.sglang.model_path)

    # -- weights from the trainer: the training rank that sends drives these calls ------------

    def weight_group_size(self) -> int:
        """Ranks this engine adds to a weight group."""
        return self.engine.weight_group_size

    def join_weights_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join the sending rank's weight group (blocks until every member has joined)."""
        self._run_weights(
            self.engine.init_weights_update_group(
                master_address=master_address,
                master_port=master_port,
                rank_offset=rank_offset,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
            )
        )

    def destroy_weights_group(self, group_name: str) -> None:
        """Leave and destroy weight group `group_name` (after a failed push)."""
        self._run_weights(self.engine.destroy_weights_update_group(group_name))

    def begin_weight_update(self) -> None:
        self._run_weights(self.engine.begin_weight_update())

    def end_weight_update(self) -> None:
        self._run_weights(self.engine.end_weight_update())

    def _taken(self, version: str | None) -> str | None:
        """The weight version the engine takes with a push: the pushed one (its old one under
        `ember certify --plant stale-version`, to test the check that versions move)."""
        if version is not None and planted(Fault.STALE_VERSION):
            return getattr(self.engine, "weight_version", None)
        return version

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        version: str | None,
        flush_cache: bool,
    ) -> None:
        """Receive and load one bucket the sending rank broadcasts; `version` comes with the
        last bucket of an update."""
        self._run_weights(
            self.engine.update_weights_from_distributed(
                names,
                dtypes,
                shapes,
                group_name=group_name,
                weight_version=self._taken(version),
                flush_cache=flush_cache,
            )
        )

    def update_weights_direct(
        self, named: list[tuple[str, torch.Tensor]], version: str | None
    ) -> None:
        """Load one bucket of tensors the training rank hands over in this process (the
        `direct` transport); `version` comes with the last bucket of an update."""
        self._run_weights(
            self.engine.update_weights_in_session(named, weight_version=self._taken(version))
        )

    def update_weights_from_ipc(
        self, payloads: list[str], version: str | None, flush_cache: bool
    ) -> None:
        """Load one bucket handed over as CUDA IPC handles (SGLang servers on this machine)."""
        self._run_weights(
            self.engine.update_weights_from_ipc(
                payloads, weight_version=self._taken(version), flush_cache=flush_cache
            )
        )

    def update_weights_from_disk(self, path: str, version: str) -> None:
        """Load every weight from the HF checkpoint directory `path`."""
        self._run_weights(
            self.engine.update_weights_from_disk(path, weight_version=self._taken(version))
        )

    def release_memory(self, tags: list[str] | None) -> None:
        """Free the engine's device memory of `tags` (None: all) while the trainer trains."""
        self._run(self.engine.release_memory(tags))

    def resume_memory(self, tags: list[str] | None) -> None:
        """Take back the device memory of `tags` (None: all) that `release_memory` freed."""
        self._run(self.engine.resume_memory(tags))

    def shutdown(self) -> None:
        for engine in (self.engine, self.launched):  # servers `launch` started count too
            if engine is not None:
                self._run(engine.shutdown())
        self.launched = None
        if self.loop_thread is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.loop_thread.join()
            self.loop_thread = None


WEIGHT_CALLS = "weights"
"""The concurrency group of a `PartialRolloutEngine`'s weight calls: one thread of its own."""
WEIGHT_METHODS = (
    "weight_group_size",
    "join_weights_group",
    "destroy_weights_group",
    "begin_weight_update",
    "end_weight_update",
    "update_weights_from_distributed",
    "update_weights_from_ipc",
    "update_weights_from_disk",
    "update_weights_direct",
)
"""The `RolloutEngine` methods a weight push calls (the driver and the sending rank)."""


def _on_weight_thread(name: str) -> Callable[..., Any]:
    """`RolloutEngine` method `name`, put in the `WEIGHT_CALLS` concurrency group."""
    method = getattr(RolloutEngine, name)

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return method(self, *args, **kwargs)

    # Not functools.wraps: ray 2.60 (actor.py `_ActorClassMethodMetadata.create`) unwraps
    # `__wrapped__` and would read the group from the base method, which has none.
    call.__name__, call.__qualname__ = name, f"PartialRolloutEngine.{name}"
    call.__doc__ = method.__doc__
    call.__signature__ = inspect.signature(method)  # type: ignore[attr-defined]
    return calls.concurrency_group(WEIGHT_CALLS)(call)


class PartialRolloutEngine(RolloutEngine):
    """`RolloutEngine` for `rollout.partial_rollouts`: its weight calls (`WEIGHT_METHODS`) run
    on a thread of their own, so a push reaches the engine while `generate` runs on the
    actor's default thread (the embedded engine takes the weights between decode steps). Every
    other call still runs on the default thread, one at a time. A push never waits for a
    thread that `generate` holds: the weight thread serves weight calls only."""


for _name in WEIGHT_METHODS:
    setattr(PartialRolloutEngine, _name, _on_weight_thread(_name))


def engine_actor(config: Any) -> Any:
    """The actor class of the run's rollout engines (`config`, a `RunConfig`):
    `PartialRolloutEngine` with `rollout.partial_rollouts`, else `RolloutEngine`, whose calls
    all run on one thread (a weight push then waits for `generate` to finish)."""
    return PartialRolloutEngine if config.rollout.partial_rollouts else RolloutEngine
