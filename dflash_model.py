"""The DFlash drafter: 1. config and Qwen3-shaped model, 2. the training mask and its tile-level BlockMask, 3. anchors,
blocks, loss, FLOPs, 4. the target's features, 5. save / load. Compiled path: compiled.py; decoding: decoding.py."""
import functools
import json
import math
import os
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_mask, flex_attention

import kernels
from errors import UserError

# ---- 1. Config and model

def build_target_layer_ids(num_target_layers, num_draft_layers):
    """Which target layers feed the drafter: spread over the depth, skipping the first and last ones."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4                     # from layer 1 to layer num_target_layers - 3
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]

def _rope_theta(cfg):
    if getattr(cfg, "rope_theta", None) is not None:
        return float(cfg.rope_theta)
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    for p in (params, *params.values()):        # one dict, or one per layer type
        if isinstance(p, dict) and "rope_theta" in p:
            return float(p["rope_theta"])
    return 10000.0

@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    num_draft_layers: int = 5
    block_size: int = 16
    mask_token_id: int = 0
    target_layer_ids: list = field(default_factory=list)
    mask_token: str = ""        # the mask token's text: serving engines that look it up by name
    target: dict = field(default_factory=dict)   # the target it drafts for (models.target_identity)

    def __post_init__(self):
        if not self.target_layer_ids:
            self.target_layer_ids = build_target_layer_ids(self.num_target_layers, self.num_draft_layers)
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} outside a target of {self.num_target_layers} layers")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside vocab {self.vocab_size}")
        if self.block_size < 2:
            raise ValueError("block_size must be >= 2")

    @classmethod
    def from_target_config(cls, tcfg, num_draft_layers=5, block_size=16, mask_token_id=0, target_layer_ids=None):
        """Take sizes from any transformers causal-LM config (Qwen3, Qwen2, Llama, ...)."""
        tcfg = getattr(tcfg, "text_config", None) or tcfg
        heads = tcfg.num_attention_heads
        return cls(hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size,
                   num_attention_heads=heads, num_key_value_heads=getattr(tcfg, "num_key_value_heads", None) or heads,
                   head_dim=getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads, vocab_size=tcfg.vocab_size,
                   num_target_layers=tcfg.num_hidden_layers, rope_theta=_rope_theta(tcfg),
                   rms_norm_eps=getattr(tcfg, "rms_norm_eps", None) or 1e-6,
                   max_position_embeddings=getattr(tcfg, "max_position_embeddings", 40960),
                   num_draft_layers=num_draft_layers, block_size=block_size, mask_token_id=mask_token_id,
                   target_layer_ids=list(target_layer_ids or []))

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight.to(x.dtype)   # stays in the compute dtype (bf16 under autocast)

def rope_tables(n_positions, head_dim, theta):
    """fp32 cos/sin (n_positions, head_dim // 2): the step gathers them by position instead of computing them."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.arange(n_positions, dtype=torch.float32)[:, None] * inv
    return ang.cos(), ang.sin()

def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin

class Attention(nn.Module):
    """Queries from the block; keys/values from [target context ; block] with shared projections."""
    def __init__(self, c):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)
        self.q_norm, self.k_norm = RMSNorm(self.hd, c.rms_norm_eps), RMSNorm(self.hd, c.rms_norm_eps)

    def kv(self, x, cos, sin):
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, L, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.nkv, self.hd).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, k_ctx, v_ctx, cos_q, sin_q, attend):
        B, L, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(B, L, self.nh, self.hd)).transpose(1, 2), cos_q, sin_q)
        k, v = self.kv(x, cos_q, sin_q)
        if k_ctx is not None:      # training: the context comes with the call (decoding keeps it in its cache)
            k, v = torch.cat([k_ctx, k], dim=2), torch.cat([v_ctx, v], dim=2)
        return self.o_proj(attend(q, k, v).transpose(1, 2).reshape(B, L, self.nh * self.hd))

class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

class DecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn, self.mlp = Attention(c), MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, h, k_ctx, v_ctx, cos_q, sin_q, attend):
        h = h + self.self_attn(self.input_layernorm(h), k_ctx, v_ctx, cos_q, sin_q, attend)
        return h + self.mlp(self.post_attention_layernorm(h))

class DFlashDrafter(nn.Module):
    """Trainable: layers, fc, hidden_norm, norm. Frozen and never saved: the target's embedding and LM head."""
    def __init__(self, config: DFlashConfig, embed_weight=None, lm_head_weight=None):
        super().__init__()
        c = self.config = config
        self.layers = nn.ModuleList([DecoderLayer(c) for _ in range(c.num_draft_layers)])
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm, self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps), RMSNorm(c.hidden_size, c.rms_norm_eps)
        e = embed_weight if embed_weight is not None else torch.zeros(c.vocab_size, c.hidden_size)
        h = lm_head_weight if lm_head_weight is not None else e
        cos, sin = rope_tables(c.max_position_embeddings, c.head_dim, c.rope_theta)
        buffers = {"embed_weight": e.detach(), "lm_head_weight": h.detach(), "rope_cos": cos, "rope_sin": sin}
        for name, t in buffers.items():     # non-persistent: they move with .to(device), not in state_dict()
            self.register_buffer(name, t, persistent=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        self.block_mask = False     # the training mask's form: compiled.compile_drafter sets the BlockMask's

    def attach_target(self, target):
        self.embed_weight, self.lm_head_weight = (target.get_input_embeddings().weight.detach(),
                                                  target.get_output_embeddings().weight.detach())
        return self

    def rope(self, positions, dtype):
        """cos/sin (B, 1, L, head_dim) of positions (B, L)."""
        c, s = self.rope_cos[positions], self.rope_sin[positions]
        return torch.cat([c, c], dim=-1)[:, None].to(dtype), torch.cat([s, s], dim=-1)[:, None].to(dtype)

    def context(self, target_feats):   # shared by all layers
        return self.hidden_norm(self.fc(target_feats))

    def trunk(self, target_feats, block_ids, ctx_pos, block_pos, mask):
        """The block tokens' final-normed hidden states; each layer projects the shared context to keys/values. mask:
        the training mask, dense (SDPA) or a BlockMask (flex: compiled.compile_drafter compiles this function)."""
        ctx = self.context(target_feats)
        h = F.embedding(block_ids, self.embed_weight).to(ctx.dtype)
        (cos_c, sin_c), (cos_q, sin_q) = self.rope(ctx_pos, ctx.dtype), self.rope(block_pos, ctx.dtype)
        attend = functools.partial(attention, mask=mask)
        for layer in self.layers:
            h = layer(h, *layer.self_attn.kv(ctx, cos_c, sin_c), cos_q, sin_q, attend)
        return self.norm(h)

    def forward(self, features, batch, weight_sum=None):
        """The training loss of a Batch (make_batch) on the target's features (B, S, layers x hidden; with
        distillation the final hidden states last, the teacher): (loss over weight_sum, the batch's own weights by
        default; acc and counts per block position 1..bs-1)."""
        c, (B, S, _), dev = self.config, batch.shape, features.device
        teacher = rows = None
        if batch.loss.distill:    # block position k's label is the target's next token after position anchor + k - 1
            features, final = features[..., :-c.hidden_size].contiguous(), features[..., -c.hidden_size:]
            positions, rows = to_device(batch.taught[0], dev), batch.taught[1]
            teacher = final[positions // S, positions % S]
        ctx_pos = torch.arange(S, device=dev).expand(B, S)
        mask = (create_dflash_block_mask if self.block_mask else dense_dflash_mask)(batch.anchors, S, c.block_size)
        hidden = self.trunk(features, batch.block_ids, ctx_pos, batch.block_pos, mask)
        return dflash_loss(hidden, self.lm_head_weight, batch.labels, batch.weights, weight_sum=weight_sum,
                           teacher=teacher, teacher_rows=rows, distill=batch.loss.distill,
                           dpace=batch.loss.dpace)

def attention(q, k, v, mask):
    """SDPA under a dense boolean mask, or flex attention under a BlockMask. Flex runs compiled only: eagerly it is a
    dense fallback (B x H x Q x KV scores). Its kv heads are repeated for their query heads: flex's backward gives
    each (key tile, kv head) one program looping over the group's query heads, and nearly every query sees the first
    context tiles, so those few programs set the kernel's tail; the repeat's gradient sums the group's (same math)."""
    if not isinstance(mask, BlockMask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if not torch.compiler.is_dynamo_compiling():
        raise RuntimeError("flex attention ran uncompiled: this would be the dense fallback (B x H x Q x KV scores); "
                           "the drafter's flex path runs through compiled.compile_drafter and its gate")
    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]                      # query head h uses kv head h // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return flex_attention(q, k, v, block_mask=mask)

# ---- 2. The training mask. Queries: A blocks of `bs` tokens (q = i*bs + k); keys: [S context features | A*bs block
# tokens]. Block i sees context kv < anchor_i (STRICTLY: the target computes the anchor's feature AFTER seeing its
# token) and its own block, (kv - S) // bs == i, both ways. Padding blocks (anchor 0) see only themselves; no loss.

def make_mask_mod(anchors, S, bs):
    def mask_mod(b, h, q_idx, kv_idx):
        # Anchors are < S, so `kv < anchor` implies `kv < S`, and for kv < S, (kv - S) // bs is negative, never a
        # block index: two comparisons, not four (nor a chain of boolean masks: compiled.py's torch notes).
        return (kv_idx < anchors[b, q_idx // bs]) | ((kv_idx - S) // bs == q_idx // bs)
    return mask_mod

def dense_dflash_mask(anchors, S, bs):
    """The same mask as a boolean tensor (B, 1, Q, KV), for the SDPA path."""
    B, A = anchors.shape
    return create_mask(make_mask_mod(anchors, S, bs), B, None, A * bs, S + A * bs, device=anchors.device)

# The BlockMask, built eagerly per 128 x 128 tile (create_block_mask runs the mask_mod per element: minutes of compile
# per shape). Context tile u is seen by some row iff 128u < the query tile's largest anchor, in full (no mask_mod) iff
# 128u + 128 <= its smallest; a block tile iff the tiles' block ranges overlap, in full iff both lie in one block.
TILE = 128

def _ordered(tiles):
    """(B, 1, R, C) bool tile map -> per row its count and indices, those in the map first (flex's layout)."""
    t = tiles.to(torch.int32).contiguous()    # the q-side maps are transposes: contiguous, as flex's
    return t.sum(-1, dtype=torch.int32), torch.argsort(t, dim=-1, descending=True, stable=True).to(torch.int32)

@functools.lru_cache(maxsize=64)
def _block_region_tiles(device, n_q_tiles, bs):
    """(any, full) tile maps of the block part of the keys (kv >= S): they do not depend on the anchors."""
    t = torch.arange(n_q_tiles, device=device) * TILE
    first, last = t // bs, (t + TILE - 1) // bs          # the blocks a tile's rows (or columns) lie in
    any_ = (first[:, None] <= last[None]) & (first[None] <= last[:, None])
    full = (first == last)[:, None] & (first == last)[None] & (first[:, None] == first[None])
    return any_, full

def create_dflash_block_mask(anchors, S, bs):
    """The DFlash training BlockMask of `anchors` (B, A) over S context positions, blocks of `bs` (see above)."""
    B, A = anchors.shape
    Q = A * bs
    if S % TILE or Q % TILE:
        # ragged tiles cost masked loads on a GPU and miscompile on CPU (compiled.py's torch notes)
        raise ValueError(f"flex path needs S ({S}) and anchors*block ({A}*{bs}) to be multiples of {TILE}")
    rows = anchors.repeat_interleave(bs, dim=1).view(B, Q // TILE, TILE)      # each query row's anchor
    lo = torch.arange(0, S, TILE, device=anchors.device)                       # context tiles' first key
    blk_any, blk_full = _block_region_tiles(anchors.device, Q // TILE, bs)
    any_ = torch.cat([lo < rows.amax(-1, keepdim=True), blk_any.expand(B, -1, -1)], dim=-1)[:, None]
    full = torch.cat([lo + TILE <= rows.amin(-1, keepdim=True), blk_full.expand(B, -1, -1)], dim=-1)[:, None]
    partial = any_ & ~full
    (kv_n, kv_i), (fkv_n, fkv_i) = _ordered(partial), _ordered(full)
    (q_n, q_i), (fq_n, fq_i) = _ordered(partial.transpose(-2, -1)), _ordered(full.transpose(-2, -1))
    return BlockMask(seq_lengths=(Q, S + Q), kv_num_blocks=kv_n, kv_indices=kv_i, full_kv_num_blocks=fkv_n,
                     full_kv_indices=fkv_i, q_num_blocks=q_n, q_indices=q_i, full_q_num_blocks=fq_n,
                     full_q_indices=fq_i, BLOCK_SIZE=(TILE, TILE), mask_mod=make_mask_mod(anchors, S, bs))

# ---- 3. Anchors, blocks, loss, FLOPs

def sample_anchors(loss_mask, lengths, num_anchors, block_size, generator=None):
    """Random anchors per sequence from positions p <= len-bs with loss_mask[p] and loss_mask[p+1]: anchors (B, A)
    long (sorted, padding 0), valid (B, A) bool; drawn on the CPU with `generator`: a resumed run draws the same."""
    lm = loss_mask.detach().to("cpu", torch.bool)
    anchors = torch.zeros(len(lm), num_anchors, dtype=torch.long)
    valid = torch.zeros(len(lm), num_anchors, dtype=torch.bool)
    for b in range(len(lm)):
        last = int(lengths[b]) - block_size          # the whole block fits inside the sequence
        if last < 0:
            continue
        cand = (lm[b, : last + 1] & lm[b, 1: last + 2]).nonzero().flatten()
        if len(cand) > num_anchors:
            cand = cand[torch.randperm(len(cand), generator=generator)[:num_anchors]].sort().values
        anchors[b, : len(cand)] = cand
        valid[b, : len(cand)] = True
    return anchors, valid

def make_blocks(input_ids, loss_mask, anchors, valid, block_size, mask_token_id, gamma):
    """Block inputs, positions, labels and loss weights: block i = [input_ids[a_i], MASK x (bs-1)] at positions a_i ..
    a_i+bs-1; label[i,k] = input_ids[a_i + k] (same position, NO shift); weight exp(-(k-1)/gamma) where the label is
    in the sequence and in loss_mask, anchor i valid and k > 0."""
    S, dev = input_ids.shape[1], input_ids.device
    anchors, valid = anchors.to(dev), valid.to(dev)
    k = torch.arange(block_size, device=dev)
    pos = anchors[:, :, None] + k                                  # (B, A, bs)
    pos_c = pos.clamp(max=S - 1)
    labels = torch.gather(input_ids, 1, pos_c.flatten(1)).view_as(pos)
    lm = torch.gather(loss_mask.to(torch.float32), 1, pos_c.flatten(1)).view_as(pos)
    weights = torch.exp(-(k.float() - 1) / gamma) * (k > 0) * lm * (pos < S) * valid[:, :, None]
    block_ids = torch.full_like(labels, mask_token_id)
    block_ids[:, :, 0] = labels[:, :, 0]
    return block_ids.flatten(1), pos.flatten(1), labels, weights

@dataclass(frozen=True)
class Loss:
    """What the loss is made of: the block positions' weights, a fixed decay exp(-(k-1)/gamma) or, with dpace > 0,
    D-PACE's from the drafter's confidence (dpace: its smoothing, see dpace_factors), and the KL's share (distill)."""
    gamma: float
    distill: float = 0.0
    dpace: float = 0.0

@dataclass
class Batch:
    """A micro-batch's training blocks, built once by make_batch on the host (the loader thread, ahead of its step):
    block inputs and positions (B, A*bs), labels and loss weights (B, A, bs), the anchors (B, A) the mask reads, the
    Loss it is made for and, with distillation, teacher_positions' result."""
    block_ids: torch.Tensor
    block_pos: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    anchors: torch.Tensor
    S: int                      # the context length: the target features' positions
    loss: Loss
    taught: tuple = None

    @property
    def shape(self):
        """(B, S, A): the key of the compiled step and of the shape plan."""
        return (self.anchors.shape[0], self.S, self.anchors.shape[1])

    def to(self, dev):
        """The tensors the step reads on `dev` (taught's rows stay on the host: the loss's chunks index with them)."""
        move = {k: to_device(getattr(self, k), dev) for k in ("block_ids", "block_pos", "labels", "weights", "anchors")}
        return replace(self, **move)

def make_batch(input_ids, loss_mask, anchors, valid, config, loss):
    """The Batch of host tensors input_ids, loss_mask (B, S) and anchors, valid (B, A) for a drafter of `config`,
    for a Loss `loss`."""
    block_ids, block_pos, labels, weights = make_blocks(input_ids, loss_mask, anchors, valid, config.block_size,
                                                        config.mask_token_id, math.inf if loss.dpace else loss.gamma)
    taught = teacher_positions(anchors, valid, input_ids.shape[1], config.block_size) if loss.distill else None
    return Batch(block_ids, block_pos, labels, weights, anchors, input_ids.shape[1], loss, taught)

def chunk_plan(n, chunk_rows):
    """(rows per chunk, chunks): equal chunks of <= chunk_rows rows covering n, the last padded: one kernel shape."""
    k = max(1, math.ceil(n / chunk_rows))
    return math.ceil(n / k), k

class _ChunkedLMHeadLoss(torch.autograd.Function):
    """sum(w * f * CE(h @ W^T, y)), w pre-normalised, chunk by chunk (with teacher hidden states t, row i's at
    t_rows[i]: the CE mixed with a KL, see kernels.ce_chunk_eager); f = 1, or reweight(each row's w * loss, w) once
    every row's loss is known. The LM head is frozen: the forward computes the one gradient needed, d loss / d h =
    (d loss / d logits) @ W (N x H, small), so no N x vocab logits wait for the backward."""
    @staticmethod
    def forward(ctx, h, weight, labels, w, chunk, ce, t=None, t_rows=None, alpha=0.0, reweight=None):
        N, need_grad = h.shape[0], h.requires_grad
        size, k = chunk_plan(N, chunk)
        if size * k > N:   # padding rows: zero hidden, weight 0 -> no loss, no gradient
            pad = lambda x: torch.cat([x, x.new_zeros(size * k - N, *x.shape[1:])])
            h, labels, w = pad(h), pad(labels), pad(w)
            if t is not None:   # a padding row reads the last row's teacher: the last chunk's range stays short
                t_rows = torch.cat([t_rows, t_rows[-1:].expand(size * k - N)])
        rows_dev = None if t is None else to_device(t_rows, h.device)
        grad_h = torch.empty_like(h) if need_grad else None
        losses, correct = h.new_empty(size * k, dtype=torch.float32), h.new_empty(size * k, dtype=torch.bool)
        for s in range(0, size * k, size):
            e, teacher, rows = s + size, None, None
            if t is not None:   # the chunk's teacher logits: one per position its rows need (host indices, no sync)
                lo, hi = int(t_rows[s:e].min()), int(t_rows[s:e].max()) + 1
                teacher, rows = t[lo:hi] @ weight.t(), rows_dev[s:e] - lo
            losses[s:e], correct[s:e], g = ce(h[s:e] @ weight.t(), labels[s:e], w[s:e], teacher, alpha, rows)
            if need_grad:
                grad_h[s:e] = (g @ weight).to(h.dtype)
        if reweight is not None:   # a row's loss and gradient are linear in its weight: scaled once all are known
            f = reweight(losses[:N], w[:N])
            losses[:N] *= f
            if need_grad:
                grad_h[:N] *= f[:, None].to(h.dtype)
        ctx.save_for_backward(grad_h[:N] if need_grad else None)
        correct = correct[:N]
        ctx.mark_non_differentiable(correct)
        return losses.sum(), correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        (grad_h,) = ctx.saved_tensors
        return (grad_h * grad_loss.to(grad_h.dtype),) + (None,) * 9

CHUNK_ROWS = 3072   # LM head + CE rows per chunk: fewer, larger chunks are faster, each costs its fp32 logits in memory

def dpace_factors(weighted, w, width, smoothing):
    """D-PACE's position weights (rows of `width` block positions 1..bs-1) from each row's weighted loss w * loss:
    the drafter's confidence q = exp(-loss), smoothed q~ = (1 - smoothing) q + smoothing, is its chance of drafting the
    position right, so sum over m of prod_{i <= m} q~_i is the block's expected acceptance, whose derivative by
    log q~_j is position j's weight sum_{m >= j} prod_{i <= m} q~_i; an unsupervised position ends the chain. With
    distillation the loss is mainly the KL to the target: q = 1 exactly where the drafter's distribution is the
    target's (a draft then passes greedy and sampled verification alike), whereas exp(-CE) would also fall where the
    target itself is unsure, a doubt the drafter cannot remove. The weights are constants of the step (no gradient
    through them)."""
    sup = w > 0
    loss = torch.where(sup, weighted / torch.where(sup, w, 1.0), 0.0).clamp(min=0)
    q = ((1 - smoothing) * torch.exp(-loss) + smoothing) * sup
    reach = torch.cumprod(q.view(-1, width), dim=1)             # prod_{i <= m} q~_i
    return reach.flip(1).cumsum(1).flip(1).reshape(-1)          # sum_{m >= j}

def dflash_loss(hidden, lm_head_weight, labels, weights, chunk_rows=CHUNK_ROWS, weight_sum=None,
                teacher=None, teacher_rows=None, distill=0.0, dpace=0.0):
    """Weighted CE over block positions 1..bs-1 of hidden (B, A*bs, H), labels/weights (B, A, bs), chunk by chunk:
    the loss over `weight_sum` (micro-batches and replicas share it: their step is one), and per position acc and
    counts (bs-1,) (acc: the drafter's top token is the label, or the teacher's). teacher (P, H): the target's final
    hidden states, matched by a KL of weight `distill` (the CE: 1 - distill); teacher_rows: teacher_positions' rows.
    dpace > 0: the weights times D-PACE's (dpace_factors, that smoothing)."""
    B, A, bs = labels.shape
    h = hidden.reshape(B, A, bs, -1)[:, :, 1:].reshape(B * A * (bs - 1), -1)   # k = 0 never scored
    y = labels[:, :, 1:].reshape(-1)
    w = weights[:, :, 1:].reshape(-1).float()
    # a host number as a fill kernel: a host-to-device copy would block until the forward just queued is done
    wsum = w.sum() if weight_sum is None else torch.full((), float(weight_sum), device=w.device)
    ce = kernels.ce_chunk_triton if kernels.triton is not None and h.is_cuda else kernels.ce_chunk_eager
    t = None if teacher is None else teacher.to(h.dtype)
    reweight = functools.partial(dpace_factors, width=bs - 1, smoothing=dpace) if dpace else None
    loss, correct = _ChunkedLMHeadLoss.apply(h, lm_head_weight.to(h.dtype), y, w / wsum.clamp(min=1e-6),
                                             chunk_rows, ce, t, teacher_rows, distill, reweight)
    sup = (w > 0).view(B * A, bs - 1)
    counts = sup.sum(0).float()
    return loss, (correct.view(B * A, bs - 1) & sup).sum(0).float() / counts.clamp(min=1), counts

def teacher_positions(anchors, valid, S, block_size):
    """Distillation's positions (P,) (flat b * S + p, ascending; the teacher's LM head runs once for each) and each
    scored row's index into them. Rows ascend but for block overlaps, so a chunk of rows needs one short range (an
    unsampled anchor's rows repeat the row before). From host anchors: on a device they cost a sync."""
    anchors, valid = anchors.cpu(), valid.cpu()
    B, A = anchors.shape
    k = torch.arange(1, block_size)
    flat = (torch.arange(B)[:, None, None] * S + (anchors[:, :, None] + k - 1).clamp(max=S - 1)).flatten()
    ok = valid[:, :, None].expand(B, A, block_size - 1).flatten()
    if not bool(ok.any()):
        return torch.zeros(1, dtype=torch.long), torch.zeros(len(flat), dtype=torch.long)
    positions, inverse = torch.unique(flat[ok], return_inverse=True)
    rows = torch.zeros(len(flat), dtype=torch.long)
    rows[ok] = inverse
    src = torch.where(ok, torch.arange(len(flat)), -1).cummax(0).values   # the last sampled row up to each row
    return positions, rows[torch.where(src < 0, ok.nonzero()[0, 0], src)]

def simulated_tau(acc):
    """1 + sum_k prod_{j<=k} acc_j: the acceptance length if position errors were independent."""
    return 1.0 + float(torch.cumprod(torch.as_tensor(acc, dtype=torch.float64), 0).sum())

def to_device(t, dev):
    """A host tensor to `dev` through pinned memory: queued like a kernel (a pageable copy waits for the stream)."""
    if t.device == dev or dev.type != "cuda" or t.device.type != "cpu":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)

def matmul_flops(c, S, A):
    """The drafter's matmul FLOPs in one forward+backward of a sequence: 3x the forward for a trainable matmul, 2x for
    the fc (its input needs no gradient), the frozen LM head's two (logits, hidden grad) on the scored rows."""
    Q = A * c.block_size
    H, I, V = c.hidden_size, c.intermediate_size, c.vocab_size
    qd, kvd = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = 2 * Q * H * qd * 2 + 2 * (S + Q) * H * kvd * 2 + 2 * Q * H * I * 3
    fc = 2 * S * len(c.target_layer_ids) * H * H
    head = 2 * 2 * Q * (c.block_size - 1) / c.block_size * H * V
    return 2 * fc + 3 * c.num_draft_layers * layer + head

def step_flops(c, S, A, ctx):
    """Matmuls plus attention over the visible keys: ctx context keys (the mean anchor) and the block's, 3x forward."""
    return matmul_flops(c, S, A) + 3 * c.num_draft_layers * 4 * A * c.block_size * \
        c.num_attention_heads * c.head_dim * (ctx + c.block_size)

def batch_flops(c, S, anchors, valid, taught=None, lengths=None):
    """One drafter step on a (B, S) batch as it runs (padding included), with the teacher's logits (one frozen LM head
    matmul) at the positions of `taught` (teacher_positions' result; None: no distillation). With the rows' `lengths`:
    only the work on real tokens, each row's context its length and its blocks its valid anchors'."""
    counts = valid.sum(1)      # a row's mean valid anchor in one pass over the batch: the loader runs this twice
    ctx = ((anchors * valid).sum(1).double() / counts.clamp(min=1)).tolist()
    teacher = 0 if taught is None else 2 * len(taught[0]) * c.hidden_size * c.vocab_size
    if lengths is None:
        return sum(step_flops(c, S, anchors.shape[1], x) for x in ctx) + teacher
    return sum(step_flops(c, int(n), k, x) for n, k, x in zip(lengths, counts.tolist(), ctx)) + teacher

# ---- 4. The target's features

def capture(target, layer_ids):
    """Every later forward of the target keeps its layers `layer_ids`' outputs (idempotent): hooks, as transformers'
    output_hidden_states goes through a ContextVar a compiled layer cannot trace."""
    if not hasattr(target, "captured"):
        target.captured, target.hooked = {}, set()
    for i in sorted(set(layer_ids) - target.hooked):
        keep = lambda _m, _args, out, i=i: target.captured.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        target.model.layers[i].register_forward_hook(keep)
        target.hooked.add(i)

def target_forward(target, input_ids, layer_ids, final=False):
    """`layer_ids`' outputs on a batch, concatenated, then with `final` the final normed hidden states (the teacher).
    Rows are right-padded: causal attention gives real positions exact features with no padding mask; pads go unread."""
    if final and isinstance(target.model.norm, nn.Identity):   # models.load_target cut it: no teacher there
        raise ValueError("target_forward(final=True) needs the target's whole depth: models.load_target(whole=True)")
    capture(target, layer_ids)
    out = target.model(input_ids=input_ids, use_cache=False).last_hidden_state
    feats = torch.cat([target.captured[i] for i in layer_ids] + ([out] if final else []), dim=-1)
    target.captured.clear()     # the hooks' references would hold a batch of layer outputs until the next forward
    return feats

# ---- 5. Save / load in the serving format

# config.json keys that are DFlashConfig fields of the same name
HF_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
           "num_target_layers", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings")

def save_drafter(drafter, path, dtype=torch.bfloat16, state=None, card=None):
    """config.json + model.safetensors (trainable weights) in `path`, as vLLM and SGLang load a DFlash drafter (the
    target's embedding and LM head are the target's), and README.md: `card` (model_card). `state`: a host copy of the
    state_dict."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    state = drafter.state_dict() if state is None else state
    sd = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
    weights = os.path.join(path, "model.safetensors")
    save_file(sd, weights, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(weights, 0o666 & ~umask)     # safetensors creates it 0600; the other files get the umask's
    cfg = drafter.config
    hf = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **{k: getattr(cfg, k) for k in HF_KEYS},
          "num_hidden_layers": cfg.num_draft_layers, "hidden_act": "silu", "attention_bias": False,
          "tie_word_embeddings": False, "torch_dtype": str(dtype).replace("torch.", ""), "block_size": cfg.block_size,
          "layer_types": ["full_attention"] * cfg.num_draft_layers,    # the block attends both ways: not causal
          "dflash_config": {"target_layer_ids": list(cfg.target_layer_ids), "block_size": cfg.block_size,
                            "mask_token_id": cfg.mask_token_id, **({"mask_token": cfg.mask_token} if cfg.mask_token
                                                                  else {}), **({"target": cfg.target} if cfg.target
                                                                               else {})}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    if card:
        with open(os.path.join(path, "README.md"), "w") as f:
            f.write(card)

def model_card(cfg, folder, recipe, results=None):
    """README.md of the drafter folder `folder`: the target it drafts for, its shape, how it was trained (`recipe`:
    {option: value}), how vLLM and SGLang serve it, and what it measured (`results`: see measured_section)."""
    target = cfg.target.get("name", "TARGET")
    spec = json.dumps({"method": "dflash", "model": folder, "num_speculative_tokens": cfg.block_size - 1})
    lines = [f"# DFlash drafter for {target}", "",
             f"A block-diffusion drafter: it drafts {cfg.block_size - 1} tokens after each accepted one in a single "
             f"forward pass, from the target's hidden states of layers {list(cfg.target_layer_ids)}; the target "
             "verifies the block in one pass (lossless: the output is the target's own).", "",
             "| | |", "| --- | --- |", f"| target | `{target}` |",
             f"| drafter | {cfg.num_draft_layers} layers, hidden {cfg.hidden_size}, block size {cfg.block_size}, mask "
             f"token {cfg.mask_token_id}" + (f" (`{cfg.mask_token}`)" if cfg.mask_token else "") + " |",
             *(f"| {k} | {v} |" for k, v in recipe.items()), "",
             "## Serve it", "", "vLLM (method dflash; the anchor is its bonus token: one token fewer than the block):",
             "", "```", f"vllm serve {target} --speculative-config '{spec}'", "```", "",
             "SGLang (draft tokens: the whole block):", "", "```",
             f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
             f"--speculative-draft-model-path {folder} --speculative-num-draft-tokens {cfg.block_size}", "```", ""]
    return "\n".join(lines) + "\n" + measured_section(results)

def measured_section(results):
    """The card's last section: {figure: value} as eval_dflash.py measured them, or how to measure them."""
    rows = results or {"measured": "not yet: `python eval_dflash.py --target <target> --drafter <this folder> "
                                   "--prompts <held-out conversations>` writes its figures here"}
    return "\n".join(["## Measured", "", "| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows.items()), ""])

def write_measured(folder, results):
    """Put `results` in the card of the drafter folder `folder` (its README.md, if it has one), in place of the last."""
    path = os.path.join(folder, "README.md")
    if os.path.isfile(path):
        with open(path) as f:
            head = f.read().split("## Measured\n")[0]
        with open(path, "w") as f:
            f.write(head + measured_section(results))

def load_drafter(path, target=None, device="cpu", dtype=torch.float32):
    """A saved drafter with `target`'s frozen embedding and LM head; else a one-line error naming the file."""
    from safetensors.torch import load_file
    cfg_path, weights = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
    if not os.path.isfile(cfg_path):
        raise UserError(f"no drafter at {path}: {cfg_path} does not exist (a drafter folder is a "
                        "checkpoint's drafter/, e.g. out/step_000690/drafter)")
    try:
        with open(cfg_path) as f:
            hf = json.load(f)
        d = hf["dflash_config"]
        cfg = DFlashConfig(**{k: hf[k] for k in HF_KEYS}, num_draft_layers=hf["num_hidden_layers"],
                           **{k: d[k] for k in ("block_size", "mask_token_id", "target_layer_ids")},
                           mask_token=d.get("mask_token", ""), target=d.get("target", {}))
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{cfg_path} is not a DFlash drafter's config ({type(e).__name__}: {e})") from None
    drafter = DFlashDrafter(cfg)
    try:
        drafter.load_state_dict(load_file(weights), strict=True)
    except Exception as e:       # missing, cut or foreign: name the file, not safetensors' internals
        raise UserError(f"cannot load the drafter weights {weights}: {e}") from None
    if target is not None:
        t = getattr(target.config, "text_config", target.config)
        if (t.hidden_size, t.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
            raise UserError(f"the drafter at {path} was trained for a target of hidden size {cfg.hidden_size} "
                            f"and {cfg.vocab_size} tokens; this one has {t.hidden_size} and {t.vocab_size}")
        drafter.attach_target(target)
    return drafter.to(device=device, dtype=dtype)
