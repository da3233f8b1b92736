"""What a training run records: train.log (Logger), and through Recorder.record(step, figures) metrics.jsonl (a line
per step), the log line and its figures as TensorBoard events (every --log-interval steps); the rates those figures
come from; the end-of-run summary."""
import json
import os
import statistics
import threading
import time

import torch

import checkpoint as ck
import dflash_model as dm

class Logger:
    """log(msg): printed (rank 0; other ranks print only failures and warnings) and kept in train.log."""
    def __init__(self, out_dir, rank=0):
        os.makedirs(out_dir, exist_ok=True)
        self.f = open(os.path.join(out_dir, "train.log" if rank == 0 else f"train.rank{rank}.log"), "a", buffering=1)
        self.rank, self.lock = rank, threading.Lock()

    def __call__(self, msg):
        with self.lock:
            if self.rank == 0 or msg.lstrip().startswith(("[FATAL]", "WARNING", "error")):
                print(msg if self.rank == 0 else f"[rank {self.rank}] {msg}", flush=True)
            self.f.write(msg + "\n")

class Recorder:
    """One run's records from `step` on: record() per step, interval() for a log line's rates, summary() at the end;
    busy and add() collect the device seconds and the sums the rates read."""
    def __init__(self, cfg, log, rank, step, devices):
        self.cfg, self.log, self.first, self.devices = cfg, log, step, devices    # devices: {"target": [...], ...}
        path = os.path.join(cfg.out_dir, "metrics.jsonl")
        if rank == 0 and os.path.exists(path):     # a resume: a killed run's later steps go
            keep_metrics_upto(path, step)
        self.metrics, self.tb = open(path if rank == 0 else os.devnull, "a", buffering=1), None   # a record a line
        if cfg.tensorboard and rank == 0:
            from torch.utils.tensorboard import SummaryWriter
            # a resume hides the events of steps trained again, as metrics.jsonl drops their records
            self.tb = SummaryWriter(cfg.tensorboard, purge_step=step + 1 if step else None)
            log(f"[tensorboard] writing to {cfg.tensorboard} (view: tensorboard --logdir {cfg.tensorboard})")
        self.busy = {role: [0.0] * len(d) for role, d in devices.items()}   # seconds of device work, per device
        self.tot = {"tokens": 0.0, "flops": 0.0, "real_flops": 0.0, "sync": 0.0, "pause": 0.0}   # this run's sums
        self.losses, self.tok_hist, self.last, self.busy_at_last = [], [], None, None

    def start(self, t_start):
        """The training window opens (the rates and the summary count from here)."""
        self.t_start, self.seen = t_start, dict(self.tot, t=t_start, busy=(0.0, 0.0), step=self.first)

    def add(self, **sums):
        for k, v in sums.items():
            self.tot[k] += v

    def step_figures(self, step, stats, lr, gnorm):
        """A step's record (metrics.jsonl) from the summed loss, hits and counts per block position."""
        bs = self.cfg.block_size
        loss, hits, counts = stats.split([1, bs - 1, bs - 1])
        acc = (hits / counts.clamp(min=1)).tolist()
        return {"step": step, "loss": float(loss), "acc": [round(a, 4) for a in acc],
                "sim_tau": round(dm.simulated_tau(acc), 4), "lr": lr, "grad_norm": gnorm, "time": time.time()}

    def record(self, step, figures, interval=None, total_steps=0):
        """A step's figures into metrics.jsonl; on a log step (`interval`: the log line's figures) the line and its
        TensorBoard events too."""
        self.last = figures
        self.losses.append(figures["loss"])
        self.busy_at_last = {k: list(v) for k, v in self.busy.items()}   # the summary's window
        self.metrics.write(json.dumps(figures) + "\n")
        if interval is None:
            return
        self.log(log_line(step, interval, total_steps, self.cfg))
        if self.tb:
            for k, v in interval.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()         # readable while the run goes on, and after a kill
        self.warn_if_slow(interval)

    def interval(self, step, last, total_steps, peak_flops, queues, budget=None):
        """The log line's figures since the last one (`last`: this step's), a checkpoint's pause left out of the rates.
        queues: the load and feature queues' lengths now; budget: (minutes left, share used) of a time budget."""
        now, cfg, tot, seen = time.time(), self.cfg, self.tot, self.seen
        dt = max(now - seen["t"] - (tot["pause"] - seen["pause"]), 1e-9)
        busy = tuple(sum(v) / len(v) for v in self.busy.values())             # mean per device
        x = {"loss": last["loss"], "acc@1": last["acc"][0], f"acc@{cfg.block_size - 1}": last["acc"][-1],
             "sim_tau": last["sim_tau"], "lr": last["lr"], "grad_norm": last["grad_norm"],
             "tok_s": (tot["tokens"] - seen["tokens"]) / dt,
             "mfu_drafter": (tot["flops"] - seen["flops"]) / dt / peak_flops,     # padding counted as work
             "mfu_drafter_real": (tot["real_flops"] - seen["real_flops"]) / dt / peak_flops,   # real tokens only
             "busy_target": (busy[0] - seen["busy"][0]) / dt, "busy_drafter": (busy[1] - seen["busy"][1]) / dt,
             "queue_load": queues[0], "queue_feat": queues[1],
             "sync_ms": 1e3 * (tot["sync"] - seen["sync"]) / max(1, step - seen["step"]),
             "eta_min": (total_steps - step) * (now - self.t_start) / max(1, step - self.first) / 60,
             "ckpt_pause_s": tot["pause"] - seen["pause"]}
        if budget:       # the budget, not the step count, ends such a run
            x["eta_min"], x["budget_used"] = min(x["eta_min"], budget[0]), budget[1]
        if self.devices["drafter"][0].type == "cuda":
            x["mem_gib"] = torch.cuda.max_memory_allocated(self.devices["drafter"][0]) / 2**30
        self.seen = dict(tot, t=now, busy=busy, step=step)
        return x

    def warn_if_slow(self, x):
        recent = self.tok_hist[-19:]
        self.tok_hist.append(x["tok_s"])
        if len(recent) >= 5 and x["tok_s"] < 0.5 * statistics.median(recent):
            last = ck.list_checkpoints(self.cfg.out_dir)
            self.log(f"WARNING: throughput {x['tok_s']:,.0f} tok/s is far below this run's recent median "
                     f"{statistics.median(recent):,.0f}. If the environment changed, run: python diagnose.py"
                     + (f" --against {last[-1]}" if last else ""))

    def summary(self, ckpt, eval_command):
        """The end-of-run block: steps, rates, loss, busy shares, the checkpoint and how to measure it."""
        cfg, last, losses, busy, tot = self.cfg, self.last, self.losses, self.busy_at_last, self.tot
        elapsed = max(last["time"] - self.t_start, 1e-9)   # the training window ends at the last step, not its write
        share = lambda role: ", ".join((f"{d} " if len(self.devices[role]) > 1 else "") + f"{x / elapsed:.0%}"
                                       for d, x in zip(self.devices[role], busy[role]))
        n = max(1, min(20, len(losses) // 5))
        return "\n".join([
            "=" * 72, "summary",
            f"  steps          {last['step']} (this run: from {self.first})",
            f"  tokens/s       {tot['tokens'] / elapsed:,.0f} (target tokens, {elapsed / 60:.1f} min)",
            f"  loss           {losses[0]:.4f} -> {losses[-1]:.4f} (mean of the first / last {n} steps: "
            f"{statistics.mean(losses[:n]):.4f} -> {statistics.mean(losses[-n:]):.4f})",
            f"  simulated tau  {last['sim_tau']:.2f}",
            f"  busy           target {share('target')}; drafter {share('drafter')} (share of the "
            f"training time on device work); optimiser step + gradient sync {tot['sync'] / elapsed:.0%}",
            f"  checkpoint     {ckpt or 'none'}",
            *([f"  tensorboard    tensorboard --logdir {cfg.tensorboard}"] if cfg.tensorboard else []),
            "  measure real acceptance:",
            f"    {eval_command}" if ckpt else "    (no checkpoint)", "=" * 72])

    def close(self):
        if self.tb:
            self.tb.close()

def log_line(step, x, total_steps, cfg):
    bs = cfg.block_size
    progress = (f"{step} ({x['budget_used']:.0%} of {cfg.max_minutes:g} min)" if cfg.max_minutes
                else f"{step}/{total_steps}")
    return (f"step {progress} | loss {x['loss']:.4f} | acc@1 {x['acc@1']:.3f} acc@{bs - 1} {x[f'acc@{bs - 1}']:.3f} "
            f"| sim_tau {x['sim_tau']:.2f} | lr {x['lr']:.2e} | gnorm {x['grad_norm']:.2f} | {x['tok_s']:,.0f} tok/s "
            f"| MFU drafter {x['mfu_drafter']:.1%} (real tokens {x['mfu_drafter_real']:.1%}) "
            f"| busy target {x['busy_target']:.0%} drafter {x['busy_drafter']:.0%} | queues load {x['queue_load']} "
            f"feat {x['queue_feat']} | sync {x['sync_ms']:.0f}ms | mem "
            + (f"{x['mem_gib']:.1f}GiB" if "mem_gib" in x else "-")
            + f" | ETA {x['eta_min']:.1f}min" + (f" | checkpoint pause {x['ckpt_pause_s']:.2f}s (not in the rates)"
                                                 if x["ckpt_pause_s"] else ""))

def keep_metrics_upto(path, step):
    """Drop the records of steps after `step` (trained again after a resume), atomically."""
    def upto(line):
        try:
            return json.loads(line)["step"] <= step
        except (ValueError, KeyError, TypeError):    # a line cut by a kill mid-write
            return False
    with open(path) as f, open(path + ".tmp", "w") as out:
        out.writelines(line for line in f if upto(line))
    os.replace(path + ".tmp", path)
