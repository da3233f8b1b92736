"""CPU tests of master_adamw.py: torch's AdamW on fp32 masters, and its state's round trip."""
import pytest
import torch


def _adamw_pair(param_dtype):
    from master_adamw import MasterAdamW
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    b.load_state_dict(a.state_dict())
    opt_a = MasterAdamW(a.parameters(), lr=0.1, betas=(0.9, 0.95), weight_decay=0.1, param_dtype=param_dtype)
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.1, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    return a, b, opt_a, opt_b


def raw(t):
    import checkpoint as ck
    return ck.as_bytes(t)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_master_adamw_is_torch_adamw_on_fp32_masters_and_writes_the_weights_from_them(param_dtype):
    """Given the same fp32 gradients, MasterAdamW's masters are torch AdamW's parameters byte for byte
    (with a grad_scale of 0.5 against gradients halved by hand), and the model's weights are the
    masters cast to the weight dtype (bf16: what a GPU run uses; fp32: CPU)."""
    a, b, opt_a, opt_b = _adamw_pair(param_dtype)
    assert all(p.dtype == param_dtype for p in a.parameters())
    assert all(m.dtype == torch.float32 for m in opt_a.masters())
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in b.parameters()]
        for p, g in zip(b.parameters(), grads):
            p.grad = g * 0.5
        opt_b.step()
        opt_a.step(grads=grads, grad_scale=torch.tensor(0.5))
    for p, m, ref in zip(a.parameters(), opt_a.masters(), b.parameters()):
        assert torch.equal(raw(m), raw(ref.detach()))
        assert torch.equal(raw(p), raw(m.to(param_dtype)))


def test_master_adamw_state_round_trip_keeps_the_masters_in_fp32_and_checks_what_it_loads():
    """A checkpoint's optimiser state restores masters, moments and steps exactly into an optimiser of
    bf16 weights (torch.optim's own load would round them to the parameters' dtype), writes the
    weights from the masters, and the next step is the uninterrupted optimiser's. Another optimiser's
    state or another model's is a clear error."""
    from master_adamw import MasterAdamW
    a, _, opt_a, _ = _adamw_pair(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=gen) for p in a.parameters()] for _ in range(2)]
    opt_a.step(grads=grads[0])
    sd = opt_a.state_dict()
    torch.manual_seed(5)
    c = torch.nn.Linear(8, 8)
    opt_c = MasterAdamW(c.parameters(), lr=0.5, param_dtype=torch.bfloat16)
    opt_c.load_state_dict(sd)
    assert opt_c.param_groups[0]["lr"] == 0.1
    for m_c, m_a, p_c in zip(opt_c.masters(), opt_a.masters(), c.parameters()):
        assert m_c.dtype == torch.float32 and torch.equal(raw(m_c), raw(m_a))
        assert torch.equal(raw(p_c), raw(m_a.to(torch.bfloat16)))
    opt_a.step(grads=grads[1])
    opt_c.step(grads=grads[1])
    for m_c, m_a in zip(opt_c.masters(), opt_a.masters()):
        assert torch.equal(raw(m_c), raw(m_a))
    with pytest.raises(ValueError, match="not a master_adamw/1 optimiser state"):
        opt_c.load_state_dict(torch.optim.AdamW(c.parameters()).state_dict())
    with pytest.raises(ValueError, match="another model"):
        MasterAdamW(torch.nn.Linear(8, 4).parameters()).load_state_dict(sd)
    with pytest.raises(ValueError, match="takes fp32 parameters"):
        MasterAdamW(c.parameters())            # already bf16: the masters would be rounded
