"""AdamW over bf16 model weights, with the fp32 master weights and moments in the optimiser.

Why: a drafter with fp32 parameters under bf16 autocast casts every weight to bf16 in each forward
and every bf16 weight gradient back to fp32 in each backward (~2.6 ms of a 137 ms Qwen3-8B-size step
on an H200, two passes over 1B parameters), and its AdamW pass then reads fp32 gradients. Here the
model holds the bf16 weights that the matmuls read, the optimiser holds the fp32 masters, and one
pass per tensor reads master, gradient, exp_avg, exp_avg_sq and writes master, exp_avg, exp_avg_sq
and the bf16 weight. Training sees the same numbers: autocast's bf16 copy of an fp32 weight is the
bf16 weight here, and a bf16 matmul's weight gradient cast to fp32 is exact.

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments, lerp for the
first moment). Gradient clipping is a factor on the device (`grad_scale`), applied inside the same
pass: no host sync and no separate scaling pass. A nan factor makes the pass store nothing (the
trainer's factor is nan for a nan/inf gradient norm: it can queue the step before it has read the
norm, and a bad step leaves master, moments and weights as they were). On CUDA the pass is a small
Triton kernel, checked against the torch-op version on first use; elsewhere it is the torch-op version.
"""
import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                # CPU-only installs: the torch-op path below is used
    triton = None

STATE_FORMAT = "master_adamw/1"

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


def cast_weights(params, dtype):
    """Cast parameters in place (their .data), so modules keep their Parameter objects. Unlike
    Module.to(dtype) this leaves buffers alone (the drafter's rope tables stay fp32)."""
    for p in params:
        p.data = p.data.to(dtype)


def _update_torch(p, g, st, scale, beta1, beta2, eps, decay, step_size, bc2_sqrt):
    """The same update with torch ops, in torch.optim.AdamW's (single-tensor) order. (A nan `scale`
    is skipped by step(), as the kernel stores nothing for it.)"""
    g = g.float() if scale is None else g.float() * scale
    w, m, v = st["master"], st["exp_avg"], st["exp_avg_sq"]
    w.mul_(decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    w.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(eps), value=-step_size)
    p.copy_(w)


def _update_triton(p, g, st, scale, beta1, beta2, eps, decay, step_size, bc2_sqrt):
    # 1024 x 4 warps: 7.16 ms for the drafter's 1.05B parameters on an H200 (4.10 TB/s); 4096 x 8 took 7.39
    n, block = p.numel(), 1024
    _adamw_kernel[(triton.cdiv(n, block),)](p, g, st["master"], st["exp_avg"], st["exp_avg_sq"], scale, n,
                                           beta1, beta2, eps, decay, step_size, bc2_sqrt, BLOCK=block, num_warps=4)


class MasterAdamW(torch.optim.Optimizer):
    """AdamW whose fp32 state includes the master weights; the parameters are cast to `param_dtype`.

    Build it from the freshly initialised fp32 model: the masters are those fp32 values, and the
    parameters themselves become `param_dtype` (bf16 on CUDA) in place, so modules keep their
    Parameter objects. step(grads=..., grad_scale=...) takes the gradients from a list (e.g. views
    of an fp32 buffer where they are summed) instead of p.grad, and a device scalar that multiplies
    them (the clip factor)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 param_dtype=torch.bfloat16):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for p in self.params():
            if p.dtype != torch.float32:
                raise ValueError(f"MasterAdamW takes fp32 parameters (the masters), got {p.dtype}")
            self.state[p] = {"step": 0, "master": p.detach().clone(memory_format=torch.contiguous_format),
                             "exp_avg": torch.zeros_like(p, memory_format=torch.contiguous_format),
                             "exp_avg_sq": torch.zeros_like(p, memory_format=torch.contiguous_format)}
        cast_weights(self.params(), param_dtype)
        self.checked = set()              # devices whose Triton kernel was checked
        self.ones = {}                    # device -> 1.0 (the grad scale when none is given)

    def params(self):
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None, *, grads=None, grad_scale=None):
        if closure is not None:
            raise ValueError("MasterAdamW.step takes no closure")
        params = self.params()
        grads = [p.grad for p in params] if grads is None else list(grads)
        if len(grads) != len(params):
            raise ValueError(f"{len(grads)} gradients for {len(params)} parameters")
        i, nan_scale = 0, None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                g = grads[i]
                i += 1
                if g is None:
                    continue
                if g.shape != p.shape:
                    raise ValueError(f"gradient of shape {tuple(g.shape)} for a parameter of shape {tuple(p.shape)}")
                st = self.state[p]
                st["step"] += 1
                t = st["step"]
                args = (beta1, beta2, group["eps"], 1 - group["lr"] * group["weight_decay"],
                        group["lr"] / (1 - beta1 ** t), math.sqrt(1 - beta2 ** t))
                if p.device.type == "cuda" and triton is not None:
                    scale = grad_scale if grad_scale is not None else self._one(p.device)
                    # Triton launches on the CURRENT device's stream, not the tensors' (torch ops
                    # switch for you): one thread stepping replicas on several GPUs must switch.
                    with torch.cuda.device(p.device):
                        self._check_kernel(p.device)
                        _update_triton(p, g.contiguous(), st, scale.float(), *args)
                else:
                    if nan_scale is None:     # once per step: a host sync on a GPU (only without Triton)
                        nan_scale = grad_scale is not None and bool(torch.isnan(grad_scale))
                    if not nan_scale:         # a nan factor stores nothing, as the kernel
                        _update_torch(p, g, st, grad_scale, *args)

    def _one(self, dev):
        if dev not in self.ones:
            self.ones[dev] = torch.ones((), device=dev)
        return self.ones[dev]

    def _check_kernel(self, dev):
        """Once per device: the Triton pass against the torch-op pass on random data (bf16 weight and
        grad, a clip factor). A kernel that a new Triton compiles wrongly fails here, not in a run."""
        if dev in self.checked:
            return
        self.checked.add(dev)
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
        _update_torch(p_ref, g, ref, scale, *args)
        for k in st:
            err = float((st[k] - ref[k]).abs().max() / ref[k].abs().max())
            if not err < 1e-5:
                raise RuntimeError(f"MasterAdamW's Triton kernel disagrees with the reference on {dev}: {k} "
                                   f"max relative error {err:.2e} (triton {triton.__version__})")
        if (p.float() - p_ref.float()).abs().max() > 2 ** -7 * p_ref.float().abs().max():
            raise RuntimeError(f"MasterAdamW's Triton kernel writes wrong bf16 weights on {dev}")
        for k in (n, 3 * 4096):          # (Triton compiles a size divisible by 16 apart)
            sub = [t[:k] for t in (p, g, st["master"], st["exp_avg"], st["exp_avg_sq"])]
            before = [t.clone() for t in sub]
            _update_triton(sub[0], sub[1], dict(zip(("master", "exp_avg", "exp_avg_sq"), sub[2:])),
                           torch.tensor(math.nan, device=dev), *args)
            if not all(torch.equal(a, b) for a, b in zip(before, sub)):
                raise RuntimeError(f"MasterAdamW's Triton kernel stores an update with a nan clip factor on {dev} "
                                   "(it must store nothing: a nan/inf gradient norm would poison the weights)")

    def masters(self):
        """fp32 master weights, in parameter order."""
        return [self.state[p]["master"] for p in self.params()]

    def state_dict(self):
        params = self.params()
        return {"format": STATE_FORMAT,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "group_sizes": [len(g["params"]) for g in self.param_groups],
                **{k: [self.state[p][k] for p in params] for k in ("step", "master", "exp_avg", "exp_avg_sq")}}

    def load_state_dict(self, sd):
        """Restores masters, moments, steps and group settings (lr, betas, ...) and writes the model's
        weights from the masters. The tensors are copied into this optimiser's own (fp32, on its
        device): torch.optim's load would cast them to the parameters' dtype, i.e. round the masters."""
        if sd.get("format") != STATE_FORMAT:
            raise ValueError(f"not a {STATE_FORMAT} optimiser state (format {sd.get('format')!r}): written by "
                             "another optimiser or an older version of this trainer")
        params = self.params()
        if sd["group_sizes"] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"optimiser state has groups of {sd['group_sizes']} tensors, this model "
                             f"{[len(g['params']) for g in self.param_groups]}")
        for i, p in enumerate(params):
            if tuple(sd["master"][i].shape) != tuple(p.shape):
                raise ValueError(f"optimiser state tensor {i} has shape {tuple(sd['master'][i].shape)}, "
                                 f"the parameter {tuple(p.shape)}")
        with torch.no_grad():
            for i, p in enumerate(params):
                st = self.state[p]
                st["step"] = int(sd["step"][i])
                for k in ("master", "exp_avg", "exp_avg_sq"):
                    st[k].copy_(sd[k][i])
                p.copy_(st["master"])
        for g, saved in zip(self.param_groups, sd["param_groups"]):
            g.update(saved)


def from_torch_adamw_state(sd, masters):
    """torch.optim.AdamW's state_dict (+ the fp32 parameters it stepped, in order) -> this format.

    Checkpoints of this trainer before MasterAdamW held fp32 parameters stepped by torch's AdamW:
    those parameters are the masters, and its moments and step counts carry over unchanged."""
    if "state" not in sd or "param_groups" not in sd:
        raise ValueError("not a torch.optim state_dict (no 'state' / 'param_groups')")
    sizes = [len(g["params"]) for g in sd["param_groups"]]
    if sum(sizes) != len(masters):
        raise ValueError(f"torch AdamW state for {sum(sizes)} tensors, {len(masters)} master weights given")
    out = {k: [] for k in ("step", "master", "exp_avg", "exp_avg_sq")}
    for i, m in enumerate(masters):
        st = sd["state"].get(i)        # absent: a parameter that never had a gradient
        out["step"].append(int(st["step"]) if st else 0)
        out["master"].append(m.float())
        out["exp_avg"].append(st["exp_avg"].float() if st else torch.zeros_like(m, dtype=torch.float32))
        out["exp_avg_sq"].append(st["exp_avg_sq"].float() if st else torch.zeros_like(m, dtype=torch.float32))
    keep = ("lr", "betas", "eps", "weight_decay", "initial_lr")
    return {"format": STATE_FORMAT, "group_sizes": sizes,
            "param_groups": [{k: g[k] for k in keep if k in g} for g in sd["param_groups"]], **out}
