"""A CPU stand-in for `python -m sglang.launch_server`: the HTTP routes the driver uses, in
SGLang 0.5.23's wire format, refusing what that server refuses. Every request is appended as
one JSON line to the file named by `--record`.

Run it as `python fake_sglang_server.py --model-path DIR --port N --record FILE`; leading
arguments it does not know (`-m sglang.launch_server`, `--tp-size`, ...) are ignored, so a
one-line shell wrapper can stand in for the `python` that `engine.sglang.python` names.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from aiohttp import web

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


def weight_sums(path: str) -> dict[str, float]:
    """Per tensor of the checkpoint at `path`, the sum of its values (what the test compares)."""
    from safetensors.torch import load_file

    sums: dict[str, float] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            sums[name] = float(tensor.double().sum())
    return sums


class Server:
    def __init__(self, model_path: str, record: Path) -> None:
        self.record_path = record
        self.weight_version = "default"  # sglang's version before any update
        self.record({"route": "launch", "model_path": model_path, **self.load(model_path)})

    def record(self, entry: dict) -> None:
        with self.record_path.open("a") as handle:
            handle.write(json.dumps(entry) + "\n")

    @staticmethod
    def load(path: str) -> dict:
        return {"sums": weight_sums(path)}

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        n = body["sampling_params"]["max_new_tokens"]
        tokens = [TOKENS[i % len(TOKENS)] for i in range(n)]
        self.record({"route": "/generate", "weight_version": self.weight_version})
        meta = {
            "id": "0",
            "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": len(body["input_ids"]),
            "weight_version": self.weight_version,
            "output_token_logprobs": [[-1.0, t, None] for t in tokens],
            "completion_tokens": n,
            "cached_tokens": 0,
        }
        return web.json_response({"text": "", "output_ids": tokens, "meta_info": meta})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        # sglang 0.5.23 http_server.py: {"success", "message", "num_paused_requests"}, HTTP 400
        # on failure; the loader reads config.json and the safetensors of `model_path`.
        body = await request.json()
        problem = checkpoint_problem(body["model_path"])
        if problem is not None:
            message = f"Failed to get weights iterator: {problem}."
            return web.json_response(
                {"success": False, "message": message, "num_paused_requests": 0}, status=400
            )
        entry = {"route": "/update_weights_from_disk", **body, **self.load(body["model_path"])}
        self.record(entry)
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return web.json_response(
            {
                "success": True,
                "message": "Succeeded to update model weights.",
                "num_paused_requests": 0,
            }
        )

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        # The driver sends weights to SGLang servers through disk: a tensor update here is a
        # mistake (CPU tensors cannot reach another process through tensor handles).
        self.record({"route": "/update_weights_from_tensor"})
        return web.json_response(
            {"success": False, "message": "tensor updates are not accepted by this server"},
            status=400,
        )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--record", type=Path, required=True)
    args, _ = parser.parse_known_args(argv)
    problem = checkpoint_problem(args.model_path)
    if problem is not None:  # sglang exits before it serves when it cannot load the model
        sys.exit(f"cannot load the model: {problem}")
    server = Server(args.model_path, args.record)
    app = web.Application()
    app.router.add_get("/health", server.health)
    app.router.add_post("/generate", server.generate)
    app.router.add_post("/update_weights_from_disk", server.update_weights_from_disk)
    app.router.add_post("/update_weights_from_tensor", server.update_weights_from_tensor)
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main(sys.argv[1:])
