"""CPU tests of the method and its machinery; `python test_smoke.py` runs the whole suite (every test_*.py).

In file order: layer ids, the drafter config from HF target configs, the training mask (flex vs dense
vs a naive loop, the tile-level BlockMask), compiled flex == SDPA, blocks / labels / weights / loss /
gradient, anchor sampling, the decoding engine (greedy vs HF generate, lossless speculative decoding, a
batch of prompts as each alone), an overfit run that proves mask, labels and inference agree, save/load in
the serving format, the compile gate, the warm-up, eval_dflash's stop ids and acceptance by position.

Compiles are expensive on this CPU (7-40 s each), so every flex test shares ONE shape set through the
module-scoped `flex_case` fixture, and all flex calls run under torch.no_grad (grad mode is a dynamo
guard: mixing modes would compile twice). FlexAttention has no backward on CPU, so training here uses
attn="sdpa". The gate tests use tiny torch.compile(backend=<counting eager backend>) functions, which
exercise dynamo's per-call checks, stances and recompile limits without inductor.
"""
if __name__ == "__main__":   # the test command sets itself up: it installs what is missing, and says what
    import install
    install.main(["--test"])

import copy
import json
import math
import os
import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import torch.nn.functional as F
from safetensors.torch import load_file
from torch.nn.attention.flex_attention import create_mask
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen3Config, Qwen3ForCausalLM

import compiled
import decoding
import dflash_model as dm
from errors import UserError
import kernels
from compiled import GATE
import models
from replicas import forward_backward

FX_ERROR = "Detected that you are using FX to symbolically trace"
DEFAULT_RECOMPILE_LIMIT = GATE.recompile_limit


# -----------------------------------------------------------------------------
# helpers


def wait_until(pred, timeout, what):
    """Poll `pred` until it holds or `timeout` seconds pass (a deadline, not a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for: {what}")
        time.sleep(0.005)


class Worker(threading.Thread):
    """A thread that keeps its result or exception for the main thread to check."""

    def __init__(self, fn, name):
        super().__init__(name=name, daemon=True)
        self.fn, self.result, self.error = fn, None, None

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.error = e

    def outcome(self, timeout):
        self.join(timeout)
        assert not self.is_alive(), f"thread {self.name} still running after {timeout}s"
        if self.error is not None:
            raise self.error
        return self.result


class CountingBackend:
    """A torch.compile backend that counts real compiles and runs the captured graph eagerly."""

    def __init__(self):
        self.compiles = 0

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        return gm.forward


def naive_mask(anchors, S, bs):
    """The DFlash mask's formula, one element at a time: (B, Q, KV) bool."""
    B, A = anchors.shape
    Q, KV = A * bs, S + A * bs
    al = anchors.tolist()
    rows = []
    for b in range(B):
        for q in range(Q):
            i = q // bs
            a = al[b][i]
            rows.append([(kv < S and kv < a) or (kv >= S and (kv - S) // bs == i) for kv in range(KV)])
    return torch.tensor(rows, dtype=torch.bool).view(B, Q, KV)


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


def rel_err(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def tiny_target(arch, seed=0):
    """A tiny random causal LM. initializer_range 0.3 makes greedy continuations diverse
    (at 0.02 a random model falls into repeating one token after a few steps)."""
    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_hidden_layers=6, vocab_size=512, max_position_embeddings=512,
                  initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(arch)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def drafter_for(target, block_size, num_draft_layers=2, seed=1):
    torch.manual_seed(seed)
    cfg = dm.DFlashConfig.from_target_config(target.config, num_draft_layers=num_draft_layers,
                                             block_size=block_size,
                                             mask_token_id=target.config.vocab_size - 1)
    return dm.DFlashDrafter(cfg).attach_target(target)


def decode(target, prompt, n, stop_token_ids=(), drafter=None, block_size=None):
    """The decoding engine on one prompt (1, P): its ids (1, P + new) and acceptance lengths; speculative with a
    drafter, or with n-gram lookup when block_size is given."""
    p, L = prompt[0].tolist(), prompt.shape[1] + n + 2 * 16
    engine = decoding.Engine(target, 1, L, drafter.config.target_layer_ids if drafter else ())
    proposer = decoding.DrafterRows(drafter, 1, L) if drafter else block_size and decoding.NGram(block_size)
    out, acc = decoding.speculate(engine, [p], n, stop_token_ids, proposer or None)[0]
    return torch.tensor([p + out]), acc


# -----------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Two CPU cores shared with other jobs: one intra-op thread is several times faster than two
    here (measured: ~35 ms per overfit step with 1 thread, ~500 ms with 2 under contention). Set
    before this module's first compile, restored after its last test (other test files)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def reset_gate():
    """The gate as a fresh process has it: cold, default limits, applied in this thread."""
    torch.compiler.set_stance("default")
    GATE.__init__()
    GATE.configure_thread()


def is_warmed(name, device, shape):
    return GATE.key(name, device, shape) in GATE.warmed


@pytest.fixture(autouse=True)
def clean_gate():
    """Every test starts and ends with a cold gate, default limits and the FX flag down."""
    reset_gate()
    yield
    torch.fx._symbolic_trace._is_fx_tracing_flag = False
    reset_gate()


@pytest.fixture(scope="module")
def flex_case():
    """The one flex shape of this file: B=3, S=256, 16 anchors x block 16 (Q=256, KV=512), block
    mask built once. Batch 0: 16 valid anchors, 8 below and 8 above 128, incl. the last valid
    position S-bs; batch 1:
    length 200, 10 valid incl. its last valid position 184, 6 padding blocks; batch 2: 3 valid
    (one of them at 0), 13 padding blocks."""
    B, S, A, bs, H = 3, 256, 16, 16, 64
    g = torch.Generator().manual_seed(1234)
    anchors = torch.zeros(B, A, dtype=torch.long)
    valid = torch.zeros(B, A, dtype=torch.bool)
    # batch 0: 8 anchors below 128 and 8 at or above 128 (so query tile 1 sees all of context
    # tile 0: a FULL tile), the last one at the last valid position S - bs
    anchors[0] = torch.cat([torch.randperm(128, generator=g)[:8].sort().values,
                            128 + torch.randperm(S - bs - 128, generator=g)[:7].sort().values,
                            torch.tensor([S - bs])])
    valid[0] = True
    anchors[1, :10] = torch.cat([torch.randperm(184, generator=g)[:9].sort().values, torch.tensor([184])])
    valid[1, :10] = True
    anchors[2, :3] = torch.tensor([0, 17, 60])
    valid[2, :3] = True
    loss_mask = torch.zeros(B, S, dtype=torch.bool)
    loss_mask[0] = True
    loss_mask[1, :200] = True
    loss_mask[2, :80] = True
    input_ids = torch.randint(0, 255, (B, S), generator=g)

    torch.manual_seed(7)
    cfg = dm.DFlashConfig(hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, vocab_size=256, num_target_layers=6, num_draft_layers=2,
                          block_size=bs, mask_token_id=255)
    drafter = dm.DFlashDrafter(cfg, embed_weight=torch.randn(256, H), lm_head_weight=0.3 * torch.randn(256, H))
    drafter.eval()
    flex = compiled.compile_drafter(copy.deepcopy(drafter))     # the same weights, compiled: flex on a BlockMask
    feats = torch.randn(B, S, len(cfg.target_layer_ids) * H)
    with torch.no_grad():
        bm = dm.create_dflash_block_mask(anchors, S, bs)
    batch = dm.make_batch(input_ids, loss_mask, anchors, valid, cfg, 7.0)
    return SimpleNamespace(B=B, S=S, A=A, bs=bs, anchors=anchors, valid=valid, loss_mask=loss_mask,
                           input_ids=input_ids, drafter=drafter, flex=flex, feats=feats, bm=bm, gamma=7.0, batch=batch)


@pytest.fixture(scope="module")
def targets():
    return {"qwen3": tiny_target("qwen3", seed=0), "llama": tiny_target("llama", seed=3)}


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
        loss, _, _ = drafter(feats, dm.make_batch(seq, loss_mask, anchors, valid, drafter.config, gamma))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        if step % 10 == 9:
            with torch.no_grad():
                _, acc, _ = drafter(feats, dm.make_batch(seq, loss_mask, all_anchors, all_valid, drafter.config,
                                                         gamma))
            tau = dm.simulated_tau(acc)
            if tau >= 7.9:
                break
    drafter.eval()
    return SimpleNamespace(target=target, drafter=drafter, seq=seq, P=P, bs=bs, train_tau=tau,
                           steps=step + 1, seconds=time.time() - t0)


# -----------------------------------------------------------------------------
# 1-2. layer ids and config


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
# 3-4. the training mask and compiled flex attention


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


def test_compiled_flex_output_equals_sdpa_with_naive_mask(flex_case):
    """Element-level check of the compiled block mask through the compiled flex kernel."""
    c = flex_case
    g = torch.Generator().manual_seed(11)
    Q, KV = c.A * c.bs, c.S + c.A * c.bs
    q = torch.randn(c.B, 4, Q, 16, generator=g)
    k = torch.randn(c.B, 2, KV, 16, generator=g)
    v = torch.randn(c.B, 2, KV, 16, generator=g)
    mask = naive_mask(c.anchors, c.S, c.bs)[:, None]
    with torch.no_grad():
        out = GATE.run("flex", "cpu", tuple(q.shape) + tuple(k.shape), compiled.compiled_attention, q, k, v, c.bm)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert rel_err(out, ref) < 1e-4
    with torch.no_grad():   # the key includes grad mode (part of dynamo's guards)
        assert is_warmed("flex", "cpu", tuple(q.shape) + tuple(k.shape))


def test_flex_drafter_forward_equals_sdpa(flex_case):
    c = flex_case
    b = c.batch
    with torch.no_grad():
        loss_f, acc_f, cnt_f = c.flex(c.feats, b)
        loss_s, acc_s, cnt_s = c.drafter(c.feats, b)
        # the hidden states themselves, through the same compiled entry the loss used
        ctx_pos = torch.arange(c.S).expand(c.B, c.S)
        h_flex = c.flex.trunk(c.feats, b.block_ids, ctx_pos, b.block_pos, c.bm)
        h_sdpa = c.drafter.trunk(c.feats, b.block_ids, ctx_pos, b.block_pos, naive_mask(c.anchors, c.S, c.bs)[:, None])
    assert math.isfinite(float(loss_s)) and float(loss_s) > 0
    assert abs(float(loss_f) - float(loss_s)) / abs(float(loss_s)) < 1e-4
    assert rel_err(h_flex, h_sdpa) < 1e-4
    assert torch.equal(cnt_f, cnt_s)
    assert torch.allclose(acc_f, acc_s)


def test_warm_up_compiles_each_replica_and_shape_sizes_the_recompile_limit_and_marks_the_gate_warm(flex_case):
    """warm_up runs every (replica, shape) in turn, one dynamo entry each (+2 spare), then marks the gate
    warm; the flex rows say how each compile went (here: the trunk this file already compiled for the
    flex_case shape, in no-grad mode, so reused in process)."""
    c, logs = flex_case, []
    rows = compiled.warm_up([c.drafter, c.drafter], [(1, 128, 8), (1, 256, 8)], forward_backward, 7.0,
                            log=logs.append)
    assert [(r[1], r[3]) for r in rows] == [((1, 128, 8), "eager (sdpa)"), ((1, 256, 8), "eager (sdpa)")] * 2
    assert GATE.recompile_limit == 2 * 2 + 2 and GATE.warm
    # each line counts the pairs and, but for the last, gives the rest's ETA
    assert logs[-1].startswith("[gate] warm: ")                    # through the warm-up's log
    found = [re.match(r"\[warmup\] (\d)/4 cpu .*?( \| ETA \d+s)?$", m) for m in logs[:-1]]
    assert [(m.group(1), m.group(2) is not None) for m in found] == \
        [("1", True), ("2", True), ("3", True), ("4", False)], logs
    reset_gate()
    with torch.no_grad():
        c.flex(c.feats, c.batch)
        reset_gate()
        rows = compiled.warm_up([c.flex], [(c.B, c.S, c.A)], forward_backward, 7.0, log=logs.append)
        assert rows[0][3] in ("reused (in process)", "cache hit") and is_warmed(
            "drafter_fwd", "cpu", (c.B, c.S, c.A, c.bs))
        # an unwarmed shape is refused under the warm gate, naming it
        with pytest.raises(compiled.UnwarmedShapeError, match=r"\(3, 128, 8, 16\)"):
            c.flex(c.feats[:, :128], dm.make_batch(c.input_ids[:, :128], c.loss_mask[:, :128],
                                                   c.anchors[:, :8].clamp(max=100), c.valid[:, :8], c.flex.config, c.gamma))


# -----------------------------------------------------------------------------
# 5. blocks, labels, weights, loss


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


@pytest.mark.parametrize("distill", [0.0, 0.6, 1.0], ids=["ce", "ce-and-kl", "kl"])
@pytest.mark.parametrize("chunk_rows", [7, 5], ids=["equal-chunks", "padded-last-chunk"])
def test_dflash_loss_matches_plain_weighted_ce_and_kl_and_gradient(chunk_rows, distill):
    """The chunked LM head + CE, mixed with the KL to a teacher's softmax (the CPU path; test_kernels checks the
    GPU kernel against the same per-chunk function), against dense logits: 24 rows in chunks of at most 7 (4 x 6)
    or 5 (5 x 5, the last one padded)."""
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
                                       teacher_rows=rows, distill=distill)
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
    ref = (w * per_row).sum() / w.sum()
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

    batch = dm.make_batch(ids, lm, anchors, valid, c, 7.0, distill=1.0)
    loss = float(drafter(feats, batch)[0].detach())
    before = dense_kl()
    assert abs(loss - before) <= 1e-4 * before, (loss, before)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(20):
        drafter(feats, batch)[0].backward()
        opt.step()
        opt.zero_grad()
    assert dense_kl() < 0.5 * before, (dense_kl(), before)


# -----------------------------------------------------------------------------
# 6. anchor sampling


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
# 7-8. speculative decoding: lossless greedy, and an overfit drafter


def _hf_greedy(target, prompt, n, eos=None):
    out = target.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                          max_new_tokens=n, eos_token_id=eos, pad_token_id=0)
    return out


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


# -----------------------------------------------------------------------------
# 9. save / load


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


# -----------------------------------------------------------------------------
# 10. the compile gate


def test_gate_fx_flag_bypass_fails_and_gated_call_waits():
    """While another thread holds the FX-tracing flag up (what make_fx does during a compile), a compiled
    call that bypasses the gate fails with dynamo's FX error; through the gate it waits, then runs."""
    cnt = CountingBackend()
    fn = torch.compile(lambda x: x * 2 + 1, backend=cnt, dynamic=False)
    x = torch.arange(4.0)
    fx = torch.fx._symbolic_trace
    assert fx._is_fx_tracing_flag is False
    raised, release = threading.Event(), threading.Event()

    def hold_flag_up():      # stands in for a compile in progress (make_fx raises this flag)
        fx._is_fx_tracing_flag = True
        raised.set()
        try:
            if not release.wait(60):
                raise AssertionError("never released")
        finally:
            fx._is_fx_tracing_flag = False

    holder = Worker(lambda: GATE.run("compiling", "cpu", (0,), hold_flag_up), "holder")
    waiter = None
    holder.start()
    try:
        assert raised.wait(30), "holder thread never raised the flag"
        assert fx.is_fx_symbolic_tracing()          # exactly what dynamo's per-call check reads
        with pytest.raises(RuntimeError, match=FX_ERROR):
            fn(x)                                    # bypassing the gate: fails in this thread
        waiter = Worker(lambda: GATE.run("toy", "cpu", (4,), fn, x), "waiter")
        waiter.start()
        wait_until(lambda: GATE.waiting == 1, 30, "the gated call to wait on the gate")
        assert waiter.is_alive() and waiter.result is None and waiter.error is None
        assert fx._is_fx_tracing_flag is True
    finally:
        release.set()
    holder.outcome(30)
    got = waiter.outcome(120)
    assert fx._is_fx_tracing_flag is False
    assert GATE.waiting == 0
    assert torch.equal(got, x * 2 + 1) and cnt.compiles == 1


def test_gate_unwarmed_shape_errors():
    cnt = CountingBackend()
    fn = torch.compile(lambda x: x * 2 + 1, backend=cnt, dynamic=False)
    x2 = torch.arange(2.0)
    assert torch.equal(GATE.run("toy", "cpu", (2,), fn, x2), x2 * 2 + 1)
    assert cnt.compiles == 1
    GATE.mark_warm()
    assert torch.equal(GATE.run("toy", "cpu", (2,), fn, x2), x2 * 2 + 1)    # warmed key: fine
    x5 = torch.arange(5.0)
    with pytest.raises(compiled.UnwarmedShapeError) as ei:
        GATE.run("toy", "cpu", (5,), fn, x5)
    msg = str(ei.value)
    assert "toy" in msg and "(5,)" in msg and "cpu" in msg
    assert cnt.compiles == 1 and not is_warmed("toy", "cpu", (5,))          # nothing ran


def test_gate_warm_stance_fails_bypassing_recompile():
    cnt = CountingBackend()
    fn = torch.compile(lambda x: x - 1, backend=cnt, dynamic=False)
    x = torch.ones(3)
    GATE.run("toy2", "cpu", (3,), fn, x)
    GATE.mark_warm()
    with pytest.raises(RuntimeError, match="fail_on_recompile"):
        fn(torch.ones(7))                        # a compile behind the gate's back is refused
    assert cnt.compiles == 1


def test_gate_recompile_limit_hit_is_an_error():
    from torch._dynamo.exc import FailOnRecompileLimitHit
    GATE.set_recompile_limit(1)
    assert torch._dynamo.config.recompile_limit == 1
    cnt = CountingBackend()
    fn = torch.compile(lambda x: x * 3, backend=cnt, dynamic=False)        # fullgraph=False on purpose
    assert torch.equal(GATE.run("lim", "cpu", (2,), fn, torch.ones(2)), 3 * torch.ones(2))
    with pytest.raises(FailOnRecompileLimitHit):
        GATE.run("lim", "cpu", (3,), fn, torch.ones(3))
    assert cnt.compiles == 1
    # control: without the gate's setting the same situation silently runs eager (what it prevents)
    cnt2 = CountingBackend()
    fn2 = torch.compile(lambda x: x * 4, backend=cnt2, dynamic=False)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=False):
        fn2(torch.ones(2))
        assert torch.equal(fn2(torch.ones(3)), 4 * torch.ones(3))
    assert cnt2.compiles == 1


def test_gate_config_takes_in_worker_thread():
    from torch._dynamo.exc import FailOnRecompileLimitHit
    GATE.set_recompile_limit(2)                  # set (and checked) in the main thread only
    cnt = CountingBackend()
    fn = torch.compile(lambda x: x + 5, backend=cnt, dynamic=False)

    def worker():
        import torch._dynamo.config as dc
        keys = ("recompile_limit", "fail_on_recompile_limit_hit", "error_on_nested_fx_trace")
        before = tuple(getattr(dc, k) for k in keys)
        GATE.configure_thread()
        after = tuple(getattr(dc, k) for k in keys)
        GATE.run("w", "cpu", (1,), fn, torch.ones(1))
        GATE.run("w", "cpu", (2,), fn, torch.ones(2))
        try:
            GATE.run("w", "cpu", (3,), fn, torch.ones(3))
            third = "ran"
        except FailOnRecompileLimitHit:
            third = "raised"
        return before, after, third

    w = Worker(worker, "cfg-worker")
    w.start()
    before, after, third = w.outcome(60)
    assert before[0] == DEFAULT_RECOMPILE_LIMIT and before[1] is False, \
        f"main-thread dynamo config leaked into a new thread ({before}): per-thread config assumption broken"
    assert after == (2, True, True)
    assert third == "raised" and cnt.compiles == 2


# -----------------------------------------------------------------------------
# speed-path details: rope table, CE 'correct', flex kernel options, position limits


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


def test_ce_correct_means_the_label_has_the_row_max():
    logits = torch.tensor([[0.0, 3.0, 1.0, -2.0],      # label 1 is the max
                           [5.0, 3.0, 1.0, 4.0],       # label 3 is not
                           [2.0, 2.0, 0.5, 0.0],       # label 1 ties with an earlier max: counted correct
                           [0.0, 0.0, 0.0, 9.0]])      # label 3 is the max
    _, correct, _ = kernels.ce_chunk_eager(logits, torch.tensor([1, 3, 1, 3]), torch.ones(4))
    assert correct.tolist() == [True, False, True, True]


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


def test_generate_refuses_positions_beyond_the_rope_table(targets):
    target = targets["qwen3"]
    drafter = drafter_for(target, 16)
    n = drafter.config.max_position_embeddings
    with pytest.raises(UserError, match="exceed the .* positions of the drafter's rotary table"):
        decode(target, torch.zeros(1, 8, dtype=torch.long), n, drafter=drafter)


# -----------------------------------------------------------------------------
# 11. what warmup.py builds, the block-mask guard, eval_dflash's stop ids and acceptance by position


def tiny_config_json(path, **extra):
    """A tiny Llama config written to `path`: a random:<path> target for the trainer's own loading."""
    path.write_text(json.dumps(dict(model_type="llama", hidden_size=64, intermediate_size=128,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    num_hidden_layers=4, vocab_size=512, max_position_embeddings=512, **extra)))
    return path


def layout(t):
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.storage_offset(), t.untyped_storage().nbytes())


@pytest.mark.parametrize("tied", [False, True])
def test_warmup_builds_the_drafter_the_trainer_builds(tmp_path, tied):
    """Compiled graphs depend on the drafter's config (mask token included), its weights' dtype, and the
    embedding / LM head tensors it reads (dtype, layout, aliasing): `python warmup.py` must fill the
    cache entries the trainer then hits, so it builds the trainer's drafters (without the target's
    weights)."""
    import config
    import train_dflash as tr
    import warmup
    path = tiny_config_json(tmp_path / "tiny.json", tie_word_embeddings=tied)
    cfg = config.parse_args(["--target", f"random:{path}", "--data", "synthetic:4", "--max-length", "256",
                             "--num-anchors", "32", "--block-size", "8", "--num-draft-layers", "2",
                             "--target-devices", "cpu", "--drafter-devices", "cpu", "--out-dir", str(tmp_path)])
    trainer = tr.Trainer(cfg, log=lambda m: None)
    trainer.setup()
    trainer.build_models()
    dcfg, drafters, shapes = warmup.build_drafters(cfg)
    mine, theirs = drafters[0], trainer.replicas.drafters[0]
    assert dcfg == trainer.dcfg and shapes == trainer.plan.shapes and len(drafters) == len(trainer.replicas.drafters) == 1
    assert dcfg.mask_token_id == 511                                # the trainer's pick for a tokenizer-less target
    assert [(n, p.dtype, p.shape, p.requires_grad) for n, p in mine.named_parameters()] == \
        [(n, p.dtype, p.shape, p.requires_grad) for n, p in theirs.named_parameters()]
    for name in ("embed_weight", "lm_head_weight"):
        assert layout(getattr(mine, name)) == layout(getattr(theirs, name)), name
    for d in (mine, theirs):      # tied: two tensor objects over one storage, in both
        assert (d.embed_weight.data_ptr() == d.lm_head_weight.data_ptr()) is tied and d.embed_weight is not d.lm_head_weight


def test_a_random_target_has_the_same_weights_on_every_device_and_in_every_run(tmp_path):
    """random:<config> targets (benchmarks) are seeded: with several target devices, a batch's features
    must not depend on which target thread took it, and two runs must see the same target."""
    import config
    path = tiny_config_json(tmp_path / "tiny.json")
    a = models.load_target(f"random:{path}", "cpu", torch.float32, [1, 2], log=lambda m: None)
    torch.randn(1000)        # whatever the global RNG did in between
    b = models.load_target(f"random:{path}", "cpu", torch.float32, [1, 2], log=lambda m: None)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert sa["model.layers.0.mlp.up_proj.weight"].std() > 0      # random, not zeros


def test_the_target_runs_only_up_to_its_deepest_captured_layer_with_the_full_models_features(tmp_path):
    """Layers past the deepest feature layer are dropped and the final norm with them; the features,
    captured by our hooks, are the full model's hidden states of those layers (transformers' indexing:
    layer i's output is hs[i + 1]), as evaluation reads them from an uncut target."""
    from transformers import LlamaConfig, LlamaForCausalLM
    import config
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path)
    full = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        hs = full.model(ids, output_hidden_states=True).hidden_states      # hs[i + 1]: layer i's output
        lines = []
        cut = models.load_target(str(tmp_path), "cpu", torch.float32, [1, 3], log=lines.append)
        feats = dm.target_forward(cut, ids, [1, 3])
    assert len(cut.model.layers) == 4 and isinstance(cut.model.norm, torch.nn.Identity)
    assert torch.equal(feats, torch.cat([hs[2], hs[4]], -1))
    assert "kept 4/6 layers" in lines[-1]
    last = models.load_target(str(tmp_path), "cpu", torch.float32, [1, 5], log=lines.append)
    assert len(last.model.layers) == 6 and not isinstance(last.model.norm, torch.nn.Identity)  # nothing to cut


# The compiled-target tests share one (B, S) set: dynamo's entries for a decoder layer's code object
# outlive a test and count toward the recompile limit that each warm-up sets.
TARGET_SHAPES = [(2, 64, 8), (1, 128, 8)]


def test_compiled_targets_give_the_eager_features_in_their_threads_through_the_warm_gate(tmp_path):
    """With flex (GPUs) the target's decoder layers are compiled, warmed with the drafter's (B, S) and
    checked against eager features at the warm-up. Then, as in training, each target runs in its own
    thread through the shared gate: the features equal the eager target's, and an unwarmed shape is refused."""
    import config
    path = f"random:{tiny_config_json(tmp_path / 'tiny.json')}"
    eager, *targets = (models.load_target(path, "cpu", torch.float32, [0, 2], log=lambda m: None) for _ in range(3))
    for t in targets:
        compiled.compile_target_layers(t)
    graphed = [compiled.GraphedTarget(t, [0, 2], False) for t in targets]
    rows = compiled.warm_up([], TARGET_SHAPES + [(1, 128, 16)], None, 7.0, log=lambda m: None, targets=graphed)
    assert [(r[0], r[1]) for r in rows] == [("cpu target", (1, 128)), ("cpu target", (2, 64))] * 2
    kinds = [r[3] for r in rows]
    assert all(re.search(r"(compile|hit|\(in process\)), features \de[+-]\d+ from eager", k) for k in kinds), kinds
    assert GATE.warm
    batches = []
    for B, S in [(2, 64), (1, 128)] * 2:
        ids = torch.randint(0, 512, (B, S))
        with torch.no_grad():
            batches.append((ids, dm.target_forward(eager, ids, [0, 2])))
    results, errors = {}, []

    def worker(i):
        try:
            # 20 passes: enough calls that threads sharing one code object's dynamo cache would race
            results[i] = [graphed[i](ids) for ids, _ in batches * 20]
        except Exception as e:       # noqa: BLE001 - asserted below, with the thread's error
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        for got, (_, want) in zip(results[i], batches * 20):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(compiled.UnwarmedShapeError, match=r"'target_layer'.*\(1, 64, 64\)"):
        graphed[0](torch.randint(0, 512, (1, 64)))


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


@pytest.mark.parametrize("where", ["every position", "one position a row"])
def test_a_compiled_target_whose_features_differ_from_eager_is_refused_at_the_warm_up(tmp_path, monkeypatch, where):
    """Refused where its rows' positions differ; not for a few positions far off (bf16 on random tokens)."""
    import config
    target = models.load_target(f"random:{tiny_config_json(tmp_path / 'tiny.json')}", "cpu", torch.float32,
                                [0, 2], log=lambda m: None)
    layer_class = type(target.model.layers[0])
    eager_forward = layer_class.forward

    def miscompiled(self, h, *args, **kwargs):      # what a wrong compile would do: other values than eager
        out = eager_forward(self, h, *args, **kwargs)
        if not torch.compiler.is_compiling():
            return out
        if where == "every position":
            return out * 1.5
        return torch.cat([out[:, :-1], 100 * out[:, -1:]], 1)    # the last position: causal, no other reads it
    monkeypatch.setattr(layer_class, "forward", miscompiled)
    compiled.compile_target_layers(target)
    rows = []
    graphed = compiled.GraphedTarget(target, [0, 2], False)
    warm = lambda: rows.extend(compiled.warm_up([], TARGET_SHAPES, None, 7.0, log=lambda m: None, targets=[graphed]))
    if where == "every position":
        with pytest.raises(UserError, match=r"^the compiled target's features at \(B, S\) = \(1, 128\) "
                           r"differ from the eager target's: a row's median position by .* \(relative; torch.float32 "
                           r"allows 0.0001\)"):
            warm()
    else:
        warm()
        notes = [float(how.split("features ")[1].split()[0]) for _, _, _, how in rows]   # "features 1e-07 from eager"
        assert len(notes) == len(TARGET_SHAPES) and max(notes) < 1e-4


def test_warmup_py_fills_the_targets_cache_from_random_weights_of_its_shape(tmp_path):
    """warmup.py compiles the target's layers on random weights of the target's shape: the compile cache
    it fills serves the real weights (a cache hit in a later process), because a compile reads shapes,
    never values. (Processes of their own: in this one, dynamo would reuse its in-process graphs.)"""
    import sys
    from test_train import run_cmd
    from transformers import LlamaConfig, LlamaForCausalLM
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "m")
    code = ("import sys, torch, compiled\n"
            f"compiled.use_compile_cache({str(tmp_path / 'cache')!r})\n"
            "import config, models, dflash_model as dm\n"
            f"t = models.load_target({str(tmp_path / 'm')!r}, 'cpu', torch.float32, [0, 2], log=print, "
            "random_weights=sys.argv[1] == 'random')\n"
            "compiled.compile_target_layers(t)\n"
            "print('rows', compiled.warm_up([], [(2, 64, 8)], None, 7.0, targets=[compiled.GraphedTarget(t, [0, 2], False)], "
            "log=lambda m: None))\n")
    out = []
    for weights in ("random", "real"):
        p = run_cmd([sys.executable, "-c", code, weights], timeout=300)
        assert p.rc == 0, p.tail()
        out.append(p.out)
    assert "random weights of" in out[0] and "cold compile" in out[0], out[0]
    assert "random weights" not in out[1] and "'cache hit, features" in out[1], out[1]


def test_flex_refuses_to_run_eagerly_when_dynamo_is_off(tmp_path):
    """TORCHDYNAMO_DISABLE=1 turns every torch.compile into the plain function: flex_attention would
    then run its dense math path (B x H x Q x KV scores), silently. The guard makes it an error, for
    the flex call alone and the compiled trunk. (A subprocess: in this one, a dynamo skip of the
    code object would stick for every later test.)"""
    import subprocess
    import sys
    code = ("import torch, compiled, dflash_model as dm\n"
            "anchors = torch.tensor([[0, 40, 100, 200, 0, 0, 0, 0]])\n"
            "bm = dm.create_dflash_block_mask(anchors, 256, 16)\n"
            "q, kv = torch.randn(1, 2, 128, 16), torch.randn(1, 2, 384, 16)\n"
            "c = dm.DFlashConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,"
            " head_dim=16, vocab_size=64, num_target_layers=4, max_position_embeddings=512, num_draft_layers=1)\n"
            "d, pos = dm.DFlashDrafter(c), torch.arange(256)[None]\n"
            "feats, ids = torch.randn(1, 256, len(c.target_layer_ids) * 32), torch.zeros(1, 128, dtype=torch.long)\n"
            "calls = [lambda: compiled.compiled_attention(q, kv, kv, bm),\n"
            "         lambda: compiled.compiled_trunk(d, feats, ids, pos, pos[:, :128], bm)]\n"
            "for call in calls:\n"
            "    try:\n"
            "        call()\n"
            "    except RuntimeError as e:\n"
            "        print('refused:', e)\n")
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.abspath(__file__)), env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("refused: flex attention ran uncompiled") == 2, p.stdout


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


def test_eval_acceptance_by_position_from_a_histogram_equals_the_hand_count():
    """Block 6, rounds by acceptance length {1: 4, 2: 3, 4: 2, 5: 1}: 10 rounds reach position 1 and 6
    accept it; 6 reach 2, 3 accept; 3 reach 3, all accept; 3 reach 4, 1 accepts; 1 reaches 5, none.
    No round reaching a position: None, not a division by zero."""
    import collections
    import eval_dflash
    got = eval_dflash.acceptance_by_position(collections.Counter({1: 4, 2: 3, 4: 2, 5: 1}), bs=6)
    assert got == [6 / 10, 3 / 6, 3 / 3, 1 / 3, 0 / 1]
    assert eval_dflash.acceptance_by_position(collections.Counter({1: 5}), bs=4) == [0.0, None, None]
    assert eval_dflash.acceptance_by_position(collections.Counter(), bs=3) == [None, None]


if __name__ == "__main__":
    # The test command: every test file of the project, on CPU. Most tests run a script in a process of
    # its own, so two pytest workers (pytest-xdist, in requirements-test.txt) take about half the time.
    import importlib.util
    import pathlib
    import sys
    # the files that need the embedded default first, the slowest first: one worker converts the default while
    # the other starts on the files that need none of it; a worker whose tests run out takes the other's last ones
    # (worksteal), so both end together
    first = ["test_train.py", "test_generate.py", "test_data.py"]
    files = sorted(pathlib.Path(__file__).resolve().parent.glob("test_*.py"),
                   key=lambda p: (first.index(p.name) if p.name in first else len(first), p.name))
    files = [str(p) for p in files]
    workers = ["-n", "2", "--dist", "worksteal"] if importlib.util.find_spec("xdist") else []
    workers += ["--timeout", "900"] if importlib.util.find_spec("pytest_timeout") else []   # a hang fails its test
    # one intra-op thread per worker: two workers and their scripts share the cores, and torch's threads
    # spinning on an oversubscribed core slow a worker's own tests many times over
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # nothing written into the checkout: pytest's own cache, and pytest-benchmark's folder where it is installed
    quiet = ["-p", "no:cacheprovider"] + (["-p", "no:benchmark"] if importlib.util.find_spec("pytest_benchmark") else [])
    sys.exit(pytest.main(["-q", *quiet, *workers, *files, *sys.argv[1:]]))
