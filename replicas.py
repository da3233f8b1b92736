"""The drafter replicas, one per drafter device, and the step that keeps them equal: the summed gradients, one clip,
the same MasterAdamW step on each. They must stay bit-identical: fingerprints of their weights and fp32 masters are
compared every log interval (across ranks too) and at the end of the run."""
import math

import torch
import torch.distributed as dist

import checkpoint as ck
import compiled
import config
from errors import UserError
from master_adamw import MasterAdamW
import models

class Replicas:
    def __init__(self, dcfg, emb, head, devices, cfg, world, lr_lambda, log):
        self.world = world
        self.drafters = [models.new_drafter(dcfg, emb, head, d, cfg.seed) for d in devices]   # identical replicas
        self.opts = [MasterAdamW(dr.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                 param_dtype=config.param_dtype(d)) for dr, d in zip(self.drafters, devices)]
        self.scheds = [torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) for opt in self.opts]
        # summed gradients (several replicas, ranks or micro-batches) add into an fp32 buffer per replica,
        # one collective per step; a lone replica with one micro-batch takes each backward's: no zeroing pass
        summed = len(devices) > 1 or world > 1 or cfg.grad_accum > 1
        self.flats, self.grads = [None] * len(devices), [None] * len(devices)
        for r, dr in enumerate(self.drafters if summed else []):
            params = list(dr.parameters())
            sizes = [p.numel() for p in params]
            self.flats[r] = torch.zeros(sum(sizes), device=devices[r], dtype=torch.float32)
            self.grads[r] = [g.view_as(p) for g, p in zip(torch.split(self.flats[r], sizes), params)]
            for p, g in zip(params, self.grads[r]):
                p.register_post_accumulate_grad_hook(add_into(g))
        n = sum(p.numel() for p in self.drafters[0].parameters())
        how = ("one flat fp32 buffer per replica (summed across replicas/ranks/micro-batches)" if summed
               else "handed over by each backward (lone replica)")
        log(f"[model] {len(devices)} drafter replica(s) x {n / 1e6:.1f}M trainable params on "
            f"{[str(d) for d in devices]} ({str(config.param_dtype(devices[0])).removeprefix('torch.')} weights, "
            f"fp32 masters in the optimiser); grads: {how}")

    def zero_grads(self):
        for opt, flat in zip(self.opts, self.flats):
            if flat is None:
                opt.zero_grad(set_to_none=True)
            else:
                flat.zero_()

    def reduce(self, stats_list):
        flats = self.flats
        if len(flats) > 1:
            if all(f.is_cuda for f in flats) and len({f.device for f in flats}) == len(flats):
                torch.cuda.nccl.all_reduce(flats)                         # in-process NCCL across GPUs
            else:
                total = sum(f.to(flats[0].device) for f in flats)
                for f in flats:
                    f.copy_(total)
        stats = sum(s.to(stats_list[0].device) for s in stats_list)
        if self.world > 1:
            dist.all_reduce(flats[0])
            dist.all_reduce(stats)
            for f in flats[1:]:
                f.copy_(flats[0])
        # read now, ready with the gradients: the log costs no wait, and this thread runs ahead of the AdamW pass
        return stats.to("cpu")

    def step(self, clip):
        for dr, opt, sched, grads in zip(self.drafters, self.opts, self.scheds, self.grads):
            gnorm = clip_and_step(opt, grads if grads is not None else [p.grad for p in dr.parameters()], clip)
            sched.step()
        self.zero_grads()
        return gnorm          # the same on every replica

    # --- checkpoints -----------------------------------------------------------------------------
    def checkpoint_state(self):
        """Replica 0's state: the others are identical."""
        dr, opt = self.drafters[0], self.opts[0]
        opt_state = opt.state_dict()
        masters = dict(zip([n for n, _ in dr.named_parameters()], opt.masters()))
        return {"optimizer": opt_state, "scheduler": self.scheds[0].state_dict(),
                # the fp32 masters by name (the same tensors as the optimiser's: stored once)
                "master_weights": {k: masters.get(k, v) for k, v in dr.state_dict().items()},
                "fingerprint": ck.digest(ck.fingerprint(self.tensors(0)[1])),   # the end-of-run log line's
                "resume_fingerprint": ck.optimizer_digest(opt_state)}

    def load(self, state, path, total_steps, log):
        """Every replica from a checkpoint's state; a schedule of other total steps is followed from the next step."""
        for dr, opt, sched in zip(self.drafters, self.opts, self.scheds):
            try:
                dr.load_state_dict(state["master_weights"])
                opt.load_state_dict(state["optimizer"])      # fp32 masters and moments; weights written from them
            except (RuntimeError, ValueError) as e:    # a drafter of another target's shape: its last line, a tensor
                why = [line.strip() for line in str(e).splitlines() if line.strip()][-1]
                raise UserError(f"{path}/state.pt holds a drafter this run cannot take ({why}): resume "
                                "with the checkpoint's --target, or start a new run") from None
            sched.load_state_dict(state["scheduler"])
        if ck.optimizer_digest(self.opts[0].state_dict()) != state["resume_fingerprint"]:
            raise RuntimeError(f"{path}: the optimiser state loaded from it is not the one saved (a load path "
                               "that rounds or skips a tensor)")
        if state.get("total_steps", total_steps) != total_steps:   # another schedule: follow it now
            lr = self.follow_schedule()
            log(f"[resume] NOTICE: the schedule changed ({state['total_steps']} -> {total_steps} steps planned): the "
                f"learning rate follows the new one from step {state['step'] + 1} (lr {lr:.3g})")

    def follow_schedule(self):
        """Set the learning rate the schedule gives the next step (after a resume under another schedule, whose
        saved value is the old one's): returns it."""
        for opt, sched in zip(self.opts, self.scheds):
            for g, base, fn in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas):
                g["lr"] = base * fn(sched.last_epoch)
        return self.opts[0].param_groups[0]["lr"]

    # --- bit-identical replicas --------------------------------------------------------------------
    def tensors(self, r):
        """Replica r's weights and fp32 masters: bf16 weights can hide a master that differs below their rounding."""
        names, tensors = map(list, zip(*self.drafters[r].named_parameters()))
        return names + [n + " (master)" for n in names], tensors + self.opts[r].masters()

    def check(self, step, log=None):
        """Every replica, and across ranks replica 0's min and max (equal iff all agree), as this rank's replica 0;
        with `log` (the end of the run, on every rank) the result is logged."""
        if len(self.drafters) == 1 and self.world == 1:
            return
        fps = [ck.fingerprint(self.tensors(r)[1]) for r in range(len(self.drafters))]
        if self.world > 1:
            fps += [fps[0].clone(), fps[0].clone()]
            dist.all_reduce(fps[-2], op=dist.ReduceOp.MIN)
            dist.all_reduce(fps[-1], op=dist.ReduceOp.MAX)
        fps, R = [fp.cpu() for fp in fps], len(self.drafters)
        bad = self.differing(fps[:R]) + self.differing(fps[R:], who="another rank")    # none: one rank
        if bad:
            raise RuntimeError(f"drafter replicas diverged by step {step}: {len(bad)} tensor fingerprint(s) differ, "
                               f"first {bad[:5]} (a bug, not noise: replicas must stay bit-identical)")
        if log:
            n = sum(p.numel() for p in self.drafters[0].parameters())
            log(f"[replicas] {R} replica(s) x {self.world} rank(s) bit-identical after step {step} "
                f"({n:,} parameters each; fingerprint {ck.digest(fps[0])})")

    def differing(self, fps, who=None):
        names = self.tensors(0)[0]
        return [f"{who or f'replica {r}'}: {names[i]}" for r in range(1, len(fps))
                for i in (fps[r] != fps[0]).nonzero()[:, 0].tolist()]

def forward_backward(drafter, work, weight_sum):
    """A replica's share of a training step: each micro-batch's loss (over the step's weight_sum) and its backward,
    the gradients adding up; work: [(target features, dm.Batch)]. Returns the summed loss, then hits and counts per
    block position (the log's figures)."""
    dev, loss_sum, hits, counts = drafter.fc.weight.device, 0.0, 0, 0
    for feats, batch in work:
        with compiled.autocast(dev):
            loss, acc, cnt = drafter(feats.to(dev, non_blocking=True), batch.to(dev), weight_sum)
        compiled.backward(drafter, loss, batch.shape)
        loss_sum, hits, counts = loss_sum + loss.detach(), hits + acc * cnt, counts + cnt
    return torch.cat([loss_sum.float().view(1), hits.float(), counts.float()])

def clip_and_step(opt, grads, clip):
    """clip_grad_norm_'s factor, applied on the device in MasterAdamW's pass (no scaling pass, no host sync). The step
    is queued BEFORE the host waits for the norm, so the device updates meanwhile; a nan/inf norm stores nothing."""
    norms = torch._foreach_norm([g for g in grads if g is not None], 2.0, dtype=torch.float32)   # fp32 for bf16
    norm = torch.linalg.vector_norm(torch.stack(norms))
    scale = torch.where(torch.isfinite(norm), (clip / (norm + 1e-6)).clamp(max=1.0), math.nan)
    host = torch.empty((), dtype=norm.dtype, pin_memory=norm.is_cuda).copy_(norm, non_blocking=True)
    ready = torch.cuda.current_stream(norm.device).record_event() if norm.is_cuda else None
    counts = [opt.state[p]["step"] for p in opt.params()]
    opt.step(grads=grads, grad_scale=scale)
    if ready is not None:
        ready.synchronize()
    value = float(host)
    if not math.isfinite(value):      # a nan/inf step would poison every weight and every later checkpoint
        for p, n in zip(opt.params(), counts):
            opt.state[p]["step"] = n
        raise FloatingPointError(f"the gradient norm is {value}")
    return value

def add_into(buf):
    def hook(p):
        buf.add_(p.grad)
        p.grad = None
    return hook
