"""The real SGLang server (sglang 0.5.23) on CPU for the tests, launched by the sglang engine.

It serves Ember's own export of the `tiny-moe` preset (the trainer's `hf_init`) in fp32 with
routed experts on; a second export from another seed is what weight updates load. Each test
attaches its own engine to the running server (`RealServer.engine`), so the server starts once
per test session (about 80-150 s on two cores: sglang's imports).
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import json
import queue
import subprocess
import sys
import textwrap
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from ember_rollout.config import SGLangEngineConfig
from ember_rollout.sglang_engine import SGLangEngine
from ember_rollout.sglang_launch import free_port

SERVER_ARGS = ["--enable-return-routed-experts", "--log-level", "warning"]
"""Flags beyond the CPU ones Ember adds itself (`ember_rollout.sglang_cpu.SERVER_ARGS`)."""

_EXPORT = textwrap.dedent(
    """
    import json, sys
    from ember_megatron_backend.model import ModelConfig, build_model
    from ember_megatron_backend.parallel import init_distributed
    from ember_megatron_backend.weights import export_hf_checkpoint
    from ember_rollout.tokenizer import save_tokenizer_for_model, toy_tokenizer

    init_distributed()
    overrides = json.loads(sys.argv[1])
    cfg = ModelConfig.preset("tiny-moe").replace(vocab_size=len(toy_tokenizer()), **overrides)
    for seed, path in enumerate(sys.argv[2:]):
        export_hf_checkpoint(build_model(cfg, seed=seed), cfg, path)
        save_tokenizer_for_model(None, path)
    """
)


def export_tiny_moe(*paths: Path, overrides: dict | None = None) -> None:
    """Export the `tiny-moe` preset (with `ModelConfig` `overrides`) over the toy vocabulary,
    from seed i into `paths[i]`, as the trainer writes `hf_init` (in a process of its own: the
    export sets up torch.distributed)."""
    subprocess.run(
        [sys.executable, "-c", _EXPORT, json.dumps(overrides or {}), *map(str, paths)],
        check=True,
        capture_output=True,
        timeout=600,
    )


async def broadcast_weights(
    engine: SGLangEngine, weights: dict, *, bucket_bytes: int, version: str | None = None
) -> int:
    """Push `weights` to the engine's servers as the trainer does: Ember's gloo weight group
    with this process as rank 0 (a thread of it sends), flattened buckets, one session.

    Returns:
        How many buckets were sent.
    """
    from ember_megatron_backend.weight_sync import WeightGroup, bucket_weights

    port, name = free_port(), f"push-{uuid.uuid4().hex[:8]}"
    buckets: queue.Queue = queue.Queue()
    described = threading.Semaphore(0)

    def send() -> None:
        group = WeightGroup.create(
            master_address="127.0.0.1",
            master_port=port,
            world_size=2,
            group_name=name,
            backend="gloo",
            timeout=datetime.timedelta(minutes=5),
        )
        for bucket in bucket_weights(weights.items(), bucket_bytes):
            buckets.put(bucket)
            described.acquire()  # the server has been told the bucket's layout
            group.broadcast(bucket).wait()
        buckets.put(None)

    sender = threading.Thread(target=send)
    sender.start()
    await engine.init_weights_update_group(
        master_address="127.0.0.1",
        master_port=port,
        rank_offset=1,
        world_size=2,
        group_name=name,
        backend="gloo",
    )
    await engine.begin_weight_update()
    sent = 0
    while (bucket := await asyncio.to_thread(buckets.get)) is not None:
        load = asyncio.ensure_future(
            engine.update_weights_from_distributed(
                bucket.names, bucket.dtypes, bucket.shapes, group_name=name, weight_version=version
            )
        )
        described.release()
        await load
        sent += 1
    await engine.end_weight_update()
    await engine.destroy_weights_update_group(name)
    sender.join()
    return sent


@dataclass
class RealServer:
    """A running server and the two checkpoints: `base` (served at start) and `other`."""

    url: str
    base: Path
    other: Path

    def engine(self, **settings) -> SGLangEngine:
        """A new engine attached to the server (model shape read from `base`)."""
        config = SGLangEngineConfig(urls=[self.url], model_path=str(self.base), **settings)
        return SGLangEngine(config)

    def run(self, body, **settings):
        """`await body(engine)` with a fresh attached engine, closed afterwards."""

        async def main():
            async with self.engine(**settings) as engine:
                return await body(engine)

        return asyncio.run(main())


def launch(root: Path) -> tuple[SGLangEngine, asyncio.AbstractEventLoop, RealServer]:
    """Export both checkpoints under `root` and launch a CPU server on `base` through the engine.

    Returns the launching engine and its event loop (stop it with `engine.shutdown()` on that
    loop) and the server's description.
    """
    base, other = root / "base", root / "other"
    export_tiny_moe(base, other)
    config = SGLangEngineConfig(
        model_path=str(base),
        device="cpu",
        dtype="float32",
        server_args=SERVER_ARGS,
        launch_timeout_s=600.0,
        log_dir=str(root / "logs"),
    )
    engine = SGLangEngine(config)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(engine.start())
    except BaseException:
        loop.run_until_complete(engine.shutdown())
        loop.close()
        raise
    return engine, loop, RealServer(url=engine.urls[0], base=base, other=other)


@functools.lru_cache(maxsize=4)
def hf_model(path: Path):
    """The checkpoint at `path` in transformers, fp32, loaded once per test session."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_log_probs(path: Path, tokens: list[int], prompt_len: int, temperature: float = 1.0):
    """transformers' fp32 log-probs of `tokens[prompt_len:]` given what precedes each, at
    `temperature`, and each layer's router top-k per position ([len - 1, layers, k], sorted)."""
    model = hf_model(path)
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    logits = out.logits[0, prompt_len - 1 : len(tokens) - 1] / temperature
    log_probs = torch.log_softmax(logits.double(), -1)
    picked = log_probs.gather(-1, torch.tensor(tokens[prompt_len:])[:, None])[:, 0]
    k = model.config.num_experts_per_tok
    routing = torch.stack([r.topk(k, -1).indices for r in out.router_logits], 1)
    return picked, routing[: len(tokens) - 1].sort(-1).values
