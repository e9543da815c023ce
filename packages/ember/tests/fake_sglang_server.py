"""A CPU stand-in for `python -m sglang.launch_server`: the HTTP routes the driver uses, in
SGLang 0.5.23's wire format, refusing what that server refuses. Every request is appended as
one JSON line to the file named by `--record`.

The protocol rules (request fields, sessions, memory tags, weight versions, answers) are the
ones the sglang engine's in-process fake enforces, imported from `packages/rollout/tests/
sglang_fake.py`. Weights broadcast by the trainer arrive for real: `/init_weights_update_group`
joins the trainer's group over gloo the way sglang does (`weight_sender.join_group`, next to
that fake), and `/update_weights_from_distributed` allocates the bucket from its names, dtypes
and shapes, receives it with `broadcast(src=0)` and loads the tensors.

A checkpoint with a `quantization_config` is held to sglang's loader rules for its scheme at
launch (the server exits with the rule, as sglang fails to start) and on every update (tensor,
distributed, disk), refused in sglang's answer format (`sglang_fake_model.ServedModel`); GET
/server_info reports `--quantization` (null unless given) and GET /model_info `model_path`.

Run it as `python fake_sglang_server.py --model-path DIR --port N --record FILE
[--weight-version V] [--tp-size N] [--dtype D] [--quantization Q]`; leading arguments it does
not know (`-m sglang.launch_server`, ...) are ignored, so a one-line shell wrapper can stand in
for the `python` that `engine.sglang.python` names.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "rollout" / "tests"))

from sglang_fake import (  # noqa: E402
    GROUP_EXISTS,
    MEMORY_TAGS,
    NO_GROUP,
    SafeUnpickler,
    ServerState,
    bucket_layout,
    check_generate,
    check_request,
    failure,
    read_body,
    success,
    unflatten_payload,
)
from sglang_fake_model import ServedModel  # noqa: E402
from weight_sender import join_group  # noqa: E402

TOKENS = list(range(3, 13))
"""What /generate answers with, cycling: the toy tokenizer's digits."""


def checkpoint_problem(path: str) -> str | None:
    """Why SGLang's default loader could not read weights from `path`, or None."""
    directory = Path(path)
    if not (directory / "config.json").is_file():
        return f"{path}: no config.json"
    if not list(directory.glob("*.safetensors")):
        return f"{path}: no *.safetensors files"
    return None


def load_weights(path: str) -> dict:
    """Every tensor of the checkpoint at `path`, by name."""
    from safetensors.torch import load_file

    weights = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        weights.update(load_file(file))
    return weights


def weight_sums(weights: dict) -> dict[str, float]:
    """Per tensor, the sum of its values (what the tests compare)."""
    return {name: float(tensor.double().sum()) for name, tensor in weights.items()}


def receive_bucket(pg, names, dtypes, shapes) -> list:
    """sglang 0.5.23 FlattenedTensorBucket.empty (its checks raise before anything is
    received), one broadcast from rank 0, then the tensors cut from the buffer."""
    import torch
    import torch.distributed as dist

    layout = bucket_layout(names, dtypes, shapes)
    flat = torch.empty(layout[-1][4], dtype=torch.uint8)
    dist.broadcast(flat, src=0, group=pg)
    return [(name, flat[a:b].view(dtype).reshape(shape)) for name, dtype, shape, a, b in layout]


class Server:
    def __init__(
        self, model_path: str, record: Path, weight_version: str, model: ServedModel
    ) -> None:
        self.record_path = record
        self.state = ServerState(weight_version=weight_version)
        self.weights = load_weights(model_path)
        self.model = model
        self.disable_radix_cache = False
        self.record(
            {
                "route": "launch",
                "model_path": model_path,
                "weight_version": weight_version,
                "quantization": model.quantization,
                "sums": weight_sums(self.weights),
            }
        )

    def record(self, entry: dict) -> None:
        with self.record_path.open("a") as handle:
            handle.write(json.dumps(entry) + "\n")

    async def body(self, request: web.Request) -> tuple[dict | None, web.Response | None]:
        """The request's body, or sglang's answer refusing it (recorded as refused)."""
        body, invalid = await read_body(request)
        if invalid is None:
            invalid, _ = check_request(request.path, body)
        if invalid is not None:
            self.record({"route": request.path, "refused": "invalid body"})
        return body, invalid

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def server_info(self, request: web.Request) -> web.Response:
        info = {**self.model.server_info(), "disable_radix_cache": self.disable_radix_cache}
        return web.json_response(info)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.model.model_info(self.state.weight_version))

    async def generate(self, request: web.Request) -> web.Response:
        body, invalid = await read_body(request)
        if invalid is None:
            invalid, _ = check_generate(body)
        if invalid is not None:
            self.record({"route": "/generate", "refused": "invalid body"})
            return invalid
        n = body["sampling_params"]["max_new_tokens"]
        tokens = [TOKENS[i % len(TOKENS)] for i in range(n)]
        version = self.state.weight_version
        self.record({"route": "/generate", "weight_version": version})
        meta = {
            "id": "0",
            "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": len(body["input_ids"]),
            "weight_version": version,
            "output_token_logprobs": [[-1.0, t, None] for t in tokens],
            "completion_tokens": n,
            "cached_tokens": 0,
        }
        if body.get("return_logprob") and body.get("logprob_start_len") == 0:
            # One entry per input token, the first without a log-prob, as sglang answers;
            # the figures are a function of the weights served (not a model's), so that the
            # same weights pushed and loaded score alike and other weights do not.
            level = -1.0 - abs(sum(weight_sums(self.weights).values())) % 1.0
            ids = body["input_ids"]
            meta["input_token_logprobs"] = [[None, ids[0], None]] + [
                [level, t, None] for t in ids[1:]
            ]
        return web.json_response({"text": "", "output_ids": tokens, "meta_info": meta})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        # sglang 0.5.23 http_server.py: {"success", "message", "num_paused_requests"}, HTTP 400
        # on failure; the loader reads config.json and the safetensors of `model_path`.
        body, invalid = await self.body(request)
        if invalid is not None:
            return invalid
        problem = checkpoint_problem(body["model_path"])
        if problem is not None:
            message = f"Failed to get weights iterator: {problem}."
            return failure(message, num_paused_requests=0)
        loaded = load_weights(body["model_path"])
        # sglang 0.5.23 weight_updater.py:216-238: restore, load, post-process; on an error
        # it loads the previous checkpoint again.
        self.model.begin()
        problem = self.model.load((n, (t.dtype, tuple(t.shape))) for n, t in loaded.items())
        problem = problem or self.model.end()
        if problem is not None:
            self.record({"route": "/update_weights_from_disk", "refused": problem})
            message = f"Failed to update weights: {problem}.\nRolling back to original weights."
            return failure(message, num_paused_requests=0)
        self.weights = loaded
        entry = {"route": "/update_weights_from_disk", **body, "sums": weight_sums(self.weights)}
        self.record(entry)
        return self.state.loaded(
            "Succeeded to update model weights.", body.get("weight_version"), num_paused_requests=0
        )

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        # Outside a session sglang refuses. Inside, TP rank 0 opens payload 0 with sglang's
        # SafeUnpickler: on GPUs CUDA IPC handles, here CPU tensors by shared-memory file name
        # (the sender's `file_system` sharing, as the real server on CPU takes them), and cuts
        # the flattened bucket as sglang 0.5.23's `_update_weights_from_flattened_bucket` does.
        body, invalid = await self.body(request)
        if invalid is not None:
            return invalid
        entry = {
            "route": "/update_weights_from_tensor",
            "weight_version": body.get("weight_version"),
        }
        outside = self.state.outside_session(request.path)
        if outside is not None:
            self.record({**entry, "refused": "outside a session"})
            return outside
        if body.get("load_format") != "flattened_bucket":
            self.record({**entry, "refused": "load_format"})
            return failure(f"this fake receives flattened buckets only: {body.get('load_format')}")
        try:
            raw = base64.b64decode(body["serialized_named_tensors"][0], validate=True)
            tensors = unflatten_payload(SafeUnpickler(io.BytesIO(raw)).load())
        except Exception as exc:  # the scheduler's error, in the answer
            self.record({**entry, "refused": f"{type(exc).__name__}: {exc}"})
            return failure(f"{type(exc).__name__}: {exc}")
        problem = self.model.load((n, (t.dtype, tuple(t.shape))) for n, t in tensors)
        if problem is not None:
            self.record({**entry, "refused": problem})
            return failure(f"Failed to update weights: {problem}")
        for tensor_name, tensor in tensors:
            have = self.weights.get(tensor_name)
            if have is not None and have.shape != tensor.shape:
                self.record({**entry, "refused": tensor_name})
                return failure(
                    f"Failed to update parameter online: Attempted to load weight "
                    f"({tensor.shape}) into parameter ({have.shape})."
                )
        for tensor_name, tensor in tensors:
            if tensor_name in self.weights:
                self.weights[tensor_name] = tensor.clone()  # the sender's buffer goes next
        self.record({**entry, "names": [n for n, _ in tensors]})
        return self.state.loaded("Success", body.get("weight_version"))

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        body, invalid = await self.body(request)
        if invalid is not None:
            return invalid
        self.record({"route": "/begin_weight_update", **body})
        answer = self.state.begin()
        if answer.status == 200:
            self.model.begin()
        return answer

    async def end_weight_update(self, request: web.Request) -> web.Response:
        _, invalid = await self.body(request)
        if invalid is not None:
            return invalid
        answer = self.state.end()
        problem = self.model.end() if answer.status == 200 else None
        if answer.status != 200:
            self.record({"route": "/end_weight_update", "refused": True})
        elif problem is not None:
            self.record({"route": "/end_weight_update", "refused": problem})
            return failure(f"end_weight_update: {problem}")
        else:
            self.record({"route": "/end_weight_update", "sums": weight_sums(self.weights)})
        return answer

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body, invalid = await self.body(request)
        if invalid is not None:
            return invalid
        self.record({"route": "/init_weights_update_group", **body})
        name = body.get("group_name", "weight_update_group")
        if name in self.state.groups:
            return failure(GROUP_EXISTS)
        if body.get("backend", "nccl") != "gloo":  # sglang would join; this CPU fake cannot
            return failure(
                f"Failed to initialize custom process group: backend {body.get('backend')!r} "
                "needs GPUs (this CPU server joins gloo groups only)."
            )
        try:
            self.state.groups[name] = await asyncio.to_thread(
                join_group,
                body["master_address"],
                body["master_port"],
                body["rank_offset"],
                body["world_size"],
                name,
            )
        except Exception as exc:
            return failure(f"Failed to initialize custom process group: {exc}.")
        return success("Succeeded to initialize custom process group.")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        import torch.distributed as dist

        body, invalid = await self.body(request)
        if invalid is not None:
            return invalid
        self.record({"route": "/destroy_weights_update_group", **body})
        pg = self.state.groups.pop(body.get("group_name", "weight_update_group"), None)
        if pg is None:
            return failure(NO_GROUP)
        dist.destroy_process_group(pg)
        return success("Succeeded to destroy custom process group.")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body, invalid = await self.body(request)
        if invalid is not None:
            return invalid
        entry = {"route": "/update_weights_from_distributed", **body}
        outside = self.state.outside_session(request.path)
        if outside is not None:
            self.record({**entry, "refused": "outside a session"})
            return outside
        name = body.get("group_name", "weight_update_group")
        if name not in self.state.groups:
            self.record({**entry, "refused": "unknown group"})
            return failure(
                f"Failed to receive weights: Group {name} not in {list(self.state.groups)}. "
                "Please call `init_weights_update_group` first."
            )
        if body.get("load_format") != "flattened_bucket":
            return failure(f"this fake receives flattened buckets only: {body.get('load_format')}")
        try:
            tensors = await asyncio.to_thread(
                receive_bucket,
                self.state.groups[name],
                body["names"],
                body["dtypes"],
                body["shapes"],
            )
        except Exception as exc:
            self.record({**entry, "refused": str(exc)})
            return failure(f"Failed to receive weights: {exc}")
        problem = self.model.load((n, (t.dtype, tuple(t.shape))) for n, t in tensors)
        if problem is not None:  # received first: the trainer's broadcast has to complete
            self.record({**entry, "refused": problem})
            return failure(
                f"Failed to update parameter online: {problem}. The full weights of the "
                "ModelRunner are partially updated. Please discard the whole weights."
            )
        ignored = [n for n, _ in tensors if n not in self.weights]  # sglang skips these
        for tensor_name, tensor in tensors:
            have = self.weights.get(tensor_name)
            if have is not None and have.shape != tensor.shape:
                self.record({**entry, "refused": tensor_name})
                return failure(
                    f"Failed to update parameter online: Attempted to load weight "
                    f"({tensor.shape}) into parameter ({have.shape})."
                )
        for tensor_name, tensor in tensors:
            if tensor_name in self.weights:
                self.weights[tensor_name] = tensor.clone()
        self.record({**entry, "ignored": ignored})
        message = "Succeeded to update parameter online."
        return self.state.loaded(message, body.get("weight_version"))

    @web.middleware
    async def memory_guard(self, request: web.Request, handler) -> web.Response:
        """Refuse generation and weight loads into released memory, where sglang 0.5.23 would
        read or write freed GPU memory (its scheduler process fails)."""
        refused = self.state.guard(request.path)
        if refused is not None:
            self.record({"route": request.path, "refused": sorted(self.state.released)})
            return refused
        return await handler(request)

    async def memory_occupation(self, request: web.Request) -> web.Response:
        """/release_memory_occupation and /resume_memory_occupation, answered 200 with a JSON
        null as sglang 0.5.23 does, refusing what its scheduler cannot survive."""
        body, invalid = await self.body(request)
        if invalid is not None:
            return invalid
        tags = body.get("tags") or list(MEMORY_TAGS)
        self.record({"route": request.path, "tags": tags})
        return self.state.memory(request.path, tags)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--record", type=Path, required=True)
    # sglang 0.5.23 arg_groups/fields/serving.py: reported until the first versioned update
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--disable-radix-cache", action="store_true")
    args, _ = parser.parse_known_args(argv)
    problem = checkpoint_problem(args.model_path)
    if problem is not None:  # sglang exits before it serves when it cannot load the model
        sys.exit(f"cannot load the model: {problem}")
    try:
        model = ServedModel.launch(
            args.model_path,
            tp_size=args.tp_size,
            dtype=args.dtype,
            quantization=args.quantization,
            tensors=load_weights(args.model_path),
        )
    except ValueError as exc:  # sglang fails to start: the error is the log's last line
        sys.exit(f"ValueError: {exc}")
    server = Server(args.model_path, args.record, args.weight_version, model)
    server.disable_radix_cache = args.disable_radix_cache
    app = web.Application(middlewares=[server.memory_guard])
    app.router.add_post("/release_memory_occupation", server.memory_occupation)
    app.router.add_post("/resume_memory_occupation", server.memory_occupation)
    app.router.add_get("/health", server.health)
    for route in ("server_info", "get_server_info"):  # the second deprecated, same answer
        app.router.add_get(f"/{route}", server.server_info)
    for route in ("model_info", "get_model_info"):
        app.router.add_get(f"/{route}", server.model_info)
    app.router.add_post("/generate", server.generate)
    for route in (
        "update_weights_from_disk",
        "update_weights_from_tensor",
        "begin_weight_update",
        "end_weight_update",
        "init_weights_update_group",
        "destroy_weights_update_group",
        "update_weights_from_distributed",
    ):
        app.router.add_post(f"/{route}", getattr(server, route))
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main(sys.argv[1:])
