"""The trainer's weights into the engines: the push after each update, the initial load, and
the transports that carry them (`weights.transport`). The driver's process starts the calls and
opens and closes the engines' weight-update sessions; it never holds a weight."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from ember import calls
from ember.checkpoints import checkpoint_name
from ember.config import run_tokenizer_path, weight_transport
from ember.layout import colocated_on_gpu
from ember.versions import INITIAL_WEIGHT_VERSION

logger = logging.getLogger(__name__)

PUSHED_WEIGHTS = "pushed_weights"
"""Run subdirectory of the HF checkpoints the engines load weights from (disk transport)."""
SESSION_TRANSPORTS = ("broadcast", "ipc", "direct")
"""The transports that load weights inside a weight-update session on every engine."""
ABORTED_PUSH_WAIT_S = 60.0
"""How long a failed push waits for the engines to close their weight-update sessions. Over
NCCL, when one member of the weight group dies mid-bucket the others stay blocked in that
bucket's broadcast until their watchdog's timeout (the sender's abort reaches only its own
communicator), their weight calls queued behind it; those engines are handed to engine
mending as failed, to be replaced with the dead one."""


class WeightPush:
    """Pushes the trainer's weights to the engines of `driver` (a `Driver`), mending failed
    engines around each push (`driver.mender`)."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self.pushed_bytes: float | None = None
        """Bytes the last complete push carried to each engine (the tensors as sent: under
        `engine.quantization` the quantized ones), None before the first."""

    @functools.cached_property
    def transport(self) -> str:
        """The run's transport (`ember.config.weight_transport`: auto resolved and checked
        against the engine kind and the placement), resolved once for the run."""
        return weight_transport(self.driver.config)

    @property
    def _actors(self) -> Any:
        assert self.driver.actors is not None
        return self.driver.actors

    def push(self, rollout_id: int) -> None:
        """Load the actor's current weights into every engine, as version `str(rollout_id)`.

        Whichever the transport, the training ranks send the weights and the engines take
        them. An engine that died or hung during the push, or the check after it, is replaced
        and the push runs again: each pass uses up a restart of a slot, so a slot that keeps
        failing ends the loop with `EnginesExhausted` (`fault_tolerance.max_restarts`).
        """
        driver, mender = self.driver, self.driver.mender
        version = str(rollout_id)
        mender.mend(probe_all=True)
        while True:
            try:
                self.send(version)
                driver.trained_version = version
                if mender.replaced:
                    mender.check_replacements()
                return
            except Exception:
                if not mender.mend(probe_all=True):
                    raise  # the push's own failure, with every engine healthy
                logger.warning(
                    "weight push %d failed on a failed engine; pushing again", rollout_id
                )

    def send(self, version: str, engines: list[Any] | None = None) -> None:
        """The trainer's current weights, as `version`, into `engines` (None: every engine)."""
        transport = self.transport
        if transport == "disk":
            self._disk(version, engines)
        else:
            self.in_session(version, transport, engines)

    def in_session(self, version: str, transport: str, engines: list[Any] | None = None) -> None:
        """A session transport (`SESSION_TRANSPORTS`) inside a weight-update session on every
        engine of `engines` (None: all; closed even when the push fails, and then the push's
        error is the one raised)."""
        one_off = engines is not None
        engines = self._actors.engines if engines is None else engines
        opened: list[Any] = []
        try:
            begun = [e.begin_weight_update.remote() for e in engines]
            failed: BaseException | None = None
            for engine, ref in zip(engines, begun, strict=True):
                try:  # every answer, so that each session that opened is closed again
                    calls.get(ref)
                    opened.append(engine)
                except Exception as exc:
                    failed = failed or exc
            if failed is not None:
                raise failed
            if transport == "broadcast":
                self._broadcast(version, engines, one_off=one_off)
            elif transport == "direct":
                self._direct(version, engines)
            else:
                self._ipc(version, engines)
        except BaseException:
            stuck = end_sessions(opened, quiet=True, timeout_s=ABORTED_PUSH_WAIT_S)
            self._fail_stuck(stuck)
            raise
        end_sessions(opened)

    def _fail_stuck(self, engines: list[Any]) -> None:
        """Tell the rollout manager that `engines` failed (they did not close their session
        after a failed push), so that engine mending replaces them; without fault tolerance
        the push's error ends the run anyway."""
        if not engines or not self.driver.mender.tolerant():
            return
        slots = self._actors.engines
        why = (
            f"did not close its weight-update session within {ABORTED_PUSH_WAIT_S:g} s of a "
            "failed push (blocked in the broadcast of a weight group that lost a member)"
        )
        manager = self._actors.manager
        for engine in engines:
            if engine in slots:
                calls.get(manager.fail_engine.remote(slots.index(engine), engine, why))

    def _broadcast(self, version: str, engines: list[Any], *, one_off: bool) -> None:
        """Every rank walks the weights; the sending rank broadcasts them to `engines` (with
        `one_off`, a replacement alone, over a group of their own)."""
        args = (engines, version, True) if one_off else (engines, version)
        self._count(calls.get([t.send_weights.remote(*args) for t in self._actors.train]))

    def _direct(self, version: str, engines: list[Any]) -> None:
        """The one training rank copies its tensors into the engines in this process."""
        self._count(
            calls.get([t.send_weights_direct.remote(engines, version) for t in self._actors.train])
        )

    def _ipc(self, version: str, engines: list[Any]) -> None:
        """Training rank i hands its copy to engine i, on the same GPU (`ray.colocate`), where
        engine i is one of `engines`."""
        slots = self._actors.engines
        sent = calls.get(
            [
                t.send_weights_ipc.remote(
                    slots[i] if i < len(slots) and slots[i] in engines else None, version
                )
                for i, t in enumerate(self._actors.train)
            ]
        )
        self._count(sent)

    def _count(self, sent: list[dict[str, float] | None]) -> None:
        """Record what the ranks report they sent to an engine (`pushed_bytes`): one rank
        sends (broadcast, direct), or each rank that feeds an engine sends it the same; the
        others report nothing."""
        self.pushed_bytes = max(((part or {}).get("bytes", 0.0) for part in sent), default=0.0)

    def _disk(self, version: str, engines: list[Any] | None = None) -> None:
        # A fresh directory per version: a server never reads one that is being written, and
        # the previous one goes only after every engine has loaded the new one.
        # A replacement's load has a directory of its own, gone once it is loaded.
        root = self.driver.run_dir / PUSHED_WEIGHTS
        name = checkpoint_name(int(version))
        target = root / (name if engines is None else f"{name}-replacement")
        calls.get([t.export_hf.remote(str(target), True) for t in self._actors.train])
        self.pushed_bytes = float(sum(f.stat().st_size for f in target.glob("*.safetensors")))
        into = self._actors.engines if engines is None else engines
        calls.get([e.update_weights_from_disk.remote(str(target), version) for e in into])
        for old in root.iterdir():
            if old != target or engines is not None:
                shutil.rmtree(old, ignore_errors=True)

    def load_initial(self) -> None:
        """Bring every engine that did not load `hf_init` itself (attached SGLang servers) to
        the trainer's initial weights, so rollout 0 comes from them: by the run's transport
        (disk: `hf_init` itself, which such a server must be able to read). Under
        `engine.quantization` every embedded engine gets them too, quantized as every push
        quantizes them."""
        driver = self.driver
        engines = self._actors.engines
        loaded = calls.get([e.loaded_model_path.remote() for e in engines])
        config = driver.config
        if config.engine.kind == "hf" and config.engine.quantization and not driver.rollout_only:
            # An embedded engine quantized `hf_init` as it loaded it, in its own dtype; the
            # pushes quantize the trainer's weights as it holds them. Rollout 0 samples from
            # what they push.
            self.send(INITIAL_WEIGHT_VERSION)
            return
        if all(loaded):
            return
        transport = "disk" if driver.rollout_only else self.transport
        if transport != "disk":
            # Engines that loaded hf_init get the same weights again: a broadcast or a
            # bucket goes to every engine at once. The trainer sends, so it takes the GPUs.
            driver.handoff.to_training()
            driver.handoff.after_training(
                lambda: self.in_session(INITIAL_WEIGHT_VERSION, transport)
            )
            return
        path = driver.config.train.hf_load if driver.rollout_only else str(driver.init_dir)
        calls.get(
            [
                e.update_weights_from_disk.remote(path, INITIAL_WEIGHT_VERSION)
                for e, done in zip(engines, loaded, strict=True)
                if not done
            ]
        )


def end_sessions(
    engines: list[Any], *, quiet: bool = False, timeout_s: float | None = None
) -> list[Any]:
    """Close the weight-update session of every engine; raise the first failure once all
    answered (log them instead when `quiet`: another error is on its way). With `timeout_s`,
    wait that long for all of them at most; returns the engines that did not answer by then
    (logged)."""
    refs = [e.end_weight_update.remote() for e in engines]
    _, late = calls.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    errors = []
    for ref in refs:
        if ref in late:
            continue
        try:
            calls.get(ref)
        except Exception as exc:
            if quiet:
                logger.error("while closing an engine's weight-update session: %s", exc)
            errors.append(exc)
    stuck = [e for e, ref in zip(engines, refs, strict=True) if ref in late]
    if stuck:
        logger.error(
            "%d engine(s) did not close their weight-update session within %g s",
            len(stuck),
            timeout_s,
        )
    if errors and not quiet:
        raise errors[0]
    return stuck


def init_complete(model_dir: Path) -> bool:
    """Whether the export of the initial weights finished, tokenizer included (saved last)."""
    return all((model_dir / name).is_file() for name in ("config.json", "tokenizer_config.json"))


def early_launch_source(config: Any, init_dir: Path, *, reuse_init: bool) -> Path | None:
    """A checkpoint that launched SGLang servers can start from before the trainer's export of
    the initial weights, while the trainer starts (`RolloutEngine.launch`; the driver then loads
    the initial weights into them, as into attached servers). A server keeps its checkpoint's
    config.json, generation_config.json and tokenizer for the whole run (a weight load replaces
    only weights), so the checkpoint must be one the export would match in all of them:

    - on resume, the run's own `hf_init` (the checkpoint's weights are pushed next anyway);
    - in a fresh run, `train.hf_load` when the model's shape is read from it (`train.model`
      unset) and `train.model_overrides` leave it as it is; when the run's tokenizer is its own
      (`run_tokenizer_path`), so the export copies its generation_config.json; when its
      config.json's BOS, EOS and padding ids are the tokenizer's, which the export writes; and
      when SGLang serves it in the dtype it would serve the export in (`engine.sglang.dtype`
      set, or the checkpoint's dtype `train.dtype`).

    None otherwise, and where an early launch would not fit: embedded engines or attached
    servers (nothing to launch), a rollout-only run (its engines start at once from
    `train.hf_load`), training ranks and engines sharing GPUs (the trainer starts first), and a
    fresh run under `engine.quantization` (its servers load the quantized export, whose layout
    a full-precision checkpoint's server cannot take).
    """
    sglang = config.engine.sglang
    if config.engine.kind != "sglang" or sglang.urls or config.run.rollout_only:
        return None
    if config.run.train_from_rollouts is not None or colocated_on_gpu(config):
        return None
    if reuse_init:
        return init_dir if init_complete(init_dir) else None
    if config.engine.quantization is not None:
        return None  # servers of a quantized run start from its quantized export only
    train = config.train
    if train.hf_load is None or train.model is not None:
        return None
    source = Path(train.hf_load).resolve()
    if source == init_dir.resolve() or not init_complete(source):
        return None
    tokenizer = run_tokenizer_path(config)
    if tokenizer is None or Path(tokenizer).resolve() != source:
        return None
    if train.model_overrides:
        as_is = dataclasses.replace(train, model_overrides={})
        if train.model_config() != as_is.model_config():
            return None
    hf = json.loads((source / "config.json").read_text())
    if sglang.dtype == "auto" and hf.get("torch_dtype", hf.get("dtype")) != train.dtype:
        return None
    from ember_rollout.tokenizer import load_tokenizer, special_token_ids

    ids = special_token_ids(load_tokenizer(str(source)))
    if any(hf.get(key) != value for key, value in ids.items()):
        return None
    return source
