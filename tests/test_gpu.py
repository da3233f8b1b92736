"""The GPU paths against their references, on a CUDA device: `python test_smoke.py -m gpu` (README, The two
commands). Skipped where no GPU is visible (the CPU suite runs the same code in its CPU form).

1. The compiled flex trunk, forward and backward, against the dense-mask SDPA trunk.
2. The target's compiled layers replayed as a CUDA graph against the eager target.
3. bf16 weights with fp32 masters (MasterAdamW, its Triton kernel) against fp32 AdamW.
4. The pipeline with the target and the drafter on one GPU, each thread on its own stream, against one stream.
"""
import contextlib
import copy
import json
import sys

import pytest
import torch

import compiled
import dflash_model as dm
from master_adamw import MasterAdamW
import models
from helpers import TINY, TRAIN, assert_ok, drafter_with_heads, metrics, run_cmd


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEV = torch.device("cuda:0")
LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)


@pytest.fixture
def random_llama(tmp_path):
    """A tiny Llama's config.json: random:<it> is a target of random weights (no tokenizer, no data needed)."""
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(LLAMA))
    return f"random:{path}"


def tiny_drafter(seed=7, H=128, V=512, bs=8):
    torch.manual_seed(seed)
    cfg = dm.DFlashConfig(hidden_size=H, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=32, vocab_size=V, num_target_layers=6, num_draft_layers=2, block_size=bs,
                          mask_token_id=V - 1)
    return drafter_with_heads(cfg, 0.3).to(DEV)


def batch(c, B=2, S=256, A=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.stack([torch.randperm(S - c.block_size, generator=g)[:A].sort().values for _ in range(B)])
    valid = torch.ones(B, A, dtype=torch.bool)
    valid[1, A // 2:] = False                                      # a row with padding blocks
    ids = torch.randint(0, c.vocab_size - 1, (B, S), generator=g).to(DEV)
    feats = torch.randn(B, S, len(c.target_layer_ids) * c.hidden_size, generator=g).to(DEV)
    return feats, dm.make_batch(ids, torch.ones(B, S, device=DEV), anchors, valid, c, dm.Loss(2.0))


def test_flex_trunk_forward_and_backward_equal_the_dense_trunk():
    dense = tiny_drafter()
    flex = compiled.compile_drafter(copy.deepcopy(dense))
    feats, b = batch(dense.config)
    out = {}
    for name, drafter in (("dense", dense), ("flex", flex)):
        loss = drafter(feats, b)[0]
        compiled.backward(drafter, loss, b.shape)
        out[name] = float(loss), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    (ld, gd), (lf, gf) = out["dense"], out["flex"]
    assert lf == pytest.approx(ld, rel=1e-4)
    assert gd.keys() == gf.keys() and len(gd) > 5
    for n in gd:
        err = float((gf[n] - gd[n]).norm() / gd[n].norm().clamp_min(1e-12))
        assert err < 1e-3, (n, err)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_the_graphed_target_replays_the_eager_targets_features(random_llama, dtype, tol):
    import config
    layers = [1, 2, 3]
    target = models.load_target(random_llama, DEV, dtype, layers, print, whole=True)
    compiled.compile_target_layers(target)
    graphed = compiled.GraphedTarget(target, layers, final=True)
    ids = torch.randint(0, target.config.vocab_size, (2, 128), device=DEV)
    graphed.forward(ids)                                     # compiles outside the capture
    graphed.capture(2, 128)
    got = graphed(ids).float()
    assert (2, 128) in graphed.graphs                        # the call was a replay
    with torch.compiler.set_stance("force_eager"):
        want = dm.target_forward(target, ids, layers, True).float()
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert float(err.median()) < tol, float(err.median())


def test_bf16_weights_with_fp32_masters_follow_fp32_adamw():
    """Given the same fp32 gradients, MasterAdamW's masters are torch.optim.AdamW's fp32 weights (to rounding) and
    its bf16 weights are the masters rounded; trained on one batch under autocast, its loss follows the fp32 run's."""
    ref, mixed = tiny_drafter(), tiny_drafter()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    opt = MasterAdamW(mixed.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, param_dtype=torch.bfloat16)
    g = torch.Generator(device=DEV).manual_seed(0)
    for _ in range(20):
        grads = [torch.randn(p.shape, device=DEV, generator=g) for p in ref.parameters()]
        for p, gr in zip(ref.parameters(), grads):
            p.grad = gr.clone()
        opt_ref.step()
        opt.step(grads=grads)
    for p_ref, p, master in zip(ref.parameters(), mixed.parameters(), opt.masters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, master.to(torch.bfloat16))
        torch.testing.assert_close(master, p_ref.detach(), rtol=1e-5, atol=1e-6)

    ref, mixed = tiny_drafter(), tiny_drafter()
    feats, b = batch(ref.config)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    opt = MasterAdamW(mixed.parameters(), lr=3e-3, param_dtype=torch.bfloat16)
    losses = {"fp32": [], "bf16": []}
    for _ in range(12):                  # the fp32 loss falls from about 10 to 3.5 (a third) in these steps
        for name, model, o in (("fp32", ref, opt_ref), ("bf16", mixed, opt)):
            with torch.autocast("cuda", torch.bfloat16) if name == "bf16" else contextlib.nullcontext():
                loss = model(feats.to(next(model.parameters()).dtype), b)[0]
            loss.backward()
            if name == "fp32":
                o.step()
                o.zero_grad(set_to_none=True)
            else:
                o.step(grads=[p.grad.float() for p in model.parameters()])
                model.zero_grad(set_to_none=True)
            losses[name].append(float(loss))
    assert losses["fp32"][-1] < 0.5 * losses["fp32"][0] and losses["bf16"][-1] < 0.5 * losses["bf16"][0], losses
    for a, b in zip(losses["fp32"], losses["bf16"]):
        assert b == pytest.approx(a, rel=0.05), losses          # bf16 rounding, not a different update


def test_target_and_drafter_sharing_a_gpu_on_two_streams_train_as_on_one(random_llama, tmp_path):
    """The trainer's threads on one GPU each queue on a stream of their own (compiled.own_stream): the same run
    with every thread on the default stream gives the same losses and gradient norms."""
    args = [*TINY, "--target", random_llama, "--data", "synthetic:64", "--max-steps", 8, "--heldout", 0,
            "--target-devices", "cuda:0", "--drafter-devices", "cuda:0", "--cache-dir", tmp_path / "cache",
            "--compile-cache", tmp_path / "cc"]
    one_stream = ("import contextlib, sys, compiled, train_dflash; "
                  "compiled.own_stream = contextlib.contextmanager(lambda dev: (yield None)); "
                  "sys.exit(train_dflash.main(sys.argv[1:]))")
    two = run_cmd([sys.executable, TRAIN, *map(str, args),
                   "--out-dir", str(tmp_path / "two")], timeout=900)
    one = run_cmd([sys.executable, "-c", one_stream, *map(str, args), "--out-dir", str(tmp_path / "one")], timeout=900)
    assert_ok(two)
    assert_ok(one)
    a, b = metrics(tmp_path / "two"), metrics(tmp_path / "one")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 9))
    for ra, rb in zip(a, b):
        for key in ("loss", "grad_norm"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-3), (ra["step"], key, ra[key], rb[key])
    assert json.dumps(a[-1]["lr"]) == json.dumps(b[-1]["lr"])
