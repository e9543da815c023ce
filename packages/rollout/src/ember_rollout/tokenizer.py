"""The toy task's tokenizer, built in code and saved in HF tokenizers format; tokenizer loading."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TOY_EOS = "<eos>"
"""End of sequence; also the padding token."""
TOY_UNK = "?"
"""Unknown words; an ordinary (non-special) token, so it shows in decoded text."""
TOY_WORDS = ("copy", "reverse", "sort", ":", "=")
"""Task words and punctuation of the toy prompts."""
TOY_VOCAB: tuple[str, ...] = (TOY_EOS, TOY_UNK, *(str(d) for d in range(10)), *TOY_WORDS)
"""Every toy token; a token's id is its index here."""


def build_toy_tokenizer(extra_words: Sequence[str] = ()) -> Any:
    """A word-level tokenizer over `TOY_VOCAB`: words and punctuation split, digits one per token.

    Decoding joins tokens without spaces, so a response of digit tokens reads as a digit string.
    Only the EOS token is special (it is skipped by `decode(..., skip_special_tokens=True)`).

    Args:
        extra_words: Words (or punctuation marks) appended to `TOY_VOCAB`, for a task of its own
            (the calc_tool example plugin adds `calc` and `+`); the toy tokens keep their ids.

    Raises:
        ValueError: An extra word is empty, holds whitespace or a digit, or is a toy token already.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    for word in extra_words:
        if not word or any(c.isspace() or c.isdigit() for c in word) or word in TOY_VOCAB:
            raise ValueError(
                f"extra word {word!r}: expected a new word without whitespace or digits"
            )
    if len(set(extra_words)) != len(extra_words):
        raise ValueError(f"extra words {list(extra_words)}: a word appears twice")
    vocab = {token: i for i, token in enumerate((*TOY_VOCAB, *extra_words))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=TOY_UNK))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=TOY_EOS, pad_token=TOY_EOS, model_max_length=1 << 20
    )


def save_toy_tokenizer(path: str | Path, extra_words: Sequence[str] = ()) -> Path:
    """Write the toy tokenizer (tokenizer.json + tokenizer_config.json) to `path`, with
    `extra_words` appended to its vocabulary (see `build_toy_tokenizer`)."""
    path = Path(path)
    build_toy_tokenizer(extra_words).save_pretrained(path)
    return path


def load_tokenizer(path: str | Path | None) -> Any:
    """Load an HF tokenizer from a local directory; None gives the toy tokenizer.

    The toy tokenizer is saved and reloaded through `AutoTokenizer` like any other, so both go
    through the same loading path.
    """
    from transformers import AutoTokenizer

    if path is None:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="ember-toy-tokenizer-") as tmp:
            return AutoTokenizer.from_pretrained(save_toy_tokenizer(tmp), local_files_only=True)
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"tokenizer_path={str(path)!r}: not a directory")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def toy_tokenizer() -> Any:
    """The toy tokenizer as loaded through `AutoTokenizer` (a fresh object per call)."""
    return load_tokenizer(None)


SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""The token ids a model's config.json and generation_config.json carry for its tokenizer."""


def special_token_ids(tokenizer: Any) -> dict[str, int | None]:
    """The tokenizer's BOS, EOS and padding ids (None where it has no such token)."""
    return {key: getattr(tokenizer, key, None) for key in SPECIAL_TOKEN_KEYS}


def ordinary_stop_ids(eos_token_ids: Sequence[int], tokenizer: Any) -> dict[int, str | None]:
    """The ids among a model's EOS ids that the tokenizer has as ordinary text, with their
    tokens (None: outside the vocabulary).

    A real model's EOS ids are special tokens of its tokenizer. One that is not usually comes
    from a config class's default written into config.json (transformers' DeepSeek-V3 config
    defaults EOS to 1, Mixtral's to 2), and an engine then ends responses at that text token.
    """
    special = set(tokenizer.all_special_ids)
    special |= {i for i, added in tokenizer.added_tokens_decoder.items() if added.special}
    return {
        i: tokenizer.convert_ids_to_tokens(i) if 0 <= i < len(tokenizer) else None
        for i in eos_token_ids
        if i not in special
    }


def save_tokenizer_for_model(tokenizer_path: str | Path | None, model_dir: str | Path) -> None:
    """Save a tokenizer next to an exported model, with the token ids the model needs to stop.

    The model's config.json gets the tokenizer's BOS, EOS and padding ids where it has none,
    and the directory gets a generation_config.json: a copy of the tokenizer directory's own
    when there is one (a real model's sampling defaults and every EOS id), else one with those
    ids. transformers then loads the directory as it is, and `generate()` and servers reading
    it stop at EOS. The tokenizer files are written last: their presence marks the export
    complete.

    Args:
        tokenizer_path: The tokenizer directory (`data.tokenizer_path`); None: the toy one.
        model_dir: A directory holding the model's config.json.
    """
    from transformers import GenerationConfig

    model_dir = Path(model_dir)
    tokenizer = load_tokenizer(tokenizer_path)
    ids = special_token_ids(tokenizer)
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    for key, value in ids.items():
        if config.get(key) is None and value is not None:
            config[key] = value
    _write_atomically(config_file, json.dumps(config, indent=2, sort_keys=True) + "\n")
    source = Path(tokenizer_path) / "generation_config.json" if tokenizer_path else None
    if source is not None and source.is_file():
        shutil.copyfile(source, model_dir / "generation_config.json")
    else:
        GenerationConfig(**{k: config.get(k) for k in SPECIAL_TOKEN_KEYS}).save_pretrained(
            model_dir
        )
    tokenizer.save_pretrained(model_dir)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
