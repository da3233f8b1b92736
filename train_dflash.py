"""Train a DFlash drafter: target threads produce hidden states, drafter threads train replicas.

    loader -> [bounded queue] -> a thread per target device (no grad, cut after the deepest feature layer)
    -> [reorder buffer] -> Trainer.loop, the main thread: each step hands every drafter thread its micro-batches
    (forward + backward on its replica), then sums the gradients, clips, steps every replica, logs, checkpoints.
"""
import dataclasses
import functools
import json
import math
import os
import sys
import time
from types import SimpleNamespace

T_PROCESS = time.time()       # before torch's import: the start-up line counts from here

import torch
import torch.distributed as dist

import checkpoint as ck
import compiled
import config
import data_dflash
import dflash_model as dm
import environment
import errors
import models
from pipeline import Clock, Stop, Threads, Workers, gather_ints, init_distributed, over_ranks
from records import Logger, Recorder
from replicas import Replicas, forward_backward

class Trainer:
    """train(): setup (options, devices, data, shapes), models, resume, warm-up, then loop(): a train_step per step,
    recorded (records.Recorder) and checkpointed (checkpoint.Checkpointer) on the clock (pipeline.Clock)."""
    def __init__(self, cfg, log, env=None):
        self.cfg, self.log, self.env_at_start, self.threads = cfg, log, env, Threads()
        self.clock = Clock(cfg.max_minutes)

    def train(self):
        cfg, log = self.cfg, self.log
        t_setup = time.time()
        self.setup()
        t_models = time.time()
        self.build_models()
        self.resume()
        steps = gather_ints(self.plan.world, self.at.step)
        if len(set(steps)) > 1:
            raise errors.UserError(f"the ranks resumed at different steps {steps} (rank order): every rank "
                                   "must see the same --out-dir (a file system all nodes share)")
        # done already: by the steps, or by the loop's budget rule on the end the checkpoint predicted for its successor
        done = (f"already at step {self.at.step} of {self.plan.total_steps}: nothing to do"
                if self.at.step >= self.plan.total_steps else
                f"the {cfg.max_minutes} min budget (--max-minutes, resumes included) was used up by step "
                f"{self.at.step}: nothing to do (a larger --max-minutes continues)" if self.clock.used_up() else "")
        if done:
            log(f"[run] {done}\n[run] measure its acceptance: "
                f"{eval_command(self.tpath, self.at.resumed_from, self.heldout)}")
            return 0
        t_warm, ddevs = time.time(), self.plan.ddevs
        if self.plan.attn == "flex":
            compiled.use_compile_cache(cfg.compile_cache)
        compiled.warm_up(self.replicas.drafters, self.plan.shapes, forward_backward, cfg.loss, log,
                         targets=self.graphed if self.plan.attn == "flex" else ())
        log(f"[warmup] done in {time.time() - t_warm:.1f}s")
        self.replicas.zero_grads()          # the warm-up's backward passes left their gradients
        peak, now = compiled.measure_peak_flops(ddevs[0]), time.time()      # measured, then the clock read
        log(f"[mfu] measured matmul peak on {ddevs[0]}: {peak / 1e12:.1f} TFLOP/s")
        log(f"[run] start-up {now - T_PROCESS:.1f}s: imports + environment report {t_setup - T_PROCESS:.1f}s, "
            f"setup + data {t_models - t_setup:.1f}s, models + resume {t_warm - t_models:.1f}s, warm-up + matmul "
            f"peak {now - t_warm:.1f}s")
        return self.loop(peak * len(set(ddevs)) * self.plan.world)

    # --- config, data, models, resume ----------------------------------------------------------------
    def setup(self):
        cfg, log = self.cfg, self.log
        plan = self.plan = config.Plan(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), [], [], "")
        if plan.world > 1:
            init_distributed(plan, log)
        plan.tdevs, plan.ddevs = config.resolve_devices(cfg)
        compiled.host_threads(plan.tdevs + plan.ddevs)      # before any compile
        plan.attn = config.resolve_attn(cfg, plan.ddevs)
        if cfg.target and not cfg.data:
            raise errors.UserError("--data is required with --target")
        self.tpath, files = models.target_and_data(cfg)
        tcfg, self.tok = models.load_target_config(self.tpath)
        self.dcfg = models.make_drafter_config(cfg, tcfg, self.tok, models.target_identity(self.tpath, tcfg))
        mask = "-" if self.tok is None else repr(self.tok.convert_ids_to_tokens(self.dcfg.mask_token_id))
        log(f"[model] drafter {self.dcfg}")
        weights = f"D-PACE (smoothing {cfg.dpace})" if cfg.dpace else f"gamma {cfg.gamma}"
        log(f"[model] mask token {self.dcfg.mask_token_id} ({mask}), loss weights {weights}, attention {plan.attn}"
            + (" (CPU: FlexAttention has no backward, dense-mask SDPA)" if plan.ddevs[0].type == "cpu" else ""))
        self.data, self.heldout = data_dflash.load_training_data(cfg, files, self.tok, self.dcfg.vocab_size,
                                                                 plan.rank, log)
        # what a resume must find the same (held-out set, target) or is told changed (the training samples)
        self.identity = {"heldout": data_dflash.digest(self.data.get("heldout") or []),
                         "target": models.target_fingerprint(self.tpath, tcfg),
                         "samples": len(self.data["input_ids"]), "data": data_dflash.samples_digest(self.data)}
        plan.shapes = config.shape_plan(cfg, self.dcfg, config.batch_memory(self.dcfg, tcfg, plan.tdevs, plan.ddevs))
        self.stream = data_dflash.BatchStream(cfg, [len(x) for x in self.data["input_ids"]], plan.rank, plan.world,
                                              {S: B for B, S, _ in plan.shapes}, config.bucket_list(cfg))
        plan.per_step = len(plan.ddevs) * cfg.grad_accum             # batches per optimiser step (this node)
        steps_per_epoch = max(1, self.stream.nb // plan.per_step)
        # shards differ in size: all ranks must agree (the same schedule, no hang at the end)
        plan.total_steps = min(gather_ints(plan.world, cfg.max_steps or max(1, int(cfg.epochs * steps_per_epoch))))
        plan.nb_by_rank = gather_ints(plan.world, self.stream.nb)   # a rank's resume position is read against its own
        if plan.attn == "flex" and any(S % 128 for _, S, _ in plan.shapes):
            raise errors.UserError(f"flex attention needs bucket lengths that are multiples of 128, got "
                                   f"{[S for _, S, _ in plan.shapes]} (set --buckets / --max-length)")
        log(f"[data] {len(self.stream.indices)} samples on this node, {self.stream.nb} batches/epoch, "
            f"buckets {self.stream.buckets}, shapes (B,S,A) {plan.shapes}, padding waste "
            f"{100 * self.stream.padding_waste:.1f}%, {steps_per_epoch} steps/epoch, {plan.total_steps} steps planned"
            + (f" (or fewer: the run stops at the last step within --max-minutes {cfg.max_minutes:g})"
               if cfg.max_minutes else ""))

    def build_models(self):
        plan, tdtype, layers = self.plan, config.param_dtype(self.plan.tdevs[0]), self.dcfg.target_layer_ids
        targets = [models.load_target(self.tpath, d, tdtype, layers, self.log, whole=self.cfg.teacher)
                   for d in plan.tdevs]
        if plan.attn == "flex":    # compiled as the drafter is: through the gate, warmed (and graphed) with its shapes
            for t in targets:
                compiled.compile_target_layers(t)
        self.graphed = [compiled.GraphedTarget(t, layers, final=self.cfg.teacher) for t in targets]
        self.replicas = Replicas(self.dcfg, targets[0].get_input_embeddings().weight.detach(),
                                 targets[0].get_output_embeddings().weight.detach(), plan.ddevs, self.cfg, plan.world,
                                 self.lr_factor, self.log)
        if plan.attn == "flex":
            for dr in self.replicas.drafters:
                compiled.compile_drafter(dr)

    def lr_factor(self, s):
        """At the middle of step s (0-based): no step runs at lr 0. Under a time budget the elapsed share counts too."""
        progress, warm = min(1.0, max((s + 0.5) / self.plan.total_steps, self.clock.frac)), self.cfg.warmup_frac
        return progress / warm if progress < warm else 0.5 * (1 + math.cos(math.pi * (progress - warm) / (1 - warm)))

    def resume(self):
        """Where the run starts (self.at: step, batch cursor, checkpoint resumed from), after the same-run checks."""
        at = self.at = SimpleNamespace(step=0, cursor=0, resumed_from=None)
        path, state = ck.load_newest(self.cfg.out_dir, self.log) if self.cfg.resume else (None, None)
        if self.cfg.resume and path is None:
            self.log(f"[resume] no checkpoint in {self.cfg.out_dir}: starting fresh")
        if path is not None:
            if notice := ck.check_same_run(path, state, self.cfg, self.identity, self.heldout, self.tpath):
                self.log(notice)
            at.step, at.cursor, at.resumed_from = state["step"], state["cursor"], path
            self.clock.resume(state["train_seconds"], state.get("next_step_ends_s", state["train_seconds"]))
            self.replicas.load(state, path, self.plan.total_steps, self.log)
            at.cursor = self.stream.resume_cursor(at.cursor, state["batches_per_epoch_by_rank"], self.log)
            self.log(f"[resume] {path}: step {at.step}, batch cursor {at.cursor}, fp32 masters + moments "
                     "match the saved digest")
        if self.heldout:      # the run's held-out conversations, now known to be the ones it started with
            data_dflash.write_chat_jsonl(self.heldout, self.data["heldout"])

    # --- the loop ------------------------------------------------------------------------------------
    def loop(self, peak_flops):
        cfg, plan = self.cfg, self.plan
        self.rec = Recorder(cfg, self.log, plan.rank, self.at.step, {"target": plan.tdevs, "drafter": plan.ddevs})
        self.ckpt = ck.Checkpointer(self.threads, cfg.out_dir, cfg.keep_last, self.log)
        load = functools.partial(load_batch, cfg, self.dcfg, self.stream, self.data, self.tok, plan.shapes)
        self.q = Workers(self.threads, plan, cfg.queue_depth, self.at.cursor, load, self.graphed,
                         self.replicas.drafters, self.rec.busy)
        threads = self.q.start(self.log)
        self.rec.start(self.clock.start())
        try:
            for step in range(self.at.step + 1, plan.total_steps + 1):     # 1-based: the step being taken
                figures, signalled = self.train_step(step, self.next_batches(step))
                last = self.clock.stops_after(step, signalled, self.log) or step == plan.total_steps
                log_now = step % cfg.log_interval == 0 or last
                interval = self.interval(step, figures, peak_flops) if log_now else None
                self.rec.record(step, figures, interval, plan.total_steps)
                if plan.rank == 0 and (step % cfg.ckpt_interval == 0 or last):
                    self.checkpoint(step)
                if last:
                    break
            self.replicas.check(self.rec.last["step"], self.log)   # a divergence found now is a failure as any
        except Stop:             # another thread failed: finish() reports it
            pass
        except Exception as e:   # noqa: BLE001 - the loop's own failure stops the run as a thread's would
            self.threads.fail("step loop", e)
        finally:                # after a failure or a Ctrl-C too: the TensorBoard events end complete
            self.clock.stop()
            self.threads.stop.set()                          # stop the loader, target and drafter threads
            self.ckpt.wait()                             # a snapshot from before a failure is still good
            self.rec.close()
        return self.finish(threads)

    def train_step(self, step, batches):
        """One optimiser step over this node's batches, replica r taking every R-th (its thread, Workers.drafter, runs
        the forward + backward): the gradients summed over replicas and ranks, one clip, one AdamW step on each replica.
        One loss normaliser over replicas x micro-batches x ranks: the step is one over their concatenation. Returns
        the step's figures and whether a signal on any rank makes it every rank's last."""
        reps, R = self.replicas, len(self.plan.ddevs)
        wsum, tokens, flops, real_flops, signalled = over_ranks(self.plan.world, [
            *(sum(b[k] for b in batches) for k in ("wsum", "tokens", "flops", "real_flops")), bool(self.clock.asked)])
        for r in range(R):
            self.threads.put(self.q.inbox[r], (batches[r::R], wsum))
        sums = [self.threads.get(q) for q in self.q.outbox]    # every replica's backward is done
        t0 = time.time()
        stats = reps.reduce(sums)                          # the gradients and the sums, over replicas and ranks
        self.clock.tick(self.plan.world)                   # before the step: the schedule reads the budget used
        lr = reps.opts[0].param_groups[0]["lr"]
        try:
            gnorm = reps.step(self.cfg.clip)
        except FloatingPointError as e:   # before any replica stepped: the weights are the last step's
            raise FloatingPointError(f"step {step}: {e} (loss {float(stats[0]):.4g}); stopped without "
                                     "stepping, the checkpoints are intact. Usual causes: too high --lr, "
                                     "or a bad batch / target feature") from None
        self.rec.add(sync=time.time() - t0, tokens=tokens, flops=flops, real_flops=real_flops)
        figures = self.rec.step_figures(step, stats, lr, gnorm)
        if step % self.cfg.log_interval == 0:
            reps.check(step)
        return figures, bool(signalled)

    def next_batches(self, step):
        """Step `step`'s batches, in stream order, from the target threads' reorder buffer."""
        j0 = self.at.cursor + (step - 1 - self.at.step) * self.plan.per_step
        return [self.q.feats.take(j) for j in range(j0, j0 + self.plan.per_step)]

    def interval(self, step, figures, peak_flops):
        budget = (self.cfg.max_minutes - self.clock.seconds() / 60, self.clock.frac) if self.cfg.max_minutes else None
        return self.rec.interval(step, figures, self.plan.total_steps, peak_flops,
                                 (self.q.load.qsize(), len(self.q.feats.items)), budget)

    def checkpoint(self, step):
        """A host snapshot of the run now, written in the background; its pause is left out of the rates."""
        cfg, clock, plan = self.cfg, self.clock, self.plan
        state = {"step": step, "cursor": self.at.cursor + (step - self.at.step) * plan.per_step,
                 "batches_per_epoch_by_rank": plan.nb_by_rank, "train_seconds": clock.seconds(),
                 "next_step_ends_s": clock.next_end_s if cfg.max_minutes else clock.seconds(),
                 "config": dataclasses.asdict(cfg), "data_manifests": self.data.get("manifests", {}),
                 "identity": self.identity, "total_steps": plan.total_steps, **self.replicas.checkpoint_state()}
        # env.json: the environment the run STARTED in (its code and packages were loaded then), the cache as now
        env = functools.partial(environment.with_cache, self.env_at_start, cfg.compile_cache)
        folder = os.path.abspath(os.path.join(cfg.out_dir, f"step_{step:06d}", "drafter"))
        recipe = {"data": ", ".join(cfg.data) or "the embedded default (ShareGPT V3)", "steps": step,
                  **{k: getattr(cfg, k) for k in ("max_length", "num_anchors", "gamma", "dpace", "distill", "lr")}}
        card = dm.model_card(self.dcfg, folder, recipe)
        self.rec.add(pause=self.ckpt.save(step, state, self.replicas.drafters[0], env, card))

    # --- the end -------------------------------------------------------------------------------------
    def finish(self, threads):
        log, cfg = self.log, self.cfg
        ckpt = (ck.list_checkpoints(cfg.out_dir) or [None])[-1]     # the writer is done: the last checkpoint
        if self.threads.failures:
            self.threads.report(log, ckpt)
            return 1
        for t in threads:    # a thread still inside torch at interpreter exit aborts the process
            t.join(60)
        log(self.rec.summary(ckpt, eval_command(self.tpath, ckpt, self.heldout)))
        if self.plan.world > 1:   # all ranks together: a group left to the interpreter's exit can abort it
            dist.barrier()
            dist.destroy_process_group()
        return 128 + self.clock.stopped if self.clock.stopped else 0    # a shell's code for a process a signal ended


def eval_command(target, ckpt, heldout):
    """The command that measures the drafter at `ckpt`, as a user pastes it; without held-out conversations the
    prompts are theirs to give (said on the next line, not inside the command)."""
    prompts = heldout or "YOUR_PROMPTS.jsonl"
    return (f"python eval_dflash.py --target {target} --drafter {ckpt}/drafter --prompts {prompts}"
            + ("" if heldout else "\n    (no held-out conversations: --heldout 0 or synthetic data)"))

def load_batch(cfg, dcfg, stream, data, tok, shapes, j):
    """Batch j of the stream with its host work done (in the loader thread, ahead of its step)."""
    S, sids = stream.batch(j)
    pad_id = 0 if tok is None else tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids, lm, lengths = data_dflash.collate(sids, data, S, pad_id)
    A = next(a for _, s, a in shapes if s == S)        # the bucket's anchors, as the shape plan has them
    item = prepare_batch(cfg, dcfg, [(i, j // stream.nb) for i in sids], ids, lm, lengths, A)
    if item["batch"].shape not in shapes:   # on every path, not only the gate's: CPU runs see it too
        raise RuntimeError(f"batch shape {item['batch'].shape} is not in the warmed shape plan {shapes}")
    return item

def prepare_batch(cfg, dcfg, keys, ids, lm, lengths, A):
    """A batch's host work, done by the loader thread ahead of its step (off the step loop's and the drafter thread's
    path): its A anchors a row, its dm.Batch, and its share of the step's sums."""
    anchors, valid = sample_anchors_for(cfg.seed, keys, lm, lengths, A, dcfg.block_size)
    batch = dm.make_batch(ids, lm, anchors, valid, dcfg, cfg.loss)
    return {"ids": ids, "batch": batch, "wsum": float(batch.weights[:, :, 1:].sum()), "tokens": float(lengths.sum()),
            "flops": dm.batch_flops(dcfg, ids.shape[1], anchors, valid, batch.taught),
            "real_flops": dm.batch_flops(dcfg, ids.shape[1], anchors, valid, batch.taught, lengths)}

def sample_anchors_for(seed, sample_keys, lm, lengths, A, block_size):
    """Drawn per (sample, epoch) with their own generator: the same however batches are split, and again on resume."""
    drawn = [dm.sample_anchors(lm[r: r + 1], lengths[r: r + 1], A, block_size,
                               generator=torch.Generator().manual_seed(seed * 1_000_003 + int(sid) * 7919 + int(epoch)))
             for r, (sid, epoch) in enumerate(sample_keys)]
    return torch.cat([a for a, _ in drawn]), torch.cat([v for _, v in drawn])

@errors.script
def main(argv=None):
    cfg = config.parse_args(sys.argv[1:] if argv is None else argv)
    config.check_outputs(cfg)
    old = ck.list_checkpoints(cfg.out_dir)
    if old and not cfg.resume:   # a new run would interleave its checkpoints with the old ones
        raise errors.UserError(f"{cfg.out_dir} holds checkpoints of an earlier run (newest {old[-1]}): "
                               "pass --resume to continue it, or use another --out-dir")
    log = Logger(cfg.out_dir, int(os.environ.get("RANK", 0)))
    log("=" * 72)
    env = environment.collect_env(cfg.compile_cache)
    log(environment.format_report(env))
    log("[config] " + json.dumps(dataclasses.asdict(cfg)))
    try:
        rc = Trainer(cfg, log, env).train()
    except errors.UserError as e:   # a clear error: printed on the way out (errors.script), and kept in the log
        log.f.write(f"error: {e}\n")
        raise
    sys.stdout.flush()
    if rc:
        os._exit(rc)          # do not wait for threads stuck in device work: stop within seconds
    return rc

if __name__ == "__main__":
    sys.exit(main())
