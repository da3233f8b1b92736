"""The hand-written Triton kernels of kernels.py, tested on CPU by Triton's interpreter
(and the eager CE they are checked against).

On a GPU each kernel is also checked against its torch version on each device's first call; these
tests run the same kernel code (TRITON_INTERPRET=1 runs it with numpy) against the torch versions on
the cases a real run meets: ragged last blocks, a vocab smaller than one block, labels that are the
row maximum or tie with it, zero weights, a clip factor. The interpreter is read when triton is
imported, so each test runs its checks in a fresh Python process.
"""
import os
import subprocess
import sys
import textwrap

import torch

import kernels
from helpers import REPO


def test_ce_correct_means_the_label_has_the_row_max():
    logits = torch.tensor([[0.0, 3.0, 1.0, -2.0],      # label 1 is the max
                           [5.0, 3.0, 1.0, 4.0],       # label 3 is not
                           [2.0, 2.0, 0.5, 0.0],       # label 1 ties with an earlier max: counted correct
                           [0.0, 0.0, 0.0, 9.0]])      # label 3 is the max
    _, correct, _ = kernels.ce_chunk_eager(logits, torch.tensor([1, 3, 1, 3]), torch.ones(4))
    assert correct.tolist() == [True, False, True, True]


def run_interpreted(code):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_ce_kernel_equals_the_eager_ce_and_its_check_catches_a_wrong_kernel():
    out = run_interpreted("""
        import torch
        import kernels as dm
        assert dm.triton is not None and dm.triton.__version__, "triton must be installed for this test"
        torch.manual_seed(0)
        for n, V in [(8, 5000), (6, 1000), (3, 4096)]:       # ragged last block, V < block, V = block
            logits = (torch.randn(n, V) * 3).to(torch.bfloat16)
            y = torch.randint(0, V, (n,))
            y[:2] = logits[:2].float().argmax(-1)             # labels that are the row maximum
            w = torch.rand(n)
            w[2] = 0.0                                        # a row that is not scored
            teacher = (torch.randn(n, V) * 3).to(torch.bfloat16)
            teacher[0] = logits[0]                            # a row whose most likely token is the teacher's
            shared = torch.arange(n) // 2                     # rows reading one teacher row in place, two at a time
            for args in [(), (teacher, 0.0), (teacher, 0.3), (teacher, 1.0), (teacher[: (n + 1) // 2], 0.5, shared)]:
                loss, correct, g = dm._ce_chunk_triton_unchecked(logits, y, w, *args)
                ref_loss, ref_correct, ref_g = dm.ce_chunk_eager(logits, y, w, *args)
                torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
                assert torch.equal(correct, ref_correct), (correct, ref_correct)
                # correct: the row's maximum is at the label, or with a teacher at the teacher's most likely token
                # (row 1: the label is the maximum, the teacher's choice is not)
                assert correct[:2].tolist() == ([True, False] if args else [True, True]), (args, correct)
                assert g.dtype == torch.bfloat16 and g.shape == logits.shape
                torch.testing.assert_close(g.float(), ref_g.float(), rtol=2 ** -7, atol=1e-6)
                assert g[2].abs().max() == 0                      # weight 0: no gradient
            print("case", n, V, "ok")
        # "correct" = the label's logit is the row max; a tie with an earlier max counts
        logits = torch.tensor([[0.0, 3.0, 1.0, -2.0], [5.0, 3.0, 1.0, 4.0], [2.0, 2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 9.0]])
        _, correct, _ = dm._ce_chunk_triton_unchecked(logits, torch.tensor([1, 3, 1, 3]), torch.ones(4))
        assert correct.tolist() == [True, False, True, True], correct
        print("ties ok")
        # the first call on a device runs the check, once
        logits = (torch.randn(20, 3000) * 3).to(torch.bfloat16)
        y, w = torch.randint(0, 3000, (20,)), torch.zeros(20)
        dm.ce_chunk_triton(logits, y, w)
        dm.ce_chunk_triton(logits, y, w, logits.flip(0), 0.5)      # the KL path is checked apart
        assert dm._CE_CHECKED == {(torch.device("cpu"), False), (torch.device("cpu"), True)}, dm._CE_CHECKED
        # a kernel that computes a wrong gradient is an error that says so
        right = dm._ce_chunk_triton_unchecked
        dm._ce_chunk_triton_unchecked = lambda *a: (lambda r: (r[0], r[1], r[2] * 1.5))(right(*a))
        try:
            dm._check_ce_kernel(logits[:16], y[:16], w[:16], None, 0.0)
            raise SystemExit("the check passed a wrong kernel")
        except RuntimeError as e:
            assert "the Triton CE kernel disagrees with the eager CE on cpu" in str(e), e
        print("check ok")
    """)
    assert out.split() == ["case", "8", "5000", "ok", "case", "6", "1000", "ok", "case", "3", "4096", "ok",
                           "ties", "ok", "check", "ok"], out


def test_adamw_kernel_equals_the_torch_update_with_a_clip_factor_over_steps_and_skips_a_nan_factor():
    out = run_interpreted("""
        import math, torch
        import kernels as ma
        assert ma.triton is not None
        gen = torch.Generator().manual_seed(0)
        n = 2 * 1024 + 37                                     # two full blocks and a ragged tail
        st = {"master": torch.randn(n, generator=gen), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
        ref = {k: v.clone() for k, v in st.items()}
        p, p_ref = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
        for t in range(1, 4):
            g = torch.randn(n, generator=gen).to(torch.bfloat16)
            scale = torch.tensor(0.25 * t)
            args = (0.9, 0.95, 1e-8, 1 - 1e-3 * 0.1, 1e-3 / (1 - 0.9 ** t), math.sqrt(1 - 0.95 ** t))
            ma._update_triton(p, g, st, scale, *args)
            ma.adamw_torch(p_ref, g, ref, scale, *args)
        for k in st:
            torch.testing.assert_close(st[k], ref[k], rtol=1e-6, atol=1e-7)
        # the weights are written from the masters: bf16(master), within one bf16 step (the interpreter
        # rounds toward zero where a GPU rounds to nearest)
        assert ((p.float() - st["master"]).abs() <= 2 ** -7 * st["master"].abs()).all()
        # a nan clip factor (a nan/inf gradient norm) stores nothing: master, moments and weights stay
        before = [t.clone() for t in (p, *st.values())]
        ma._update_triton(p, torch.full((n,), float("nan"), dtype=torch.bfloat16), st, torch.tensor(math.nan), *args)
        assert all(torch.equal(a, b) for a, b in zip(before, (p, *st.values())))
        ma._check_adamw_kernel(torch.device("cpu"))            # the per-device check passes a right kernel
        print("adamw ok")
    """)
    assert out.split() == ["adamw", "ok"], out


def test_adamw_kernel_compiles_for_the_h200_ahead_of_time():
    """The interpreter runs the kernel's Python; this runs Triton's compiler down to an sm_90 cubin
    (no GPU needed), so a kernel that only a GPU could reject fails here, in CI, not in a GPU run."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import kernels as ma
    sig = {"param_ptr": "*bf16", "grad_ptr": "*bf16", "master_ptr": "*fp32", "m_ptr": "*fp32", "v_ptr": "*fp32",
           "scale_ptr": "*fp32", "n": "i32", "beta1": "fp32", "beta2": "fp32", "eps": "fp32", "decay": "fp32",
           "step_size": "fp32", "bc2_sqrt": "fp32", "BLOCK": "constexpr"}
    k = triton.compile(ASTSource(fn=ma._adamw_kernel, signature=sig, constexprs={"BLOCK": 1024}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert len(k.asm["cubin"]) > 1000 and ".entry _adamw_kernel" in k.asm["ptx"]


def test_ce_kernel_compiles_for_the_h200_ahead_of_time():
    """The CE kernel, with and without the teacher, through Triton's compiler to an sm_90 cubin (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import kernels
    sig = {"x_ptr": "*bf16", "t_ptr": "*bf16", "r_ptr": "*i64", "g_ptr": "*bf16", "y_ptr": "*i64", "w_ptr": "*fp32",
           "loss_ptr": "*fp32", "correct_ptr": "*i1", "stride": "i32", "t_stride": "i32", "alpha": "fp32",
           "V": "constexpr", "BLOCK": "constexpr", "TEACHER": "constexpr"}
    for teacher in (False, True):
        k = triton.compile(ASTSource(fn=kernels._ce_rows_kernel, signature=sig,
                                     constexprs={"V": 49152, "BLOCK": 4096, "TEACHER": teacher}),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        assert len(k.asm["cubin"]) > 1000 and ".entry _ce_rows_kernel" in k.asm["ptx"]


def test_row_attention_kernel_equals_masked_sdpa_and_its_check_catches_a_wrong_kernel():
    """Rows of other lengths, grouped heads (9 over 3, as SmolLM2; 4 over 2), one query (a decoding step) or a
    block (causal: the target's verify step; all visible: the drafter's block), a head dim that is not a power
    of two, fp32 and fp16 (the interpreter has no bf16 matmul; a GPU checks bf16 on its first call)."""
    out = run_interpreted("""
        import torch
        import kernels as K
        torch.manual_seed(0)
        for R, H, KV, T, D, L, causal in [(3, 9, 3, 1, 64, 200, True), (2, 4, 2, 16, 32, 300, True),
                                           (2, 4, 2, 16, 24, 100, False), (1, 2, 2, 5, 16, 70, True),
                                           (2, 9, 3, 50, 16, 120, True),    # a prefill: several tiles of queries
                                           (2, 9, 3, 50, 16, 40, True)]:    # and queries past the cache's end
            for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
                q, k, v = (torch.randn(*s).to(dtype) for s in ((R, H, T, D), (R + 2, L, KV, D), (R + 2, L, KV, D)))
                lens = torch.randint(1, max(2, L - T), (R,))
                for rows in (None, torch.randperm(R + 2)[:R]):   # the cache rows of q's rows: 0.. or any
                    got = K._row_attention_triton_unchecked(q, k, v, lens, causal, D ** -0.5, rows)
                    ref = K.row_attention_torch(q, k, v, lens, causal, D ** -0.5, rows)
                    assert got.shape == (R, T, H, D) and (got.float() - ref.float()).abs().max() < tol, (got - ref).abs().max()
                K._check_row_attention(q, k, v, lens, causal, D ** -0.5)
        ref = K.row_attention_torch(q, k, v, lens, causal, D ** -0.5, torch.tensor([1, 0]))
        assert torch.equal(ref, K.row_attention_torch(q, k[[1, 0]], v[[1, 0]], lens, causal, D ** -0.5))
        K._row_attention_triton_unchecked = lambda q, *a: torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3])
        try:
            K._check_row_attention(q, k, v, lens, causal, D ** -0.5)
            raise SystemExit("the check passed a wrong kernel")
        except RuntimeError as e:
            assert "the Triton row-attention kernel disagrees with SDPA on cpu" in str(e), e
        print("rows ok")
    """)
    assert out.split() == ["rows", "ok"], out


def test_row_attention_kernel_compiles_for_the_h200_ahead_of_time():
    """As above, for the decoding attention at SmolLM2's verify-step shape in bf16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import kernels as K
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "lens_ptr": "*i64", "rows_ptr": "*i64",
           "scale": "fp32", "L": "i64", "T": "i32",
           **{s: "i64" for s in ("sq_r", "sq_h", "sq_t", "sk_r", "sk_l", "sk_h", "so_r", "so_t", "so_h")},
           **{c: "constexpr" for c in ("G", "D", "BLOCK_M", "BLOCK_D", "BLOCK_N", "CAUSAL", "IEEE")}}
    consts = {"G": 3, "D": 64, "BLOCK_M": 64, "BLOCK_D": 64, "BLOCK_N": 64, "CAUSAL": True, "IEEE": False}
    k = triton.compile(ASTSource(fn=K._row_attention_kernel, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert len(k.asm["cubin"]) > 1000 and ".entry _row_attention_kernel" in k.asm["ptx"]


def test_sampling_kernel_draws_what_the_torch_code_draws():
    """The Gumbel-max kernel's draws equal the torch code's (the same hashed noise, bit for bit) on fp32 and bf16
    logits, a ragged last block and a vocabulary under one block; its first-use check passes."""
    out = run_interpreted("""
        import torch
        import kernels
        torch.manual_seed(0)
        for rows, V, dtype in [(6, 5000, torch.float32), (4, 1000, torch.bfloat16), (3, 4096, torch.float32)]:
            logits = (torch.randn(rows, V) * 2).to(dtype)
            seeds = torch.randint(0, 1 << 62, (rows,))
            got = kernels._gumbel_argmax_unchecked(logits, seeds, 1 / 0.8)
            ref = kernels.gumbel_scores_torch(logits, seeds, 1 / 0.8).argmax(-1)
            assert torch.equal(got, ref), (got, ref)
            print("case", rows, V, "ok")
        kernels._check_gumbel("cpu")
        print("check ok")
    """)
    assert out.count("ok") == 4, out
