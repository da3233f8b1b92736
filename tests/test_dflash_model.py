"""CPU tests of the drafter (dflash_model.py): layer ids, the config from HF target configs, the training mask
(dense and flex's mask_mod vs a naive loop, the tile-level BlockMask), blocks / labels / weights / loss / gradient,
distillation, anchor sampling, save/load in the serving format, the rope table, GQA, the target's features, and the
FLOPs the MFU counts. FlexAttention has no backward on CPU, so training here uses attn="sdpa"; the flex shape is
conftest.py's `flex_case`.
"""
import json
import math

import pytest
import torch

import torch.nn.functional as F
from safetensors.torch import load_file
from torch.nn.attention.flex_attention import create_mask
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

import decoding
import dflash_model as dm
import models
from helpers import drafter_for, drafter_with_heads, naive_mask, small_config, tiny_config_json, tiny_target


# the compile gate and dynamo's limits are process-wide: each test starts and ends with them as a fresh process
# has them; one intra-op thread for the module (conftest.py: clean_gate, one_thread)
pytestmark = pytest.mark.usefixtures("one_thread", "clean_gate")


def tiles_from_indices(num_blocks, indices, n_kv_tiles):
    """(B, H, Qt) counts + (B, H, Qt, n) indices -> dense (B, H, Qt, KVt) bool tile map."""
    B, H, Qt = num_blocks.shape
    out = torch.zeros(B, H, Qt, n_kv_tiles, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for qt in range(Qt):
                for j in range(int(num_blocks[b, h, qt])):
                    out[b, h, qt, int(indices[b, h, qt, j])] = True
    return out


# -----------------------------------------------------------------------------
# layer ids and config


def test_build_target_layer_ids():
    assert dm.build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    for L in (1, 6, 7, 36):
        assert dm.build_target_layer_ids(L, 1) == [L // 2]
    # the formula round(1 + i*(L-4)/(n-1)) for another shape
    assert dm.build_target_layer_ids(28, 5) == [round(1 + i * 24 / 4) for i in range(5)] == [1, 7, 13, 19, 25]


@pytest.mark.parametrize("cls", [Qwen3Config, LlamaConfig, Qwen2Config])
def test_config_from_target_config(cls):
    kw = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=10, vocab_size=300, rms_norm_eps=1e-5,
              rope_parameters={"rope_type": "default", "rope_theta": 12345.0})
    if cls is not Qwen2Config:
        kw["head_dim"] = 32          # deliberately != hidden/heads: must be read, not derived
    tcfg = cls(**kw)
    assert getattr(tcfg, "rope_theta", None) is None or tcfg.rope_theta == 12345.0
    c = dm.DFlashConfig.from_target_config(tcfg, num_draft_layers=3, block_size=10, mask_token_id=299)
    assert c.hidden_size == 64
    assert c.intermediate_size == 96
    assert c.num_attention_heads == 4
    assert c.num_key_value_heads == 2
    assert c.head_dim == (32 if cls is not Qwen2Config else 16)
    assert c.rope_theta == 12345.0
    assert c.rms_norm_eps == 1e-5
    assert c.vocab_size == 300
    assert c.num_target_layers == 10
    assert c.num_draft_layers == 3 and c.block_size == 10 and c.mask_token_id == 299
    assert c.target_layer_ids == dm.build_target_layer_ids(10, 3)
    # the drafter built from it has the target's attention geometry
    d = dm.DFlashDrafter(c)
    attn = d.layers[0].self_attn
    assert attn.q_proj.weight.shape == (4 * c.head_dim, 64)
    assert attn.k_proj.weight.shape == (2 * c.head_dim, 64)
    assert d.fc.weight.shape == (64, 3 * 64)


# -----------------------------------------------------------------------------
# the training mask


def test_mask_mod_dense_and_naive_agree(flex_case):
    c = flex_case
    ref = naive_mask(c.anchors, c.S, c.bs)                                   # (B, Q, KV)
    B, Q, KV = ref.shape
    # the reference itself encodes the formula (spot checks of its rules)
    a = int(c.anchors[0, -1])
    assert a == c.S - c.bs                                                   # last valid position
    assert ref[0, Q - 1, a - 1] and not ref[0, Q - 1, a]                     # strictly before the anchor
    assert not ref[2, 3 * c.bs, :c.S].any()                                  # padding block: no context
    assert ref[2, 3 * c.bs, c.S + 3 * c.bs: c.S + 4 * c.bs].all()            # ...only itself
    assert not ref[2, 0, :c.S].any()                                         # valid anchor 0: no context

    dense = dm.dense_dflash_mask(c.anchors, c.S, c.bs)
    assert dense.shape == (B, 1, Q, KV) and dense.dtype == torch.bool
    assert torch.equal(dense[:, 0], ref)

    mm = dm.make_mask_mod(c.anchors, c.S, c.bs)
    bi = torch.arange(B)[:, None, None, None]
    hi = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    qi = torch.arange(Q)[None, None, :, None]
    ki = torch.arange(KV)[None, None, None, :]
    elem = mm(bi, hi, qi, ki)
    assert torch.equal(elem.expand(B, 1, Q, KV)[:, 0], ref)

    # flex's own (vmap) evaluation of the mask_mod
    fm = create_mask(mm, B, 1, Q, KV, device="cpu")
    assert torch.equal(fm[:, 0], ref)


def check_block_mask(bm, anchors, S, bs):
    """The tile maps of `bm` against the element-level formula: partial and full tiles exactly (full
    tiles skip the mask_mod in the kernel), the q-side maps their transposes, the element-level mask_mod
    the formula, and the layout flex expects (torch's create_block_mask's: dtypes, shapes, contiguity,
    each row's listed tiles in ascending order). Returns the (any, all) tile maps."""
    from torch.nn.attention.flex_attention import create_block_mask
    ref = naive_mask(anchors, S, bs)
    B, Q, KV = ref.shape
    T = 128
    assert tuple(bm.shape) == (B, 1, Q, KV) and tuple(bm.BLOCK_SIZE) == (T, T)
    tiles = ref.view(B, Q // T, T, KV // T, T)
    any_t = tiles.any(dim=(2, 4))[:, None]                                  # (B, 1, Qt, KVt)
    all_t = tiles.all(dim=(2, 4))[:, None]
    assert torch.equal(bm.to_dense().bool(), any_t)
    full = tiles_from_indices(bm.full_kv_num_blocks, bm.full_kv_indices, KV // T)
    partial = tiles_from_indices(bm.kv_num_blocks, bm.kv_indices, KV // T)
    assert torch.equal(full, all_t)
    assert torch.equal(partial, any_t & ~all_t)
    assert torch.equal(tiles_from_indices(bm.q_num_blocks, bm.q_indices, Q // T), partial.transpose(-2, -1))
    assert torch.equal(tiles_from_indices(bm.full_q_num_blocks, bm.full_q_indices, Q // T), full.transpose(-2, -1))
    assert torch.equal(create_mask(bm.mask_mod, B, 1, Q, KV, device="cpu")[:, 0], ref)
    theirs = create_block_mask(dm.make_mask_mod(anchors, S, bs), B, None, Q, KV, device="cpu")
    for side in ("kv", "full_kv", "q", "full_q"):
        n, idx = getattr(bm, f"{side}_num_blocks"), getattr(bm, f"{side}_indices")
        want_n, want_idx = getattr(theirs, f"{side}_num_blocks"), getattr(theirs, f"{side}_indices")
        assert torch.equal(n, want_n) and n.dtype == want_n.dtype == torch.int32 and n.is_contiguous(), side
        assert idx.shape == want_idx.shape and idx.dtype == torch.int32 and idx.is_contiguous(), side
        listed = torch.arange(idx.shape[-1]) < n[..., None]
        assert torch.equal(idx[listed], want_idx[listed]), side
    return any_t, all_t


def test_block_mask_matches_reference(flex_case):
    c = flex_case
    any_t, all_t = check_block_mask(c.bm, c.anchors, c.S, c.bs)
    # the test shape really has skipped tiles, partial tiles and full tiles
    assert (~any_t).any() and (any_t & ~all_t).any() and all_t.any()


@pytest.mark.parametrize("S,A,bs", [(256, 16, 16), (384, 8, 32), (128, 32, 8), (256, 2, 128), (256, 1, 256),
                                    (384, 8, 48), (256, 16, 24), (512, 2, 192)])
def test_block_mask_matches_reference_for_other_shapes(S, A, bs):
    """Tiles holding several blocks, one block, part of one (bs > 128: then block tiles are full), or
    parts of two (bs 24, 48, 192: blocks across tile edges); random anchors, padding anchors (0) and
    anchors at the last valid position."""
    g = torch.Generator().manual_seed(S + A + bs)
    B = 3
    anchors = torch.zeros(B, A, dtype=torch.long)
    anchors[0] = torch.randint(0, S - bs + 1, (A,), generator=g).sort().values
    n = max(1, A // 2)
    anchors[1, :n] = torch.randint(0, S - bs + 1, (n,), generator=g).sort().values
    anchors[2] = S - bs
    with torch.no_grad():
        check_block_mask(dm.create_dflash_block_mask(anchors, S, bs), anchors, S, bs)


# -----------------------------------------------------------------------------
# blocks, labels, weights, loss


def test_make_blocks_hand_worked():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17, 18, 19]])             # S = 10
    loss_mask = torch.tensor([[1, 1, 1, 1, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)  # position 4 unsupervised
    anchors = torch.tensor([[0, 3, 7, 0]])
    valid = torch.tensor([[True, True, True, False]])
    M, bs, gamma = 99, 4, 2.0
    block_ids, pos, labels, w = dm.make_blocks(ids, loss_mask, anchors, valid, bs, M, gamma)
    assert block_ids.tolist() == [[10, M, M, M, 13, M, M, M, 17, M, M, M, 10, M, M, M]]
    assert pos.tolist() == [[0, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1, 2, 3]]
    # same-position labels, no shift (the out-of-range slot 7+3=10 is not checked: its weight is 0)
    assert labels[0, 0].tolist() == [10, 11, 12, 13]
    assert labels[0, 1].tolist() == [13, 14, 15, 16]
    assert labels[0, 2, :3].tolist() == [17, 18, 19]
    e = math.exp
    expected = torch.tensor([[
        [0.0, 1.0, e(-0.5), e(-1.0)],       # k=0 no loss; exp(-(k-1)/gamma)
        [0.0, 0.0, e(-0.5), e(-1.0)],       # label position 4 has loss_mask 0
        [0.0, 1.0, e(-0.5), 0.0],           # position 10 is out of range
        [0.0, 0.0, 0.0, 0.0],               # invalid (padding) anchor
    ]])
    assert labels.shape == w.shape == (1, 4, bs)
    assert torch.allclose(w, expected, atol=1e-7, rtol=0)


def dpace_reference(per_row, w, width, a):
    """D-PACE's weights written out: w_j = sum over m >= j of prod over i <= m of ((1 - a) exp(-loss_i) + a), a
    product of 0 from an unscored position on."""
    q = (((1 - a) * torch.exp(-per_row.detach()) + a) * (w > 0)).view(-1, width)
    out = torch.zeros_like(q)
    for r in range(q.shape[0]):
        for j in range(width):
            out[r, j] = sum(math.prod(q[r, i].item() for i in range(m + 1)) for m in range(j, width))
    return out.reshape(-1)

@pytest.mark.parametrize("dpace", [0.0, 0.5], ids=["decay", "dpace"])
@pytest.mark.parametrize("distill", [0.0, 0.6, 1.0], ids=["ce", "ce-and-kl", "kl"])
@pytest.mark.parametrize("chunk_rows", [7, 5], ids=["equal-chunks", "padded-last-chunk"])
def test_dflash_loss_matches_plain_weighted_ce_and_kl_and_gradient(chunk_rows, distill, dpace):
    """The chunked LM head + CE, mixed with the KL to a teacher's softmax (the CPU path; test_kernels checks the
    GPU kernel against the same per-chunk function), against dense logits: 24 rows in chunks of at most 7 (4 x 6)
    or 5 (5 x 5, the last one padded); with D-PACE each row's weight times dpace_reference's of the rows' losses,
    no gradient through them."""
    g = torch.Generator().manual_seed(3)
    B, A, bs, H, V = 2, 3, 5, 16, 50
    hidden = torch.randn(B, A * bs, H, generator=g)
    W = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (B, A, bs), generator=g)
    weights = torch.rand(B, A, bs, generator=g) * (torch.rand(B, A, bs, generator=g) > 0.3)
    weights[:, :, 0] = 5.0            # k = 0 must never be scored, whatever the weight says
    N = B * A * (bs - 1)

    h1 = hidden.clone().requires_grad_(True)
    # rows share teacher states (overlapping blocks do), each row's index ascending as teacher_positions gives them
    teacher = torch.randn(N // 2, H, generator=g) if distill else None
    rows = torch.randint(0, N // 2, (N,), generator=g).sort().values if teacher is not None else None
    loss, acc, counts = dm.dflash_loss(h1, W, labels, weights, chunk_rows=chunk_rows, teacher=teacher,
                                       teacher_rows=rows, distill=distill, dpace=dpace)
    size, k = dm.chunk_plan(N, chunk_rows)
    assert k > 2 and size * k >= N and size <= chunk_rows                 # several chunks ran
    assert (size * k > N) == (chunk_rows == 5)
    (3.0 * loss).backward()                                                # non-unit upstream gradient

    h2 = hidden.clone().requires_grad_(True)
    logits = (h2.view(B, A, bs, H) @ W.t())[:, :, 1:].reshape(-1, V)
    y = labels[:, :, 1:].reshape(-1)
    w = weights[:, :, 1:].reshape(-1)
    per_row = F.cross_entropy(logits, y, reduction="none")
    if distill:
        kl = F.kl_div(logits.log_softmax(-1), (teacher[rows] @ W.t()).log_softmax(-1), log_target=True,
                      reduction="none").sum(-1)
        per_row = (1 - distill) * per_row + distill * kl
    factors = dpace_reference(per_row, w, bs - 1, dpace) if dpace else 1.0
    ref = (w * factors * per_row).sum() / w.sum()
    (3.0 * ref).backward()

    assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(h1.grad, h2.grad, rtol=1e-4, atol=1e-7)
    assert h1.grad[:, 0::bs].abs().max() == 0                             # k = 0 rows get no gradient
    sup = (w > 0).view(B * A, bs - 1)
    top = y if teacher is None else (teacher[rows] @ W.t()).argmax(-1)     # the target's choice under distillation
    assert teacher is None or (top != y).float().mean() > 0.5
    hit = (logits.argmax(-1) == top).view(B * A, bs - 1) & sup
    assert torch.equal(counts, sup.sum(0).float())
    assert torch.allclose(acc, hit.sum(0).float() / sup.sum(0).clamp(min=1).float())


def test_dpace_weighs_a_position_by_the_confidence_in_it_and_before_it_and_an_unscored_one_ends_the_chain():
    """Rows of 3 block positions: a position's weight is the block's expected acceptance through it (sum over m >= j of
    prod over i <= m of the smoothed confidences); a drafter sure of every position weighs them 3, 2, 1; an unscored
    position gets 0 and ends the chain for the positions after it; a higher loss lowers the later weights only."""
    sure = torch.zeros(3)
    assert dm.dpace_factors(sure, torch.ones(3), 3, 0.5).tolist() == [3.0, 2.0, 1.0]
    assert dm.dpace_factors(sure, torch.tensor([1.0, 0.0, 1.0]), 3, 0.5).tolist() == [1.0, 0.0, 0.0]
    w = torch.full((3,), 0.25)                                     # weighted losses are w * loss
    loss = torch.tensor([0.0, math.log(2.0), 0.0])                 # position 2: confidence 1/2, smoothed 3/4
    assert torch.allclose(dm.dpace_factors(w * loss, w, 3, 0.5), torch.tensor([1 + 0.75 + 0.75, 0.75 + 0.75, 0.75]))
    assert torch.allclose(dm.dpace_factors(w * loss, w, 3, 1.0), torch.tensor([3.0, 2.0, 1.0]))   # all smoothed away


def test_distillation_matches_the_targets_next_token_distributions_and_training_lowers_the_kl():
    """--distill 1: block position k of anchor a is taught the target's own distribution after position a + k - 1
    (its whole depth, final norm, LM head), equal to a dense KL over full logits, with the teacher's logits computed
    once per distinct position (overlapping blocks share them; unsampled anchors add none); a few steps lower it."""
    target = tiny_target("llama")
    drafter = drafter_for(target, block_size=4)
    c, B, S = drafter.config, 2, 48
    g = torch.Generator().manual_seed(0)
    ids, lm = torch.randint(0, c.vocab_size, (B, S), generator=g), torch.ones(B, S)
    anchors, valid = dm.sample_anchors(lm, torch.tensor([S, 10]), 8, c.block_size, g)   # row 1: 7 anchors of 8
    assert valid[0].all() and valid[1].sum() == 7
    positions, rows = dm.teacher_positions(anchors, valid, S, c.block_size)
    need = {b * S + min(int(a) + k - 1, S - 1) for b in range(B) for a, v in zip(anchors[b], valid[b]) if v
            for k in range(1, c.block_size)}
    assert positions.tolist() == sorted(need) and len(need) < int(valid.sum()) * (c.block_size - 1)
    flat = (torch.arange(B)[:, None, None] * S + anchors[:, :, None] + torch.arange(c.block_size - 1)).flatten()
    sampled = valid[:, :, None].expand(-1, -1, c.block_size - 1).flatten()
    assert torch.equal(positions[rows][sampled], flat[sampled])
    with torch.no_grad():
        feats = dm.target_forward(target, ids, c.target_layer_ids, final=True)
        full = target(ids).logits                                    # (B, S, V): the dense reference's teacher
    assert feats.shape[-1] == (len(c.target_layer_ids) + 1) * c.hidden_size
    cut = tiny_target("llama")
    cut.model.norm = torch.nn.Identity()          # as models.load_target cuts a target: its last state is no teacher
    with pytest.raises(ValueError, match="needs the target's whole depth"):
        dm.target_forward(cut, ids, c.target_layer_ids, final=True)

    def dense_kl():
        with torch.no_grad():
            block_ids, pos, labels, w = dm.make_blocks(ids, lm, anchors, valid, c.block_size, c.mask_token_id, 7.0)
            hidden = drafter.trunk(feats[..., :-c.hidden_size], block_ids, torch.arange(S).expand(B, S), pos,
                                   dm.dense_dflash_mask(anchors, S, c.block_size))
            h = hidden.view(B, -1, c.block_size, c.hidden_size)[:, :, 1:]
            q = (h @ drafter.lm_head_weight.t()).log_softmax(-1)
            at = (pos.view(B, -1, c.block_size)[:, :, 1:] - 1).clamp(max=S - 1)
            p = full[torch.arange(B)[:, None, None], at].log_softmax(-1)
            kl = F.kl_div(q, p, log_target=True, reduction="none").sum(-1)
            return float((kl * w[:, :, 1:]).sum() / w[:, :, 1:].sum())

    batch = dm.make_batch(ids, lm, anchors, valid, c, dm.Loss(7.0, distill=1.0))
    loss = float(drafter(feats, batch)[0].detach())
    before = dense_kl()
    assert abs(loss - before) <= 1e-4 * before, (loss, before)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(20):
        drafter(feats, batch)[0].backward()
        opt.step()
        opt.zero_grad()
    assert dense_kl() < 0.5 * before, (dense_kl(), before)


def test_a_batch_of_many_sequences_gives_the_losses_and_gradients_of_its_rows_run_one_by_one():
    """The sized batches change the speed, not the result: a step over 6 rows of different lengths has the
    loss, the hits and counts, and the gradients of the same rows run one at a time with the same weight sum."""
    import dflash_model as dm
    import train_dflash as tr
    S, A, bs, H, B = 128, 16, 8, 64, 6
    torch.manual_seed(3)
    cfg = small_config(hidden_size=H, block_size=bs)
    drafter = drafter_with_heads(cfg)
    lengths = torch.tensor([128, 100, 77, 64, 50, 33])
    ids, feats = torch.randint(0, 255, (B, S)), torch.randn(B, S, len(cfg.target_layer_ids) * H)
    lm = (torch.arange(S)[None] < lengths[:, None]).long()
    lm[:, :10] = 0                                                      # a prompt: no loss there
    anchors, valid = tr.sample_anchors_for(0, [(i, 0) for i in range(B)], lm, lengths, A, bs)
    wsum = float(dm.make_batch(ids, lm, anchors, valid, cfg, dm.Loss(4.0)).weights[:, :, 1:].sum())

    def run(rows):
        drafter.zero_grad(set_to_none=True)
        batch = dm.make_batch(ids[rows], lm[rows], anchors[rows], valid[rows], cfg, dm.Loss(4.0))
        loss, acc, cnt = drafter(feats[rows], batch, wsum)
        loss.backward()
        return loss.detach(), acc * cnt, cnt, [p.grad.clone() for p in drafter.parameters()]

    together = run(slice(0, B))
    alone = [run(slice(r, r + 1)) for r in range(B)]
    assert torch.allclose(together[0], sum(a[0] for a in alone), rtol=1e-5, atol=1e-6)
    assert torch.equal(together[1], sum(a[1] for a in alone)) and torch.equal(together[2], sum(a[2] for a in alone))
    for g, parts in zip(together[3], zip(*(a[3] for a in alone))):
        assert torch.allclose(g, sum(parts), rtol=1e-4, atol=1e-6)


# -----------------------------------------------------------------------------
# anchor sampling


def test_sample_anchors_rules_padding_and_determinism():
    B, S, bs, A = 4, 64, 8, 16
    lm = torch.rand(B, S, generator=torch.Generator().manual_seed(0)) < 0.7
    lengths = torch.tensor([64, 40, 9, 5])
    anchors, valid = dm.sample_anchors(lm, lengths, A, bs, torch.Generator().manual_seed(42))
    assert anchors.shape == valid.shape == (B, A) and anchors.dtype == torch.long
    n_cand = []
    for b in range(B):
        n = int(lengths[b])
        cand = [p for p in range(0, n - bs + 1) if lm[b, p] and lm[b, p + 1]]
        n_cand.append(len(cand))
        nv = int(valid[b].sum())
        assert valid[b, :nv].all() and not valid[b, nv:].any()            # valid first, then padding
        assert (anchors[b, nv:] == 0).all()                                # padding anchors are 0
        picked = anchors[b, :nv].tolist()
        assert picked == sorted(set(picked))                               # distinct, sorted
        for p in picked:
            assert p <= n - bs and lm[b, p] and lm[b, p + 1]
        if len(cand) <= A:
            assert picked == cand                                          # all of them, then padding
        else:
            assert nv == A
    assert n_cand[0] > A and 0 < n_cand[2] < A and n_cand[3] == 0          # the cases really occur
    # deterministic with a seeded generator, different with another seed
    again = dm.sample_anchors(lm, lengths, A, bs, torch.Generator().manual_seed(42))
    assert torch.equal(again[0], anchors) and torch.equal(again[1], valid)
    other = dm.sample_anchors(lm, lengths, A, bs, torch.Generator().manual_seed(43))
    assert not torch.equal(other[0][0], anchors[0])


# -----------------------------------------------------------------------------
# save / load


def _expected_weight_names(n_layers):
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(n_layers):
        p = f"layers.{i}."
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    return names


def test_save_load_roundtrip_and_format(targets, tmp_path):
    target = targets["qwen3"]
    d = drafter_for(target, 16, num_draft_layers=3, seed=4).eval()
    with torch.no_grad():                       # non-trivial norm weights, so a dropped tensor shows
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    path32 = tmp_path / "fp32"
    dm.save_drafter(d, str(path32), dtype=torch.float32)
    cfg = json.loads((path32 / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["num_hidden_layers"] == 3
    assert cfg["dflash_config"] == {"target_layer_ids": d.config.target_layer_ids, "block_size": 16,
                                    "mask_token_id": target.config.vocab_size - 1}
    for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "vocab_size", "rms_norm_eps", "rope_theta"):
        assert cfg[k] == getattr(d.config, k), k
    sd = load_file(str(path32 / "model.safetensors"))
    assert set(sd) == _expected_weight_names(3)
    assert not any("embed" in k or "lm_head" in k for k in sd)

    loaded = dm.load_drafter(str(path32), target=target).eval()
    assert loaded.config == d.config
    for k, v in d.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    with torch.no_grad():
        feats = dm.target_forward(target, torch.arange(20)[None], d.config.target_layer_ids)
    outs = []
    for m in (d, loaded):
        rows = decoding.DrafterRows(m, 1, 64)
        rows.prefill([0], feats, [20])
        outs.append(rows.propose(None, None, torch.tensor([5]))[0])
    assert torch.equal(outs[0], outs[1])

    # default save dtype (bf16): same names, bf16 tensors, loads to the bf16-rounded weights
    path16 = tmp_path / "bf16"
    dm.save_drafter(d, str(path16))
    sd16 = load_file(str(path16 / "model.safetensors"))
    assert set(sd16) == _expected_weight_names(3) and all(v.dtype == torch.bfloat16 for v in sd16.values())
    assert json.loads((path16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded16 = dm.load_drafter(str(path16), target=target)
    for k, v in d.state_dict().items():
        assert torch.equal(loaded16.state_dict()[k], v.to(torch.bfloat16).float()), k


def test_a_saved_drafter_folder_holds_what_vllm_and_sglang_read_and_a_model_card(tmp_path):
    """config.json: the mask token by id and by text (SGLang can look it up by name), the target it drafts for,
    full-attention layer types (the block attends both ways), block_size at the top and in dflash_config; weights
    under bare names (vLLM prefixes model.). README.md: the target, and vLLM's command with block_size - 1
    speculative tokens (the anchor is its bonus token), SGLang's with block_size draft tokens."""
    target = {"name": "org/target", "config": "c" * 16, "weights": None}
    cfg = small_config(block_size=8, mask_token="<|MASK|>", target=target)
    folder = str(tmp_path / "drafter")
    card = dm.model_card(cfg, folder, {"steps": 12}, {"tau": 3.1})
    dm.save_drafter(drafter_with_heads(cfg), folder, card=card)
    hf = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert hf["dflash_config"] == {"target_layer_ids": cfg.target_layer_ids, "block_size": 8, "mask_token_id": 255,
                                   "mask_token": "<|MASK|>", "target": target}
    assert hf["block_size"] == 8 and hf["layer_types"] == ["full_attention"] * 2
    assert set(load_file(str(tmp_path / "drafter" / "model.safetensors"))) == _expected_weight_names(2)
    loaded = dm.load_drafter(folder)
    assert (loaded.config.mask_token, loaded.config.target) == ("<|MASK|>", target)
    readme = (tmp_path / "drafter" / "README.md").read_text()
    spec = json.dumps({"method": "dflash", "model": folder, "num_speculative_tokens": 7})
    assert f"vllm serve org/target --speculative-config '{spec}'" in readme
    assert (f"python -m sglang.launch_server --model-path org/target --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {folder} --speculative-num-draft-tokens 8") in readme
    assert "| steps | 12 |" in readme and "| tau | 3.1 |" in readme


# -----------------------------------------------------------------------------
# rope table, GQA, the target's features, FLOPs


def test_rope_table_gives_the_angle_formula_exactly_and_is_not_saved():
    """The per-drafter cos/sin table, gathered by position, equals computing the angles in place
    (the pre-table code), in fp32 and after the bf16 cast; it is a non-persistent buffer."""
    c = dm.DFlashConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=64, num_target_layers=4, rope_theta=12345.0,
                        max_position_embeddings=300, num_draft_layers=1)
    d = dm.DFlashDrafter(c)
    pos = torch.tensor([[0, 1, 7, 150, 299], [3, 3, 298, 42, 5]])
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
    ang = pos.float()[..., None] * inv
    ang = torch.cat([ang, ang], dim=-1)[:, None]
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = d.rope(pos, dtype)
        assert cos.shape == sin.shape == (2, 1, 5, c.head_dim) and cos.dtype == dtype
        assert torch.equal(cos, ang.cos().to(dtype)) and torch.equal(sin, ang.sin().to(dtype))
    assert d.rope_cos.shape == (300, c.head_dim // 2)
    assert not any(k.startswith("rope_") for k in d.state_dict())       # the saved format is unchanged


def test_gqa_expand_hands_flex_one_kv_head_per_query_head_with_the_same_output_and_gradients(monkeypatch):
    """dm.attention repeats each kv head for its query heads before flex: the kernel sees as many kv heads as
    query heads, and the output equals flex's own GQA. (flex has no backward on CPU: the gradients are
    checked with SDPA over the same mask standing in for the kernel, against SDPA's own GQA.)"""
    S, A, bs = 128, 8, 16
    anchors = torch.tensor([[3, 20, 41, 60, 77, 90, 101, 112]])
    bm = dm.create_dflash_block_mask(anchors, S, bs)
    mask = dm.dense_dflash_mask(anchors, S, bs)
    g = torch.Generator().manual_seed(5)
    x = [torch.randn(1, h, L, 16, generator=g, dtype=torch.float64) for h, L in ((4, A * bs), (2, S + A * bs), (2, S + A * bs))]
    heads, real_flex = [], dm.flex_attention
    monkeypatch.setattr(dm, "flex_attention", lambda q, k, v, **kw: heads.append(k.shape[1]) or real_flex(q, k, v, **kw))
    monkeypatch.setattr(torch.compiler, "is_dynamo_compiling", lambda: True)    # flex eagerly: the kernel's math
    with torch.no_grad():
        ours = dm.attention(*x, bm)
        theirs = real_flex(*x, block_mask=bm, enable_gqa=True)
    assert heads == [4]
    sdpa = lambda q, k, v, **kw: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours, sdpa(*x), rtol=1e-10, atol=1e-10)
    monkeypatch.setattr(dm, "flex_attention", sdpa)
    grads = []
    for attend in (dm.attention, lambda q, k, v, bm: sdpa(q, k, v)):
        q, k, v = (t.clone().requires_grad_() for t in x)
        attend(q, k, v, bm).pow(2).sum().backward()
        grads.append((q.grad, k.grad, v.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_right_padded_rows_get_their_exact_features_without_a_mask(tmp_path):
    """The trainer pads rows on the right and runs the target with no padding mask: causal attention never
    lets a position see the ones after it, so each row's real positions get the features of that row alone."""
    import config
    target = models.load_target(f"random:{tiny_config_json(tmp_path / 'tiny.json')}", "cpu", torch.float32,
                                [0, 2], log=lambda m: None, whole=True)
    lengths, S = [64, 9, 40], 64
    ids = torch.randint(0, 512, (len(lengths), S))
    with torch.no_grad():
        batch = dm.target_forward(target, ids, [0, 2], final=True)
        for b, n in enumerate(lengths):
            alone = dm.target_forward(target, ids[b:b + 1, :n], [0, 2], final=True)
            torch.testing.assert_close(batch[b:b + 1, :n], alone, rtol=1e-5, atol=1e-5)


def test_matmul_flops_of_the_mfu_equal_torchs_flop_counter_on_a_real_step():
    """The MFU's analytic matmul FLOPs are what a drafter forward+backward really runs: torch's FLOP
    counter over one step of a tiny drafter (SDPA path: the counter sees the matmuls, not attention)
    counts exactly dm.matmul_flops. (The fc over the frozen target features has no input grad.)"""
    import dflash_model as dm
    from torch.utils.flop_counter import FlopCounterMode
    S, A, bs, H = 256, 16, 16, 64
    torch.manual_seed(7)
    cfg = small_config(hidden_size=H, num_draft_layers=3, block_size=bs)
    drafter = drafter_with_heads(cfg)
    feats = torch.randn(1, S, len(cfg.target_layer_ids) * H)
    ids, lm = torch.randint(0, 255, (1, S)), torch.ones(1, S)
    anchors, valid = dm.sample_anchors(lm, torch.tensor([S]), A, bs, torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        loss, _, _ = drafter(feats, dm.make_batch(ids, lm, anchors, valid, cfg, dm.Loss(7.0)))
        loss.backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    matmuls = sum(n for op, n in counts.items() if op in ("aten.mm", "aten.addmm", "aten.bmm"))
    assert matmuls == dm.matmul_flops(cfg, S, A), counts
    ctx = 100.0
    assert dm.step_flops(cfg, S, A, ctx) == matmuls + 3 * 3 * 4 * A * bs * 64 * (ctx + bs)
    # per row, attention from that row's VALID anchors only; all A anchors and the bucket's S in the matmuls
    anchors2 = torch.tensor([[10, 30, 0], [50, 0, 0]])
    valid2 = torch.tensor([[True, True, False], [True, False, False]])
    assert dm.batch_flops(cfg, S, anchors2, valid2) == (dm.step_flops(cfg, S, 3, ctx=20.0)
                                                        + dm.step_flops(cfg, S, 3, ctx=50.0))
    # on real tokens only (the MFU's second figure): each row's own length and its valid anchors' blocks
    assert dm.batch_flops(cfg, S, anchors2, valid2, lengths=torch.tensor([60, 80])) == \
        dm.step_flops(cfg, 60, 2, ctx=20.0) + dm.step_flops(cfg, 80, 1, ctx=50.0)
    assert dm.batch_flops(cfg, S, anchors, valid, lengths=[S]) == dm.batch_flops(cfg, S, anchors, valid)
    # distillation adds one LM head matmul per distinct taught position: 10-24 and 30-44, then 50-64
    taught2 = dm.teacher_positions(anchors2, valid2, S, bs)
    assert len(taught2[0]) == 30 + 15
    assert dm.batch_flops(cfg, S, anchors2, valid2, taught2) == \
        dm.batch_flops(cfg, S, anchors2, valid2) + 2 * (30 + 15) * H * 256
    taught = len(dm.teacher_positions(anchors, valid, S, bs)[0])
    feats_final = torch.cat([feats, torch.randn(1, S, H)], -1)     # the target's final states: the teacher
    batch = dm.make_batch(ids, lm, anchors, valid, cfg, dm.Loss(7.0, distill=0.5))
    with FlopCounterMode(display=False) as counter:
        drafter(feats_final, batch)[0].backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert sum(n for op, n in counts.items() if op in ("aten.mm", "aten.addmm", "aten.bmm")) == \
        dm.matmul_flops(cfg, S, A) + 2 * taught * H * 256, counts
