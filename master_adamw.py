"""AdamW over bf16 model weights, with the fp32 master weights and moments in the optimiser.

fp32 weights under bf16 autocast cost two extra passes a step (cast to bf16 in the forward, gradients back to fp32).
Here the matmuls read bf16 weights, and one pass per tensor updates master and moments and writes the bf16 weight.
The numbers are autocast's (its bf16 copy of an fp32 weight is this weight; a bf16 gradient cast to fp32 is exact),
the update torch.optim.AdamW's. The clip factor is applied in the same pass (no scaling pass); a nan one stores nothing.
"""
import math

import torch

import kernels

STATE_FORMAT = "master_adamw/1"

def cast_weights(params, dtype):
    """In place (.data): modules keep their Parameter objects, and unlike Module.to(dtype) buffers stay fp32."""
    for p in params:
        p.data = p.data.to(dtype)

class MasterAdamW(torch.optim.Optimizer):
    """Built from the fp32 model. step() takes the gradients as a list: views of the fp32 buffer they are summed in."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, param_dtype=torch.bfloat16):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for p in self.params():
            if p.dtype != torch.float32:
                raise ValueError(f"MasterAdamW takes fp32 parameters (the masters), got {p.dtype}")
            self.state[p] = {"step": 0, "master": p.detach().clone(memory_format=torch.contiguous_format),
                             "exp_avg": torch.zeros_like(p, memory_format=torch.contiguous_format),
                             "exp_avg_sq": torch.zeros_like(p, memory_format=torch.contiguous_format)}
        cast_weights(self.params(), param_dtype)
        params = self.params()       # advance()'s per-parameter scalars, and their pinned staging copy on a GPU
        cuda = params[0].device.type == "cuda"
        self.hyper = torch.zeros(len(params), 3, device=params[0].device)
        self.hyper_host, self.copied = torch.zeros(len(params), 3, pin_memory=cuda), None
        self.hyper_values, self.advanced = [(1.0, 0.0, 1.0)] * len(params), []

    def params(self):
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, grads, grad_scale=None):
        self.advance([g is not None for g in grads])
        self.update(grads, grad_scale)

    def advance(self, which=None):
        """The host half of a step: the step counts of the parameters `which` marks (default all), and each one's
        decay, step size and bias correction, queued to the device on the current stream for update() to read."""
        params, self.hyper_values = self.params(), []
        which = [True] * len(params) if which is None else which
        if len(which) != len(params):
            raise ValueError(f"{len(which)} gradients for {len(params)} parameters")
        self.advanced = [p for p, w in zip(params, which) if w]
        for w, (group, p) in zip(which, [(g, p) for g in self.param_groups for p in g["params"]]):
            (beta1, beta2), lr, st = group["betas"], group["lr"], self.state[p]
            t = st["step"] = st["step"] + bool(w)
            self.hyper_values.append((1 - lr * group["weight_decay"], lr / (1 - beta1 ** max(t, 1)),
                                      math.sqrt(1 - beta2 ** max(t, 1))))
        if self.copied is not None:
            self.copied.synchronize()     # the last step's copy has left the pinned buffer (it has, but for a race)
        self.hyper_host.copy_(torch.tensor(self.hyper_values, dtype=torch.float64))    # rounded as a kernel argument
        self.hyper.copy_(self.hyper_host, non_blocking=True)
        if self.hyper.is_cuda:
            self.copied = torch.cuda.current_stream(self.hyper.device).record_event()

    def rewind(self):
        """Undo the last advance() (an update that stored nothing: a nan/inf gradient norm)."""
        for p in self.advanced:
            self.state[p]["step"] -= 1

    @torch.no_grad()
    def update(self, grads, grad_scale=None):
        """The device half: one pass per parameter with a gradient, reading advance()'s scalars; it runs no host
        code that depends on the step, so a CUDA graph can capture it (the trainer's lone replica does)."""
        pairs = [(group, p) for group in self.param_groups for p in group["params"]]
        if len(grads) != len(pairs):
            raise ValueError(f"{len(grads)} gradients for {len(pairs)} parameters")
        nan_scale = None
        for i, ((group, p), g) in enumerate(zip(pairs, grads)):
            if g is None:
                continue
            if g.shape != p.shape:
                raise ValueError(f"gradient of shape {tuple(g.shape)} for a parameter of shape {tuple(p.shape)}")
            st, (beta1, beta2), eps = self.state[p], group["betas"], group["eps"]
            if p.device.type == "cuda" and kernels.triton is not None:
                scale = grad_scale if grad_scale is not None else torch.ones((), device=p.device)
                kernels.adamw_triton(p, g.contiguous(), st, scale.float(), self.hyper[i], beta1, beta2, eps)
            else:
                if nan_scale is None:     # once per step: a host sync on a GPU (only without Triton)
                    nan_scale = grad_scale is not None and bool(torch.isnan(grad_scale))
                if not nan_scale:         # a nan factor stores nothing, as the kernel
                    kernels.adamw_torch(p, g, st, grad_scale, beta1, beta2, eps, *self.hyper_values[i])

    def masters(self):
        return [self.state[p]["master"] for p in self.params()]

    def state_dict(self):
        return {"format": STATE_FORMAT,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                **{k: [self.state[p][k] for p in self.params()] for k in ("step", "master", "exp_avg", "exp_avg_sq")}}

    def load_state_dict(self, sd):
        """Copied into this optimiser's own fp32 tensors (torch.optim's load would round them), then the weights."""
        if sd.get("format") != STATE_FORMAT:
            raise ValueError(f"not a {STATE_FORMAT} optimiser state (format {sd.get('format')!r}): written by "
                             "another optimiser or an older version of this trainer")
        params = self.params()
        if [tuple(t.shape) for t in sd["master"]] != [tuple(p.shape) for p in params]:
            raise ValueError("optimiser state of another model: its tensors' shapes differ")
        with torch.no_grad():
            for i, p in enumerate(params):
                st = self.state[p]
                st["step"] = int(sd["step"][i])
                for k in ("master", "exp_avg", "exp_avg_sq"):
                    st[k].copy_(sd[k][i])
                p.copy_(st["master"])
        for g, saved in zip(self.param_groups, sd["param_groups"]):
            g.update(saved)
