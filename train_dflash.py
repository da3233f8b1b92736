"""Train a DFlash drafter: target threads produce hidden states, drafter threads train replicas.

    python train_dflash.py --target Qwen/Qwen3-8B --data sharegpt.json \\
        --target-devices cuda:0,cuda:1,cuda:2,cuda:3,cuda:4 --drafter-devices cuda:5,cuda:6,cuda:7
    python train_dflash.py                      # the embedded default: SmolLM2-135M-Instruct + ShareGPT
    python train_dflash.py --help               # every option

    loader --batches--> [bounded queue] --> one target thread per target device
        (no grad, bf16, compiled layers on GPUs, stops after the deepest captured layer, no LM head)
    --features--> [reorder buffer] --> one drafter thread per drafter device, each its own replica:
        anchors -> block mask -> compiled forward -> loss -> backward; the replicas meet at every
        optimiser step: gradients summed (NCCL between GPUs, a plain sum on one device; across nodes
        under torchrun), clipped, the same AdamW step on every replica.

Trainer.train() reads top to bottom: config, data, models, warm-up, threads, step, checkpoint. Any
exception in any thread stops the run within seconds, prints that thread's traceback and exits
non-zero; checkpoints are written atomically, so the last one stays intact.
"""
import dataclasses
import itertools
import json
import math
import os
import queue
import signal
import statistics
import sys
import threading
import time

T_PROCESS = time.time()       # before torch's import: the start-up line counts from here

import numpy as np
import torch
import torch.distributed as dist

import checkpoint as ck
import config
import data_dflash
import compiled
import environment
import dflash_model as dm
import layout
from replicas import Replicas
from pipeline import ReorderBuffer, Run, StepSync, fault, inject


class Trainer:
    def __init__(self, cfg, log, env=None):
        self.cfg, self.log, self.env_at_start, self.env_change_said = cfg, log, env, False
        self.time_frac = 0.0          # the share of a --max-minutes budget used
        self.next_end_s = 0.0         # when the next step is predicted to end, in train_seconds (all ranks' max)
        self.run = Run()
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))

    def train(self):
        """The whole run; returns the exit status."""
        cfg, log = self.cfg, self.log
        old = ck.list_checkpoints(cfg.out_dir)
        if old and not cfg.resume:   # a new run would interleave its checkpoints with the old ones
            raise SystemExit(f"error: {cfg.out_dir} holds checkpoints of an earlier run (newest {old[-1]}): "
                             "pass --resume to continue it, or use another --out-dir")
        t_setup = time.time()
        self.setup()
        t_models = time.time()
        self.build_models()
        self.resume()
        steps = gather_ints(self.world, self.step)
        if len(set(steps)) > 1:
            raise SystemExit(f"error: the ranks resumed at different steps {steps} (rank order): every rank "
                             "must see the same --out-dir (a file system all nodes share)")
        if self.step >= self.total_steps:
            log(f"[run] already at step {self.step} of {self.total_steps}: nothing to do")
            return 0
        # the budget's rule: a step runs only if it ends within the budget; a resume applies it to the end the
        # checkpointed step predicted for its successor, so it agrees with where the run stopped
        if cfg.max_minutes and self.step and self.next_end_s >= 60 * cfg.max_minutes:
            log(f"[run] the {cfg.max_minutes} min budget (--max-minutes, resumes included) was used up by step "
                f"{self.step}: nothing to do (a larger --max-minutes continues)")
            return 0
        t_warm = time.time()
        compiled.GATE.log = log
        if self.attn == "flex":
            compiled.use_compile_cache(cfg.compile_cache, log)
        compiled.warm_up(self.replicas.drafters, self.shapes, self.gamma, self.attn, cfg.on_unwarmed, log,
                       targets=self.targets if self.attn == "flex" else ())
        log(f"[warmup] done in {time.time() - t_warm:.1f}s")
        if self.ddevs[0].type == "cuda" and self.world == 1:   # one process holds the node's GPUs
            self.advise_layout()
        self.replicas.zero_grads()          # the warm-up's backward passes added into the flat buffers
        self.peak_flops = compiled.measure_peak_flops(self.ddevs[0])
        now = time.time()
        log(f"[mfu] measured matmul peak on {self.ddevs[0]}: {self.peak_flops / 1e12:.1f} TFLOP/s")
        log(f"[run] start-up {now - T_PROCESS:.1f}s: imports + environment report {t_setup - T_PROCESS:.1f}s, "
            f"setup + data {t_models - t_setup:.1f}s, models + resume {t_warm - t_models:.1f}s, warm-up + matmul "
            f"peak {now - t_warm:.1f}s")
        return self.run_threads()

    # --- config, data ------------------------------------------------------------------------
    def setup(self):
        cfg, log = self.cfg, self.log
        if self.world > 1:
            init_distributed(self.rank, self.world, log)
        self.tdevs, self.ddevs = config.resolve_devices(cfg)
        self.attn = config.resolve_attn(cfg, self.ddevs)
        if cfg.target and not cfg.data:
            raise SystemExit("error: --data is required with --target")
        self.tpath, files = config.target_and_data(cfg)
        self.tcfg, self.tok = config.load_target_config(self.tpath)
        self.dcfg = config.make_drafter_config(cfg, self.tcfg, self.tok)
        self.gamma = cfg.gamma
        self.pad_id = 0 if self.tok is None else (
            self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id)
        mask = "-" if self.tok is None else repr(self.tok.convert_ids_to_tokens(self.dcfg.mask_token_id))
        log(f"[model] drafter {self.dcfg}")
        log(f"[model] mask token {self.dcfg.mask_token_id} ({mask}), gamma {self.gamma}, attention {self.attn}"
            + (" (CPU: FlexAttention has no backward, dense-mask SDPA)" if self.ddevs[0].type == "cpu" else ""))
        self.data, self.heldout = load_data(cfg, files, self.tok, self.dcfg.vocab_size, self.rank, log)
        self.shapes = config.shape_plan(cfg, self.dcfg, config.batch_memory(self.dcfg, self.tcfg, self.tdevs, self.ddevs))
        self.stream = BatchStream(cfg, [len(x) for x in self.data["input_ids"]], self.rank, self.world,
                                  {S: B for B, S, _ in self.shapes})
        self.per_step = len(self.ddevs) * cfg.grad_accum             # batches per optimiser step (this node)
        steps_per_epoch = max(1, self.stream.nb // self.per_step)
        # shards differ in size: all ranks must agree (the same schedule, no hang at the end)
        self.total_steps = min(gather_ints(self.world, cfg.max_steps or max(1, int(cfg.epochs * steps_per_epoch))))
        self.nb_by_rank = gather_ints(self.world, self.stream.nb)   # a rank's resume position is read against its own
        if self.attn == "flex" and any(S % 128 for _, S, _ in self.shapes):
            raise SystemExit(f"error: flex attention needs bucket lengths that are multiples of 128, got "
                             f"{[S for _, S, _ in self.shapes]} (set --buckets / --max-length)")
        log(f"[data] {len(self.stream.indices)} samples on this node, {self.stream.nb} batches/epoch, "
            f"buckets {self.stream.buckets}, shapes (B,S,A) {self.shapes}, padding waste "
            f"{100 * self.stream.padding_waste:.1f}%, {steps_per_epoch} steps/epoch, {self.total_steps} steps planned"
            + (f" (or fewer: the run stops at the last step within --max-minutes {cfg.max_minutes:g})"
               if cfg.max_minutes else ""))

    # --- models, resume ----------------------------------------------------------------------
    def build_models(self):
        tdtype = config.param_dtype(self.tdevs[0])
        self.targets = [config.load_target(self.tpath, d, tdtype, self.dcfg.target_layer_ids, self.log)
                        for d in self.tdevs]
        if self.attn == "flex":    # compiled as the drafter is: through the gate, warmed with its shapes
            for t in self.targets:
                compiled.compile_target_layers(t)
        t0 = self.targets[0]
        self.replicas = Replicas(self.dcfg, t0.get_input_embeddings().weight.detach(),
                                 t0.get_output_embeddings().weight.detach(), self.ddevs, self.cfg, self.world,
                                 self.lr_factor, self.log)

    def lr_factor(self, s):
        """Linear warm-up over the first warmup_frac, then cosine decay to 0, at the middle of step s (0-based),
        so that no step runs at lr 0. Under a time budget the elapsed share counts too (the same on every rank)."""
        progress, warm = min(1.0, max((s + 0.5) / self.total_steps, self.time_frac)), self.cfg.warmup_frac
        if progress < warm:
            return progress / warm
        return 0.5 * (1 + math.cos(math.pi * (progress - warm) / (1 - warm)))

    def resume(self):
        """The newest intact checkpoint's weights, optimiser, schedule, step, data position and budget used."""
        self.step, self.cursor, self.seconds_before = 0, 0, 0.0
        if not self.cfg.resume:
            return
        path, state = ck.load_newest(self.cfg.out_dir, self.log)
        if path is None:
            self.log(f"[resume] no checkpoint in {self.cfg.out_dir}: starting fresh")
            return
        # the optimiser's settings come from the checkpoint: a different --lr or --weight-decay is an error
        changed = [f"--{k.replace('_', '-')} {getattr(self.cfg, k)} (checkpoint: {state['config'][k]})"
                   for k in ("lr", "weight_decay") if state["config"][k] != getattr(self.cfg, k)]
        if changed:
            raise SystemExit(f"error: {path} continues with its own optimiser settings, but {', '.join(changed)}: "
                             "drop the option(s) or start a new run")
        self.replicas.load(state, path)
        self.step, self.seconds_before, self.cursor = state["step"], state["train_seconds"], state["cursor"]
        self.next_end_s = state.get("next_step_ends_s", self.seconds_before)
        nb_old, nb = state["batches_per_epoch_by_rank"][self.rank], self.stream.nb
        if nb_old != nb:
            self.log(f"[resume] NOTICE: the data set changed ({nb_old} -> {nb} batches/epoch); continuing at "
                     "the same epoch and position within it")
            self.cursor = (self.cursor // nb_old) * nb + min(self.cursor % nb_old, nb - 1)
        self.log(f"[resume] {path}: step {self.step}, batch cursor {self.cursor}, fp32 masters + moments "
                 "match the saved digest")

    def advise_layout(self):
        """Log the predicted tokens/s of every layout of this node's GPUs, from one timed target forward and
        drafter step per shape (kept beside the compile cache), and warn when one beats this run's by >10%."""
        key = {"gpu": torch.cuda.get_device_name(self.ddevs[0]), "torch": torch.__version__, "target": self.tpath,
               "target_layers": len(self.targets[0].model.layers), "drafter": repr(self.dcfg),
               "shapes": [list(s) for s in self.shapes], "attn": self.attn}
        times = compiled.time_shapes(self.targets[0], self.replicas.drafters[0], self.shapes, self.gamma, self.attn,
                                   os.path.join(self.cfg.compile_cache, "layout_times.json"), key)
        batches, lengths = self.stream._epoch(0), self.stream.lengths
        buckets = []
        for B, S, A in self.shapes:
            mine = [sum(min(lengths[i], S) for i in idx) for s, idx in batches if s == S]
            if mine:                  # share of the batches, mean real tokens of a batch, its seconds
                buckets.append(layout.Bucket(len(mine), sum(mine) / len(mine), *times[(B, S, A)]))
        rows = layout.layouts(torch.cuda.device_count(), buckets)
        warning = layout.warning(rows, buckets, self.tdevs, self.ddevs)
        self.log("[layout] predicted tokens/s of this node's layouts (times per shape (B,S,A): "
                 + ", ".join(f"{s} target {1e3 * t:.0f} ms drafter {1e3 * d:.0f} ms" for s, (t, d) in times.items())
                 + f"):\n{layout.format_table(rows)}" + (f"\n[layout] {warning}" if warning else ""))

    # --- threads -----------------------------------------------------------------------------
    def run_threads(self):
        cfg, log = self.cfg, self.log
        os.makedirs(cfg.out_dir, exist_ok=True)
        metrics = os.path.join(cfg.out_dir, "metrics.jsonl")
        if self.rank == 0 and os.path.exists(metrics):     # a resume: a killed run's later steps go
            keep_metrics_upto(metrics, self.step)
        self.meter = Meter(self, open(metrics if self.rank == 0 else os.devnull, "a"))
        self.ckpt = ck.Checkpointer(self.run, cfg.out_dir, cfg.keep_last, log)
        self.finish_at = None
        self.load_q = queue.Queue(maxsize=cfg.queue_depth * len(self.tdevs))
        self.buf = ReorderBuffer(self.run, self.cursor, cfg.queue_depth * self.per_step + len(self.tdevs))
        sync = StepSync(self.run, len(self.ddevs))
        threads = [self.run.start_thread("loader", self.loader)]
        threads += [self.run.start_thread(f"target-{i}:{d}", self.target_worker, i) for i, d in enumerate(self.tdevs)]
        drafters = [self.run.start_thread(f"drafter-{r}:{d}", self.drafter_worker, r, sync)
                    for r, d in enumerate(self.ddevs)]
        log(f"[run] {len(threads) - 1} target + {len(drafters)} drafter threads started")
        try:
            while any(t.is_alive() for t in drafters) and not self.run.stop.is_set():
                for t in drafters:
                    t.join(timeout=0.5)
        finally:                # after a failure or a Ctrl-C too: the TensorBoard events end complete
            self.run.stop.set()                               # stop loader and target threads
            self.ckpt.close()
            self.meter.close()
        if self.run.failures:
            for name, tb in self.run.failures:
                log(f"\n[FATAL] thread {name} failed:\n{tb}")
            last = ck.list_checkpoints(cfg.out_dir)
            log(f"[FATAL] run stopped. Last intact checkpoint: {last[-1] if last else 'none'}")
            return 1
        for t in threads:    # a thread still inside torch at interpreter exit aborts the process
            t.join(60)
        self.replicas.check_identical(self.meter.last_step, log)
        self.meter.summary()
        if self.world > 1:   # all ranks together: a group left to the interpreter's exit can abort it
            dist.barrier()
            dist.destroy_process_group()
        return 0

    def loader(self):
        for j in itertools.count(self.cursor):
            S, sids = self.stream.batch(j)
            ids, am, lm = data_dflash.collate(sids, self.data, S, self.pad_id)
            self.run.put(self.load_q, (j, S, [(i, j // self.stream.nb) for i in sids], ids, lm, am.sum(1)))

    def target_worker(self, ti):
        dev, model = self.tdevs[ti], self.targets[ti]
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        for n in itertools.count(1):
            j, S, sids, ids, lm, lengths = self.run.get(self.load_q)
            inject("target", n)
            t0 = time.time()
            with torch.no_grad():
                am = (torch.arange(S)[None] < lengths[:, None]).to(dev)
                feats = dm.target_forward(model, ids.to(dev, non_blocking=True), am, self.dcfg.target_layer_ids)
            compiled.sync_device(dev)            # busy = device time, not launch time
            self.meter.t_busy[ti] += time.time() - t0
            self.buf.put(j, (S, sids, ids, lm, lengths, feats))

    def drafter_worker(self, r, sync):
        cfg, dev, dr = self.cfg, self.ddevs[r], self.replicas.drafters[r]
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        for step in range(self.step + 1, self.total_steps + 1):          # 1-based: the step being taken
            inject("drafter", step)
            base = self.cursor + (step - 1 - self.step) * self.per_step
            items = [self.buf.take(base + g * len(self.ddevs) + r) for g in range(cfg.grad_accum)]
            t0 = time.time()
            prepared, wsum, flops = prepare_batches(cfg, self.dcfg, self.gamma, items)
            # one loss normaliser over replicas x micro-batches (x ranks): a step equals one over their concatenation
            wsum = sync.gather(r, wsum, lambda sums: self.replicas.over_ranks([sum(sums)])[0])
            loss_sum, hits, counts = 0.0, 0, 0
            for S, ids, lm, feats, anchors, valid in prepared:
                shape = (ids.shape[0], S, anchors.shape[1])
                if shape not in self.shapes:     # on every path, not only the gate's: CPU tests see it too
                    raise RuntimeError(f"batch shape {shape} is not in the warmed shape plan {self.shapes}")
                with compiled.autocast(dev):
                    loss, acc, cnt = dm.drafter_forward_loss(dr, feats.to(dev, non_blocking=True),
                                                             dm.to_device(ids, dev), dm.to_device(lm, dev), anchors,
                                                             valid, self.gamma, compiled.trunk(self.attn), weight_sum=wsum)
                compiled.backward(loss, dev, shape, self.attn)
                loss_sum, hits, counts = loss_sum + loss.detach(), hits + acc * cnt, counts + cnt
            compiled.sync_device(dev)            # the step waits for the grads anyway; this makes busy = device time
            self.meter.d_busy[r] += time.time() - t0
            t1 = time.time()
            n_tok = float(sum(int(it[4].sum()) for it in items))          # real (unpadded) target tokens
            stats = torch.cat([loss_sum.float().view(1), hits.float(), counts.float(),
                               torch.tensor([n_tok, flops], device=hits.device)]).to(dev)
            gnorm, stats = sync.gather(r, stats, self.optimizer_step)
            self.meter.d_sync[r] += time.time() - t1
            if r == 0:
                self.after_step(step, stats, gnorm)
            sync.wait()                # the checkpoint and the stop decision are seen by every replica
            if self.finish_at is not None and step >= self.finish_at:
                break

    # --- the step, after every replica's backward ---------------------------------------------
    def optimizer_step(self, stats_list):
        """In the leader thread while the others wait: sum the gradients and stats, clip, step every replica."""
        t0 = time.time()
        stats = self.replicas.reduce(stats_list)
        if self.cfg.max_minutes:
            # the budget clock is the same on every rank (the same lr, the same last step); the run stops
            # at the last step that ends within the budget, the next one predicted to take as long as this one
            now, budget = self.train_seconds(), 60 * self.cfg.max_minutes
            step_s = now - getattr(self, "t_prev_step", now)
            self.t_prev_step = now
            self.time_frac, self.next_frac = self.replicas.over_ranks([now / budget, (now + step_s) / budget], "MAX")
            self.next_end_s = self.next_frac * budget
        self.t_sync_last = time.time() - t0
        self.lr_used = self.replicas.opts[0].param_groups[0]["lr"]
        try:
            gnorm = self.replicas.step(self.cfg.clip)
        except FloatingPointError as e:   # before any replica stepped: the weights are the last step's
            raise FloatingPointError(f"step {self.meter.last_step + 1}: {e} (loss {float(stats[0]):.4g}); stopped "
                                     "without stepping, the checkpoints are intact. Usual causes: too high "
                                     "--lr, or a bad batch / target feature") from None
        return gnorm, stats

    def after_step(self, step, stats, gnorm):
        cfg = self.cfg
        rec = self.meter.record(step, stats, gnorm, self.lr_used)
        self.replicas.watch(step, cfg.log_interval)
        if cfg.max_minutes and self.finish_at is None and self.next_frac >= 1.0:
            self.finish_at = step
            self.log(f"[run] time budget of {cfg.max_minutes} min: step {step} is the last that ends within it")
        if step % cfg.log_interval == 0 or step == self.total_steps or self.finish_at == step:
            self.meter.log_line(step, rec)
        if self.rank == 0 and (step % cfg.ckpt_interval == 0 or step == self.total_steps or self.finish_at == step):
            self.save_checkpoint(step)
        # rank 0 only: it writes the checkpoints, and its death ends the others (torchrun stops them)
        if fault("kill") == step and self.rank == 0:
            self.ckpt.wait()                    # killed once its checkpoint is on disk
            self.log(f"[test] SIGKILL after step {step}")
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    # --- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, step):
        r = self.replicas
        state = {"step": step, "cursor": self.cursor + (step - self.step) * self.per_step,
                 "batches_per_epoch_by_rank": self.nb_by_rank, "train_seconds": self.train_seconds(),
                 "next_step_ends_s": self.next_end_s if self.cfg.max_minutes else self.train_seconds(),
                 "config": dataclasses.asdict(self.cfg), "data_manifests": self.data.get("manifests", {}),
                 **r.checkpoint_state()}
        self.meter.ckpt_pause += self.ckpt.save(step, state, r.drafters[0], self.checkpoint_env,
                                                lambda: self.meter.last_step)

    def checkpoint_env(self):
        """env.json: the environment the run STARTED in (its code and packages were loaded then), the
        compile cache as it is now, and under changed_during_run what differs now."""
        now = environment.collect_env(self.cfg.compile_cache)
        if self.env_at_start is None:
            return now
        changed = [r for r in environment.diff_env(self.env_at_start, now) if not r[0].startswith("compile_cache.")]
        if changed and not self.env_change_said:     # once: every later checkpoint has the same news
            self.env_change_said = True
            self.log(f"WARNING: the environment changed while this run was going ({len(changed)} field(s): "
                     + "; ".join(f"{k} {a} -> {b}" for k, a, b in changed[:3])[:300] + "). Checkpoints keep "
                     "the environment the run started with, and these changes under changed_during_run")
        return {**self.env_at_start, "compile_cache": now["compile_cache"],
                "changed_during_run": [list(r) for r in changed]}

    def train_seconds(self):
        """Training time of the whole run, the runs it resumed included: what --max-minutes budgets."""
        return self.seconds_before + time.time() - self.meter.t_start


# --- Set-up pieces --------------------------------------------------------------------------------


def init_distributed(rank, world, log):
    kw = {}
    if torch.cuda.is_available():   # before any collective: else every rank's NCCL runs on cuda:0
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        kw["device_id"] = torch.device("cuda", local)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", **kw)
    log(f"[dist] rank {rank}/{world} backend {dist.get_backend()}")


def gather_ints(world, value):
    """[value of rank 0, value of rank 1, ...] (a collective: every rank calls it at the same point)."""
    if world == 1:
        return [int(value)]
    t = torch.zeros(world, dtype=torch.int64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    t[dist.get_rank()] = int(value)
    dist.all_reduce(t)
    return t.tolist()


def load_data(cfg, files, tok, vocab, rank, log):
    """(samples, path of the held-out conversations or None): tokenised chats, or synthetic samples."""
    if files[0].startswith("synthetic:"):
        return synthetic_data(files[0], cfg.max_length, vocab, cfg.seed), None
    if tok is None:
        raise SystemExit("error: a random:<config> target has no tokenizer; use --data synthetic:N")
    data = data_dflash.build_dataset(tok, files, cfg.max_length, cfg.block_size, cfg.cache_dir,
                                     min_supervised=cfg.min_supervised, log=log,
                                     max_conversations=cfg.max_samples, heldout=cfg.heldout)
    if not data["input_ids"]:
        raise SystemExit("error: no usable training samples (see the skip counts above)")
    data["manifests"] = {}
    for name in files:         # data written by generate_data.py: which target wrote it, and how
        if os.path.isfile(name + ".manifest.json"):
            with open(name + ".manifest.json") as f:
                m = data["manifests"][name] = json.load(f)
            st = {k: v for k, v in m["settings"].items() if k not in ("sources", "target", "target_sha256")}
            log(f"[data] {name}: answers written by {m['settings']['target']} (weights sha256 "
                f"{m['settings']['target_sha256'][:12]}), {st}, counts {m['counts']}")
    heldout = None
    if data["heldout"] and rank == 0:
        heldout = os.path.join(cfg.out_dir, "heldout.jsonl")
        data_dflash.write_chat_jsonl(heldout, data["heldout"])
        log(f"[data] {len(data['heldout'])} held-out conversations (never trained on) -> {heldout}")
    return data, heldout


# --- What a run reports: metrics.jsonl, the log line, the summary ---------------------------------


class Meter:
    """Counters of the steps that ran: metrics.jsonl records, a line every log interval, the summary at the end."""

    def __init__(self, trainer, metrics_file):
        t = self.t = trainer
        self.metrics = metrics_file
        self.t_busy, self.d_busy, self.d_sync = [0.0] * len(t.tdevs), [0.0] * len(t.ddevs), [0.0] * len(t.ddevs)
        self.tokens = self.tokens_log = self.flops = self.flops_log = 0.0
        self.tok_hist, self.losses, self.last, self.ckpt_pause, self.mfu_warned = [], [], None, 0.0, False
        self.busy_log = (0.0, 0.0)
        self.t_start = self.t_log = time.time()
        self.tb = None
        if t.cfg.tensorboard and t.rank == 0:
            from torch.utils.tensorboard import SummaryWriter
            # a resume hides the events of steps trained again, as metrics.jsonl drops their records
            self.tb = SummaryWriter(t.cfg.tensorboard, purge_step=t.step + 1 if t.step else None)
            t.log(f"[tensorboard] writing to {t.cfg.tensorboard} (view: tensorboard --logdir {t.cfg.tensorboard})")

    def close(self):
        """Writes the TensorBoard events still buffered (metrics.jsonl is flushed at every record)."""
        if self.tb:
            self.tb.close()

    @property
    def last_step(self):
        return self.last["step"] if self.last else self.t.step

    def record(self, step, stats, gnorm, lr):
        bs = self.t.cfg.block_size
        self.tokens += float(stats[2 * bs - 1])     # summed over replicas and ranks
        self.flops += float(stats[2 * bs])
        acc = (stats[1: bs] / stats[bs: 2 * bs - 1].clamp(min=1)).tolist()
        rec = {"step": step, "loss": float(stats[0]), "acc": [round(a, 4) for a in acc],
               "sim_tau": round(dm.simulated_tau(acc), 4), "lr": lr, "grad_norm": gnorm, "time": time.time()}
        self.losses.append(rec["loss"])
        self.last = rec
        self.busy_at_last = (list(self.t_busy), list(self.d_busy), list(self.d_sync))  # the summary's window
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()
        return rec

    def log_line(self, step, rec):
        """The log line and the TensorBoard scalars, both from one dict of the interval's figures."""
        t, bs = self.t, self.t.cfg.block_size
        now = time.time()
        # a checkpoint's pause is reported apart: the rates say how fast training runs
        pause, self.ckpt_pause = self.ckpt_pause, 0.0
        dt = max(now - self.t_log - pause, 1e-9)
        busy = sum(self.t_busy) / len(self.t_busy), sum(self.d_busy) / len(self.d_busy)   # mean per device
        x = {"loss": rec["loss"], "acc@1": rec["acc"][0], f"acc@{bs - 1}": rec["acc"][-1], "sim_tau": rec["sim_tau"],
             "lr": rec["lr"], "grad_norm": rec["grad_norm"], "tok_s": (self.tokens - self.tokens_log) / dt,
             "mfu_drafter": (self.flops - self.flops_log) / dt / (t.peak_flops * len(set(t.ddevs)) * t.world),
             "busy_target": (busy[0] - self.busy_log[0]) / dt, "busy_drafter": (busy[1] - self.busy_log[1]) / dt,
             "queue_load": t.load_q.qsize(), "queue_feat": len(t.buf), "sync_ms": 1000 * t.t_sync_last,
             "eta_min": (t.total_steps - step) * (now - self.t_start) / max(1, step - t.step) / 60,
             "ckpt_pause_s": pause}
        self.t_log, self.tokens_log, self.flops_log, self.busy_log = now, self.tokens, self.flops, busy
        progress = f"{step}/{t.total_steps}"
        if t.cfg.max_minutes:       # the budget, not the step count, ends such a run
            x["eta_min"] = min(x["eta_min"], t.cfg.max_minutes - t.train_seconds() / 60)
            x["budget_used"] = t.time_frac
            progress = f"{step} ({t.time_frac:.0%} of {t.cfg.max_minutes:g} min)"
        if t.ddevs[0].type == "cuda":
            x["mem_gib"] = torch.cuda.max_memory_allocated(t.ddevs[0]) / 2**30
        t.log(f"step {progress} | loss {x['loss']:.4f} | acc@1 {x['acc@1']:.3f} acc@{bs - 1} {x[f'acc@{bs - 1}']:.3f} "
              f"| sim_tau {x['sim_tau']:.2f} | lr {x['lr']:.2e} | gnorm {x['grad_norm']:.2f} | {x['tok_s']:,.0f} tok/s "
              f"| MFU drafter {x['mfu_drafter']:.1%} | busy target {x['busy_target']:.0%} drafter "
              f"{x['busy_drafter']:.0%} | queues load {x['queue_load']} feat {x['queue_feat']} | sync "
              f"{x['sync_ms']:.0f}ms | mem " + (f"{x['mem_gib']:.1f}GiB" if "mem_gib" in x else "-") + f" | ETA "
              f"{x['eta_min']:.1f}min" + (f" | checkpoint pause {pause:.2f}s (not in the rates)" if pause else ""))
        if self.tb:
            for k, v in x.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()         # readable while the run goes on, and after a kill
        tok_s, mfu = x["tok_s"], x["mfu_drafter"]
        if mfu > 1.0 and not self.mfu_warned:
            self.mfu_warned = True
            t.log(f"WARNING: MFU above 100%: the matmul peak measured at the start ({t.peak_flops / 1e12:.0f} "
                  f"TFLOP/s on {t.ddevs[0]}) was too low; was the device busy with another process then? This run's "
                  "MFU figures are not comparable")
        recent = self.tok_hist[-19:]
        self.tok_hist.append(tok_s)
        if len(recent) >= 5 and tok_s < 0.5 * statistics.median(recent):
            last = ck.list_checkpoints(t.cfg.out_dir)
            t.log(f"WARNING: throughput {tok_s:,.0f} tok/s is far below this run's recent median "
                  f"{statistics.median(recent):,.0f}. If the environment changed, run: python diagnose.py"
                  + (f" --against {last[-1]}" if last else ""))

    def summary(self):
        t = self.t
        # the training window ends at the last step, not the final checkpoint's write
        elapsed = max((self.last["time"] if self.last else time.time()) - self.t_start, 1e-9)
        t_busy, d_busy, d_sync = self.busy_at_last if self.last else (self.t_busy, self.d_busy, self.d_sync)
        share = lambda xs: [f"{x / elapsed:.0%}" for x in xs]
        last = ck.list_checkpoints(t.cfg.out_dir)
        prompts = t.heldout or "YOUR_PROMPTS.jsonl (no held-out conversations: --heldout 0 or synthetic data)"
        n = max(1, min(20, len(self.losses) // 5))
        t.log("\n".join([
            "=" * 72, "summary",
            f"  steps          {self.last_step} (this run: from {t.step})",
            f"  tokens/s       {self.tokens / elapsed:,.0f} (target tokens, {elapsed / 60:.1f} min)",
            f"  loss           {self.losses[0]:.4f} -> {self.losses[-1]:.4f} (mean of the first / last {n} steps: "
            f"{statistics.mean(self.losses[:n]):.4f} -> {statistics.mean(self.losses[-n:]):.4f})"
            if self.losses else "  loss -",
            f"  simulated tau  {self.last['sim_tau']:.2f}" if self.last else "  simulated tau -",
            f"  busy           target {share(t_busy)} drafter {share(d_busy)} (share of the training time on "
            f"device work); drafter wait at the step barrier + sync {share(d_sync)}",
            f"  checkpoint     {last[-1] if last else 'none'}",
            *([f"  tensorboard    tensorboard --logdir {t.cfg.tensorboard}"] if t.cfg.tensorboard else []),
            "  measure real acceptance:",
            f"    python eval_dflash.py --target {t.tpath} --drafter {last[-1]}/drafter --prompts {prompts}"
            + eval_processes(t) if last else "    (no checkpoint)", "=" * 72]))


def eval_processes(t):
    """The eval's --processes for this machine: on a GPU as many fp32 copies of the target as fit in 80%
    of its memory (a decoding process leaves a GPU mostly idle), at most 8 and one per two CPU cores."""
    if t.tdevs[0].type != "cuda":
        return ""
    params = sum(p.numel() for p in t.targets[0].parameters())
    n = min(8, (os.cpu_count() or 2) // 2, int(0.8 * torch.cuda.get_device_properties(t.tdevs[0]).total_memory
                                                 / (4.8 * params)))
    return f" --processes {n}" if n > 1 else ""


# --- Data order and anchors: functions of the seed, the epoch and the sample, so a resume is exact ---


class BatchStream:
    """Batch j of a flat stream over the epochs: (bucket length, sample indices) of this rank's shard,
    in an order fixed by (seed, epoch)."""

    def __init__(self, cfg, lengths, rank, world, rows):
        self.cfg = cfg
        self.indices = list(range(rank, len(lengths), world))          # this node's shard
        self.lengths = [lengths[i] for i in self.indices]
        self.buckets = config.bucket_list(cfg)
        self.rows = rows              # bucket length -> rows: the shape plan's
        self.epoch, self.batches = None, None
        self.nb = len(self._epoch(0))
        self.padding_waste = data_dflash.padding_waste(self.lengths, self.batches)

    def _epoch(self, epoch):
        if epoch != self.epoch:
            self.epoch, self.batches = epoch, data_dflash.make_batches(self.lengths, self.buckets, self.rows,
                                                                       self.cfg.seed, epoch)
        return self.batches

    def batch(self, j):
        S, local = self._epoch(j // self.nb)[j % self.nb]
        return S, [self.indices[i] for i in local]


def prepare_batches(cfg, dcfg, gamma, items):
    """Anchors of each micro-batch of a step, the step's loss-weight sum and its FLOPs."""
    prepared, wsum, flops = [], 0.0, 0.0
    for S, sids, ids, lm, lengths, feats in items:
        A = config.anchors_for(cfg, S, cfg.block_size)
        anchors, valid = sample_anchors_for(cfg.seed, sids, lm, lengths, A, cfg.block_size)
        w = dm.make_blocks(ids, lm, anchors, valid, cfg.block_size, dcfg.mask_token_id, gamma)[3]
        wsum += float(w[:, :, 1:].sum())
        flops += dm.batch_flops(dcfg, S, anchors, valid)
        prepared.append((S, ids, lm, feats, anchors, valid))
    return prepared, wsum, flops


def sample_anchors_for(seed, sample_keys, lm, lengths, A, block_size):
    """Anchors drawn per (sample, epoch) with their own generator: the same sample gets the same
    anchors however the batches are split across replicas, and a resumed run draws them again."""
    anchors, valid = [], []
    for r, (sid, epoch) in enumerate(sample_keys):
        g = torch.Generator().manual_seed(seed * 1_000_003 + int(sid) * 7919 + int(epoch))
        a, v = dm.sample_anchors(lm[r: r + 1], lengths[r: r + 1], A, block_size, generator=g)
        anchors.append(a)
        valid.append(v)
    return torch.cat(anchors), torch.cat(valid)


def synthetic_data(spec, length, vocab, seed):
    """Random samples for benchmarks: synthetic:N = N full-length samples, synthetic:N:varied = lengths
    uniform in [length/8, length] (every bucket occurs). Loss on all but the first 10%."""
    parts = spec.split(":")
    n, varied = int(parts[1]), parts[2:] == ["varied"]
    rng = np.random.default_rng(seed)
    ids, masks = [], []
    for _ in range(n):
        L = int(rng.integers(max(2, length // 8), length + 1)) if varied else length
        m = np.ones(L, dtype=np.uint8)
        m[: L // 10] = 0
        ids.append(rng.integers(0, vocab, L, dtype=np.int32))
        masks.append(m)
    return {"input_ids": ids, "loss_mask": masks}


# --- Logs and the command line --------------------------------------------------------------------


def keep_metrics_upto(path, step):
    """Drop the records of steps after `step` (trained again after a resume), atomically."""
    def upto(line):
        try:
            return json.loads(line)["step"] <= step
        except (ValueError, KeyError, TypeError):    # a line cut by a kill mid-write
            return False
    with open(path) as f:
        keep = [line for line in f if upto(line)]
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


class Logger:
    """print + append to <out_dir>/train.log. Under torchrun, rank r > 0 writes train.rank<r>.log and
    prints only failures and warnings."""

    def __init__(self, out_dir, rank=0):
        os.makedirs(out_dir, exist_ok=True)
        self.f = open(os.path.join(out_dir, "train.log" if rank == 0 else f"train.rank{rank}.log"), "a")
        self.rank, self.lock = rank, threading.Lock()

    def __call__(self, msg):
        with self.lock:
            if self.rank == 0 or msg.lstrip().startswith(("[FATAL]", "WARNING", "error")):
                print(msg if self.rank == 0 else f"[rank {self.rank}] {msg}", flush=True)
            self.f.write(msg + "\n")
            self.f.flush()


def main(argv=None):
    cfg = config.parse_args(sys.argv[1:] if argv is None else argv)
    log = Logger(cfg.out_dir, int(os.environ.get("RANK", 0)))
    log("=" * 72)
    env = environment.collect_env(cfg.compile_cache)
    log(environment.format_report(env))
    log("[config] " + json.dumps(dataclasses.asdict(cfg)))
    try:
        rc = Trainer(cfg, log, env).train()
    except SystemExit as e:       # a clear error: printed by Python on the way out, and kept in the log
        log.f.write(f"{e}\n")
        raise
    sys.stdout.flush()
    if rc:
        os._exit(rc)          # do not wait for threads stuck in device work: stop within seconds
    return rc


if __name__ == "__main__":
    sys.exit(main())
