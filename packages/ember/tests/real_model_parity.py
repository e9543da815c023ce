"""Megatron against transformers on a real checkpoint, in a process of its own (megatron-core's
parallel state is global): HF -> Megatron -> HF bit for bit, and fp32 log-probs of chat prompts.

    python real_model_parity.py MODEL_DIR OUT_DIR

prints one JSON line: the tensors compared, how many differ, and the per-token maximum
|Megatron - transformers| log-prob over the samples, at temperature 0.7.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ember_core.heads import PolicyHead
from ember_core.types import Sample, pack_samples
from ember_megatron_backend.hf_layout import model_config_from_hf
from ember_megatron_backend.model import build_model, packed_causal_mask
from ember_megatron_backend.parallel import init_distributed
from ember_megatron_backend.weights import export_hf_checkpoint, load_hf_checkpoint

CHATS = [
    ("What is 7 + 5? Put the final answer in \\boxed{}.", "7 + 5 = 12, so \\boxed{12}."),
    ("What is 36 - 20?", "36 - 20 = 16. The answer is \\boxed{16}."),
    ("Name a prime number.", "Seven is a prime number."),
]
TEMPERATURE = 0.7


def weight_files(path: Path) -> dict[str, Path]:
    names = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def main(model_dir: Path, out_dir: Path) -> None:
    torch.set_num_threads(2)
    init_distributed()
    cfg = model_config_from_hf(AutoConfig.from_pretrained(model_dir))
    model = build_model(cfg, seed=1).eval()
    load_hf_checkpoint(model, model_dir, cfg)
    exported = export_hf_checkpoint(model, cfg, out_dir)
    mine, theirs = weight_files(exported), weight_files(model_dir)
    differ = []
    for name in theirs:
        with safe_open(str(theirs[name]), framework="pt") as a:
            with safe_open(str(mine[name]), framework="pt") as b:
                if not torch.equal(a.get_tensor(name), b.get_tensor(name)):
                    differ.append(name)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = []
    for i, (question, answer) in enumerate(CHATS):
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
        samples.append(
            Sample(tokens=prompt_ids + answer_ids, response_length=len(answer_ids), index=i)
        )
    batch = pack_samples(samples, pad_multiple=8)
    mask = packed_causal_mask(batch.cu_seqlens, batch.padded_length)
    with torch.no_grad():
        logits = model(batch.tokens[None], batch.position_ids[None], attention_mask=mask)
    head = PolicyHead(TEMPERATURE).log_probs(
        logits[:, : batch.num_tokens],
        batch.tokens[: batch.num_tokens],
        batch.total_lengths,
        batch.response_lengths,
    )
    del model, logits
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst, tokens = 0.0, 0
    for sample, got in zip(samples, head.log_probs, strict=True):
        ids = torch.tensor([sample.tokens])
        with torch.no_grad():
            rows = hf(ids).logits[0].double() / TEMPERATURE
        start = len(sample.tokens) - sample.response_length
        want = rows[start - 1 : -1].log_softmax(-1).gather(1, ids[0, start:, None])[:, 0]
        worst = max(worst, (got.double() - want).abs().max().item())
        tokens += sample.response_length
    print(
        json.dumps(
            {"tensors": len(theirs), "differ": differ, "max_abs_diff": worst, "tokens": tokens}
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
