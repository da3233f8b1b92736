"""CPU tests of replicas.py: fingerprints of the replicas, the step on handed-over gradients, a bad gradient norm,
the flat gradient buffer, resuming a drafter of another shape."""
import pytest
import torch

from errors import UserError
from helpers import toy_config


def _replicas(n, world=1):
    """A Replicas stand-in over n copies of one Linear with MasterAdamW (fp32 weights)."""
    import replicas
    from master_adamw import MasterAdamW
    r = replicas.Replicas.__new__(replicas.Replicas)
    torch.manual_seed(0)
    first = torch.nn.Linear(4, 4)
    r.drafters = []
    for _ in range(n):
        m = torch.nn.Linear(4, 4)
        m.load_state_dict(first.state_dict())
        r.drafters.append(m)
    r.opts = [MasterAdamW(m.parameters(), lr=0.1, param_dtype=torch.float32) for m in r.drafters]
    r.world = world
    return r


def test_replica_fingerprints_catch_a_divergence_naming_the_tensor_and_the_step():
    """The check at a log interval: equal replicas pass; one that differs by offsetting +-e (a float sum
    would not see it), or -0.0 against 0.0 (torch.equal would not), stops the run naming the tensor and
    the step; the end-of-run check says the same."""
    import checkpoint as ck
    r = _replicas(2)
    a, b = r.drafters
    r.check(10)
    logged = []
    r.check(7, logged.append)
    assert logged == ["[replicas] 2 replica(s) x 1 rank(s) bit-identical after step 7 (20 parameters each; "
                      f"fingerprint {ck.digest(ck.fingerprint(r.tensors(0)[1]))})"]
    with torch.no_grad():
        b.weight[0, 0] += 0.5
        b.weight[0, 1] -= 0.5
    with pytest.raises(RuntimeError, match=r"diverged by step 20: 1 tensor fingerprint\(s\) differ, first \['replica 1: weight'\]"):
        r.check(20)
    with torch.no_grad():
        b.weight.copy_(a.weight)
        a.bias[0], b.bias[0] = 0.0, -0.0
    assert torch.equal(a.bias, b.bias)       # what a value comparison would accept
    with pytest.raises(RuntimeError, match=r"by step 30: .*replica 1: bias"):
        r.check(30)


@pytest.mark.parametrize("clip", [1e-3, 1e3])        # clipped / not clipped
def test_a_lone_replica_steps_on_handed_over_grads_and_clips_exactly_like_clip_grad_norm(clip):
    """One replica without a flat buffer (MasterAdamW, the clip factor applied inside its pass): the same
    parameters, byte for byte, and the same norm as clip_grad_norm_ + torch's AdamW.step; grads None
    afterwards (the next backward's grads are handed over, not added to zeros); the step's stats on
    the host."""
    r = _replicas(1)
    a = r.drafters[0]
    b = torch.nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    r.flats, r.grads = [None], [None]
    r.scheds = [torch.optim.lr_scheduler.LambdaLR(r.opts[0], lambda s: 1.0)]
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.1, foreach=False)
    x = torch.randn(4, 4)
    for m in (a, b):
        m(x).square().sum().backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(b.parameters(), clip))
    opt_b.step()
    stats = r.reduce([torch.tensor([1.0, 2.0])])
    gnorm = r.step(clip)
    assert gnorm == ref_norm and (ref_norm > clip) == (clip < 1)
    assert stats.device.type == "cpu" and stats.tolist() == [1.0, 2.0]
    import checkpoint as ck
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert pa.grad is None and torch.equal(ck.as_bytes(pa), ck.as_bytes(pb))


def test_a_nan_or_inf_gradient_norm_raises_with_nothing_stepped_and_the_next_step_is_the_first():
    """clip_and_step queues the update before it reads the norm (on a GPU the host must not wait for the
    norm first), so a bad norm must make the update a no-op: FloatingPointError, and weights, masters,
    moments and step counts as they were; a good step afterwards is step 1 and equals a fresh
    optimiser's."""
    from replicas import clip_and_step
    r = _replicas(2)
    opt_a, opt_b = r.opts
    a = r.drafters[0]
    state = lambda opt: [t.clone() for p in opt.params() for t in (p.detach(), *(opt.state[p][k] for k in
                                                                                ("master", "exp_avg", "exp_avg_sq")))]
    before = state(opt_a)
    for bad in (float("nan"), float("inf")):
        grads = [torch.randn_like(p) for p in a.parameters()]
        grads[1][0] = bad
        with pytest.raises(FloatingPointError, match="the gradient norm is"):
            clip_and_step(opt_a, grads, 1.0)
        assert all(torch.equal(x, y) for x, y in zip(before, state(opt_a)))
        assert [opt_a.state[p]["step"] for p in opt_a.params()] == [0, 0]
    grads = [torch.randn_like(p) for p in a.parameters()]
    assert clip_and_step(opt_a, grads, 1.0) == clip_and_step(opt_b, [g.clone() for g in grads], 1.0)
    assert all(torch.equal(x, y) for x, y in zip(state(opt_a), state(opt_b)))


def test_gradients_summed_in_the_flat_buffer_by_the_hooks():
    """Where grads are summed (replicas, ranks, micro-batches), each backward's gradient is added into
    the replica's fp32 buffer by a hook and freed; two backward passes sum there."""
    from replicas import add_into
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    params = list(lin.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    views = [g.view_as(p) for g, p in zip(torch.split(flat, [p.numel() for p in params]), params)]
    for p, v in zip(params, views):
        p.register_post_accumulate_grad_hook(add_into(v))
    x1, x2 = torch.randn(2, 4), torch.randn(5, 4)
    lin(x1).sum().backward()
    lin(x2).sum().backward()
    assert all(p.grad is None for p in params)
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(lin.state_dict())
    ref(torch.cat([x1, x2])).sum().backward()
    for v, p in zip(views, ref.parameters()):
        torch.testing.assert_close(v, p.grad)


def test_resuming_a_drafter_of_another_targets_shape_is_a_one_line_error_naming_a_tensor():
    import config
    from replicas import Replicas

    def replicas(hidden):
        dcfg = toy_config(hidden_size=hidden, max_position_embeddings=64)
        emb = torch.zeros(64, hidden)
        return Replicas(dcfg, emb, emb, [torch.device("cpu")], config.TrainConfig(), 1, lambda s: 1.0, lambda m: None)
    state = replicas(32).checkpoint_state()
    with pytest.raises(UserError, match=r"^out/step_000001/state.pt holds a drafter this run cannot take "
                                         r"\(size mismatch for .*\): resume with the checkpoint's --target"):
        replicas(48).load(state, "out/step_000001", 1, print)
