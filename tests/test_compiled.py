"""CPU tests of compiled.py: compiled flex == SDPA, the warm-up, the compile gate, compiled targets, the compile
cache's folders and the host's threads.

Compiles are expensive on this CPU (7-40 s each), so every flex test shares ONE shape set through the
module-scoped `flex_case` fixture (conftest.py), and all flex calls run under torch.no_grad (grad mode is a
dynamo guard: mixing modes would compile twice). The gate tests use tiny torch.compile(backend=<counting eager
backend>) functions, which exercise dynamo's per-call checks, stances and recompile limits without inductor.
"""
import math
import os
import re
import threading
import time

import pytest
import torch

import torch.nn.functional as F

import compiled
import dflash_model as dm
from errors import UserError
from compiled import GATE
import models
from replicas import forward_backward
from helpers import REPO, drafter_with_heads, naive_mask, reset_gate, tiny_config_json, toy_config


# the compile gate and dynamo's limits are process-wide: each test starts and ends with them as a fresh process
# has them; one intra-op thread for the module (conftest.py: clean_gate, one_thread)
pytestmark = pytest.mark.usefixtures("one_thread", "clean_gate")


FX_ERROR = "Detected that you are using FX to symbolically trace"
DEFAULT_RECOMPILE_LIMIT = GATE.recompile_limit


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


def rel_err(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def is_warmed(name, device, shape):
    return GATE.key(name, device, shape) in GATE.warmed


# -----------------------------------------------------------------------------
# compiled flex attention and the warm-up


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
    rows = compiled.warm_up([c.drafter, c.drafter], [(1, 128, 8), (1, 256, 8)], forward_backward, dm.Loss(7.0),
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
        rows = compiled.warm_up([c.flex], [(c.B, c.S, c.A)], forward_backward, dm.Loss(7.0), log=logs.append)
        assert rows[0][3] in ("reused (in process)", "cache hit") and is_warmed(
            "drafter_fwd", "cpu", (c.B, c.S, c.A, c.bs))
        # an unwarmed shape is refused under the warm gate, naming it
        with pytest.raises(compiled.UnwarmedShapeError, match=r"\(3, 128, 8, 16\)"):
            c.flex(c.feats[:, :128], dm.make_batch(c.input_ids[:, :128], c.loss_mask[:, :128],
                                                   c.anchors[:, :8].clamp(max=100), c.valid[:, :8], c.flex.config,
                                                   dm.Loss(c.gamma)))


def test_the_warm_up_runs_the_trainers_own_step_on_each_shape():
    """warm_shape hands the step it is given (replicas.forward_backward, the drafter threads' own) a Batch of the
    shape, with distillation features that carry the teacher's states, and that step's backward fills the grads."""
    import compiled
    from replicas import forward_backward
    c = toy_config(max_position_embeddings=128)
    d = drafter_with_heads(c)
    seen = []

    def step(drafter, work, weight_sum):
        seen.append((work[0][0].shape[-1], work[0][1].shape, work[0][1].loss))
        return forward_backward(drafter, work, weight_sum)
    for shape, loss in (((1, 64, 4), dm.Loss(7.0)), ((2, 32, 2), dm.Loss(7.0, distill=0.5, dpace=0.5))):
        compiled.warm_shape(d, shape, step, loss)
    n = len(c.target_layer_ids)
    assert seen == [(n * 32, (1, 64, 4), dm.Loss(7.0)),
                    ((n + 1) * 32, (2, 32, 2), dm.Loss(7.0, distill=0.5, dpace=0.5))]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in d.parameters())


# -----------------------------------------------------------------------------
# the compile gate


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
# compiled targets, the block-mask guard, the cache's folders, threads


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
    rows = compiled.warm_up([], TARGET_SHAPES + [(1, 128, 16)], None, dm.Loss(7.0), log=lambda m: None, targets=graphed)
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
    warm = lambda: rows.extend(compiled.warm_up([], TARGET_SHAPES, None, dm.Loss(7.0), log=lambda m: None,
                                                targets=[graphed]))
    if where == "every position":
        with pytest.raises(UserError, match=r"^the compiled target's features at \(B, S\) = \(1, 128\) "
                           r"differ from the eager target's: a row's median position by .* \(relative; torch.float32 "
                           r"allows 0.0001\)"):
            warm()
    else:
        warm()
        notes = [float(how.split("features ")[1].split()[0]) for _, _, _, how in rows]   # "features 1e-07 from eager"
        assert len(notes) == len(TARGET_SHAPES) and max(notes) < 1e-4


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
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("refused: flex attention ran uncompiled") == 2, p.stdout


def test_use_compile_cache_sets_the_cache_folders_and_leaves_a_users_cache_switches(tmp_path, monkeypatch):
    import compiled
    for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"):
        monkeypatch.delenv(k, raising=False)      # use_compile_cache sets them; restored after the test
    monkeypatch.setenv("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
    cache = compiled.use_compile_cache(str(tmp_path / "compile_cache"))
    assert os.path.isdir(cache) and os.environ["TORCHINDUCTOR_CACHE_DIR"] == cache
    assert os.environ["TRITON_CACHE_DIR"] == os.path.join(cache, "triton")
    assert (os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"], os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"]) == ("1", "0")


def test_host_threads_is_one_intra_op_thread_only_where_every_device_is_a_gpu():
    import compiled
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        compiled.host_threads([torch.device("cpu")])
        compiled.host_threads([torch.device("cuda:0"), torch.device("cpu")])
        assert torch.get_num_threads() == 2        # a CPU device trains with the intra-op threads
        compiled.host_threads([torch.device("cuda:0"), torch.device("cuda:1")])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
