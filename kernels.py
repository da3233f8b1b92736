"""Triton kernels beside the torch code each must equal, checked against it on each device's first use (a miscompiling
Triton build stops the run at its start): 1. cross entropy over a chunk of LM-head logits, 2. AdamW over bf16 weights
with fp32 masters, 3. decoding attention, 4. sampling. Without Triton the torch code runs; tests interpret the
kernels on CPU."""
import math
import threading
from contextlib import nullcontext

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_CHECK_LOCK = threading.Lock()
_CE_CHECKED, _ADAMW_CHECKED, _ROW_CHECKED, _GUMBEL_CHECKED = set(), set(), set(), set()   # checked devices

def _check_once(checked, dev, check, *args):
    """check(*args) on `dev`'s first use of a kernel, once even when several threads reach it."""
    if dev not in checked:
        with _CHECK_LOCK:
            if dev not in checked:
                check(*args)
                checked.add(dev)

# ---- 1. Cross entropy of one chunk of logits

def ce_chunk_eager(logits, y, w, teacher=None, alpha=0.0, rows=None):
    """(w * loss, correct, dloss/dlogits * w) of (n, V) logits, per row. The loss: CE to the labels y, or with teacher
    logits (row i's: teacher[rows[i]]) (1 - alpha) CE + alpha KL(teacher's softmax || softmax). correct: the logit at
    the label (with a teacher: at the teacher's top token) is the row's maximum."""
    x = logits.float()
    lse, tgt = torch.logsumexp(x, dim=-1), x.gather(1, y[:, None]).squeeze(1)
    loss, correct, g = lse - tgt, tgt >= x.amax(-1), torch.softmax(x, dim=-1)
    g[torch.arange(len(y), device=x.device), y] -= 1.0 if teacher is None else 1.0 - alpha
    if teacher is not None:
        t = (teacher if rows is None else teacher[rows]).float()
        correct = x.gather(1, t.argmax(-1, keepdim=True)).squeeze(1) >= x.amax(-1)
        p = torch.softmax(t, dim=-1)
        kl = lse - torch.logsumexp(t, dim=-1) - (p * (x - t)).sum(-1)
        loss, g = (1 - alpha) * loss + alpha * kl, g - alpha * p
    g *= w[:, None]
    return loss * w, correct, g.to(logits.dtype)

if triton is not None:
    @triton.jit
    def _ce_rows_kernel(x_ptr, t_ptr, r_ptr, g_ptr, y_ptr, w_ptr, loss_ptr, correct_ptr, stride, t_stride, alpha,
                        V: tl.constexpr, BLOCK: tl.constexpr, TEACHER: tl.constexpr):
        # one program per row: pass 1 keeps a running max and rescaled sum (and the teacher's, with its weighted
        # logit gap for the KL and the row's logit at the teacher's first maximum), pass 2 writes the gradient
        row = tl.program_id(0).to(tl.int64)
        x_row, g_row = x_ptr + row * stride, g_ptr + row * stride
        t_row = t_ptr + tl.load(r_ptr + row).to(tl.int64) * t_stride     # the teacher's row read in place
        cols = tl.arange(0, BLOCK)
        m = tl.max(tl.full([BLOCK], -1e30, tl.float32), 0)
        s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        mt, st, gap, at_top = m, s, s, m
        for start in range(0, V, BLOCK):
            x = tl.load(x_row + start + cols, mask=start + cols < V, other=-1e30).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
            if TEACHER:
                t = tl.load(t_row + start + cols, mask=start + cols < V, other=-1e30).to(tl.float32)
                bt, bi = tl.max(t, 0, return_indices=True)     # the block's first maximum and where it is
                at_top = tl.where(bt > mt, tl.sum(tl.where(cols == bi, x, 0.0), 0), at_top)
                mt_new = tl.maximum(mt, bt)
                e = tl.exp(t - mt_new)
                st = st * tl.exp(mt - mt_new) + tl.sum(e, 0)
                gap = gap * tl.exp(mt - mt_new) + tl.sum(e * (x - t), 0)
                mt = mt_new
        y = tl.load(y_ptr + row)
        w = tl.load(w_ptr + row)
        tgt = tl.load(x_row + y).to(tl.float32)
        loss = m + tl.log(s) - tgt
        hard, top = w, tgt
        if TEACHER:
            loss = (1 - alpha) * loss + alpha * (m + tl.log(s) - mt - tl.log(st) - gap / st)
            hard, top = w * (1 - alpha), at_top
        tl.store(loss_ptr + row, loss * w)
        tl.store(correct_ptr + row, top >= m)
        for start in range(0, V, BLOCK):
            c = start + cols
            x = tl.load(x_row + c, mask=c < V, other=0.0).to(tl.float32)
            g = tl.exp(x - m) * (w / s) - tl.where(c == y, hard, 0.0)
            if TEACHER:
                t = tl.load(t_row + c, mask=c < V, other=0.0).to(tl.float32)
                g -= tl.exp(t - mt) * (w * alpha / st)
            tl.store(g_row + c, g.to(g_ptr.dtype.element_ty), mask=c < V)

def _ce_chunk_triton_unchecked(logits, y, w, teacher=None, alpha=0.0, rows=None):
    n, V = logits.shape
    logits = logits.contiguous()
    t = logits if teacher is None else teacher.contiguous()
    r = y if teacher is None else (torch.arange(n, device=y.device) if rows is None else rows).contiguous()
    g = torch.empty_like(logits)
    loss, correct = logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, dtype=torch.bool)
    with torch.cuda.device(logits.device) if logits.is_cuda else nullcontext():   # Triton: the CURRENT device's stream
        _ce_rows_kernel[(n,)](logits, t, r, g, y.contiguous(), w.float().contiguous(), loss, correct,
                              logits.stride(0), t.stride(0), float(alpha), V=V, BLOCK=4096,
                              TEACHER=teacher is not None, num_warps=8)
    return loss, correct, g

def ce_chunk_triton(logits, y, w, teacher=None, alpha=0.0, rows=None):
    """ce_chunk_eager's result from one Triton kernel, two passes over the logits: nothing to compile in the gate."""
    _check_once(_CE_CHECKED, (logits.device, teacher is not None), _check_ce_kernel, logits[:16], y[:16], w[:16],
                teacher, alpha, None if rows is None else rows[:16])
    return _ce_chunk_triton_unchecked(logits, y, w, teacher, alpha, rows)

def _check_ce_kernel(logits, y, w, teacher, alpha, rows=None):
    w = torch.linspace(0.5, 1.5, len(w), device=w.device)    # real weights may be 0 on these rows
    if teacher is not None and rows is None:
        teacher = teacher[: len(y)]
    loss, correct, g = _ce_chunk_triton_unchecked(logits, y, w, teacher, alpha, rows)
    ref_loss, ref_correct, ref_g = ce_chunk_eager(logits, y, w, teacher, alpha, rows)
    loss, ref_loss = float(loss.sum()), float(ref_loss.sum())
    g_err = float((g.float() - ref_g.float()).abs().max())
    if not (abs(loss - ref_loss) <= 1e-4 * max(abs(ref_loss), 1.0) and bool((correct == ref_correct).all())
            and g_err <= 1e-2 * float(ref_g.float().abs().max()) + 1e-6):
        raise RuntimeError(f"the Triton CE kernel disagrees with the eager CE on {logits.device}: loss {loss} vs "
                           f"{ref_loss}, max grad error {g_err:.3g}, correct {correct.tolist()} vs "
                           f"{ref_correct.tolist()}; this triton/GPU is not supported")

# ---- 2. AdamW over bf16 weights with fp32 masters

if triton is not None:
    @triton.jit
    def _adamw_kernel(param_ptr, grad_ptr, master_ptr, m_ptr, v_ptr, scale_ptr, n,
                      beta1, beta2, eps, decay, step_size, bc2_sqrt, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        scale = tl.load(scale_ptr)
        load = offs < n
        keep = offs < tl.where(scale == scale, n, 0)     # a nan factor (a nan/inf gradient norm): store nothing
        g = tl.load(grad_ptr + offs, mask=load).to(tl.float32) * scale
        w = tl.load(master_ptr + offs, mask=load) * decay
        m = tl.load(m_ptr + offs, mask=load)
        v = tl.load(v_ptr + offs, mask=load)
        m = m + (1.0 - beta1) * (g - m)
        v = v * beta2 + (1.0 - beta2) * g * g
        w = w - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
        tl.store(master_ptr + offs, w, mask=keep)
        tl.store(m_ptr + offs, m, mask=keep)
        tl.store(v_ptr + offs, v, mask=keep)
        tl.store(param_ptr + offs, w.to(param_ptr.dtype.element_ty), mask=keep)

def adamw_torch(p, g, st, scale, beta1, beta2, eps, decay, step_size, bc2_sqrt):
    """The same update with torch ops, in torch.optim.AdamW's (single-tensor) order (step() skips a nan `scale`)."""
    g = g.float() if scale is None else g.float() * scale
    w, m, v = st["master"], st["exp_avg"], st["exp_avg_sq"]
    w.mul_(decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    w.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(eps), value=-step_size)
    p.copy_(w)

def _update_triton(p, g, st, scale, beta1, beta2, eps, decay, step_size, bc2_sqrt):
    n, block = p.numel(), 1024      # 1024 x 4 warps: faster than 4096 x 8 on an H200
    _adamw_kernel[(triton.cdiv(n, block),)](p, g, st["master"], st["exp_avg"], st["exp_avg_sq"], scale, n,
                                           beta1, beta2, eps, decay, step_size, bc2_sqrt, BLOCK=block, num_warps=4)

def adamw_triton(p, g, st, scale, *args):
    with torch.cuda.device(p.device):     # Triton launches on the CURRENT device's stream, not the tensors'
        _check_once(_ADAMW_CHECKED, p.device, _check_adamw_kernel, p.device)
        _update_triton(p, g, st, scale, *args)

def _check_adamw_kernel(dev):
    gen = torch.Generator(device=dev).manual_seed(0)
    n = 3 * 4096 + 17                                     # several blocks and a ragged tail
    mk = lambda: torch.randn(n, device=dev, generator=gen)
    g = mk().to(torch.bfloat16)
    st = {"master": mk(), "exp_avg": mk() * 1e-2, "exp_avg_sq": mk().abs() * 1e-3}
    ref = {k: v.clone() for k, v in st.items()}
    p, p_ref = torch.empty(n, device=dev, dtype=torch.bfloat16), torch.empty(n, device=dev, dtype=torch.bfloat16)
    scale = torch.tensor(0.5, device=dev)
    args = (0.9, 0.95, 1e-8, 1 - 1e-3 * 0.1, 1e-3 / (1 - 0.9 ** 3), math.sqrt(1 - 0.95 ** 3))
    _update_triton(p, g, st, scale, *args)
    adamw_torch(p_ref, g, ref, scale, *args)
    for k in st:
        err = float((st[k] - ref[k]).abs().max() / ref[k].abs().max())
        if not err < 1e-5:
            raise RuntimeError(f"the Triton AdamW kernel disagrees with the reference on {dev}: {k} "
                               f"max relative error {err:.2e} (triton {triton.__version__})")
    if (p.float() - p_ref.float()).abs().max() > 2 ** -7 * p_ref.float().abs().max():
        raise RuntimeError(f"the Triton AdamW kernel writes wrong bf16 weights on {dev}")
    for k in (n, 3 * 4096):     # a nan factor stores nothing: ragged, and divisible by 16 (Triton compiles it apart)
        sub = {key: t[:k] for key, t in st.items()}
        before = [t.clone() for t in (p[:k], g[:k], *sub.values())]
        _update_triton(p[:k], g[:k], sub, torch.tensor(math.nan, device=dev), *args)
        if not all(torch.equal(a, b) for a, b in zip(before, (p[:k], g[:k], *sub.values()))):
            raise RuntimeError(f"the Triton AdamW kernel stores an update with a nan clip factor on {dev} "
                               "(it must store nothing: a nan/inf gradient norm would poison the weights)")

# ---- 3. Decoding attention: each row of a static KV cache read up to its own length

def row_attention_torch(q, k, v, lens, causal, scale, rows=None):
    """q (R, H, T, D) against cache rows `rows` (R,) (default 0..R-1) of k, v (rows, L, KV heads, D) -> (R, T, H, D):
    query t of row r sees keys j < lens[r] + t (causal) or j < lens[r]. SDPA up to the longest row, masked."""
    n = min(k.shape[1], int(lens.max()) + q.shape[2])   # the keys some row sees (a sync: no CUDA graph runs this)
    k, v = (c[:len(q), :n] if rows is None else c[rows, :n] for c in (k, v))
    j, t = torch.arange(n, device=q.device), torch.arange(q.shape[2], device=q.device)
    visible = j < (lens[:, None, None] + (t[None, :, None] if causal else 0))
    return torch.nn.functional.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), scale=scale,
                                                            attn_mask=visible[:, None], enable_gqa=True).transpose(1, 2)

if triton is not None:
    @triton.jit
    def _row_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lens_ptr, rows_ptr, scale, L, sq_r, sq_h, sq_t, sk_r,
                              sk_l, sk_h, so_r, so_t, so_h, T, G: tl.constexpr, D: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                              CAUSAL: tl.constexpr, IEEE: tl.constexpr):
        # one program per (row, KV head, tile of queries): the tile's rows are positions x the G query heads of the
        # KV head, so each key is read once for all of them, and only the keys the row has (a flash-attention loop)
        r, g = tl.program_id(0).to(tl.int64), tl.program_id(1)
        m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        t, head = m // G, g * G + m % G
        d = tl.arange(0, BLOCK_D)
        qm = (m < T * G)[:, None] & (d < D)[None, :]
        q = tl.load(q_ptr + r * sq_r + head[:, None] * sq_h + t[:, None] * sq_t + d[None, :], mask=qm, other=0.0)
        n = tl.load(lens_ptr + r)
        cache_row = tl.load(rows_ptr + r).to(tl.int64)
        precision: tl.constexpr = "ieee" if IEEE else None     # fp32 tiles: exact products, not tf32
        if CAUSAL:   # the tile's last query sees the keys before n + its position
            lim, end = n + t, n + tl.minimum(T - 1, (tl.program_id(2) * BLOCK_M + BLOCK_M - 1) // G)
        else:
            lim, end = n + 0 * t, n
        lim, end = tl.minimum(lim, L), tl.minimum(end, L)     # a prefill's padding queries run past the L keys
        best = tl.full([BLOCK_M], -1e30, tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(0, end, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            km = (j < end)[:, None] & (d < D)[None, :]
            kv_off = cache_row * sk_r + j[:, None] * sk_l + g * sk_h + d[None, :]
            k = tl.load(k_ptr + kv_off, mask=km, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=precision)
            s = tl.where(j[None, :] < lim[:, None], s * scale, -1e30)
            new = tl.maximum(best, tl.max(s, 1))
            p = tl.exp(s - new[:, None])
            alpha = tl.exp(best - new)
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_off, mask=km, other=0.0)
            pv = tl.dot(p.to(v.dtype), v, input_precision=precision)
            acc = acc * alpha[:, None] + pv
            best = new
        out = acc / total[:, None]
        tl.store(o_ptr + r * so_r + t[:, None] * so_t + head[:, None] * so_h + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=qm)

def pow2(n):
    return 1 << (n - 1).bit_length()   # the least power of two >= n

def _query_tile(q, k):
    """(queries x grouped heads per tile, tiles): a decoding step's in one tile, a prefill's in several."""
    m = q.shape[2] * q.shape[1] // k.shape[2]
    tile = min(pow2(max(m, 16)), 64 if q.dtype == torch.float32 else 128)
    return tile, -(-m // tile)

def _row_attention_triton_unchecked(q, k, v, lens, causal, scale, rows=None):
    (R, H, T, D), fp32 = q.shape, q.dtype == torch.float32
    out = torch.empty(R, T, H, D, device=q.device, dtype=q.dtype)
    rows = torch.arange(R, device=q.device) if rows is None else rows.contiguous()
    tile, tiles = _query_tile(q, k)
    with torch.cuda.device(q.device) if q.is_cuda else nullcontext():
        _row_attention_kernel[(R, k.shape[2], tiles)](
            q, k, v, out, lens.contiguous(), rows, scale, k.shape[1], *q.stride()[:3], *k.stride()[:3],
            *out.stride()[:3], T=T, G=H // k.shape[2], D=D, BLOCK_M=tile, BLOCK_D=pow2(max(D, 16)),
            BLOCK_N=32 if fp32 else 64, CAUSAL=causal, IEEE=fp32, num_warps=8 if fp32 else 4)
    return out

def row_attention(q, k, v, lens, causal, scale, rows=None):
    """row_attention_torch's result; on a GPU one Triton kernel that reads each row's keys only up to its length."""
    if not q.is_cuda or triton is None:
        return row_attention_torch(q, k, v, lens, causal, scale, rows)
    _check_once(_ROW_CHECKED, (q.device, q.dtype, causal, _query_tile(q, k)[1] > 1), _check_row_attention, q, k, v,
                lens, causal, scale, rows)      # per kind of call; its first precedes any CUDA graph capture
    return _row_attention_triton_unchecked(q, k, v, lens, causal, scale, rows)

def _check_row_attention(q, k, v, lens, causal, scale, rows=None):
    got = _row_attention_triton_unchecked(q, k, v, lens, causal, scale, rows).float()
    ref = row_attention_torch(q, k, v, lens, causal, scale, rows).float()
    err, tol = float((got - ref).abs().max()), (1e-4 if q.dtype == torch.float32 else 2e-2) * float(ref.abs().max())
    if not err <= tol + 1e-6:
        raise RuntimeError(f"the Triton row-attention kernel disagrees with SDPA on {q.device} ({q.dtype}): max "
                           f"error {err:.3g}; this triton/GPU is not supported")

# ---- 4. Sampling: the Gumbel-max draw of each row, its noise hashed from the row's seed and the token id

MIX = ((33, -49064778989728563), (33, -4265267296055464877), (33, 1))     # murmur3's 64-bit finaliser

def noise_bits(seeds, V):
    """(rows, V) 24-bit integers: for token j in a row of seed s, bits 38-61 of murmur3's mix of s * V + j (63 is 0
    after the mix). (bits + 0.5) / 2**24 is the token's uniform in (0, 1)."""
    x = seeds[:, None] * V + torch.arange(V, device=seeds.device)
    for shift, mult in MIX:
        x = (x ^ (x >> shift)) * mult
    return (x >> 38) & 0xFFFFFF

def gumbel_scores_torch(logits, seeds, inv_temperature):
    """logits (rows, V) * inv_temperature + Gumbel noise, fp32: the row's draw is the argmax."""
    u = noise_bits(seeds, logits.shape[-1]).float().add_(0.5).div_(1 << 24)
    return logits.float() * inv_temperature - (-u.log()).log()

if triton is not None:
    @triton.jit
    def _gumbel_argmax_kernel(x_ptr, seed_ptr, out_ptr, stride, inv_t, V: tl.constexpr, BLOCK: tl.constexpr):
        # one program per row: gumbel_scores_torch block by block, keeping the first maximum (MIX's constants)
        row = tl.program_id(0).to(tl.int64)
        seed = tl.load(seed_ptr + row)
        cols = tl.arange(0, BLOCK)
        best = tl.max(tl.full([BLOCK], -float("inf"), tl.float32), 0)
        best_at = tl.sum(tl.zeros([BLOCK], tl.int64), 0)
        for start in range(0, V, BLOCK):
            c = start + cols
            x = tl.load(x_ptr + row * stride + c, mask=c < V, other=0.0).to(tl.float32)
            h = seed * V + c.to(tl.int64)
            h = (h ^ (h >> 33)) * -49064778989728563
            h = (h ^ (h >> 33)) * -4265267296055464877
            h = h ^ (h >> 33)
            u = (((h >> 38) & 0xFFFFFF).to(tl.float32) + 0.5) / 16777216.0
            s = tl.where(c < V, x * inv_t - tl.log(-tl.log(u)), -float("inf"))
            top, at = tl.max(s, 0, return_indices=True)
            best_at = tl.where(top > best, start + at.to(tl.int64), best_at)
            best = tl.maximum(best, top)
        tl.store(out_ptr + row, best_at)

def _gumbel_argmax_unchecked(logits, seeds, inv_temperature):
    out = torch.empty(len(logits), dtype=torch.long, device=logits.device)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    with torch.cuda.device(logits.device) if logits.is_cuda else nullcontext():
        _gumbel_argmax_kernel[(len(logits),)](logits, seeds.contiguous(), out, logits.stride(0), inv_temperature,
                                              V=logits.shape[-1], BLOCK=2048, num_warps=8)
    return out

def gumbel_argmax(logits, seeds, inv_temperature):
    """gumbel_scores_torch's argmax per row; on a GPU one Triton pass over the logits (bf16 or fp32)."""
    if not logits.is_cuda or triton is None:
        return gumbel_scores_torch(logits, seeds, inv_temperature).argmax(-1)
    _check_once(_GUMBEL_CHECKED, logits.device, _check_gumbel, logits.device)
    return _gumbel_argmax_unchecked(logits, seeds, inv_temperature)

def _check_gumbel(dev):
    """The kernel's draws are the torch code's; where a rounding of the logs splits a near-tie otherwise, the two
    picks' scores (in float64) agree to 1e-5."""
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(64, 50000, device=dev, generator=gen) * 3
    seeds = torch.randint(0, 1 << 62, (64,), device=dev, generator=gen)
    got, ref = _gumbel_argmax_unchecked(logits, seeds, 1.25), gumbel_scores_torch(logits, seeds, 1.25)
    exact = logits.double() * 1.25 - (-(noise_bits(seeds, logits.shape[1]).double() + 0.5).div(1 << 24).log()).log()
    gap = (exact.gather(1, ref.argmax(-1, keepdim=True)) - exact.gather(1, got[:, None])).abs().max()
    if not float(gap) <= 1e-5:
        raise RuntimeError(f"the Triton sampling kernel disagrees with the torch code on {dev}: a pick's score is "
                           f"{float(gap):.3g} off; this triton/GPU is not supported")
