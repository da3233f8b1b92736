"""Train a DFlash drafter: target threads produce hidden states, drafter threads train replicas.

    loader -> [bounded queue] -> a thread per target device (no grad, cut after the deepest feature layer)
    -> [reorder buffer] -> Trainer.loop, the main thread: each step hands every drafter thread its micro-batches
    (forward + backward on its replica), then sums the gradients, clips, steps every replica, logs, checkpoints.
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

import torch
import torch.distributed as dist

import checkpoint as ck
import compiled
import config
import data_dflash
import dflash_model as dm
import environment
from pipeline import ReorderBuffer, Run, Stop
from replicas import Replicas, forward_backward

class Trainer:
    def __init__(self, cfg, log, env=None):
        self.cfg, self.log, self.env_at_start = cfg, log, env
        self.run, self.time_frac, self.next_end_s = Run(), 0.0, 0.0   # the share of --max-minutes used; see loop
        self.stopped = 0      # the signal that stopped the run at a step, on any rank: see loop
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))

    def train(self):
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
        # done already: by the steps, or by the loop's budget rule on the end the checkpoint predicted for its successor
        done = ""
        if self.step >= self.total_steps:
            done = f"already at step {self.step} of {self.total_steps}: nothing to do"
        elif cfg.max_minutes and self.next_end_s >= 60 * cfg.max_minutes:
            done = (f"the {cfg.max_minutes} min budget (--max-minutes, resumes included) was used up by step "
                    f"{self.step}: nothing to do (a larger --max-minutes continues)")
        if done:
            log(f"[run] {done}\n[run] measure its acceptance: {self.eval_command(self.resumed_from)}")
            return 0
        t_warm = time.time()
        if self.attn == "flex":
            compiled.use_compile_cache(cfg.compile_cache)
        compiled.warm_up(self.replicas.drafters, self.shapes, forward_backward, cfg.gamma, cfg.distill, log,
                         targets=self.graphed if self.attn == "flex" else ())
        log(f"[warmup] done in {time.time() - t_warm:.1f}s")
        self.replicas.zero_grads()          # the warm-up's backward passes added into the flat buffers
        self.peak_flops = compiled.measure_peak_flops(self.ddevs[0])
        now = time.time()
        log(f"[mfu] measured matmul peak on {self.ddevs[0]}: {self.peak_flops / 1e12:.1f} TFLOP/s")
        log(f"[run] start-up {now - T_PROCESS:.1f}s: imports + environment report {t_setup - T_PROCESS:.1f}s, "
            f"setup + data {t_models - t_setup:.1f}s, models + resume {t_warm - t_models:.1f}s, warm-up + matmul "
            f"peak {now - t_warm:.1f}s")
        return self.loop()

    # --- config, data, models, resume ----------------------------------------------------------------
    def setup(self):
        cfg, log = self.cfg, self.log
        if self.world > 1:
            local, cuda = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.is_available()
            if cuda:   # before any collective: else every rank's NCCL runs on cuda:0
                torch.cuda.set_device(local)
            dist.init_process_group("nccl" if cuda else "gloo", device_id=torch.device("cuda", local) if cuda else None)
            log(f"[dist] rank {self.rank}/{self.world} backend {dist.get_backend()}")
        self.tdevs, self.ddevs = config.resolve_devices(cfg)
        compiled.host_threads(self.tdevs + self.ddevs)      # before any compile
        self.attn = config.resolve_attn(cfg, self.ddevs)
        if cfg.target and not cfg.data:
            raise SystemExit("error: --data is required with --target")
        self.tpath, files = config.target_and_data(cfg)
        self.tcfg, self.tok = config.load_target_config(self.tpath)
        self.dcfg = config.make_drafter_config(cfg, self.tcfg, self.tok)
        self.pad_id = 0 if self.tok is None else (
            self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id)
        mask = "-" if self.tok is None else repr(self.tok.convert_ids_to_tokens(self.dcfg.mask_token_id))
        log(f"[model] drafter {self.dcfg}")
        log(f"[model] mask token {self.dcfg.mask_token_id} ({mask}), gamma {cfg.gamma}, attention {self.attn}"
            + (" (CPU: FlexAttention has no backward, dense-mask SDPA)" if self.ddevs[0].type == "cpu" else ""))
        self.data, self.heldout = data_dflash.load_training_data(cfg, files, self.tok, self.dcfg.vocab_size,
                                                                 self.rank, log)
        # what a resume must find the same (held-out set, target) or is told changed (the training samples)
        self.identity = {"heldout": data_dflash.digest(self.data.get("heldout") or []),
                         "target": config.target_fingerprint(self.tpath, self.tcfg),
                         "samples": len(self.data["input_ids"]), "data": data_dflash.samples_digest(self.data)}
        memory = config.batch_memory(self.dcfg, self.tcfg, self.tdevs, self.ddevs)
        self.shapes = config.shape_plan(cfg, self.dcfg, memory)
        self.stream = data_dflash.BatchStream(cfg, [len(x) for x in self.data["input_ids"]], self.rank, self.world,
                                              {S: B for B, S, _ in self.shapes}, config.bucket_list(cfg))
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

    def build_models(self):
        tdtype, layers = config.param_dtype(self.tdevs[0]), self.dcfg.target_layer_ids
        self.targets = [config.load_target(self.tpath, d, tdtype, layers, self.log, whole=self.cfg.teacher)
                        for d in self.tdevs]
        if self.attn == "flex":    # compiled as the drafter is: through the gate, warmed (and graphed) with its shapes
            for t in self.targets:
                compiled.compile_target_layers(t)
        self.graphed = [compiled.GraphedTarget(t, layers, final=self.cfg.teacher) for t in self.targets]
        t0 = self.targets[0]
        self.replicas = Replicas(self.dcfg, t0.get_input_embeddings().weight.detach(),
                                 t0.get_output_embeddings().weight.detach(), self.ddevs, self.cfg, self.world,
                                 self.lr_factor, self.log)
        if self.attn == "flex":
            for dr in self.replicas.drafters:
                compiled.compile_drafter(dr)

    def lr_factor(self, s):
        """At the middle of step s (0-based): no step runs at lr 0. Under a time budget the elapsed share counts too."""
        progress, warm = min(1.0, max((s + 0.5) / self.total_steps, self.time_frac)), self.cfg.warmup_frac
        return progress / warm if progress < warm else 0.5 * (1 + math.cos(math.pi * (progress - warm) / (1 - warm)))

    def resume(self):
        self.step, self.cursor, self.seconds_before, self.resumed_from = 0, 0, 0.0, None
        path, state = ck.load_newest(self.cfg.out_dir, self.log) if self.cfg.resume else (None, None)
        if self.cfg.resume and path is None:
            self.log(f"[resume] no checkpoint in {self.cfg.out_dir}: starting fresh")
        if path is not None:
            self.check_same_run(path, state)
            self.step, self.seconds_before, self.cursor = state["step"], state["train_seconds"], state["cursor"]
            self.next_end_s = state.get("next_step_ends_s", self.seconds_before)
            self.time_frac = self.seconds_before / (60 * self.cfg.max_minutes) if self.cfg.max_minutes else 0.0
            self.replicas.load(state, path)
            self.resumed_from = path
            if state.get("total_steps", self.total_steps) != self.total_steps:   # another schedule: follow it now
                lr = self.replicas.follow_schedule()
                self.log(f"[resume] NOTICE: the schedule changed ({state['total_steps']} -> {self.total_steps} steps "
                         f"planned): the learning rate follows the new one from step {self.step + 1} (lr {lr:.3g})")
            nb_old, nb = state["batches_per_epoch_by_rank"][self.rank], self.stream.nb
            if nb_old != nb:
                self.log(f"[resume] NOTICE: {nb_old} -> {nb} batches/epoch; continuing at the same epoch and position "
                         "within it")
                self.cursor = (self.cursor // nb_old) * nb + min(self.cursor % nb_old, nb - 1)
            self.log(f"[resume] {path}: step {self.step}, batch cursor {self.cursor}, fp32 masters + moments "
                     "match the saved digest")
        if self.heldout:      # the run's held-out conversations, now known to be the ones it started with
            data_dflash.write_chat_jsonl(self.heldout, self.data["heldout"])

    def check_same_run(self, path, state):
        """A resume continues the run of `path`: the same drafter, optimiser, loss, seed, target and held-out
        conversations (else a one-line error before anything is written); other training samples are said."""
        saved = {"distill": 0.0, **state["config"]}    # a config without the key: labels only
        changed = [f"--{k.replace('_', '-')} {getattr(self.cfg, k)} (checkpoint: {saved[k]})"
                   for k in ("num_draft_layers", "block_size", "target_layer_ids", "mask_token_id", "lr",
                             "weight_decay", "distill", "gamma", "seed") if saved[k] != getattr(self.cfg, k)]
        if changed:
            raise SystemExit(f"error: {path} continues with its own drafter, optimiser, loss and seed settings, but "
                             f"{', '.join(changed)}: pass the checkpoint's values or start a new run")
        old, new = state.get("identity", {}), self.identity
        if not old and self.heldout and os.path.isfile(self.heldout):   # a checkpoint that predates the record
            old = {"heldout": data_dflash.digest(data_dflash.load_conversations([self.heldout])[0])}
        if old.get("target", new["target"]) != new["target"]:
            raise SystemExit(f"error: {path} was trained against another target than --target {self.tpath} (other "
                             f"weights or config: fingerprint {old['target']}, now {new['target']}): resume with the "
                             "run's target, or start a new run")
        if old.get("heldout", new["heldout"]) != new["heldout"]:
            raise SystemExit(f"error: {path}'s run holds out other conversations ({self.cfg.out_dir}/heldout.jsonl) "
                             "than this --data, --heldout give: the new ones may be conversations it trained on. "
                             "Resume with the run's --data and --heldout, or start a new --out-dir")
        if old.get("data", new["data"]) != new["data"]:
            self.log(f"[resume] NOTICE: the training samples changed ({old['samples']} -> {new['samples']} samples, "
                     f"digest {old['data']} -> {new['data']}); the held-out conversations did not")

    # --- the loop ------------------------------------------------------------------------------------
    def loop(self):
        cfg, log, run, reps, bs = self.cfg, self.log, self.run, self.replicas, self.cfg.block_size
        R, rank0, budget = len(self.ddevs), self.rank == 0, 60 * cfg.max_minutes
        metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
        if rank0 and os.path.exists(metrics_path):     # a resume: a killed run's later steps go
            keep_metrics_upto(metrics_path, self.step)
        metrics, tb = open(metrics_path if rank0 else os.devnull, "a", buffering=1), None   # a record per line
        if cfg.tensorboard and rank0:
            from torch.utils.tensorboard import SummaryWriter
            # a resume hides the events of steps trained again, as metrics.jsonl drops their records
            tb = SummaryWriter(cfg.tensorboard, purge_step=self.step + 1 if self.step else None)
            log(f"[tensorboard] writing to {cfg.tensorboard} (view: tensorboard --logdir {cfg.tensorboard})")
        self.ckpt = ck.Checkpointer(run, cfg.out_dir, cfg.keep_last, log)
        self.load_q = queue.Queue(maxsize=cfg.queue_depth * len(self.tdevs))
        self.buf = ReorderBuffer(run, self.cursor, cfg.queue_depth * self.per_step + len(self.tdevs))
        self.inbox, self.outbox = [queue.Queue(1) for _ in range(R)], [queue.Queue(1) for _ in range(R)]
        self.busy = {"target": [0.0] * len(self.tdevs), "drafter": [0.0] * R}   # seconds of device work
        threads = [run.start_thread("loader", self.loader)]
        threads += [run.start_thread(f"target-{i}:{d}", self.target_worker, i) for i, d in enumerate(self.tdevs)]
        threads += [run.start_thread(f"drafter-{r}:{d}", self.drafter_worker, r) for r, d in enumerate(self.ddevs)]
        log(f"[run] {len(self.tdevs)} target + {R} drafter threads started")
        if self.ddevs[0].type == "cuda":
            torch.cuda.set_device(self.ddevs[0])      # the gradient sum and the steps run from this thread
        self.t_start, t_prev = time.time(), self.seconds_before        # t_prev: the last step's end, budget clock
        tot = {"tokens": 0.0, "flops": 0.0, "sync": 0.0, "pause": 0.0}   # this run's sums
        seen = dict(tot, t=self.t_start, busy=(0.0, 0.0), step=self.step)    # the sums at the last log line
        self.losses, tok_hist = [], []
        # Ctrl-C or SIGTERM (a scheduler, `timeout`): the step under way ends, is checkpointed, and the run stops
        asked = 0                   # this rank's signal; a second one acts at once (the handler restores the old one)
        def on_signal(signum, frame):
            nonlocal asked
            asked = asked or signum
            signal.signal(signum, previous[signum])
        in_main = threading.current_thread() is threading.main_thread()   # where signal handlers live
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
        try:
            for step in range(self.step + 1, self.total_steps + 1):     # 1-based: the step being taken
                # this step's micro-batches in stream order: replica r takes every R-th, grad_accum of them
                j0 = self.cursor + (step - 1 - self.step) * self.per_step
                batches = [self.buf.take(j) for j in range(j0, j0 + self.per_step)]
                # one loss normaliser over replicas x micro-batches x ranks: the step is one over their concatenation;
                # a signal on any rank makes this step every rank's last
                wsum, tokens, flops, signalled = over_ranks(
                    self.world, [*(sum(b[k] for b in batches) for k in ("wsum", "tokens", "flops")), bool(asked)])
                for r in range(R):
                    run.put(self.inbox[r], (step, batches[r::R], wsum))
                sums = [run.get(q) for q in self.outbox]    # every replica's backward is done
                t0 = time.time()
                stats = reps.reduce(sums)                     # the gradients and the sums, over replicas and ranks
                if cfg.max_minutes:
                    # a step runs only if it ends within the budget, the next one predicted to take as long as
                    # this one; the clock is every rank's latest (the same lr, the same last step everywhere)
                    now = self.train_seconds()
                    used, self.next_end_s = over_ranks(self.world, [now, 2 * now - t_prev], "MAX")
                    t_prev, self.time_frac = now, used / budget        # before the step: the schedule reads it
                lr = reps.opts[0].param_groups[0]["lr"]
                try:
                    gnorm = reps.step(cfg.clip)
                except FloatingPointError as e:   # before any replica stepped: the weights are the last step's
                    raise FloatingPointError(f"step {step}: {e} (loss {float(stats[0]):.4g}); stopped without "
                                             "stepping, the checkpoints are intact. Usual causes: too high --lr, "
                                             "or a bad batch / target feature") from None
                tot["sync"] += time.time() - t0
                loss, hits, counts = stats.split([1, bs - 1, bs - 1])
                tot["tokens"], tot["flops"] = tot["tokens"] + tokens, tot["flops"] + flops
                acc = (hits / counts.clamp(min=1)).tolist()
                self.last = {"step": step, "loss": float(loss), "acc": [round(a, 4) for a in acc],
                             "sim_tau": round(dm.simulated_tau(acc), 4), "lr": lr, "grad_norm": gnorm,
                             "time": time.time()}
                self.losses.append(self.last["loss"])
                self.busy_at_last = {k: list(v) for k, v in self.busy.items()}   # the summary's window
                metrics.write(json.dumps(self.last) + "\n")
                if step % cfg.log_interval == 0:
                    reps.check(step)
                budget_end = bool(cfg.max_minutes and self.next_end_s >= budget)
                if budget_end:
                    log(f"[run] time budget of {cfg.max_minutes} min: step {step} is the last that ends within it")
                if signalled:   # this rank's signal, or another's (torchrun passes a SIGTERM on to every rank)
                    self.stopped = asked or signal.SIGTERM
                    log(f"[run] {signal.Signals(self.stopped).name}: step {step} is the last, checkpointed; run "
                        "again with --resume (start_training.sh passes it) to go on from it")
                last = budget_end or step == self.total_steps or bool(signalled)
                if step % cfg.log_interval == 0 or last:
                    x, seen = self.interval(step, tot, seen)
                    log(log_line(step, x, self.total_steps, cfg))
                    if tb:
                        for k, v in x.items():
                            tb.add_scalar(k, v, step)
                        tb.flush()         # readable while the run goes on, and after a kill
                    self.warn_if_slow(x, tok_hist)
                if rank0 and (step % cfg.ckpt_interval == 0 or last):   # snapshot now, written in the background
                    state = {"step": step, "cursor": j0 + self.per_step, "batches_per_epoch_by_rank": self.nb_by_rank,
                             "train_seconds": self.train_seconds(),
                             "next_step_ends_s": self.next_end_s if cfg.max_minutes else self.train_seconds(),
                             "config": dataclasses.asdict(cfg), "data_manifests": self.data.get("manifests", {}),
                             "identity": self.identity, "total_steps": self.total_steps,
                             **reps.checkpoint_state()}
                    tot["pause"] += self.ckpt.save(step, state, reps.drafters[0], self.checkpoint_env)
                if last:
                    break
        except Stop:             # another thread failed: finish() reports it
            pass
        except Exception as e:   # noqa: BLE001 - the loop's own failure stops the run as a thread's would
            run.fail("step loop", e)
        finally:                # after a failure or a Ctrl-C too: the TensorBoard events end complete
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            run.stop.set()                               # stop the loader, target and drafter threads
            self.ckpt.wait()                             # a snapshot from before a failure is still good
            if tb:
                tb.close()
        return self.finish(threads, tot)

    def loader(self):
        for j in itertools.count(self.cursor):
            S, sids = self.stream.batch(j)
            ids, lm, lengths = data_dflash.collate(sids, self.data, S, self.pad_id)
            keys = [(i, j // self.stream.nb) for i in sids]
            item = prepare_batch(self.cfg, self.dcfg, keys, ids, lm, lengths)
            if item["batch"].shape not in self.shapes:     # on every path, not only the gate's: CPU runs see it too
                raise RuntimeError(f"batch shape {item['batch'].shape} is not in the warmed shape plan {self.shapes}")
            self.run.put(self.load_q, (j, item))

    def target_worker(self, ti):
        dev, graphed = self.tdevs[ti], self.graphed[ti]
        with compiled.own_stream(dev):
            while True:
                j, batch = self.run.get(self.load_q)
                t0 = time.time()
                batch["feats"] = graphed(batch["ids"])   # rows right-padded to S: no mask (dm.target_forward)
                compiled.sync_device(dev)            # busy = device time, not launch time; feats ready for any stream
                self.busy["target"][ti] += time.time() - t0
                self.buf.put(j, batch)

    def drafter_worker(self, r):
        dev, drafter = self.ddevs[r], self.replicas.drafters[r]
        with compiled.own_stream(dev) as stream:
            while True:
                step, batches, wsum = self.run.get(self.inbox[r])
                if stream is not None:   # the step loop's AdamW pass, queued on the default stream, writes the weights
                    stream.wait_stream(torch.cuda.default_stream(dev))
                t0 = time.time()
                sums = forward_backward(drafter, [(b["feats"], b["batch"]) for b in batches], wsum)
                compiled.sync_device(dev)      # the step waits for the grads anyway; this makes busy = device time
                self.busy["drafter"][r] += time.time() - t0
                self.run.put(self.outbox[r], sums)

    # --- what a run reports --------------------------------------------------------------------------
    def interval(self, step, tot, seen):
        """The log line's figures since the last one, a checkpoint's pause left out of the rates."""
        now, cfg, last = time.time(), self.cfg, self.last
        dt = max(now - seen["t"] - (tot["pause"] - seen["pause"]), 1e-9)
        busy = tuple(sum(v) / len(v) for v in self.busy.values())             # mean per device
        x = {"loss": last["loss"], "acc@1": last["acc"][0], f"acc@{cfg.block_size - 1}": last["acc"][-1],
             "sim_tau": last["sim_tau"], "lr": last["lr"], "grad_norm": last["grad_norm"],
             "tok_s": (tot["tokens"] - seen["tokens"]) / dt,
             "mfu_drafter": (tot["flops"] - seen["flops"]) / dt / (self.peak_flops * len(set(self.ddevs)) * self.world),
             "busy_target": (busy[0] - seen["busy"][0]) / dt, "busy_drafter": (busy[1] - seen["busy"][1]) / dt,
             "queue_load": self.load_q.qsize(), "queue_feat": len(self.buf.items),
             "sync_ms": 1e3 * (tot["sync"] - seen["sync"]) / max(1, step - seen["step"]),
             "eta_min": (self.total_steps - step) * (now - self.t_start) / max(1, step - self.step) / 60,
             "ckpt_pause_s": tot["pause"] - seen["pause"]}
        if cfg.max_minutes:       # the budget, not the step count, ends such a run
            x["eta_min"] = min(x["eta_min"], cfg.max_minutes - self.train_seconds() / 60)
            x["budget_used"] = self.time_frac
        if self.ddevs[0].type == "cuda":
            x["mem_gib"] = torch.cuda.max_memory_allocated(self.ddevs[0]) / 2**30
        return x, dict(tot, t=now, busy=busy, step=step)

    def warn_if_slow(self, x, tok_hist):
        recent = tok_hist[-19:]
        tok_hist.append(x["tok_s"])
        if len(recent) >= 5 and x["tok_s"] < 0.5 * statistics.median(recent):
            last = ck.list_checkpoints(self.cfg.out_dir)
            self.log(f"WARNING: throughput {x['tok_s']:,.0f} tok/s is far below this run's recent median "
                     f"{statistics.median(recent):,.0f}. If the environment changed, run: python diagnose.py"
                     + (f" --against {last[-1]}" if last else ""))

    def finish(self, threads, tot):
        log, cfg = self.log, self.cfg
        ckpt = (ck.list_checkpoints(cfg.out_dir) or [None])[-1]     # the writer is done: the last checkpoint
        if self.run.failures:
            for name, report in self.run.failures:
                log(f"\n[FATAL] thread {name} failed:{report}")
            log(f"[FATAL] run stopped. Last intact checkpoint: {ckpt or 'none'}")
            return 1
        for t in threads:    # a thread still inside torch at interpreter exit aborts the process
            t.join(60)
        last, losses, busy = self.last, self.losses, self.busy_at_last     # a step ran: else a failure is reported
        self.replicas.check(last["step"], log)
        # the training window ends at the last step, not the final checkpoint's write
        elapsed = max(last["time"] - self.t_start, 1e-9)
        devs = {"target": self.tdevs, "drafter": self.ddevs}
        share = lambda role: ", ".join((f"{d} " if len(devs[role]) > 1 else "") + f"{x / elapsed:.0%}"
                                       for d, x in zip(devs[role], busy[role]))
        n = max(1, min(20, len(losses) // 5))
        log("\n".join([
            "=" * 72, "summary",
            f"  steps          {last['step']} (this run: from {self.step})",
            f"  tokens/s       {tot['tokens'] / elapsed:,.0f} (target tokens, {elapsed / 60:.1f} min)",
            f"  loss           {losses[0]:.4f} -> {losses[-1]:.4f} (mean of the first / last {n} steps: "
            f"{statistics.mean(losses[:n]):.4f} -> {statistics.mean(losses[-n:]):.4f})",
            f"  simulated tau  {last['sim_tau']:.2f}",
            f"  busy           target {share('target')}; drafter {share('drafter')} (share of the "
            f"training time on device work); optimiser step + gradient sync {tot['sync'] / elapsed:.0%}",
            f"  checkpoint     {ckpt or 'none'}",
            *([f"  tensorboard    tensorboard --logdir {cfg.tensorboard}"] if cfg.tensorboard else []),
            "  measure real acceptance:",
            f"    {self.eval_command(ckpt)}" if ckpt else "    (no checkpoint)", "=" * 72]))
        if self.world > 1:   # all ranks together: a group left to the interpreter's exit can abort it
            dist.barrier()
            dist.destroy_process_group()
        return 128 + self.stopped if self.stopped else 0    # a shell's code for a process the signal ended

    def eval_command(self, ckpt):
        prompts = self.heldout or "YOUR_PROMPTS.jsonl (no held-out conversations: --heldout 0 or synthetic data)"
        return f"python eval_dflash.py --target {self.tpath} --drafter {ckpt}/drafter --prompts {prompts}"

    def checkpoint_env(self):
        """env.json: the environment the run STARTED in (its code and packages were loaded then), the cache as now."""
        return {**self.env_at_start, "compile_cache": environment.cache_state(self.cfg.compile_cache)}

    def train_seconds(self):
        """Training time of the whole run, the runs it resumed included: what --max-minutes budgets."""
        return self.seconds_before + time.time() - self.t_start

def log_line(step, x, total_steps, cfg):
    bs = cfg.block_size
    progress = (f"{step} ({x['budget_used']:.0%} of {cfg.max_minutes:g} min)" if cfg.max_minutes
                else f"{step}/{total_steps}")
    return (f"step {progress} | loss {x['loss']:.4f} | acc@1 {x['acc@1']:.3f} acc@{bs - 1} {x[f'acc@{bs - 1}']:.3f} "
            f"| sim_tau {x['sim_tau']:.2f} | lr {x['lr']:.2e} | gnorm {x['grad_norm']:.2f} | {x['tok_s']:,.0f} tok/s "
            f"| MFU drafter {x['mfu_drafter']:.1%} | busy target {x['busy_target']:.0%} drafter "
            f"{x['busy_drafter']:.0%} | queues load {x['queue_load']} feat {x['queue_feat']} | sync "
            f"{x['sync_ms']:.0f}ms | mem " + (f"{x['mem_gib']:.1f}GiB" if "mem_gib" in x else "-")
            + f" | ETA {x['eta_min']:.1f}min" + (f" | checkpoint pause {x['ckpt_pause_s']:.2f}s (not in the rates)"
                                                 if x["ckpt_pause_s"] else ""))

def prepare_batch(cfg, dcfg, keys, ids, lm, lengths):
    """A batch's host work, done by the loader thread ahead of its step (off the step loop's and the drafter thread's
    path): its anchors, its dm.Batch, and its share of the step's sums."""
    A = config.anchors_for(cfg, ids.shape[1])
    anchors, valid = sample_anchors_for(cfg.seed, keys, lm, lengths, A, cfg.block_size)
    batch = dm.make_batch(ids, lm, anchors, valid, dcfg, cfg.gamma, cfg.distill)
    return {"ids": ids, "batch": batch, "wsum": float(batch.weights[:, :, 1:].sum()), "tokens": float(lengths.sum()),
            "flops": dm.batch_flops(dcfg, ids.shape[1], anchors, valid, batch.taught)}

def sample_anchors_for(seed, sample_keys, lm, lengths, A, block_size):
    """Drawn per (sample, epoch) with their own generator: the same however batches are split, and again on resume."""
    drawn = [dm.sample_anchors(lm[r: r + 1], lengths[r: r + 1], A, block_size,
                               generator=torch.Generator().manual_seed(seed * 1_000_003 + int(sid) * 7919 + int(epoch)))
             for r, (sid, epoch) in enumerate(sample_keys)]
    return torch.cat([a for a, _ in drawn]), torch.cat([v for _, v in drawn])

def over_ranks(world, values, op="SUM"):
    """Each number reduced over the ranks (SUM or MAX): a collective, so every rank calls it at the same point."""
    if world == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return t.tolist()

def gather_ints(world, value):
    values = [0] * world
    values[dist.get_rank() if world > 1 else 0] = value
    return [int(v) for v in over_ranks(world, values)]

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

class Logger:
    def __init__(self, out_dir, rank=0):
        os.makedirs(out_dir, exist_ok=True)
        self.f = open(os.path.join(out_dir, "train.log" if rank == 0 else f"train.rank{rank}.log"), "a", buffering=1)
        self.rank, self.lock = rank, threading.Lock()

    def __call__(self, msg):
        with self.lock:
            if self.rank == 0 or msg.lstrip().startswith(("[FATAL]", "WARNING", "error")):
                print(msg if self.rank == 0 else f"[rank {self.rank}] {msg}", flush=True)
            self.f.write(msg + "\n")

def main(argv=None):
    cfg = config.parse_args(sys.argv[1:] if argv is None else argv)
    config.check_outputs(cfg)
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
