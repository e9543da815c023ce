"""Prompt data: toy task and tokenizer, JSONL reading, chat templates, length policy, epochs."""

from __future__ import annotations

import json

import pytest

from ember_rollout.config import DataConfig, ToyTaskConfig
from ember_rollout.data import PromptDataset, PromptEncoder, PromptRecord, load_prompts, read_jsonl
from ember_rollout.tokenizer import TOY_VOCAB, load_tokenizer, save_toy_tokenizer, toy_tokenizer
from ember_rollout.toy_task import make_toy_prompts, toy_prompt


def test_toy_prompts_are_seeded_and_labelled():
    config = ToyTaskConfig(task="reverse", num_prompts=50, min_digits=2, max_digits=5, seed=3)
    records = make_toy_prompts(config)
    assert records == make_toy_prompts(config)
    assert records != make_toy_prompts(ToyTaskConfig(task="reverse", num_prompts=50, seed=4))
    for record in records:
        task, digits, eq = record["prompt"].split()
        assert (task, eq) == ("reverse", "=") and 2 <= len(digits) <= 5
        assert record["label"] == digits[::-1]
    assert toy_prompt("sort", "3141") == {"prompt": "sort 3141 =", "label": "1134"}
    assert toy_prompt("copy", "07")["label"] == "07"
    with pytest.raises(ValueError, match="toy task 'add'"):
        toy_prompt("add", "12")


def test_shift_prompts_ask_for_each_digit_plus_the_shift_mod_10():
    from ember_rollout.config import ToyTaskConfig
    from ember_rollout.tokenizer import TOY_UNK, toy_tokenizer

    assert toy_prompt("shift", "3149", 2) == {"prompt": "3149 : 2 =", "label": "5361"}
    for bad in (None, 0, 10):
        with pytest.raises(ValueError, match="shift: shift="):
            toy_prompt("shift", "31", bad)
    with pytest.raises(ValueError, match="shift task only"):
        toy_prompt("copy", "31", 2)
    records = make_toy_prompts(ToyTaskConfig(task="shift", num_prompts=300, min_digits=2,
                                             max_digits=4, seed=5))  # fmt: skip
    tokenizer = toy_tokenizer()
    shifts = set()
    for record in records:
        digits, colon, shift, eq = record["prompt"].split()
        shifts.add(int(shift))
        assert (colon, eq) == (":", "=") and 2 <= len(digits) <= 4
        assert record["label"] == "".join(str((int(d) + int(shift)) % 10) for d in digits)
        ids = tokenizer(record["prompt"])["input_ids"]
        assert tokenizer.convert_tokens_to_ids(TOY_UNK) not in ids
        assert len(ids) == len(digits) + 3
    assert shifts == set(range(1, 10))
    # The first prompt's digits come from the same stream as a word task's.
    first = make_toy_prompts(ToyTaskConfig(task="shift", num_prompts=1, seed=5))[0]
    copy = make_toy_prompts(ToyTaskConfig(task="copy", num_prompts=1, seed=5))[0]
    assert first["prompt"].split()[0] == copy["label"]


def test_toy_tokenizer_round_trips_through_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = save_toy_tokenizer(tmp_path / "tok")
    assert (path / "tokenizer.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert len(tokenizer) == len(TOY_VOCAB) == 17
    ids = tokenizer("copy 314 =")["input_ids"]
    assert [TOY_VOCAB[i] for i in ids] == ["copy", "3", "1", "4", "="]
    eos = tokenizer.eos_token_id
    assert TOY_VOCAB[eos] == "<eos>" and tokenizer.pad_token_id == eos
    response = tokenizer("413")["input_ids"] + [eos]
    assert tokenizer.decode(response, skip_special_tokens=True) == "413"
    # Unknown words become the visible "?" token, never a hidden special token.
    assert tokenizer.decode(tokenizer("copy banana")["input_ids"]) == "copy?"
    assert load_tokenizer(path).get_vocab() == toy_tokenizer().get_vocab()


def test_toy_tokenizer_takes_extra_words_after_its_own(tmp_path):
    path = save_toy_tokenizer(tmp_path / "tok", extra_words=("calc", "+"))
    tokenizer = load_tokenizer(path)
    assert len(tokenizer) == 19
    assert all(tokenizer.convert_tokens_to_ids(t) == i for i, t in enumerate(TOY_VOCAB))
    ids = tokenizer("3 + 4 calc")["input_ids"]
    assert ids == [5, 18, 6, 17] and tokenizer.decode(ids) == "3+4calc"
    for bad in (("copy",), ("two words",), ("x1",), ("",), ("calc", "calc")):
        with pytest.raises(ValueError, match="extra word"):
            save_toy_tokenizer(tmp_path / "bad", extra_words=bad)


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_with_configurable_keys(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"question": "what is 2+2?", "answer": "4", "meta": {"id": 1}},
            "",
            {"question": [{"role": "user", "content": "hi"}], "answer": 5, "meta": {}},
        ],
    )
    records = read_jsonl(path, input_key="question", label_key="answer", metadata_key="meta")
    assert [r.prompt for r in records] == ["what is 2+2?", [{"role": "user", "content": "hi"}]]
    assert [r.label for r in records] == ["4", 5] and records[0].metadata == {"id": 1}
    assert records[1].source == f"{path}:3"
    config = DataConfig(prompt_data=str(path), input_key="question", label_key="answer")
    assert [r.label for r in load_prompts(config)] == ["4", 5]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "a", "label": 1', r":2: malformed JSON \(Expecting ',' delimiter"),
        ('["a"]', ":2: expected a JSON object, got list"),
        ('{"label": 1}', ":2: no 'prompt' key"),
        ('{"prompt": "a"}', ":2: no 'label' key"),
        ('{"prompt": [{"role": "user"}], "label": 1}', ":2: 'prompt' must be a string"),
    ],
)
def test_bad_jsonl_lines_name_file_and_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "label": 0}, line])
    with pytest.raises(ValueError, match=str(path).replace(".", r"\.") + message):
        read_jsonl(path)


def test_missing_or_empty_files_are_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        read_jsonl(tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match="no prompts in the file"):
        read_jsonl(write_jsonl(tmp_path / "empty.jsonl", [""]))


TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} = {% endfor %}"
    "{% if add_generation_prompt %}sort :{% endif %}"
)


def test_chat_template_applied_when_present():
    tokenizer = toy_tokenizer()
    tokenizer.chat_template = TEMPLATE
    encoder = PromptEncoder(tokenizer)
    record = PromptRecord(prompt="copy 12", source="x")
    assert encoder.text(record) == "user : copy 12 = sort :"
    ids = encoder.encode(record)
    assert ids == tokenizer("user : copy 12 = sort :", add_special_tokens=False)["input_ids"]
    messages = PromptRecord(prompt=[{"role": "system", "content": "sort"}], source="x")
    assert encoder.text(messages) == "system : sort = sort :"
    plain = PromptEncoder(tokenizer, apply_chat_template=False)
    assert plain.text(record) == "copy 12"


def test_messages_without_a_template_name_the_prompt():
    encoder = PromptEncoder(toy_tokenizer())
    with pytest.raises(ValueError, match="data.jsonl:4: the prompt is a list of chat messages"):
        messages = [{"role": "user", "content": "1"}]
        encoder.encode(PromptRecord(prompt=messages, source="data.jsonl:4"))


def test_overlong_prompts_error_truncate_or_drop_and_are_counted():
    record = PromptRecord(prompt="copy 123456 =", source="toy:9")  # 8 tokens
    with pytest.raises(
        ValueError, match=r"toy:9: the prompt has 8 tokens, more than max_prompt_len"
    ):
        PromptEncoder(toy_tokenizer(), max_prompt_len=5).encode(record)
    truncate = PromptEncoder(toy_tokenizer(), max_prompt_len=5, overlong_prompt="truncate")
    assert [TOY_VOCAB[i] for i in truncate.encode(record)] == ["3", "4", "5", "6", "="]
    assert truncate.truncated == 1
    drop = PromptEncoder(toy_tokenizer(), max_prompt_len=5, overlong_prompt="drop")
    assert drop.encode(record) is None and drop.dropped == 1
    assert drop.encode(PromptRecord(prompt="copy 1 =")) is not None and drop.dropped == 1


def test_dataset_epochs_are_reshuffled_deterministically_and_resumable():
    records = [PromptRecord(prompt=str(i)) for i in range(5)]
    data = PromptDataset(records, seed=1)
    first = [r.prompt for r in data.next(7)]
    assert sorted(first[:5]) == ["0", "1", "2", "3", "4"] and data.epoch == 1
    state = data.state_dict()
    rest = [r.prompt for r in data.next(6)]
    again = PromptDataset(records, seed=1)
    again.load_state_dict(state)
    assert [r.prompt for r in again.next(6)] == rest
    assert [r.prompt for r in PromptDataset(records, seed=1).next(7)] == first
    in_order = PromptDataset(records, shuffle=False)
    assert [r.prompt for r in in_order.next(6)] == ["0", "1", "2", "3", "4", "0"]
