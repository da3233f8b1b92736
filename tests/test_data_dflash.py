"""CPU tests for data_dflash.py. Tokenizers are built here or from the pip-shipped GGUF: no network."""
import copy
import json
import errno
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

import data_dflash as D
from errors import UserError
from helpers import REPO, _masked_runs, masked_id_runs, run_cmd, tokenize_conversation


# a Qwen2.5-like ChatML template: default system prompt, no {% generation %} markers
QWEN_TEMPLATE = (
    "{%- if messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if not (loop.first and m.role == 'system') -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Qwen3-like: only the *last* assistant turn gets an empty think block, so earlier renders
# change once a later turn is added
THINK_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m.role + '\\n' -}}"
    "{%- if m.role == 'assistant' and loop.last -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- m.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

CONV = [
    {"role": "user", "content": "What is 2+2? Answer briefly."},
    {"role": "assistant", "content": "It is 4, the sum of two and two."},
    {"role": "user", "content": "And in words, with an emoji?"},
    {"role": "assistant", "content": "Four 🎉 — quatre, 日本語 too."},
]
CONV_SYS = [{"role": "system", "content": "You answer in one line."}] + CONV


def _tiny_tokenizer(template):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [m["content"] for m in CONV_SYS] + ["the user and the assistant say hello world"] * 20
    tk.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def qwen_tok():
    return _tiny_tokenizer(QWEN_TEMPLATE)


@pytest.fixture(scope="session")
def smollm(embedded_default):
    cache, target_dir, data_jsonl = embedded_default       # conftest.py: prepared once, in a temporary folder
    from transformers import AutoTokenizer
    return {"cache": cache, "target_dir": target_dir, "data_jsonl": data_jsonl,
            "tok": AutoTokenizer.from_pretrained(target_dir)}


def _write_jsonl(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line, ensure_ascii=False)) + "\n")
    return str(path)


def _arrow_files(cache_dir):
    """{cache file: mtime_ns} of the tokenised data `datasets` keeps under cache_dir."""
    return {str(p): p.stat().st_mtime_ns for p in Path(cache_dir).rglob("*.arrow")}


def _build(tok, files, cache_dir, **kw):
    """build_dataset(tok, files, cache_dir=cache_dir, **kw) and whether it tokenised: True when it wrote a cache file
    (a new one: no earlier one is touched), False when it wrote none and read the cache it found."""
    before = _arrow_files(cache_dir)
    data = D.build_dataset(tok, files, cache_dir=cache_dir, **{"log": lambda m: None, **kw})
    after = _arrow_files(cache_dir)
    written = {f for f, t in after.items() if before.get(f) != t}
    assert before.keys() <= after.keys() and not written & before.keys(), (before, after)
    return data, bool(written)


def _sharegpt(conv):
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"id": "x", "conversations": [{"from": names[m["role"]], "value": m["content"]} for m in conv]}


# -----------------------------------------------------------------------------
# the embedded default (SmolLM2 GGUF + ShareGPT)


def _stamps(*paths):
    """(inode, mtime_ns) of each path and, for a folder, of each file in it: a file renamed into place changes them."""
    files = [os.path.join(r, n) for p in paths if os.path.isdir(p) for r, _, names in os.walk(p) for n in names]
    return {f: (os.stat(f).st_ino, os.stat(f).st_mtime_ns) for f in [*paths, *files]}


def test_prepare_embedded_default(smollm):
    from transformers import AutoModelForCausalLM
    tok = smollm["tok"]
    assert tok.eos_token == "<|im_end|>"  # the GGUF converter says <|im_start|>; we fix it
    assert tok.pad_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert "<|im_start|>" in tok.chat_template
    model = AutoModelForCausalLM.from_pretrained(smollm["target_dir"])
    assert model.config.num_hidden_layers == 30 and not hasattr(model.config, "quantization_config")
    with open(smollm["data_jsonl"], encoding="utf-8") as f:
        n = sum(1 for _ in f)
    assert 17000 < n < 18500  # every complete record of the cut-off ShareGPT V3 file
    # second call reuses both: the same paths, and neither the model folder nor the JSONL is written again
    before = _stamps(smollm["target_dir"], smollm["data_jsonl"])
    assert D.prepare_embedded_default(smollm["cache"]) == (smollm["target_dir"], smollm["data_jsonl"])
    assert _stamps(smollm["target_dir"], smollm["data_jsonl"]) == before


def test_processes_preparing_the_embedded_default_at_once_build_it_once(smollm, tmp_path):
    """torchrun ranks of a node call prepare_embedded_default at once: one builds (here the ShareGPT
    JSONL; the model folder is linked in, prepared), the others wait for it and reuse its file."""
    cache = tmp_path / "cache"
    cache.mkdir()
    os.symlink(smollm["target_dir"], cache / "SmolLM2-135M-Instruct")
    here = str(REPO)
    # each process records what prepare_embedded_default returned and the JSONL files it wrote (_write_jsonl's calls)
    code = ("import json, sys, data_dflash as D\n"
            "wrote, write = [], D._write_jsonl\n"
            "D._write_jsonl = lambda path, records: wrote.append(path) or write(path, records)\n"
            f"result = D.prepare_embedded_default({str(cache)!r})\n"
            "with open(sys.argv[1], 'w') as f:\n"
            "    json.dump({'result': list(result), 'wrote': wrote}, f)\n")
    with ThreadPoolExecutor(3) as pool:
        procs = list(pool.map(lambda i: run_cmd([sys.executable, "-c", code, tmp_path / f"result_{i}.json"],
                                                timeout=300, cwd=here), range(3)))
    assert [p.rc for p in procs] == [0, 0, 0], [p.tail() for p in procs]
    results = [json.loads((tmp_path / f"result_{i}.json").read_text()) for i in range(3)]
    want = [str(cache / "SmolLM2-135M-Instruct"), str(cache / "sharegpt_v3.jsonl")]
    assert [r["result"] for r in results] == [want] * 3, results
    assert sorted(w for r in results for w in r["wrote"]) == [str(cache / "sharegpt_v3.jsonl")], results  # one wrote
    assert (cache / "sharegpt_v3.jsonl").read_text() == open(smollm["data_jsonl"], encoding="utf-8").read()


@pytest.mark.parametrize("conv", [CONV, CONV_SYS])
def test_mask_smollm2_template(smollm, conv):
    tok = smollm["tok"]
    ids, mask = tokenize_conversation(tok, conv, 512)
    assert ids == tok(tok.apply_chat_template(conv, tokenize=False), add_special_tokens=False)["input_ids"]
    want = [m["content"] + "<|im_end|>" for m in conv if m["role"] == "assistant"]
    assert _masked_runs(tok, ids, mask) == want


def test_a_reply_is_learnt_as_the_ids_the_target_wrote_and_ids_that_are_not_its_text_are_counted(smollm, tmp_path):
    """A reply with the "ids" generate_data.py writes is learnt as those tokens (here "hel" "lo" " wor" "ld", which the
    tokenizer would write as "hello" " world"), its end of turn the template's; ids that do not decode to the reply's
    text (another tokenizer, an edited file) or lie outside the vocabulary leave its text tokens, counted; the
    truncation to max_length comes after."""
    tok = smollm["tok"]
    own = tok.convert_tokens_to_ids(["hel", "lo", "Ġwor", "ld"])
    conv = [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": "hello world", "ids": own},
            {"role": "user", "content": "Again."}, {"role": "assistant", "content": "hello world", "ids": own}]
    text_ids, text_mask = tokenize_conversation(tok, [{k: m[k] for k in ("role", "content")} for m in conv], 512)
    ids, mask, truncated, unused = D._encode(tok, [conv], 512)[0]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert masked_id_runs(ids, mask) == [own + [end]] * 2 and unused == 0 and not truncated
    assert len(ids) == len(text_ids) + 4 and sum(mask) == sum(text_mask) + 4      # 2 tokens became 4, twice
    for bad in (tok("good bye", add_special_tokens=False)["input_ids"], own[:3] + [len(tok)]):
        conv[3]["ids"] = bad
        ids, mask, truncated, unused = D._encode(tok, [conv], 512)[0]
        assert masked_id_runs(ids, mask) == [own + [end], tok("hello world")["input_ids"] + [end]]
        assert unused == 1
    ids, mask, truncated, unused = D._encode(tok, [conv], len(text_ids))[0]
    assert len(ids) == len(mask) == len(text_ids) and truncated
    lines = []     # the trainer's log says how many replies it could not learn as written
    data = D.build_dataset(tok, [_write_jsonl(tmp_path / "d.jsonl", [{"messages": conv}])], 512, 4,
                           str(tmp_path / "cache"), min_supervised=1, log=lines.append)
    assert data["stats"]["written_ids_unused"] == 1
    assert sum("1 repl(ies) carry target-written ids that do not decode to their text" in x for x in lines) == 1, lines


# -----------------------------------------------------------------------------
# chat-template masks


@pytest.mark.parametrize("conv", [CONV, CONV_SYS])
def test_mask_qwen_style_template(qwen_tok, conv):
    ids, mask = tokenize_conversation(qwen_tok, conv, 512)
    text = qwen_tok.apply_chat_template(conv, tokenize=False)
    assert text.startswith("<|im_start|>system\n")  # the default system prompt when none is given
    assert qwen_tok.decode(ids, skip_special_tokens=False) == text
    want = [m["content"] + "<|im_end|>" for m in conv if m["role"] == "assistant"]
    assert _masked_runs(qwen_tok, ids, mask) == want


def test_mask_truncated(qwen_tok):
    ids_full, mask_full = tokenize_conversation(qwen_tok, CONV, 10_000)
    first_reply = mask_full.index(1) + 5
    ids, mask = tokenize_conversation(qwen_tok, CONV, first_reply)
    assert len(ids) == len(mask) == first_reply
    assert ids == ids_full[:first_reply] and mask == mask_full[:first_reply]


def test_template_that_marks_only_the_last_reply_masks_every_reply():
    """Qwen3-like: an empty think block only in the last reply, so an earlier reply's own render is
    not a prefix of the whole conversation's. Each reply is then found in the whole render: masked are
    exactly its content + <|im_end|> (the last one with its think block, which the target generates)."""
    tok = _tiny_tokenizer(THINK_TEMPLATE)
    ids, mask = tokenize_conversation(tok, CONV, 512)
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(CONV, tokenize=False)
    assert _masked_runs(tok, ids, mask) == [CONV[1]["content"] + "<|im_end|>",
                                            "<think>\n\n</think>\n\n" + CONV[3]["content"] + "<|im_end|>"]
    conv = [dict(m) for m in CONV]
    conv[1]["content"] += "\n"                 # a reply ending in whitespace keeps its end-of-turn token
    ids, mask = tokenize_conversation(tok, conv, 512)
    assert _masked_runs(tok, ids, mask)[0] == CONV[1]["content"] + "\n<|im_end|>"


@pytest.mark.parametrize("template", [QWEN_TEMPLATE, THINK_TEMPLATE], ids=["prefix-consistent", "think-in-last"])
def test_an_unfinished_reply_is_trained_on_without_the_end_of_turn_the_template_closes_it_with(template, tmp_path):
    """generate_data.py --unfinished cut marks a reply cut at --max-new-tokens: read back from chat JSONL the mark
    stays, the ids are the unmarked conversation's, and the loss covers that reply's content but not the <|im_end|>
    after it, while a finished reply keeps its own (both ways of placing replies)."""
    tok = _tiny_tokenizer(template)
    conv = [dict(m) for m in CONV]
    conv[3]["unfinished"] = True
    other = [dict(m, unfinished="yes") if m["role"] == "assistant" else m for m in CONV]   # only JSON true marks
    convs, _ = D.load_conversations([_write_jsonl(tmp_path / "d.jsonl", [{"messages": conv}, {"messages": other}])])
    assert convs == [conv, CONV]
    convs = convs[:1]
    ids, mask = tokenize_conversation(tok, convs[0], 512)
    assert ids == tokenize_conversation(tok, CONV, 512)[0]
    think = "<think>\n\n</think>\n\n" if template == THINK_TEMPLATE else ""
    assert _masked_runs(tok, ids, mask) == [CONV[1]["content"] + "<|im_end|>", think + CONV[3]["content"]]


# a template that rewrites earlier turns (a turn count in the header): no reply can be placed
COUNTING_TEMPLATE = "{{- messages|length }} turns\n" + QWEN_TEMPLATE


def test_prompt_ids_of_each_turn_are_the_chat_templates_ids_with_its_generation_prompt(smollm):
    """generate_data.py asks for a conversation's prompts turn after turn: each is the tokenized render of the
    turns so far + the generation prompt, on the embedded default's first 100 conversations (SmolLM2's
    tokenizer); a prompt over max_tokens, or one that does not end with a user turn, is refused with why."""
    tok = smollm["tok"]
    for conv in D.load_conversations([smollm["data_jsonl"]])[0][:100]:
        turns = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
        got = D.prompt_ids(tok, [conv[:i] for i in turns], 10 ** 6)
        assert got == [(list(tok.apply_chat_template(conv[:i], add_generation_prompt=True)["input_ids"]), None)
                       for i in turns]
    n = len(got[0][0])
    assert D.prompt_ids(tok, [conv[:turns[0]], conv[:turns[0] + 1]], n - 1) == [
        (None, "prompt longer than max length"), (None, "assistant turn without a user turn before it")]


def test_inconsistent_template_is_a_clear_error_or_a_counted_skip(tmp_path):
    tok = _tiny_tokenizer(COUNTING_TEMPLATE)
    with pytest.raises(D.ChatTemplateError, match="not prefix-consistent.*4 turns"):
        tokenize_conversation(tok, CONV, 512)
    path = _write_jsonl(tmp_path / "d.jsonl", [_sharegpt(CONV)] * 3)
    logs = []
    data = D.build_dataset(tok, [path], 128, 4, str(tmp_path / "cache"), log=logs.append)
    assert data["stats"]["samples"] == 0 and data["stats"]["skipped"] == {"chat template not prefix-consistent": 3}
    # the first failure's reason, in full, once: only the log says it (the stats keep the counts, not the reasons)
    assert sum("not prefix-consistent: the render of" in line for line in logs) == 1, logs


# -----------------------------------------------------------------------------
# reading conversations


def test_truncated_json_array_recovers_complete_records(tmp_path):
    records = [_sharegpt(CONV), _sharegpt(CONV_SYS), {"id": "3", "conversations": [], "x": [1, {"y": "]"}]}]
    head = "[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in records) + ",\n"
    partial = json.dumps(_sharegpt(CONV), ensure_ascii=False)
    # cut the 4th record inside the 4 bytes of "🎉": the scan must not choke on half a character
    partial = partial[:partial.index("🎉") + 1].encode("utf-8")[:-2]
    path = tmp_path / "cut.json"
    path.write_bytes(head.encode("utf-8") + partial)
    info = {}
    assert list(D.iter_json_array(str(path), info, chunk_chars=64)) == records  # small chunks: records span reads
    assert info["tail_bytes"] == len(partial)
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(records), encoding="utf-8")
    info = {}
    assert list(D.iter_json_array(str(whole), info)) == records and info["tail_bytes"] == 0
    convs, skipped = D.load_conversations([str(path)])
    assert len(convs) == 2 and skipped == {"empty conversation": 1, "malformed record": 1}


def test_a_malformed_record_mid_list_is_skipped_and_the_rest_is_read(tmp_path):
    """A stray quote inside a reply, a missing comma and a bare token, each between good records of a
    compact list: every good record comes back (also when records span reads), each bad one counted."""
    good = [_sharegpt(CONV), _sharegpt(CONV_SYS)] * 20
    parts = [json.dumps(r, ensure_ascii=False) for r in good]
    stray = parts[3].replace('"value": "', '"value": "a"b ', 1)                # a quote that ends the string early
    no_comma = '{"id": "y", "conversations": [{"from": "human" "value": "hi"}]}'
    text = "[" + ", ".join(parts[:3] + [stray] + parts[4:10] + [no_comma] + parts[10:20] + ["garbage"] + parts[20:]) + "]"
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    for chunk in (1000, 1 << 20):      # (records are judged whole when shorter than a read: ~330 chars here)
        info = {}
        got = list(D.iter_json_array(str(path), info, chunk_chars=chunk))
        assert got == good[:3] + good[4:], chunk
        assert info == {"tail_bytes": 0, "malformed": 3, "invalid_utf8": 0}, (chunk, info)


def test_load_conversations_counts_skips(tmp_path):
    path = _write_jsonl(tmp_path / "mixed.jsonl", [
        _sharegpt(CONV),
        '{"conversations": [{"from": "human", "value": "cut off',         # invalid JSON
        "not json at all",                                                # invalid JSON
        {"conversations": [{"from": "bard", "value": "hi"}]},             # unknown role
        {"conversations": []},                                            # empty conversation
        {"conversations": [{"from": "human", "value": "anyone?"}]},       # no assistant turn
        {"conversations": [{"from": "human", "value": None}]},            # malformed record
        '{"conversations": [{"from": "human", "value": "\\ud83d"}, {"from": "gpt", "value": "?"}]}',  # lone surrogate
        {"text": "no conversation here"},                                 # malformed record
        {"conversations": [{"from": "gpt", "value": "orphan reply"},      # leading reply trimmed
                           {"from": "human", "value": "q"}, {"from": "chatgpt", "value": "a"},
                           {"from": "human", "value": "unanswered"}]},    # trailing user trimmed
        "",
    ])
    chat = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONV_SYS}])
    convs, skipped = D.load_conversations([path, chat])
    assert skipped == {"malformed record": 4, "unknown role": 1, "empty conversation": 1, "no assistant turn": 1,
                       "invalid UTF-8": 1}
    assert convs[0] == CONV
    assert convs[1] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert convs[2] == CONV_SYS


def test_a_folder_of_parts_gzip_and_a_json_object_are_read_as_users_hand_them(tmp_path):
    """What users hand over besides JSON(L) files: a folder of JSONL parts (read in name order, other files left
    alone), a .jsonl.gz, a pretty-printed JSON object with its records under "train"; an object without one list
    of records is a counted skip that says so, a folder without parts an early error."""
    import gzip
    convs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(4)]
    parts = tmp_path / "parts"
    parts.mkdir()
    _write_jsonl(parts / "b.jsonl", [{"messages": convs[2]}, {"messages": convs[3]}])
    _write_jsonl(parts / "a.jsonl", [{"messages": convs[0]}, {"messages": convs[1]}])
    (parts / "README.txt").write_text("not data")
    assert D.load_conversations([str(parts)]) == (convs, {})
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"messages": c}) + "\n" for c in convs)
    (tmp_path / "d.json").write_text(json.dumps({"version": 2, "train": [{"messages": c} for c in convs]}, indent=2))
    (tmp_path / "e.json").write_text(json.dumps({"version": 2, "items": [1, 2]}, indent=2))
    got, skipped = D.load_conversations([str(tmp_path / n) for n in ("c.jsonl.gz", "d.json", "e.json")])
    assert got == convs + convs and skipped == {"JSON object without one list of records (keys ['items', "
                                                "'version'])": 1}
    # a folder's identity (the tokenised cache's key) changes with any of its parts
    before = D.identity(str(parts))
    _write_jsonl(parts / "b.jsonl", [{"messages": convs[2]}])
    assert D.identity(str(parts)) != before
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no .json, .jsonl, .json.gz, .jsonl.gz file"):
        D.load_conversations([str(tmp_path / "empty")])


def test_missing_file_is_an_early_error(tmp_path):
    good = _write_jsonl(tmp_path / "good.jsonl", [_sharegpt(CONV)])
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        D.load_conversations([good, str(tmp_path / "nope.jsonl")])


# -----------------------------------------------------------------------------
# build_dataset: skips, cache, held-out split


def test_build_dataset_counts_and_cache(qwen_tok, tmp_path):
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    long = CONV + [{"role": "user", "content": "more?"}, {"role": "assistant", "content": "the quick brown fox " * 8}]
    path = _write_jsonl(tmp_path / "d.jsonl", [_sharegpt(long), _sharegpt(short), "{bad", _sharegpt(CONV)])
    logs = []
    kw = dict(max_length=128, block_size=8, min_supervised=20, log=logs.append)
    data, built = _build(qwen_tok, [path], str(tmp_path / "cache"), **kw)
    stats = data["stats"]
    assert built
    assert stats["samples"] == len(data["input_ids"]) == len(data["loss_mask"]) == 2
    assert stats["skipped"] == {"malformed record": 1, "too few supervised tokens": 1}
    assert stats["conversations"] == 4 and stats["truncated"] >= 1
    assert all(len(x) <= 128 and x.dtype == np.int32 for x in data["input_ids"])
    assert all(m.dtype == np.uint8 and m.sum() >= 20 for m in data["loss_mask"])
    # README: what is skipped is counted, skipped and reported in one log line (the user's view of the counts above)
    report = [line for line in logs if "| skipped:" in line]
    assert len(report) == 1 and report[0].startswith("data: 4 conversations -> 2 samples"), logs
    assert report[0].endswith("| skipped: malformed record=1, too few supervised tokens=1"), report

    again, built = _build(qwen_tok, [path], str(tmp_path / "cache"), **kw)
    assert not built
    assert again["stats"] == stats and again["heldout"] == data["heldout"] == []
    assert len(again["input_ids"]) == 2
    assert all(np.array_equal(a, b) for a, b in zip(again["input_ids"], data["input_ids"]))
    assert all(np.array_equal(a, b) for a, b in zip(again["loss_mask"], data["loss_mask"]))


def test_the_tokens_of_a_span_are_found_at_its_ends_or_among_all_offsets_where_an_end_is_in_no_token():
    class Encoding:    # 4 tokens over "ab cd ef": char 2 (the space) in none, as a dropping normalizer leaves it
        offsets = [(0, 2), (3, 5), (5, 6), (6, 8)]

        def char_to_token(self, c):
            return next((i for i, (s, e) in enumerate(self.offsets) if s <= c < e), None)
    assert list(D._tokens_of(Encoding(), 3, 6)) == [1, 2]
    assert list(D._tokens_of(Encoding(), 1, 4)) == [0, 1]        # a token across an edge holds span chars too
    assert list(D._tokens_of(Encoding(), 2, 6)) == [1, 2]        # the first char in no token
    assert list(D._tokens_of(Encoding(), 2, 3)) == []


def test_cache_is_rebuilt_when_the_file_the_max_length_or_the_chat_template_changes(qwen_tok, tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [_sharegpt(CONV), _sharegpt(CONV_SYS)])
    kw = dict(max_length=128, block_size=4)

    def build(tok=qwen_tok, **change):
        return _build(tok, [path], str(tmp_path / "cache"), **{**kw, **change})

    assert build()[1] and not build()[1]
    assert build(max_length=96)[1]
    assert not build(tok=copy.deepcopy(qwen_tok))[1]        # an equal tokenizer, another object: reused
    tok = copy.deepcopy(qwen_tok)
    tok.chat_template = QWEN_TEMPLATE.replace("You are a helpful assistant.", "You are terse.")
    assert build(tok=tok)[1]
    st = os.stat(path)                                      # the same bytes, touched: read again
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert build()[1]
    with open(path, "a", encoding="utf-8") as f:            # a record added: read again, and counted
        f.write(json.dumps(_sharegpt(CONV)) + "\n")
    data, built = build()
    assert built and data["stats"]["conversations"] == data["stats"]["samples"] == 3


def test_cache_is_reused_by_a_new_process_but_not_for_another_template_or_max_length(smollm, tmp_path):
    """datasets fingerprints the tokenizer by content: a fresh process loading the same folder gets the
    cached rows; a changed chat template or max_length in that process does not."""
    with open(smollm["data_jsonl"], encoding="utf-8") as f:
        path = _write_jsonl(tmp_path / "d.jsonl", [line.rstrip("\n") for _, line in zip(range(20), f)])
    cache = str(tmp_path / "cache")
    data, built = _build(smollm["tok"], [path], cache, max_length=256, block_size=8)
    assert built and data["stats"]["used"] == 20
    # the new process records, per call, whether it wrote a cache file (as _build does), the stats and the samples
    script = ("import json, sys, pathlib, data_dflash as D\nfrom transformers import AutoTokenizer\n"
              f"tok = AutoTokenizer.from_pretrained({smollm['target_dir']!r})\n"
              f"files = lambda: {{str(p): p.stat().st_mtime_ns for p in pathlib.Path({cache!r}).rglob('*.arrow')}}\n"
              "calls = []\n"
              "def build(max_length):\n"
              "    before = files()\n"
              f"    data = D.build_dataset(tok, [{path!r}], max_length, 8, {cache!r})\n"
              "    calls.append(dict(built=files() != before, stats=data['stats'], digest=D.samples_digest(data)))\n"
              "build(256)\n"
              "build(200)\n"
              "tok.chat_template = tok.chat_template.replace('named SmolLM', 'named Bob')\n"
              "build(256)\n"
              "with open(sys.argv[1], 'w') as f:\n"
              "    json.dump(calls, f)\n")
    p = run_cmd([sys.executable, "-c", script, tmp_path / "calls.json"],
                cwd=os.path.dirname(os.path.abspath(D.__file__)))
    assert p.rc == 0, p.tail()
    calls = json.loads((tmp_path / "calls.json").read_text())
    assert [c["built"] for c in calls] == [False, True, True], calls
    assert calls[0]["stats"] == data["stats"] and calls[0]["digest"] == D.samples_digest(data)   # reused: the same rows
    assert [c["stats"]["used"] for c in calls[1:]] == [20, 20] and calls[1]["stats"]["max_length"] == 200
    assert calls[2]["digest"] != calls[0]["digest"]         # the other template's render is what was tokenised


def test_heldout_split_is_the_last_usable_conversations_and_never_trained_on(qwen_tok, tmp_path):
    convs = [[{"role": "user", "content": f"question number {i}?"},
              {"role": "assistant", "content": f"the answer to question number {i} is {i * 7}, said the assistant"}]
             for i in range(25)]
    lines = ([_sharegpt(c) for c in convs[:20]] + ["{bad"] + [_sharegpt(c) for c in convs[20:]]
             + [{"conversations": []}])
    path = _write_jsonl(tmp_path / "d.jsonl", lines)
    kw = dict(max_length=128, block_size=4)

    def build(**settings):
        return _build(qwen_tok, [path], str(tmp_path / "cache"), **kw, **settings)

    data, _ = build(heldout=5)        # 25 usable: min(5, 25 // 10) = 2
    assert data["heldout"] == convs[23:] and data["stats"]["heldout"] == 2
    assert data["stats"]["samples"] == 23 and data["stats"]["usable"] == 25 and data["stats"]["conversations"] == 27
    assert data["stats"]["used"] == 23 and data["stats"]["not_trained"] == 2     # every one not held out tokenised
    trained = [qwen_tok.decode(ids) for ids in data["input_ids"]]
    assert not any(c[1]["content"] in text for c in data["heldout"] for text in trained)
    assert all(any(c[1]["content"] in text for text in trained) for c in convs[:23])
    again, built = build(heldout=5)
    assert not built and again["heldout"] == convs[23:] and again["stats"] == data["stats"]
    assert build(heldout=1)[0]["heldout"] == convs[24:]

    first, _ = build(heldout=5, max_conversations=3)   # counted on what is left once the held-out are off
    assert first["heldout"] == convs[23:] and first["stats"]["used"] == first["stats"]["samples"] == 3
    assert [qwen_tok.decode(ids) for ids in first["input_ids"]] == trained[:3]
    assert (first["stats"]["conversations"], first["stats"]["usable"], first["stats"]["not_trained"]) == (27, 25, 2)

    out = str(tmp_path / "heldout.jsonl")
    D.write_chat_jsonl(out, data["heldout"])
    assert D.load_conversations([out]) == (convs[23:], {})
    assert sorted(os.listdir(tmp_path)) == ["cache", "d.jsonl", "heldout.jsonl"]     # no temporary file left


def test_answers_to_one_prompt_are_held_out_together_and_the_prompt_listed_once(qwen_tok, tmp_path):
    """generate_data.py --answers 3 writes three answers to each prompt side by side: the trainer holds out the
    last --heldout prompts' runs of answers (at most a tenth of them) whole, so no prompt is both trained on and
    held out, and heldout.jsonl lists each held-out prompt once."""
    from types import SimpleNamespace
    prompt = lambda i: [{"role": "user", "content": f"question number {i}?"}]
    answer = lambda i, j: [{"role": "assistant", "content": f"answer {j}: question number {i} gives {i * 7}, it says"}]
    convs = [prompt(i) + answer(i, j) for i in range(30) for j in range(3)]
    path = _write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in convs])
    cfg = SimpleNamespace(max_length=128, block_size=4, cache_dir=str(tmp_path / "cache"), min_supervised=1,
                          max_samples=0, heldout=5, out_dir=str(tmp_path))
    data, heldout = D.load_training_data(cfg, [path], qwen_tok, len(qwen_tok), 0, lambda m: None)
    held = data["heldout"]                                             # 30 prompts: min(5, 30 // 10) = 3
    assert heldout == str(tmp_path / "heldout.jsonl")          # where the trainer writes them (once it resumed)
    assert held == [prompt(i) + answer(i, 0) for i in (27, 28, 29)]
    trained = [qwen_tok.decode(ids) for ids in data["input_ids"]]
    assert data["stats"]["samples"] == 90 - 9 and data["stats"]["not_trained"] == 9
    assert data["stats"]["heldout"] == len(held) == 3        # 3 held out, and 6 more answers to their prompts untrained
    assert not any(f"question number {i}?" in text for i in (27, 28, 29) for text in trained)
    assert sum("question number 26?" in text for text in trained) == 3


def test_a_held_out_prompt_is_trained_on_in_no_file(qwen_tok, tmp_path):
    """A regenerated file given before its source (--data regen.jsonl source.jsonl): the source's last prompts are
    held out, and the regenerated answers to those prompts, earlier in the list, are not trained on either."""
    from types import SimpleNamespace
    prompt = lambda i: [{"role": "user", "content": f"question number {i}?"}]
    answer = lambda i, who: [{"role": "assistant", "content": f"{who}: question number {i} gives {i * 7}, it says"}]
    regen = _write_jsonl(tmp_path / "regen.jsonl", [{"messages": prompt(i) + answer(i, "target")} for i in range(30)])
    source = _write_jsonl(tmp_path / "source.jsonl", [{"messages": prompt(i) + answer(i, "data")} for i in range(30)])
    cfg = SimpleNamespace(max_length=128, block_size=4, cache_dir=str(tmp_path / "cache"), min_supervised=1,
                          max_samples=0, heldout=5, out_dir=str(tmp_path))
    data, heldout = D.load_training_data(cfg, [regen, source], qwen_tok, len(qwen_tok), 0, lambda m: None)
    assert data["heldout"] == [prompt(i) + answer(i, "data") for i in range(25, 30)]  # 60 // 10
    trained = [qwen_tok.decode(ids) for ids in data["input_ids"]]
    assert data["stats"]["samples"] == 50 and data["stats"]["not_trained"] == 10
    assert data["stats"]["heldout"] == 5 and heldout == str(tmp_path / "heldout.jsonl")   # + 5 regenerated, untrained
    assert not any(f"question number {i}?" in text for i in range(25, 30) for text in trained)
    assert sum("question number 24?" in text for text in trained) == 2


def test_build_dataset_counts_template_errors(tmp_path):
    # a template that insists on alternating roles (as Llama-2/Mistral ones do)
    strict = QWEN_TEMPLATE.replace(
        "{%- for m in messages -%}",
        "{%- for m in messages -%}{%- if loop.index0 > 0 and m.role == messages[loop.index0 - 1].role -%}"
        "{{- raise_exception('roles must alternate') -}}{%- endif -%}")
    tok = _tiny_tokenizer(strict)
    twice = [CONV[0], CONV[0]] + CONV[1:]
    path = _write_jsonl(tmp_path / "d.jsonl", [_sharegpt(CONV), _sharegpt(twice), "[1, 2]"])
    data = D.build_dataset(tok, [path], 128, 4, str(tmp_path / "cache"), log=lambda s: None)
    assert data["stats"]["skipped"] == {"chat template error": 1, "malformed record": 1}
    assert data["stats"]["samples"] == 1


def test_all_lines_bad_is_not_fatal(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", ["{", "nope"])
    assert D.load_conversations([path]) == ([], {"malformed record": 2})


# -----------------------------------------------------------------------------
# buckets, batches, collate


def test_buckets():
    assert D.default_buckets(3072) == [256, 512, 1024, 2048, 3072]
    assert D.default_buckets(4096) == [256, 512, 1024, 2048, 4096]
    for n in (1, 8, 64, 100, 256, 511, 512, 1000):
        b = D.default_buckets(n)
        assert b[-1] == n and all(x < y for x, y in zip(b, b[1:])) and b[0] >= 1
    assert D.bucket_length(1, [16, 32, 64]) == 16
    assert D.bucket_length(17, [16, 32, 64]) == 32 and D.bucket_length(64, [16, 32, 64]) == 64
    with pytest.raises(ValueError):
        D.bucket_length(65, [16, 32, 64])


def test_make_batches_deterministic_and_complete():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, size=300)
    buckets = D.default_buckets(64)
    rows = {b: max(1, 256 // b) for b in buckets}          # about 256 tokens per batch
    a = D.make_batches(lengths, buckets, rows, seed=1, epoch=0)
    assert a == D.make_batches(lengths, buckets, rows, seed=1, epoch=0)
    assert a != D.make_batches(lengths, buckets, rows, seed=1, epoch=1)
    assert a != D.make_batches(lengths, buckets, rows, seed=2, epoch=0)
    assert set(i for _, idx in a for i in idx) == set(range(300))
    for b, idx in a:
        assert len(idx) == max(1, 256 // b)     # full batches only: the one warmed shape per bucket
        assert all(D.bucket_length(int(lengths[i]), buckets) == b for i in idx)
    extra = sum(len(idx) for _, idx in a) - 300
    assert 0 < extra < sum(max(1, 256 // b) for b in buckets)     # each bucket's last batch filled up, no more
    tiny = D.make_batches([10, 12, 30], buckets, rows, seed=0, epoch=0)     # fewer samples than one batch's rows
    assert sorted(len(idx) for _, idx in tiny) == [256 // 32, 256 // 16] and {i for _, idx in tiny for i in idx} == {0, 1, 2}
    waste = D.padding_waste(lengths, a)
    assert 0 < waste < 0.5
    assert D.padding_waste([16, 16], [(16, [0, 1])]) == 0.0


def test_collate():
    data = {"input_ids": [np.array([5, 6, 7], np.int32), np.array([8], np.int32)],
            "loss_mask": [np.array([0, 1, 1], np.uint8), np.array([1], np.uint8)]}
    ids, loss, lengths = D.collate([1, 0], data, 4, pad_id=0)
    assert ids.dtype == loss.dtype == lengths.dtype == torch.long and ids.shape == (2, 4)
    assert ids.tolist() == [[8, 0, 0, 0], [5, 6, 7, 0]]
    assert lengths.tolist() == [1, 3]
    assert loss.tolist() == [[1, 0, 0, 0], [0, 1, 1, 0]]
    with pytest.raises(ValueError):
        D.collate([0], data, 2, pad_id=0)


def test_a_hub_data_set_whose_hub_does_not_answer_is_one_line_without_retries(monkeypatch, request):
    """Offline, a hub name in --data is refused at once in one line (load_dataset would retry for half a minute);
    in offline mode (HF_HUB_OFFLINE) or behind a proxy the hub is not probed and load_dataset decides."""
    import socket
    import datasets
    from huggingface_hub import constants

    def unreachable(address, timeout):
        raise OSError(errno.ENETUNREACH, os.strerror(errno.ENETUNREACH))

    def loaded(name):
        raise AssertionError("load_dataset ran")
    request.addfinalizer(D.hub_unreachable.cache_clear)     # the probe's answer is kept for the process
    D.hub_unreachable.cache_clear()
    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setattr(datasets, "load_dataset", loaded)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for k in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(UserError, match=r"^--data org/chats is no local file or folder, and the hub data set "
                                         r"of that name cannot load: huggingface.co does not answer \(Network is "
                                         r"unreachable\); give a local file or folder, or set HF_HUB_OFFLINE=1"):
        D._hub_records("org/chats")
    for offline, proxy in ((True, None), (False, "http://proxy:3128")):
        D.hub_unreachable.cache_clear()
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
        if proxy:
            monkeypatch.setenv("https_proxy", proxy)
        with pytest.raises(UserError, match="does not load: AssertionError: load_dataset ran"):
            D._hub_records("org/chats")
