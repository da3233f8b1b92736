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

    def params(self):
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, grads, grad_scale=None):
        pairs = [(group, p) for group in self.param_groups for p in group["params"]]
        if len(grads) != len(pairs):
            raise ValueError(f"{len(grads)} gradients for {len(pairs)} parameters")
        nan_scale = None
        for (group, p), g in zip(pairs, grads):
            if g is None:
                continue
            if g.shape != p.shape:
                raise ValueError(f"gradient of shape {tuple(g.shape)} for a parameter of shape {tuple(p.shape)}")
            beta1, beta2 = group["betas"]
            st = self.state[p]
            st["step"] += 1
            t = st["step"]
            args = (beta1, beta2, group["eps"], 1 - group["lr"] * group["weight_decay"],
                    group["lr"] / (1 - beta1 ** t), math.sqrt(1 - beta2 ** t))
            if p.device.type == "cuda" and kernels.triton is not None:
                scale = grad_scale if grad_scale is not None else torch.ones((), device=p.device)
                kernels.adamw_triton(p, g.contiguous(), st, scale.float(), *args)
            else:
                if nan_scale is None:     # once per step: a host sync on a GPU (only without Triton)
                    nan_scale = grad_scale is not None and bool(torch.isnan(grad_scale))
                if not nan_scale:         # a nan factor stores nothing, as the kernel
                    kernels.adamw_torch(p, g, st, grad_scale, *args)

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
