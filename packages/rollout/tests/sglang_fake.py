"""A fake SGLang server for the sglang engine's tests: sglang 0.5.23's wire formats and rules.

The rules live here once and serve both fakes: `FakeSGLang` (aiohttp servers in the test's own
process) and `packages/ember/tests/fake_sglang_server.py` (a subprocess that stands in for
`python -m sglang.launch_server`), which imports them.

What the real server checks, the fakes check, in its answer format:
- request bodies as FastAPI validates sglang's request structs (managers/io_struct.py): a missing
  or mistyped field is HTTP 400 with an OpenAI-style ErrorResponse (entrypoints/http_server.py
  `validation_exception_handler` turns FastAPI's 422 into 400). Unknown fields are ignored, as
  sglang's schema does (`extra_behavior="ignore"`, utils/msgspec_utils.py); `FakeSGLang`
  collects them in `ignored_fields`, so a test can insist that every field sent means
  something. Types are checked as JSON types, stricter than pydantic's lax mode (which would
  take "3" for 3): Ember sends JSON-native values, and a coercion would hide a mistake.
- /generate's JSON contract (entrypoints/api_contract.py): `sampling_params` with an unknown key
  or a mistyped value is 400 `{"error": "<message>"}`; values SamplingParams.verify refuses are
  400 `{"error": {"message": ...}}`.
- tensor and distributed updates only inside a begin/end_weight_update session, begin while one
  is open and end while none is are refused (managers/scheduler_components/weight_updater.py);
  one serialization per TP rank, each rank opening only its own (managers/tp_worker.py); tensor
  pickles limited to the globals of sglang's `SafeUnpickler` (utils/common.py).
- memory released and resumed by tag, where the real scheduler process dies instead of answering
  (a busy release, a tag released twice, a resume of memory not released, generation or weight
  loads into released memory): the fakes refuse those in sglang's error format.
- /pause_generation and /continue_generation (tokenizer_manager.py, scheduler.py): a /generate
  that arrives while paused waits; an update asking for a cache flush while paused requests
  run fails after loading (scheduler_components/weight_updater.py); GET /server_info reports
  `disable_radix_cache`.
- `meta_info.weight_version`: the launch version ("default", or `--weight-version`) until an
  update that names a version succeeds; `meta_info.weight_versions` with it, one span
  {"version", "start": 0, "end": completion_tokens} for a request that no update overlapped,
  else one span per version it ran under (srt/utils/weight_versions.py; the fake shares the
  tokens out equally).
- a model launched from a quantized checkpoint (`FakeSGLang(model=ServedModel.launch(...))`,
  `sglang_fake_model.py`): its config.json and tensors at launch, and every tensor update,
  distributed update and session held to sglang's loader rules for the scheme; GET /server_info
  reports `quantization` (--quantization, null unless given) and GET /model_info the
  checkpoint's `model_path`, as sglang 0.5.23's do.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import math
import pickle
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web
from sglang_fake_model import ServedModel

from ember_rollout.config import SGLangEngineConfig
from ember_rollout.engine import GenerateRequest, ModelInfo, SamplingParams
from ember_rollout.routing import encode_routed_experts
from ember_rollout.sglang_engine import SGLangEngine

INFO = ModelInfo(
    num_layers=2, topk=2, num_experts=4, moe_layers=(0, 1), vocab_size=50, context_len=64
)

# -- request structs (sglang 0.5.23 managers/io_struct.py): field -> allowed JSON types --------

NONE = type(None)
SELECTORS = ("target", "draft", "all")
BASE_FIELDS = {"rid": (str, NONE), "http_worker_ipc": (str, NONE)}
DISK_FIELDS = {
    **BASE_FIELDS,
    "model_path": (str,),
    "load_format": (str, NONE),
    "abort_all_requests": (bool,),
    "weight_version": (str, NONE),
    "is_async": (bool,),
    "torch_empty_cache": (bool,),
    "keep_pause": (bool,),
    "recapture_cuda_graph": (bool,),
    "token_step": (int,),
    "flush_cache": (bool,),
    "manifest": (dict, NONE),
}
TENSOR_FIELDS = {
    **BASE_FIELDS,
    "serialized_named_tensors": (list,),
    "load_format": (str, NONE),
    "flush_cache": (bool,),
    "abort_all_requests": (bool,),
    "weight_version": (str, NONE),
    "selector": SELECTORS,
    "torch_empty_cache": (bool,),
}
BEGIN_FIELDS = {**BASE_FIELDS, "selector": SELECTORS}
END_FIELDS = dict(BASE_FIELDS)
MEMORY_FIELDS = {**BASE_FIELDS, "tags": (list, NONE)}
INIT_GROUP_FIELDS = {
    **BASE_FIELDS,
    "master_address": (str,),
    "master_port": (int,),
    "rank_offset": (int,),
    "world_size": (int,),
    "group_name": (str,),
    "backend": (str,),
}
DESTROY_GROUP_FIELDS = {**BASE_FIELDS, "group_name": (str,)}
PAUSE_FIELDS = {**BASE_FIELDS, "mode": ("abort", "retract", "in_place")}
CONTINUE_FIELDS = {**BASE_FIELDS, "torch_empty_cache": (bool,)}
DISTRIBUTED_FIELDS = {
    **BASE_FIELDS,
    "names": (list,),
    "dtypes": (list,),
    "shapes": (list,),
    "group_name": (str,),
    "flush_cache": (bool,),
    "abort_all_requests": (bool,),
    "weight_version": (str, NONE),
    "load_format": (str, NONE),
    "selector": SELECTORS,
    "torch_empty_cache": (bool,),
}
MEMORY_PATHS = ("/release_memory_occupation", "/resume_memory_occupation")
SESSION_PATHS = ("/update_weights_from_disk", "/update_weights_from_tensor")
GROUP_PATHS = (
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/update_weights_from_distributed",
)
REQUESTS = {
    "/update_weights_from_disk": DISK_FIELDS,
    "/update_weights_from_tensor": TENSOR_FIELDS,
    "/begin_weight_update": BEGIN_FIELDS,
    "/end_weight_update": END_FIELDS,
    "/init_weights_update_group": INIT_GROUP_FIELDS,
    "/destroy_weights_update_group": DESTROY_GROUP_FIELDS,
    "/update_weights_from_distributed": DISTRIBUTED_FIELDS,
    **dict.fromkeys(MEMORY_PATHS, MEMORY_FIELDS),
    "/pause_generation": PAUSE_FIELDS,
    "/continue_generation": CONTINUE_FIELDS,
}
REQUIRED = {
    "/update_weights_from_disk": {"model_path"},
    "/update_weights_from_tensor": {"serialized_named_tensors"},
    "/init_weights_update_group": {"master_address", "master_port", "rank_offset", "world_size"},
    "/update_weights_from_distributed": {"names", "dtypes", "shapes"},
}
HEALTH_PATHS = ("/health", "/health_generate")
"""sglang 0.5.23's health routes: each a one-token generate (http_server.py)."""
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
"""sglang 0.5.23 constants.py GPU_MEMORY_ALL_TYPES: what `tags` null or [] stands for."""
TENSOR_LOAD_FORMATS = (None, "direct", "flattened_bucket")
"""load_format values of a tensor update a server without custom loaders knows; another one
raises NotImplementedError in its scheduler (model_runner_components/weight_updater.py)."""

GENERATE_FIELDS = frozenset(
    "rid session_id text input_ids input_embeds image_data video_data audio_data mm_hashes "
    "mm_content_hashes use_audio_in_video video_config sampling_params watermark return_logprob "
    "logprob_start_len top_logprobs_num token_ids_logprob return_sampling_mask "
    "sampling_logprobs_mode return_text_in_logprobs return_flat_raw_top_logprobs "
    "return_flat_raw_output_top_logprobs return_flat_raw_top_logprobs_b64 stream log_metrics "
    "return_hidden_states return_routed_experts routed_experts_start_len return_indexer_topk "
    "modalities session_params lora_path lora_id custom_logit_processor "
    "positional_embed_overrides bootstrap_host bootstrap_port bootstrap_room bootstrap_pair_key "
    "decode_tp_size routed_dp_rank data_parallel_rank disagg_prefill_dp_rank routing_key "
    "conversation_id http_worker_ipc background require_reasoning max_thinking_tokens priority "
    "extra_key no_logs custom_labels return_bytes return_entropy return_prompt_token_ids "
    "external_trace_header received_time need_wait_for_mm_inputs num_items_assigned "
    "encoder_urls max_dynamic_patch min_dynamic_patch image_max_dynamic_patch "
    "video_max_dynamic_patch images_config mm_processor_kwargs multi_item_delimiter_indices "
    "token_indices_to_pool cache_salt kv_hints".split()
)
"""The fields of sglang 0.5.23's GenerateReqInput; the server ignores any other key."""

_INT, _FLOAT, _BOOL, _STR = "i64", "f64", "a boolean", "a string"
SAMPLING_FIELDS = {
    "max_new_tokens": _INT,
    **dict.fromkeys(("stop",), "strings"),
    "stop_token_ids": "ints",
    "stop_regex": "strings",
    **dict.fromkeys(("temperature", "top_p"), _FLOAT),
    "top_k": _INT,
    "min_p": _FLOAT,
    **dict.fromkeys(("frequency_penalty", "presence_penalty", "repetition_penalty"), _FLOAT),
    **dict.fromkeys(("min_new_tokens", "n"), _INT),
    **dict.fromkeys(("json_schema", "regex", "ebnf", "structural_tag"), _STR),
    **dict.fromkeys(("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"), _BOOL),
    "no_stop_trim": _BOOL,
    "stream_interval": _INT,
    "logit_bias": "map",
    "sampling_seed": _INT,
    "custom_params": "any",
    "beam_width": _INT,
    "watermark": "map",
    "choice": "strings",
}
"""sglang 0.5.23's /generate contract (api/v1/api_types.py SamplingParams): the only keys it
takes in `sampling_params`, each with its JSON type, in its order (its refusal of an unknown
key lists them so); an unknown key is refused."""

# -- answers -------------------------------------------------------------------------------------

ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NOT_OPEN = "no weight-update session is open; call begin_weight_update() first"
OUTSIDE = (
    "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
)
OUTSIDE_DISTRIBUTED = OUTSIDE.replace(
    "update_weights_from_tensor", "update_weights_from_distributed"
)
GROUP_EXISTS = (
    "Failed to initialize custom process group: The specified group name has already been "
    "created, please use a different group name."
)
NO_GROUP = "The group to be destroyed does not exist."
NOT_IDLE = "release_memory_occupation should be called only when server is idle."
NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache."
)


def validation_error(errors: list[dict]) -> web.Response:
    """A body FastAPI could not fit into the request struct, as sglang 0.5.23 answers it
    (http_server.py `validation_exception_handler`): HTTP 400 with an ErrorResponse."""
    message = f"{len(errors)} validation error(s): {errors}"
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None}
    return web.json_response({**body, "code": 400}, status=400)


def error_answer(message: str, status: int = 400) -> web.Response:
    """sglang 0.5.23 http_server.py `_create_error_response`: {"error": {"message": ...}}."""
    return web.json_response({"error": {"message": message}}, status=status)


def failure(message: str, status: int = 400, **extra) -> web.Response:
    """SGLang's answer to a refused or failed weight operation."""
    return web.json_response({"success": False, "message": message, **extra}, status=status)


def success(message: str, **extra) -> web.Response:
    """SGLang's answer to a weight operation that succeeded."""
    return web.json_response({"success": True, "message": message, **extra})


async def read_body(request: web.Request) -> tuple[Any, web.Response | None]:
    """The request's JSON, or the answer to a body that is not JSON."""
    try:
        return await request.json(), None
    except ValueError:
        return None, validation_error([{"type": "json_invalid", "loc": ["body"]}])


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fits(value, allowed: tuple) -> bool:
    if not all(isinstance(a, type) for a in allowed):  # a Literal
        return value in allowed
    if isinstance(value, bool):
        return bool in allowed
    return isinstance(value, allowed)


LIST_ELEMENTS = ("names", "dtypes", "shapes", "tags", "serialized_named_tensors")
"""List fields whose elements are typed: List[str] names, dtypes and tags, List[List[int]]
shapes, and base64 strings for serialized_named_tensors (msgspec_utils.py `Base64Bytes`)."""


def _element_ok(key: str, item) -> bool:
    if key == "shapes":
        return isinstance(item, list) and all(_is_int(d) for d in item)
    if key == "serialized_named_tensors":
        if not isinstance(item, str):
            return False
        try:
            base64.b64decode(item, validate=True)
        except binascii.Error:
            return False
        return True
    return isinstance(item, str)


def check_request(path: str, body) -> tuple[web.Response | None, list[str]]:
    """The answer to a body that does not fit `path`'s request struct (else None), and the
    fields of `body` the struct does not have (sglang ignores them)."""
    if not isinstance(body, dict):
        return validation_error([{"type": "dict_type", "loc": ["body"]}]), []
    fields = REQUESTS[path]
    errors = [
        {"type": "missing", "loc": ["body", key], "msg": "Field required"}
        for key in sorted(REQUIRED.get(path, set()) - set(body))
    ]
    ignored = []
    for key, value in body.items():
        allowed = fields.get(key)
        if allowed is None:
            ignored.append(key)
        elif not _fits(value, allowed):
            errors.append({"type": "type_error", "loc": ["body", key], "input": value})
        elif key in LIST_ELEMENTS and isinstance(value, list):
            errors += [
                {"type": "value_error", "loc": ["body", key, i], "input": repr(item)[:40]}
                for i, item in enumerate(value)
                if not _element_ok(key, item)
            ]
    return (validation_error(errors) if errors else None), ignored


def _contract_type_error(key: str, value, kind: str) -> str | None:
    if value is None or kind == "any":
        return None
    ok = {
        _INT: _is_int(value),
        _FLOAT: isinstance(value, int | float) and not isinstance(value, bool),
        _BOOL: isinstance(value, bool),
        _STR: isinstance(value, str),
        "map": isinstance(value, dict),
        "ints": isinstance(value, list) and all(_is_int(v) for v in value),
        "strings": isinstance(value, str)
        or (isinstance(value, list) and all(isinstance(v, str) for v in value)),
    }[kind]
    return None if ok else f"invalid type: {value!r} for `{key}`, expected {kind}"


def _sampling_problem(params: dict) -> str | None:
    """What sglang 0.5.23 SamplingParams.verify refuses (sampling/sampling_params.py), for the
    values Ember sends; None and -1 mean the defaults."""
    get = params.get
    temperature, top_p, top_k = get("temperature"), get("top_p"), get("top_k")
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        return f"temperature must be a non-negative finite number, got {temperature}."
    if top_p is not None and not 0.0 < top_p <= 1.0:
        return f"top_p must be in (0, 1], got {top_p}."
    if top_k is not None and top_k != -1 and top_k < 1:
        return f"top_k must be -1 (disable) or at least 1, got {top_k}."
    if get("max_new_tokens") is not None and get("max_new_tokens") < 0:
        return f"max_new_tokens must be at least 0, got {get('max_new_tokens')}."
    return None


def check_generate(body) -> tuple[web.Response | None, list[str]]:
    """The answer to a /generate body sglang 0.5.23 refuses (else None), and its top-level keys
    that are not GenerateReqInput fields (ignored by sglang)."""
    if not isinstance(body, dict):
        return validation_error([{"type": "dataclass_type", "loc": ["body"]}]), []
    errors = []
    ids = body.get("input_ids")
    if ids is not None and not (
        isinstance(ids, list)
        and all(_is_int(t) or (isinstance(t, list) and all(map(_is_int, t))) for t in ids)
    ):
        errors.append({"type": "list_type", "loc": ["body", "input_ids"]})
    for key in ("return_logprob", "return_routed_experts", "stream"):
        if key in body and not isinstance(body[key], bool | NONE):
            errors.append({"type": "bool_type", "loc": ["body", key], "input": body[key]})
    params = body.get("sampling_params")
    if params is not None and not isinstance(params, dict):
        errors.append({"type": "dict_type", "loc": ["body", "sampling_params"]})
    if errors:
        return validation_error(errors), []
    for key, value in (params or {}).items():  # api_contract.py: the contract gate
        if key not in SAMPLING_FIELDS:
            expected = ", ".join(f"`{k}`" for k in SAMPLING_FIELDS)
            message = f"unknown field `{key}`, expected one of {expected}"
        else:
            message = _contract_type_error(key, value, SAMPLING_FIELDS[key])
        if message is not None:
            return web.json_response({"error": message}, status=400), []
    if body.get("text") is None and ids is None and body.get("input_embeds") is None:
        return error_answer("Either text, input_ids or input_embeds should be provided."), []
    problem = _sampling_problem(params or {})
    if problem is not None:
        return error_answer(problem), []
    return None, [key for key in body if key not in GENERATE_FIELDS]


# -- tensors ------------------------------------------------------------------------------------

SAFE_GLOBALS = {
    ("builtins", name) for name in ("bool", "bytes", "dict", "float", "int", "list", "str", "tuple")
} | {
    ("copyreg", "__newobj__"),
    ("multiprocessing.resource_sharer", "DupFd"),
    ("torch", "Size"),
    ("torch", "Tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.nn.parameter", "Parameter"),
    ("types", "SimpleNamespace"),
    ("torch.storage", "TypedStorage"),
    ("torch.storage", "UntypedStorage"),
    *(
        ("torch.multiprocessing.reductions", name)
        for name in (
            "rebuild_tensor",
            "rebuild_cuda_tensor",
            "rebuild_typed_storage",
            "rebuild_storage_fd",
            "rebuild_storage_filename",
            "rebuild_storage_empty",
        )
    ),
}
"""The globals of sglang's SafeUnpickler that tensors and their containers need (a subset: it
also takes sglang's own FlattenedTensorMetadata, which a sender without sglang cannot make)."""


class SafeUnpickler(pickle.Unpickler):
    """Refuses every global outside `SAFE_GLOBALS` (and the torch dtypes), as SGLang does."""

    def find_class(self, module, name):
        if (module, name) in SAFE_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def bucket_layout(names, dtypes, shapes) -> list[tuple[str, torch.dtype, list[int], int, int]]:
    """(name, dtype, shape, start byte, end byte) per tensor, after sglang 0.5.23
    FlattenedTensorBucket.empty's checks: one dtype and shape per name, torch dtype names, no
    negative dimension, each tensor at an offset its item size divides, not empty."""
    offset, layout = 0, []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        dtype = getattr(torch, dtype)
        if not isinstance(dtype, torch.dtype):
            raise AttributeError(f"module 'torch' has no dtype {dtype!r}")
        if any(d < 0 for d in shape):
            raise ValueError(f"Negative dimension in received tensor {name}: {shape}")
        if offset % dtype.itemsize:
            raise ValueError(
                f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}"
            )
        size = torch.Size(shape).numel() * dtype.itemsize
        layout.append((name, dtype, list(shape), offset, offset + size))
        offset += size
    if not layout:
        raise ValueError("Cannot create empty tensor bucket")
    return layout


def unflatten_payload(payload) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a flattened-bucket tensor update, as sglang 0.5.23's
    `_update_weights_from_flattened_bucket` cuts them: metadata read by attribute."""
    flat = payload["flattened_tensor"]
    tensors = []
    for meta in payload["metadata"]:
        part = flat[meta.start_idx : meta.end_idx]
        if part.numel() != meta.numel:
            raise RuntimeError(f"{meta.name}: {part.numel()} bytes, metadata says {meta.numel}")
        tensors.append((meta.name, part.view(meta.dtype).reshape(meta.shape)))
    return tensors


# -- one server's state --------------------------------------------------------------------------


@dataclass
class ServerState:
    """What one sglang 0.5.23 server remembers between requests, with its rules."""

    weight_version: str = "default"
    """What meta_info.weight_version reports: --weight-version, then each update's version."""
    session: bool = False
    """A begin_weight_update session is open."""
    released: set[str] = field(default_factory=set)
    """Memory tags released and not resumed."""
    groups: dict[str, Any] = field(default_factory=dict)
    """Weight groups joined, by name."""
    paused: str | None = None
    """The mode of /pause_generation until /continue_generation."""
    unpaused: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while not paused: a /generate that arrives during a pause waits for it (sglang's
    tokenizer manager waits on `is_pause_cond`)."""
    running: list[list[str]] = field(default_factory=list)
    """Per /generate being served, the weight versions it has run under, oldest first."""
    radix_cache: bool = True
    """What GET /server_info reports as `not disable_radix_cache`."""

    def __post_init__(self) -> None:
        self.unpaused.set()

    def pause(self, mode: str) -> web.Response:
        """sglang 0.5.23: the tokenizer manager aborts every request in mode "abort" (the fake
        does not model that) and hands the others to the scheduler, which keeps requests where
        they are ("in_place") or retracts them to its waiting queue."""
        self.paused = mode
        self.unpaused.clear()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    def resume(self) -> web.Response:
        self.paused = None
        self.unpaused.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    def flush_refused(self, body: dict) -> web.Response | None:
        """An update that asks for a cache flush while requests are paused in the running batch
        fails after loading (weight_updater.py `flush_cache_after_weight_update`); outside a
        pause the tokenizer manager holds the update until the requests have finished, which the
        fake's tests never need to wait for."""
        if body.get("flush_cache", True) and self.paused and self.running:
            return failure(NOT_FLUSHED)
        return None

    def begin(self) -> web.Response:
        if self.session:
            return failure(ALREADY_OPEN)
        self.session = True
        return success("Success")

    def end(self) -> web.Response:
        if not self.session:
            return failure(NOT_OPEN)
        self.session = False
        return success("Success")

    def outside_session(self, path: str) -> web.Response | None:
        if self.session:
            return None
        return failure(OUTSIDE.replace("update_weights_from_tensor", path.lstrip("/")))

    def loaded(self, message: str, weight_version: str | None, **extra) -> web.Response:
        """A successful update's answer; the tokenizer manager records its version."""
        if weight_version is not None:
            self.weight_version = weight_version
            message += f" Weight version updated to {weight_version}."
            for versions in self.running:  # utils/weight_versions.py: a new span for each
                if versions[-1] != weight_version:
                    versions.append(weight_version)
        return success(message, **extra)

    def guard(self, path: str) -> web.Response | None:
        """Refuse generation and weight loads into released memory (the real scheduler reads
        or writes unmapped GPU memory and dies). GET /health is a generation too: sglang
        0.5.23 answers it with a one-token generate of input [0] (http_server.py
        `health_generate`, SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION true by default)."""
        if path in ("/generate", *HEALTH_PATHS) and self.released:
            return error_answer(
                f"{path.lstrip('/')} while {sorted(self.released)} memory is released; call "
                "/resume_memory_occupation first"
            )
        if path.startswith("/update_weights") and "weights" in self.released:
            return error_answer(
                f"{path} while the weights' memory is released; resume "
                '{"tags": ["weights"]} first'
            )
        return None

    def memory(self, path: str, tags: list[str] | None, *, busy: bool = False) -> web.Response:
        """Release or resume `tags` (None or []: all). sglang 0.5.23 asserts the server is
        idle, and torch_memory_saver exits on pausing paused or resuming active memory (as
        `offload_tags.remove` fails on a tag not released): refused here instead."""
        tags = list(tags or MEMORY_TAGS)
        if path == "/release_memory_occupation":
            if busy:
                return error_answer(NOT_IDLE)
            again = sorted(set(tags) & self.released)
            if again:
                return error_answer(f"memory already released: {again}")
            self.released.update(tags)
        else:
            missing = sorted(set(tags) - self.released)
            if missing:
                return error_answer(f"memory not released: {missing}")
            self.released.difference_update(tags)
        return web.json_response(None)


def version_spans(versions: list[str], n: int) -> list[dict]:
    """sglang's `meta_info.weight_versions` of a response of `n` tokens generated under
    `versions` in turn: here each takes an equal share of the tokens (the first gets the rest)."""
    share = n // len(versions)
    starts = [0] + [n - share * (len(versions) - i) for i in range(1, len(versions))]
    ends = [*starts[1:], n]
    spans = zip(versions, starts, ends, strict=True)
    return [{"version": v, "start": a, "end": b} for v, a, b in spans]


def sglang_answer(
    body, *, finish="length", experts_rows=None, weight_version="default", versions=None
):
    """What SGLang's /generate returns for `body`: tokens 10, 11, ... with log-probs -0.5, ...;
    `versions` are the weight versions it ran under (default: `weight_version` alone)."""
    n = body["sampling_params"]["max_new_tokens"]
    tokens = [10 + i for i in range(n)]
    versions = versions or [weight_version]
    weight_version = versions[-1]
    meta = {
        "id": "5f1c",
        "finish_reason": {"type": "length", "length": n}
        if finish == "length"
        else {"type": "stop", "matched": tokens[-1]},
        "prompt_tokens": len(body["input_ids"]),
        "weight_version": weight_version,
        # sglang reports the spans by weight version of every finished request; with no
        # update while it ran, one span over the whole response.
        "weight_versions": version_spans(versions, n),
        "completion_tokens": n,
        "cached_tokens": 0,
        "e2e_latency": 0.01,
    }
    if body.get("return_logprob"):  # sglang sends no log-probs unless asked
        meta["output_token_logprobs"] = [[-0.5 - 0.1 * i, t, None] for i, t in enumerate(tokens)]
    if body.get("return_routed_experts"):
        rows = len(body["input_ids"]) + n - 1 if experts_rows is None else experts_rows
        experts = torch.arange(rows * 4, dtype=torch.int32).reshape(rows, 2, 2) % 4
        meta["routed_experts"] = encode_routed_experts(experts)
    return {
        "text": "".join(chr(97 + t % 26) for t in tokens),
        "output_ids": tokens,
        "meta_info": meta,
    }


class FakeSGLang:
    """aiohttp servers on 127.0.0.1 with scripted answers; records every request.

    One instance can serve several servers (`running()` once per server); each keeps its own
    `ServerState`. `respond(body, hit)` answers a valid /generate (by default `sglang_answer`
    with the server's weight version); `hold(fake)` is awaited inside every /generate before its
    answer; `in_flight` and `peak` count the /generate requests being served at once.
    """

    def __init__(
        self,
        respond=None,
        *,
        healthy: bool = True,
        hold: Callable[[FakeSGLang], Awaitable[None]] | None = None,
        tp_size: int = 1,
        fail_tensor_updates_on: tuple[int, ...] = (),
        model_shapes: dict[str, tuple[int, ...]] | None = None,
        weight_version: str = "default",
        radix_cache: bool = True,
        fail_pause_on: tuple[int, ...] = (),
        health_s: float = 0.0,
        model: ServedModel | None = None,
    ):
        self.bodies: list[dict] = []
        self.radix_cache = radix_cache
        self.fail_pause_on = fail_pause_on
        """Servers whose /pause_generation fails (a server in trouble answers 500)."""
        """Whether the servers keep their radix cache (launched without --disable-radix-cache)."""
        self.respond = respond
        self.healthy = healthy
        self.health_s = health_s
        """How long GET /health takes: sglang 0.5.23 answers once the scheduler returns its
        one-token generate, polled each second for up to SGLANG_HEALTH_CHECK_TIMEOUT (20 s)."""
        self.hold = hold
        self.in_flight = 0
        self.peak = 0
        self.tp_size = tp_size
        self.fail_tensor_updates_on = fail_tensor_updates_on
        self.weight_version = weight_version
        """The servers' --weight-version."""
        self.ports: list[int] = []
        self.states: list[ServerState] = []
        self.weight_calls: list[tuple[int, str, dict]] = []
        """(server index, path, body) of every weight request that passed validation."""
        self.ignored_fields: set[str] = set()
        self.calls: list[tuple[int, str]] = []
        """(server index, path) of every request, in arrival order."""
        self.model_shapes = model_shapes
        """The served model's parameters by checkpoint name, when a test gives them."""
        self.aborted: list[str | None] = []
        """Request ids of every /abort_request, in arrival order."""
        self.ignored_names: set[str] = set()
        """Weight names sglang's loaders skip without a word (no such parameter)."""
        self.model = model
        """The checkpoint the servers launched from (`ServedModel.launch`), when a test gives
        one: a quantized one holds every update to sglang's loader rules."""

    @property
    def open_sessions(self) -> set[int]:
        return {i for i, state in enumerate(self.states) if state.session}

    @property
    def released(self) -> dict[int, set[str]]:
        """Per server, the memory tags released and not resumed."""
        return {i: state.released for i, state in enumerate(self.states)}

    def _server(self, request) -> tuple[int, ServerState]:
        server = self.ports.index(request.url.port)
        return server, self.states[server]

    def _ignore(self, path: str, keys) -> None:
        self.ignored_fields.update(f"{path}:{key}" for key in keys)

    async def _generate(self, request):
        server, state = self._server(request)
        body, invalid = await read_body(request)
        self.bodies.append(body)
        hit = len(self.bodies)
        if invalid is None:
            invalid, ignored = check_generate(body)
            self._ignore("/generate", ignored)
        if invalid is not None:
            return invalid
        await state.unpaused.wait()
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        versions = [state.weight_version]
        state.running.append(versions)
        try:
            if self.hold is not None:
                await self.hold(self)
            if self.respond is None:
                return web.json_response(sglang_answer(body, versions=versions))
            return self.respond(body, hit)
        finally:
            self.in_flight -= 1
            state.running.remove(versions)

    async def _abort(self, request):
        """sglang 0.5.23 http_server.py `abort_request`: 200 with an empty body, known id or
        not (an unknown one is dropped silently)."""
        body, invalid = await read_body(request)
        if invalid is not None:
            return invalid
        self.aborted.append(body.get("rid") if isinstance(body, dict) else None)
        return web.Response(status=200)

    async def _health(self, request):
        await asyncio.sleep(self.health_s)
        return web.Response(status=200 if self.healthy else 503)

    async def _pause(self, request):
        server, state, body, invalid = await self._checked(request)
        if invalid is not None:
            return invalid
        if server in self.fail_pause_on:
            return web.Response(status=500, text="Internal Server Error")
        return state.pause(body.get("mode", "abort"))

    async def _continue(self, request):
        _, state, _, invalid = await self._checked(request)
        return invalid or state.resume()

    async def _server_info(self, request):
        """GET /server_info: the launch arguments, resolved (the radix cache's, and with a
        model its --quantization, null unless given: sglang 0.5.23 reads the scheme from the
        checkpoint then)."""
        _, state = self._server(request)
        info = {"disable_radix_cache": not state.radix_cache, "tp_size": 1, "quantization": None}
        if self.model is not None:
            info.update(self.model.server_info())
        return web.json_response(info)

    async def _model_info(self, request):
        """GET /model_info: the checkpoint served and the weight version (with a model)."""
        _, state = self._server(request)
        if self.model is None:
            return web.json_response({"model_path": None, "weight_version": state.weight_version})
        return web.json_response(self.model.model_info(state.weight_version))

    async def _checked(
        self, request, *, record: bool = True
    ) -> tuple[int, ServerState, dict | None, web.Response | None]:
        """Server, state and body of a control request, and the answer refusing its body (or
        None); `record` adds a valid one to `weight_calls`."""
        server, state = self._server(request)
        body, invalid = await read_body(request)
        if invalid is None:
            invalid, ignored = check_request(request.path, body)
            self._ignore(request.path, ignored)
        if invalid is None and record:
            self.weight_calls.append((server, request.path, body))
        return server, state, body, invalid

    async def _weights(self, request):
        path = request.path
        server, state, body, invalid = await self._checked(request)
        if invalid is not None:
            return invalid
        if path == "/begin_weight_update":
            answer = state.begin()
            if answer.status == 200 and self.model is not None:
                self.model.begin()
            return answer
        if path == "/end_weight_update":
            answer = state.end()
            problem = self.model.end() if answer.status == 200 and self.model else None
            return answer if problem is None else failure(f"end_weight_update: {problem}")
        refused = state.flush_refused(body) if path.startswith("/update_weights") else None
        if refused is not None:
            return refused
        if path == "/update_weights_from_disk":
            if body["model_path"] == "/missing":
                return failure(
                    "Failed to get weights iterator: no such checkpoint.", num_paused_requests=0
                )
            return state.loaded(
                "Succeeded to update model weights.",
                body.get("weight_version"),
                num_paused_requests=0,
            )
        return state.outside_session(path) or self._tensor_update(server, state, body)

    # -- weight groups (weights broadcast by the trainer) -----------------------------------------
    #
    # sglang 0.5.23: /init_weights_update_group joins a torch process group whose rank 0 is the
    # trainer (TP rank r as rank_offset + r) and fails a name it has already; /update_weights_
    # from_distributed runs only inside a begin/end session, asserts that the group exists,
    # allocates the bucket from names, dtypes and shapes (FlattenedTensorBucket.empty: strict
    # zip, torch dtype names, aligned offsets), receives it, and loads the tensors: a shape
    # that does not fit fails the call, a name the model lacks is skipped. No sender runs here,
    # so the fake checks everything but receives nothing.

    async def _groups(self, request):
        path = request.path
        server, state, body, invalid = await self._checked(request)
        if invalid is not None:
            return invalid
        groups = state.groups
        name = body.get("group_name", "weight_update_group")
        if path == "/init_weights_update_group":
            if name in groups:
                return failure(GROUP_EXISTS)
            offset, world = body["rank_offset"], body["world_size"]
            if not 0 < offset or offset + self.tp_size > world:
                return failure(
                    f"Failed to initialize custom process group: ranks {offset}.."
                    f"{offset + self.tp_size - 1} of a world of {world}."
                )
            groups[name] = body
            return success("Succeeded to initialize custom process group.")
        if path == "/destroy_weights_update_group":
            if groups.pop(name, None) is None:
                return failure(NO_GROUP)
            return success("Succeeded to destroy custom process group.")
        outside = state.outside_session(path) or state.flush_refused(body)
        if outside is not None:
            return outside
        if name not in groups:
            return failure(
                f"Failed to receive weights: Group {name} not in {list(groups)}. Please call "
                "`init_weights_update_group` first."
            )
        try:
            layout = bucket_layout(body["names"], body["dtypes"], body["shapes"])
        except (ValueError, AttributeError) as exc:
            return failure(f"Failed to receive weights: {exc}")
        problem = (
            None
            if self.model is None
            else self.model.load(
                (name, (dtype, tuple(shape))) for name, dtype, shape, _, _ in layout
            )
        )
        if problem is not None:
            return failure(
                f"Failed to update parameter online: {problem}. The full weights of the "
                "ModelRunner are partially updated. Please discard the whole weights."
            )
        for tensor_name, _, shape, _, _ in layout:
            want = (self.model_shapes or {}).get(tensor_name)
            if self.model_shapes is not None and want is None:
                self.ignored_names.add(tensor_name)
            elif want is not None and tuple(want) != tuple(shape):
                return failure(
                    f"Failed to update parameter online: Attempted to load weight "
                    f"({torch.Size(shape)}) into parameter ({torch.Size(want)}). The full "
                    "weights of the ModelRunner are partially updated. Please discard the "
                    "whole weights."
                )
        return state.loaded("Succeeded to update parameter online.", body.get("weight_version"))

    def _tensor_update(self, server: int, state: ServerState, body: dict) -> web.Response:
        entries = body["serialized_named_tensors"]
        load_format = body.get("load_format")
        if len(entries) < self.tp_size:  # the real scheduler's IndexError
            return failure(
                f"list index out of range: {len(entries)} payloads, tp_size {self.tp_size}"
            )
        if load_format not in TENSOR_LOAD_FORMATS:
            return failure(f"Unknown load_format={load_format}")
        decoded = []
        for entry in entries[: self.tp_size]:  # TP rank r opens entry r only
            try:
                raw = base64.b64decode(entry, validate=True)
                decoded.append(SafeUnpickler(io.BytesIO(raw)).load())
            except (EOFError, TypeError, RuntimeError, pickle.UnpicklingError) as exc:
                return failure(f"{type(exc).__name__}: {exc}")
        body["decoded"] = decoded
        if load_format == "flattened_bucket":
            try:
                body["tensors"] = [unflatten_payload(payload) for payload in decoded]
            except (AttributeError, KeyError, TypeError, RuntimeError) as exc:
                return failure(f"{type(exc).__name__}: {exc}")
        if server in self.fail_tensor_updates_on:
            return failure("Failed to update weights: unknown parameter 'bogus.weight'")
        if self.model is not None:
            named = body["tensors"][0] if load_format == "flattened_bucket" else decoded[0]
            problem = self.model.load((n, (t.dtype, tuple(t.shape))) for n, t in named)
            if problem is not None:
                return failure(f"Failed to update weights: {problem}")
        return state.loaded("Success", body.get("weight_version"))

    # -- memory occupation (colocated hand-off) ---------------------------------------------------

    @web.middleware
    async def _memory_guard(self, request, handler):
        """Records every request; refuses generation and weight loads into released memory."""
        server, state = self._server(request)
        self.calls.append((server, request.path))
        return state.guard(request.path) or await handler(request)

    async def _memory(self, request):
        _, state, body, invalid = await self._checked(request, record=False)
        if invalid is not None:
            return invalid
        for tag in body.get("tags") or ():
            if tag not in MEMORY_TAGS:  # sglang records the tag and frees nothing for it
                self.ignored_fields.add(f"{request.path}:tags={tag}")
        return state.memory(request.path, body.get("tags"), busy=self.in_flight > 0)

    @contextlib.asynccontextmanager
    async def running(self):
        app = web.Application(middlewares=[self._memory_guard])
        for path in MEMORY_PATHS:
            app.router.add_post(path, self._memory)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_get("/health", self._health)
        for route in ("/server_info", "/get_server_info"):  # the second deprecated, same answer
            app.router.add_get(route, self._server_info)
        for route in ("/model_info", "/get_model_info"):
            app.router.add_get(route, self._model_info)
        app.router.add_post("/pause_generation", self._pause)
        app.router.add_post("/continue_generation", self._continue)
        for path in (*SESSION_PATHS, "/begin_weight_update", "/end_weight_update"):
            app.router.add_post(path, self._weights)
        for path in GROUP_PATHS:
            app.router.add_post(path, self._groups)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.states.append(
            ServerState(weight_version=self.weight_version, radix_cache=self.radix_cache)
        )
        self.ports.append(port)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            await runner.cleanup()


def engine_for(urls, *, partial_rollouts=False, **kw):
    config = SGLangEngineConfig(
        urls=list(urls),
        launch_timeout_s=kw.pop("launch_timeout_s", 5.0),
        health_poll_s=0.05,
        max_retries=kw.pop("max_retries", 2),
        retry_backoff_s=0.01,
        retry_backoff_max_s=0.02,
        request_timeout_s=kw.pop("request_timeout_s", 5.0),
        **kw,
    )
    engine = SGLangEngine(config, model_info=INFO)
    engine.partial_rollouts = partial_rollouts
    return engine


def request(i=0, n=3, routed=False):
    return GenerateRequest(
        input_ids=[1, 2, 3],
        sampling=SamplingParams(max_new_tokens=n, temperature=0.7, top_p=0.9, top_k=20),
        fields={"return_routed_experts": True} if routed else {},
        name=f"sample {i} (group 0)",
    )


def run(fake, body, *, n_servers=1, **kw):
    """Start `n_servers` servers of `fake`, attach an engine, and run `body(engine)`."""

    async def main():
        async with contextlib.AsyncExitStack() as stack:
            urls = [await stack.enter_async_context(fake.running()) for _ in range(n_servers)]
            engine = engine_for(urls, **kw)
            try:
                await engine.start()
                return await body(engine)
            finally:
                await engine.shutdown()

    return asyncio.run(main())


@contextlib.contextmanager
def serving(fake: FakeSGLang) -> Iterator[str]:
    """One server of `fake` on an event loop of its own thread; yields its URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-sglang", daemon=True)
    thread.start()
    stack = contextlib.AsyncExitStack()
    try:
        enter = stack.enter_async_context(fake.running())
        yield asyncio.run_coroutine_threadsafe(enter, loop).result(timeout=30)
    finally:
        asyncio.run_coroutine_threadsafe(stack.aclose(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
