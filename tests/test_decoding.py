"""CPU tests of the decoding engine (decoding.py): greedy decoding vs HF generate, lossless speculative decoding
with a drafter and with n-gram lookup, a batch of prompts as each alone, an overfit drafter that proves mask, labels
and inference agree, stop ids, rows refilled and prefilled, the compiled engine, sampling.
"""
import math
import time
from types import SimpleNamespace

import pytest
import torch

import decoding
import dflash_model as dm
from errors import UserError
import kernels
from helpers import drafter_for, tiny_target


# the compile gate and dynamo's limits are process-wide: each test starts and ends with them as a fresh process
# has them; one intra-op thread for the module (conftest.py: clean_gate, one_thread)
pytestmark = pytest.mark.usefixtures("one_thread", "clean_gate")


def decode(target, prompt, n, stop_token_ids=(), drafter=None, block_size=None):
    """The decoding engine on one prompt (1, P): its ids (1, P + new) and acceptance lengths; speculative with a
    drafter, or with n-gram lookup when block_size is given."""
    p, L = prompt[0].tolist(), prompt.shape[1] + n + 2 * 16
    engine = decoding.Engine(target, 1, L, drafter.config.target_layer_ids if drafter else ())
    proposer = decoding.DrafterRows(drafter, 1, L) if drafter else block_size and decoding.NGram(block_size)
    out, acc = decoding.speculate(engine, [p], n, stop_token_ids, proposer or None)[0]
    return torch.tensor([p + out]), acc


@pytest.fixture(scope="module")
def trained(targets):
    """A drafter overfit (attn="sdpa", AdamW, CPU) on ONE sequence that is the target's own greedy
    continuation of an 8-token prompt, so that at inference the target continues exactly the
    training sequence."""
    target = targets["qwen3"]
    P, S, bs = 8, 96, 8
    prompt = torch.randint(0, 500, (1, P), generator=torch.Generator().manual_seed(5))
    seq = decode(target, prompt, S - P)[0]
    assert seq.shape == (1, S)
    drafter = drafter_for(target, bs)
    with torch.no_grad():
        feats = dm.target_forward(target, seq, drafter.config.target_layer_ids)
    loss_mask = torch.ones(1, S, dtype=torch.bool)
    lengths = torch.tensor([S])
    all_anchors, all_valid = dm.sample_anchors(loss_mask, lengths, S, bs)       # every position
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    gamma, tau, t0 = 4.0, 1.0, time.time()
    for step in range(400):
        anchors, valid = dm.sample_anchors(loss_mask, lengths, 32, bs, gen)
        loss, _, _ = drafter(feats, dm.make_batch(seq, loss_mask, anchors, valid, drafter.config, dm.Loss(gamma)))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        if step % 10 == 9:
            with torch.no_grad():
                _, acc, _ = drafter(feats, dm.make_batch(seq, loss_mask, all_anchors, all_valid, drafter.config,
                                                         dm.Loss(gamma)))
            tau = dm.simulated_tau(acc)
            if tau >= 7.9:
                break
    drafter.eval()
    return SimpleNamespace(target=target, drafter=drafter, seq=seq, P=P, bs=bs, train_tau=tau,
                           steps=step + 1, seconds=time.time() - t0)


def _hf_greedy(target, prompt, n, eos=None):
    out = target.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                          max_new_tokens=n, eos_token_id=eos, pad_token_id=0)
    return out


# -----------------------------------------------------------------------------
# speculative decoding: lossless greedy, and an overfit drafter


@pytest.mark.parametrize("arch,bs", [("qwen3", 16), ("llama", 10)])
def test_greedy_speculative_decoding_with_a_drafter_is_lossless(targets, arch, bs):
    target = targets[arch]
    drafter = drafter_for(target, bs).eval()
    prompt = torch.randint(0, 500, (1, 7), generator=torch.Generator().manual_seed(9))
    n = 30
    ref = decode(target, prompt, n)[0]
    assert ref.shape == (1, 7 + n)
    assert len(set(ref[0, 7:].tolist())) > 10                              # a non-degenerate continuation
    assert torch.equal(_hf_greedy(target, prompt, n), ref)
    out, al = decode(target, prompt, n, drafter=drafter)
    assert torch.equal(out, ref)
    assert al and all(1 <= a <= bs for a in al)
    assert 1 + sum(al) >= n and 1 + sum(al[:-1]) < n                       # rounds account for the tokens

    # stop token: the first token generated at index >= 12 that did not occur before it
    gen = ref[0, 7:].tolist()
    j = next(i for i in range(12, n) if gen[i] not in gen[:i])
    stop = gen[j]
    ref_s = decode(target, prompt, n, [stop])[0]
    assert ref_s.shape == (1, 7 + j + 1) and int(ref_s[0, -1]) == stop
    assert torch.equal(_hf_greedy(target, prompt, n, eos=stop), ref_s)
    out_s, al_s = decode(target, prompt, n, [stop], drafter)
    assert torch.equal(out_s, ref_s)
    assert all(1 <= a <= bs for a in al_s)


def test_a_batch_of_prompts_decodes_as_each_prompt_alone(trained, monkeypatch):
    """Prompts of other lengths side by side, each row advancing by its own accepted lengths: per prompt, the
    greedy, n-gram and drafter outputs and acceptance lengths equal the one-prompt engine's (fp32), prefilled
    in one batch or in one batch per length, every speculative output is the greedy one, and the greedy one
    is HF generate's. Rows include spans of the training sequence (long accepted blocks) and random prompts
    (short ones), some ending at a stop id."""
    t, bs, n = trained, trained.bs, 40
    prompts = [t.seq[0, :P].tolist() for P in (8, 11, 30)] + \
        [torch.randint(0, 500, (P,), generator=torch.Generator().manual_seed(P)).tolist() for P in (5, 17)]
    stop = t.seq[0, 50].item()
    L = max(map(len, prompts)) + n + 2 * bs
    ways = [(None, ()), (lambda rows: decoding.NGram(bs), ()),
            (lambda rows: decoding.DrafterRows(t.drafter, rows, L), t.drafter.config.target_layer_ids)]
    results = []
    for make, layers in ways:
        def together():
            return decoding.speculate(decoding.Engine(t.target, len(prompts), L, layers), prompts, n, [stop],
                                      make and make(len(prompts)))
        engine, proposer = decoding.Engine(t.target, 1, L, layers), make and make(1)
        alone = [decoding.speculate(engine, [p], n, [stop], proposer)[0] for p in prompts]
        assert together() == alone
        with monkeypatch.context() as m:
            m.setattr(decoding.Engine, "CALL_TOKENS", 0)    # a prefill batch costs nothing: one per length,
            m.setattr(decoding.Engine, "GRAPH_TOKENS", 0)   # in its own shape (not padded)
            assert together() == alone
        results.append(alone)
    greedy, ngram, dflash = results
    for p, (g, _) in zip(prompts, greedy):
        assert g == _hf_greedy(t.target, torch.tensor([p]), n, eos=stop)[0, len(p):].tolist()
    assert [o for o, _ in ngram] == [o for o, _ in dflash] == [g for g, _ in greedy]
    assert any(g[-1] == stop and len(g) < n for g, _ in greedy) and any(len(g) == n for g, _ in greedy)
    accepted = [a for _, acc in dflash for a in acc]
    assert max(accepted) == bs and any(1 < a < bs for a in accepted) and 1 in accepted, accepted


def test_a_compiled_drafter_proposes_as_the_eager_one(trained):
    """compile=True (eval_dflash.py's batch-1 loop on a GPU): the drafter's layers compiled, the attention outside
    their graphs; per prompt the same outputs and acceptance lengths as the eager drafter, long blocks included."""
    from torch._dynamo.utils import counters
    t, bs, n = trained, trained.bs, 40
    prompts = [t.seq[0, :P].tolist() for P in (8, 30)]
    L, layers, out = max(map(len, prompts)) + n + 2 * bs, trained.drafter.config.target_layer_ids, {}
    for compile in (False, True):
        before = counters["stats"]["unique_graphs"]
        engine, rows = decoding.Engine(t.target, 1, L, layers), decoding.DrafterRows(t.drafter, 1, L, compile)
        out[compile] = [decoding.speculate(engine, [p], n, [], rows)[0] for p in prompts]
    assert counters["stats"]["unique_graphs"] > before, "nothing was compiled"
    assert out[True] == out[False] and max(a for _, acc in out[True] for a in acc) == bs, out


def test_overfit_drafter_reaches_high_acceptance(trained):
    t = trained
    S = t.seq.shape[1]
    prefix = t.seq[:, : t.P]
    out, al = decode(t.target, prefix, S - t.P, drafter=t.drafter)
    assert torch.equal(out, t.seq)                                         # lossless on the training span
    mean_tau = sum(al) / len(al)
    assert all(1 <= a <= t.bs for a in al)
    assert mean_tau >= 6.0, (f"mean acceptance {mean_tau:.2f} < 6 (train simulated tau {t.train_tau:.2f} "
                             f"after {t.steps} steps in {t.seconds:.1f}s), acceptance lengths {al}")


def test_trained_drafter_lossless_with_partial_acceptance_and_stop(trained):
    """Near the end of the training span the drafter is partly right (a block anchored 4 tokens
    before the end: those 4 are known, the rest not), so a partial block is accepted; and a stop
    token inside an accepted block truncates exactly like plain greedy decoding."""
    t = trained
    S = t.seq.shape[1]
    P = t.P + 3                    # rounds anchor at P + 8r: the one at S - 5 straddles the end
    prefix = t.seq[:, :P]
    n = S - P + 40
    ref = decode(t.target, prefix, n)[0]
    out, al = decode(t.target, prefix, n, drafter=t.drafter)
    assert torch.equal(out, ref)
    assert any(1 < a < t.bs for a in al), f"no partial acceptance exercised: {al}"
    assert max(al) == t.bs

    # a stop token in the middle of a fully accepted block: generated index j with j % bs not in
    # {0, 1} (index 0 is the prefill token; round r commits indices bs*(r-1)+1 .. bs*r)
    gen = out[0, P:].tolist()
    j = next(i for i in range(12, S - P) if i % t.bs not in (0, 1) and gen[i] not in gen[:i])
    stop = gen[j]
    ref_s = decode(t.target, prefix, n, [stop])[0]
    out_s, al_s = decode(t.target, prefix, n, [stop], t.drafter)
    assert torch.equal(out_s, ref_s)
    assert out_s.shape[1] == P + j + 1 and int(out_s[0, -1]) == stop
    assert 1 + sum(al_s) > j + 1                                           # the last block was cut at the stop


def test_generate_refuses_positions_beyond_the_rope_table(targets):
    target = targets["qwen3"]
    drafter = drafter_for(target, 16)
    n = drafter.config.max_position_embeddings
    with pytest.raises(UserError, match="exceed the .* positions of the drafter's rotary table"):
        decode(target, torch.zeros(1, 8, dtype=torch.long), n, drafter=drafter)


# -----------------------------------------------------------------------------
# stop ids and n-gram lookup


def _word_tokenizer(words, eos):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token=eos)


def test_eval_stop_ids_take_the_generation_config_eos_list():
    """Llama-3.1: the tokenizer's eos is <|end_of_text|>, but a chat turn ends with <|eot_id|>, which
    only generation_config.eos_token_id (a list) names. No <|im_end|> in the vocabulary: the unk id
    (what convert_tokens_to_ids returns for it) must not become a stop id."""
    llama_tok = _word_tokenizer(["<unk>", "hi", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], "<|end_of_text|>")
    target = tiny_target("llama")
    target.generation_config.eos_token_id = [2, 3, 4]
    assert decoding.stop_token_ids(llama_tok, target) == [2, 3, 4]
    target.generation_config.eos_token_id = 4                    # an int, not in the tokenizer's eos
    assert decoding.stop_token_ids(llama_tok, target) == [2, 4]
    target.generation_config.eos_token_id = None
    assert decoding.stop_token_ids(llama_tok, target) == [2]
    # a ChatML tokenizer: <|im_end|> joins its eos
    chatml_tok = _word_tokenizer(["<unk>", "<|endoftext|>", "hi", "<|im_end|>"], "<|endoftext|>")
    target.generation_config.eos_token_id = 1
    assert decoding.stop_token_ids(chatml_tok, target) == [1, 3]


def test_ngram_lookup_tau_on_a_hand_made_sequence_equals_the_hand_count():
    """A hand-made target whose greedy next token is a table lookup (1->2->3->4->1, one-hot embeddings,
    the layers' outputs zeroed, the LM head the table): after the prompt 5 1 2 6 3 4 it emits 1 2 3 4 ...
    By hand, block 4 (up to 3 proposed): context ..4 1: last 3 and 2 unmatched, "1" matched at index 1
    -> 2 6 3, one accepted + 3 (length 2); ..1 2 3: "3" at index 4 -> 4 1 2, all accepted + 3 (4); then
    "1 2 3" matched at 6 -> 4 1 2, all accepted, cut at 10 new tokens (4). Rounds 2, 4, 4."""
    from transformers import LlamaConfig, LlamaForCausalLM
    V = 8
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=V, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1, head_dim=V,
                                         tie_word_embeddings=False)).eval()
    table = {1: 2, 2: 3, 3: 4, 4: 1}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(V))
        model.model.norm.weight.fill_(1.0)
        for a, b in table.items():
            model.lm_head.weight[b, a] = 1.0
    prompt = torch.tensor([[5, 1, 2, 6, 3, 4]])
    ref = decode(model, prompt, 10)[0]
    assert ref[0, 6:].tolist() == [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    out, rounds = decode(model, prompt, 10, block_size=4)
    assert torch.equal(out, ref) and rounds == [2, 4, 4], rounds
    ngram = decoding.NGram(4)
    tokens = torch.tensor([[5, 1, 2, 6, 3, 4, 1, 0, 0], [7, 8, 0, 0, 0, 0, 0, 0, 0]])
    ids, k = ngram.propose(tokens, torch.tensor([7, 2]), None)
    assert ids[0].tolist() == [2, 6, 3] and k.tolist() == [3, 0]
    # the device's comparisons propose what a scan of the whole context finds, rows of other lengths side by side
    def scan(tokens, k):
        for n in (3, 2, 1):
            at = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tokens[-n:]]
            if at:
                return tokens[at[-1] + n: at[-1] + n + k]
        return []
    ngram, g = decoding.NGram(6), torch.Generator().manual_seed(0)
    rows = [[1], [2, 3]]
    for _ in range(60):
        for seq in rows:
            seq += torch.randint(0, 4, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
        L = max(map(len, rows)) + 3
        tokens = torch.tensor([seq + [0] * (L - len(seq)) for seq in rows])
        ids, k = ngram.propose(tokens, torch.tensor([len(seq) for seq in rows]), None)
        for r, seq in enumerate(rows):
            assert ids[r, :int(k[r])].tolist() == scan(seq, 5), seq
            assert not ids[r, int(k[r]):].any()


# -----------------------------------------------------------------------------
# the engine's rows, prefill batches, compile and sampling (generate_data.py's decoding)


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
