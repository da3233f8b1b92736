"""CPU tests of the threaded trainer end to end, in processes of their own (train_dflash.py, torchrun): checkpoints
and resume, signals and time budgets, replicas, failures and bad data; and the loader's prepared batch. Python
scripts fork from a server that has imported torch and transformers once (helpers.run_cmd).

Every training run is tiny: a random 4-layer Llama/Qwen3 target (hidden 64) with the SmolLM2
tokenizer, a 2-layer drafter, a handful of steps. What each test asserts is in its name. Faults are
injected by the tests: break_() wraps the project's own function that is to fail, in the run's process.
"""
import json
import math
import os
import re
import signal
import shutil
import sys
from pathlib import Path

import pytest
import torch

from errors import UserError
from helpers import (TINY, assert_ok, checkpoints, free_port, here, load_state, metrics, read_trace, run_cmd,
                     short_chats, small_config, tb_scalars, traced, tracing_code, train)


def _at(events, fn, at, pred=lambda args: True):
    """Where in a trace (helpers.trace_calls) the first `at` ("call" or "return") of `fn` is whose args satisfy pred."""
    return next(i for i, e in enumerate(events) if e["fn"] == fn and e["at"] == at and pred(e["args"]))


def _calls(events, fn, at="call"):
    return [e for e in events if e["fn"] == fn and e["at"] == at]


def _grad_buffers(events):
    """The gradient buffers the run's replicas add their backward's gradients into (replicas.add_into): described."""
    return [e["args"][0] for e in _calls(events, "replicas:add_into")]


def _lines(out_dir):
    """metrics.jsonl as written, a line a step (their time stamps tell a kept record from one written again)."""
    return (Path(out_dir) / "metrics.jsonl").read_text().splitlines()


def _files(folder):
    """{path: bytes} of every file under `folder`: what a run that does nothing must leave as it was."""
    return {f: f.read_bytes() for f in sorted(Path(folder).rglob("*")) if f.is_file()}


# -----------------------------------------------------------------------------
# checkpoints, signals, time budgets


def test_sigkill_after_or_in_a_checkpoint_write_then_resume_is_bit_equal_and_a_damaged_one_falls_back(
        llama, sharegpt, cache_dir, tmp_path):
    # 12 conversations -> a few samples -> a few batches per epoch: 6 steps x grad_accum 2 cross
    # epoch boundaries, so the cursor, the per-epoch batch order and per-(sample, epoch) anchors
    # all have to come back right after the kill.
    import checkpoint as ck
    common = [*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 12,
              "--heldout", 0, "--grad-accum", 2, "--max-steps", 6, "--ckpt-interval", 3]
    straight, cut = tmp_path / "straight", tmp_path / "cut"

    # ckpt_lag:3: checkpoint 3 is written in the background only once step 6 has run - it must hold step
    # 3's state all the same (the snapshot is a copy; compared with the cut run's below), and the save
    # at step 6 waits for it: the trace says in which order the run's functions ran
    trace = tmp_path / "trace.jsonl"
    p = run_cmd(traced("train_dflash", [*common, "--out-dir", straight], trace,
                       ["records:Recorder.record", "checkpoint:Checkpointer.save", "checkpoint:Checkpointer._write",
                        "dflash_model:save_drafter", "replicas:add_into"], fault="ckpt_lag:3"))
    assert_ok(p)
    events = read_trace(trace)
    record6 = _at(events, "records:Recorder.record", "call", lambda a: a[1] == 6)
    assert _at(events, "dflash_model:save_drafter", "call", lambda a: "step_000003.tmp" in a[1]) > record6
    save6 = [_at(events, "checkpoint:Checkpointer.save", at, lambda a: a[1] == 6) for at in ("call", "return")]
    assert save6[0] < _at(events, "checkpoint:Checkpointer._write", "return", lambda a: a[1] == 3) < save6[1]
    # micro-batches are added in fp32: every parameter's gradient is a view of one flat fp32 buffer (one replica)
    grads = _grad_buffers(events)
    assert grads and all(g["tensor"] == "torch.float32" and g["base"] == grads[0]["base"] for g in grads), grads
    assert sum(math.prod(g["shape"]) for g in grads) == grads[0]["base"]
    # the run crosses an epoch boundary: 6 steps x grad_accum 2 = 12 batches, more than an epoch has
    st6 = load_state(straight / "step_000006")
    assert st6["cursor"] == 12 and st6["batches_per_epoch_by_rank"][0] < 12, st6["batches_per_epoch_by_rank"]

    killed = train(*common, "--out-dir", cut, fault="kill:3")
    assert killed.rc == -signal.SIGKILL, f"expected SIGKILL, got {killed.rc}\n{killed.tail()}"
    assert checkpoints(cut) == ["step_000003"] and [r["step"] for r in metrics(cut)] == [1, 2, 3]
    assert load_state(cut / "step_000003")["cursor"] == 6
    kept, state3 = _lines(cut), (cut / "step_000003" / "state.pt").read_bytes()

    # the resume goes on from checkpoint 3 (not from scratch): steps 1-3's records stand as the killed run wrote
    # them (time stamps included) and checkpoint 3 is not written again
    resumed = train(*common, "--out-dir", cut, "--resume")
    assert_ok(resumed)
    assert _lines(cut)[:3] == kept and (cut / "step_000003" / "state.pt").read_bytes() == state3

    # killed in the middle of checkpoint 6's write (its drafter folder written, its state not): the folder stays a
    # .tmp, never taken; the resume goes on from 3
    mid = tmp_path / "mid_write"
    killed = train(*common, "--out-dir", mid, fault="kill_write:6")
    assert killed.rc == -signal.SIGKILL, killed.tail()
    tmp6 = mid / "step_000006.tmp"
    assert checkpoints(mid) == ["step_000003"] and (tmp6 / "drafter").is_dir()
    assert not (tmp6 / "state.pt").exists() and not (tmp6 / "DONE").exists()
    assert [r["step"] for r in metrics(mid)] == [1, 2, 3, 4, 5, 6]
    kept, state3 = _lines(mid), (mid / "step_000003" / "state.pt").read_bytes()
    resumed = train(*common, "--out-dir", mid, "--resume")
    assert_ok(resumed)
    assert _lines(mid)[:3] == kept[:3] and (mid / "step_000003" / "state.pt").read_bytes() == state3
    assert checkpoints(mid) == ["step_000003", "step_000006"] and not (mid / "step_000006.tmp").exists()

    # both continue bit for bit as the straight run: every record, every checkpoint (the last too)
    for out in (cut, mid):
        a, b = metrics(straight), metrics(out)
        assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
        for ra, rb in zip(a, b):
            assert [ra[k] for k in ("loss", "grad_norm", "lr", "acc")] == [rb[k] for k in ("loss", "grad_norm",
                                                                                            "lr", "acc")], ra["step"]
        for step in ("step_000003", "step_000006"):
            sa, sb = load_state(straight / step), load_state(out / step)
            assert sa["resume_fingerprint"] == sb["resume_fingerprint"], (out, step)    # masters and moments
            assert sa["fingerprint"] == sb["fingerprint"], (out, step)                  # the weights
    # the files are world-readable like the rest (safetensors creates its file 0600)
    mode = lambda f: os.stat(f).st_mode & 0o777
    assert mode(straight / "step_000006" / "drafter" / "model.safetensors") == mode(straight / "step_000006" / "state.pt")

    # damaged newest checkpoints: each is passed over (once), and the newest intact one is taken
    def damaged(name, edit):
        out = tmp_path / name
        shutil.copytree(straight, out)
        edit(out / "step_000006")
        warned = []
        path, state = ck.load_newest(str(out), warned.append)
        assert path == str(out / "step_000003") and state["step"] == 3, warned
        assert len(warned) == 1, warned
        return str(out / "step_000006")

    def cut_file(rel):
        def edit(d):
            with open(d / rel, "r+b") as f:
                f.truncate(os.path.getsize(d / rel) // 2)
        return edit

    # a cut file is caught by its size against DONE's record (cut weights: state.pt still loads and its digest matches)
    assert ck.damage(damaged("cut_state", cut_file("state.pt"))) is not None
    cut_weights = damaged("cut_weights", cut_file("drafter/model.safetensors"))
    assert ck.damage(cut_weights) is not None
    assert ck.optimizer_digest(load_state(cut_weights)["optimizer"]) == load_state(cut_weights)["resume_fingerprint"]

    def nudge(d):                  # one value of a moment, one ulp up: loads fine, is not what was saved
        st = load_state(d)
        t = st["optimizer"]["exp_avg_sq"][-1].view(-1)
        t[-1] = torch.nextafter(t[-1], torch.tensor(math.inf))
        torch.save(st, d / "state.pt")
        files = json.loads((d / "DONE").read_text())
        files["files"]["state.pt"] = os.path.getsize(d / "state.pt")
        (d / "DONE").write_text(json.dumps(files))
    # a nudged moment: every file has its recorded size, so the optimiser state's digest is what catches it
    nudged = damaged("nudged", nudge)
    assert ck.damage(nudged) is None
    assert ck.optimizer_digest(load_state(nudged)["optimizer"]) != load_state(nudged)["resume_fingerprint"]
    out = tmp_path / "all_bad"
    shutil.copytree(straight, out)
    for d in ("step_000003", "step_000006"):
        cut_file("state.pt")(out / d)
    with pytest.raises(UserError, match="every checkpoint in .* is damaged"):
        ck.load_newest(str(out), lambda m: None)


def test_sigterm_checkpoints_the_step_under_way_and_stops_then_resume_goes_on(llama, sharegpt, cache_dir, tmp_path):
    """SIGTERM (a scheduler, `timeout`, Ctrl-C's SIGINT alike) mid-run: the run ends its step (or the next: the
    signal is read as a step starts), checkpoints it, says how to go on, and exits 128 + 15; --resume trains the
    rest."""
    common = [*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 12,
              "--heldout", 0, "--max-steps", 6, "--ckpt-interval", 100, "--out-dir", tmp_path / "out"]
    out = tmp_path / "out"
    p = train(*common, fault="term:2")
    assert p.rc == 128 + signal.SIGTERM, p.tail()
    stop = p.records[-1]["step"]            # the step under way as the signal came, or the next
    assert stop in (2, 3) and [r["step"] for r in p.records] == list(range(1, stop + 1)), p.records
    assert p.checkpoints == [f"step_{stop:06d}"]       # --ckpt-interval 100: the signal's checkpoint
    state = load_state(out / f"step_{stop:06d}")
    assert state["step"] == stop and state["cursor"] == stop and state["total_steps"] == 6
    assert "summary" in p.out, p.tail()                 # the end-of-run summary block, as on any other end
    # and says how to go on: the signal's line names --resume
    assert any("SIGTERM" in line and "--resume" in line for line in p.out.splitlines()), p.tail()
    kept = _lines(out)
    resumed = train(*common, "--resume")
    assert_ok(resumed)
    # the rest trained from the signal's checkpoint: its steps' records kept as written, steps stop+1..6 added
    assert _lines(out)[:stop] == kept and [r["step"] for r in resumed.records] == [1, 2, 3, 4, 5, 6]
    assert resumed.checkpoints == [f"step_{stop:06d}", "step_000006"]
    assert load_state(out / "step_000006")["step"] == 6 and load_state(out / "step_000006")["cursor"] == 6


def test_checkpoints_are_written_in_the_background_and_a_failed_write_stops_the_run(llama, sharegpt, cache_dir,
                                                                                     tmp_path):
    """A checkpoint's files are written by a thread while training goes on: a write that fails (a full disk) stops
    the run like any thread (non-zero exit, one line saying why, the previous checkpoint intact and named,
    the half-written folder removed); the log line reports the step loop's pause for the snapshot
    apart from the rates."""
    out = tmp_path / "out"
    p = train(*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 60,
              "--max-steps", 40, "--ckpt-interval", 2, "--out-dir", out, "--tensorboard", tmp_path / "tb",
              fault="ckpt:4")
    assert p.rc not in (0, None) and p.rc > 0, f"exit code {p.rc}\n{p.tail()}"
    # one line: which checkpoint, where, and the system's reason (a full disk), not a traceback
    assert re.search(r"\[FATAL\] thread checkpoint-writer failed: checkpoint 4 could not be written to \S+"
                     r"step_000004\.tmp: OSError: \[Errno 28\] No space left on device", p.out), p.tail()
    assert "Traceback" not in p.out, p.tail()
    assert re.search(r"\[FATAL\] run stopped\. Last intact checkpoint: \S+step_000002", p.out), p.tail()
    assert sorted(x.name for x in out.glob("step_*")) == ["step_000002"], "the failed write's folder is left"
    assert not (out / "step_000004.tmp").exists()          # its partial folder removed
    # the run stops at the failure, not after training on: at the latest at step 6's save, which waits for write 4
    trained = [r["step"] for r in p.records]
    assert trained == list(range(1, len(trained) + 1)) and 4 <= len(trained) <= 6, trained
    state = load_state(out / "step_000002")    # the masters by name are the optimiser's, stored once
    shared = {t.untyped_storage().data_ptr() for t in state["master_weights"].values()}
    assert all(m.untyped_storage().data_ptr() in shared for m in state["optimizer"]["master"])
    # checkpoint 2 is snapshotted after step 2's figures: its pause is in step 3's, reported apart from the rates
    pause = dict(tb_scalars(tmp_path / "tb")["ckpt_pause_s"])
    assert pause[1] == pause[2] == 0 and pause[3] > 0, pause


def test_a_time_budget_stops_at_the_last_step_within_it_and_resume_rules(llama, sharegpt, cache_dir, tmp_path):
    """--max-minutes: the progress line gives the share of the budget used, the run stops at the last
    step that ends within the budget and checkpoints it once; a resume counts the time already used (a spent
    budget: nothing to do). Without --resume an out dir with checkpoints is refused before any work; a
    different --lr, --distill, --gamma or drafter shape is an error (the drafter's, the optimiser's and the loss's
    settings come from the checkpoint); a resume drops the
    metrics of steps after the checkpoint and continues, with a notice, on a larger data set."""
    out = tmp_path / "out"
    common = [*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 30,
              "--heldout", 0, "--log-interval", 5, "--ckpt-interval", 1000, "--out-dir", out]
    tb = tmp_path / "tb"
    p = train(*common, "--max-minutes", 0.1, "--tensorboard", tb)
    assert_ok(p)
    steps = [r["step"] for r in p.records]
    last = steps[-1]
    assert steps == list(range(1, last + 1)) and p.checkpoints == [f"step_{last:06d}"], (steps, p.checkpoints)
    state = load_state(out / f"step_{last:06d}")
    # why it stopped: the budget, not the step count - the next step was predicted to end past it (the resume below
    # applies the same rule to it), and steps were still planned
    assert state["step"] == last and state["next_step_ends_s"] >= 6 and last < state["total_steps"], state
    assert state["batches_per_epoch_by_rank"] == [m_ := state["batches_per_epoch_by_rank"][0]] and m_ > 0
    # progress: the budget's share used, at every logged step (every 5th and the last), growing, and at the last
    # step no more than the training time the checkpoint records
    used = tb_scalars(tb)["budget_used"]
    assert [s for s, _ in used] == [s for s in steps if s % 5 == 0 or s == last], used
    assert all(0 < a < b for (_, a), (_, b) in zip(used, used[1:])) and used[0][1] > 0, used
    assert used[-1][1] * 6 <= state["train_seconds"] * (1 + 1e-6), (used[-1], state["train_seconds"])

    # a spent budget: nothing to do - no step, no record, no checkpoint written
    before = _files(out)
    p = here("train_dflash", *common, "--max-minutes", 0.1, "--resume")
    assert_ok(p)
    assert {f: b for f, b in _files(out).items() if f.name != "train.log"} == \
        {f: b for f, b in before.items() if f.name != "train.log"}
    # and says again how to measure the result (the command a user runs): no held-out file here (--heldout 0)
    assert f"python eval_dflash.py --target {llama} --drafter {out}/step_{last:06d}/drafter" \
        " --prompts YOUR_PROMPTS.jsonl" in p.out, p.tail()
    assert (out / f"step_{last:06d}" / "drafter").is_dir() and not (out / "heldout.jsonl").exists()
    before = _files(out)
    p = here("train_dflash", *common, "--max-steps", last + 2)
    assert p.rc != 0 and "holds checkpoints of an earlier run" in p.out and "--resume" in p.out, p.tail()
    assert _files(out) == before                          # refused before any work: not a line of train.log
    p = here("train_dflash", *common, "--max-steps", last + 2, "--resume", "--lr", 1e-5)
    assert p.rc != 0 and "--lr 1e-05 (checkpoint: 0.0006)" in p.out, p.tail()
    p = here("train_dflash", *common, "--max-steps", last + 2, "--resume", "--distill", 0.5, "--gamma", 2,
             "--dpace", 0.5)
    assert p.rc != 0 and ("--distill 0.5 (checkpoint: 0.0), --gamma 2.0 (checkpoint: 4.0), "
                          "--dpace 0.5 (checkpoint: 0.0)") in p.out, p.tail()  # a new run
    p = here("train_dflash", *common, "--max-steps", last + 2, "--resume", "--num-draft-layers", 1)
    assert p.rc != 0 and "--num-draft-layers 1 (checkpoint: 2)" in p.out, p.tail()
    p = here("train_dflash", *common, "--max-steps", last + 2, "--resume", "--seed", 1)
    assert p.rc != 0 and "--seed 1 (checkpoint: 0)" in p.out, p.tail()
    # the run's identity: its held-out conversations and its target's weights; both are refused before anything
    # is written (heldout.jsonl stays the run's)
    held = list(common)
    held[held.index("--heldout") + 1] = 3
    p = here("train_dflash", *held, "--max-steps", last + 2, "--resume")
    assert p.rc != 0 and "holds out other conversations" in p.out and not (out / "heldout.jsonl").exists(), p.tail()
    from transformers import AutoModelForCausalLM
    other = AutoModelForCausalLM.from_pretrained(llama)
    with torch.no_grad():
        other.model.layers[0].mlp.up_proj.weight.mul_(2)       # the same shape, other weights
    shutil.copytree(llama, tmp_path / "other")
    other.save_pretrained(tmp_path / "other")
    p = here("train_dflash", *[tmp_path / "other" if a == llama else a for a in common], "--max-steps", last + 2,
             "--resume")
    assert p.rc != 0 and "was trained against another target than --target" in p.out, p.tail()

    with open(out / "metrics.jsonl", "a") as f:     # a killed run's steps after the checkpoint, one cut mid-line
        f.write(json.dumps({"step": last + 1, "loss": 1.0}) + "\n" + '{"step": 4, "lo')
    common[common.index("--max-samples") + 1] = 60
    p = train(*common, "--max-steps", last + 2, "--resume")
    assert_ok(p)
    assert re.search(r"\[resume\] NOTICE: the training samples changed \(\d+ -> \d+ samples", p.out), p.tail()
    # a new schedule (the budget's end was near its step count's): its learning rate from the first resumed step on
    assert f"[resume] NOTICE: the schedule changed ({state['total_steps']} -> {last + 2} steps planned)" in p.out
    lr = [r["lr"] for r in metrics(out)][last]
    progress = (last + 0.5) / (last + 2)
    assert lr > 0 and lr == pytest.approx(6e-4 * 0.5 * (1 + math.cos(math.pi * (progress - 0.04) / 0.96)), rel=1e-9)
    assert [r["step"] for r in metrics(out)] == list(range(1, last + 3))


def test_distillation_runs_the_whole_target_and_trains(llama, sharegpt, cache_dir, tmp_path):
    """--distill: the target keeps its last layers and final norm (the teacher's distribution), and the run trains
    on the mixed loss, here under D-PACE's weights (--dpace, kept in the checkpoint's config); --distill outside
    [0, 1] is an error."""
    common = [*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 30,
              "--heldout", 0, "--out-dir", tmp_path / "out"]
    p = here("train_dflash", *common, "--distill", 1.5)
    assert p.rc != 0 and "--distill must lie in [0, 1], got 1.5" in p.out, p.tail()
    trace = tmp_path / "trace.jsonl"
    p = run_cmd(traced("train_dflash", [*common, "--distill", 0.5, "--dpace", 0.5, "--max-steps", 3], trace,
                       ["models:load_target"]))
    assert_ok(p)
    # the target the run trains against is whole: all its layers and its final norm (a cut one has fewer parameters)
    from transformers import AutoModelForCausalLM
    whole = sum(x.numel() for x in AutoModelForCausalLM.from_pretrained(llama).parameters())
    loaded = [e["out"] for e in _calls(read_trace(trace), "models:load_target", "return")]
    assert loaded and all(t["params"] == whole for t in loaded), (loaded, whole)
    saved = load_state(tmp_path / "out" / "step_000003")["config"]
    assert saved["distill"] == 0.5 and saved["dpace"] == 0.5
    losses = [r["loss"] for r in metrics(tmp_path / "out")]
    assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses), losses


# -----------------------------------------------------------------------------
# replicas


def test_two_replicas_equal_one_replica_on_the_concatenated_batch(qwen3, cache_dir, tmp_path):
    # Why this construction: replica r of step s takes stream batch base + g*R + r, and the stream's
    # batch order is a permutation over the NUMBER of batches in the epoch, so "R batches of B" and
    # "1 batch of R*B" are the same samples only when one epoch is exactly one optimiser step.
    # So: 4 samples, all in the single bucket 256; R=2 x B=2 (2 batches/epoch) vs R=1 x B=4
    # (1 batch/epoch). Every step then sees all 4 samples in both runs; anchors are drawn per
    # (sample, epoch), and the weight normaliser is global, so each step's update must agree.
    # The 2-replica run also uses 2 target threads (features arrive out of order, reorder buffer).
    data = short_chats(tmp_path / "chats4.jsonl", 4)
    common = [*TINY, "--target", qwen3, "--data", data, "--cache-dir", cache_dir, "--buckets", "256",
              "--heldout", 0, "--max-steps", 3, "--ckpt-interval", 1, "--keep-last", 3]
    two, one = tmp_path / "two", tmp_path / "one"
    calls = ["pipeline:Threads.start_thread", "train_dflash:load_batch", "replicas:add_into", "replicas:Replicas.check"]
    p2 = run_cmd(traced("train_dflash", [*common, "--out-dir", two, "--drafter-devices", "cpu,cpu", "--target-devices",
                                         "cpu,cpu", "--tokens-per-batch", 512], tmp_path / "two.jsonl", calls))
    assert_ok(p2)
    p1 = run_cmd(traced("train_dflash", [*common, "--out-dir", one, "--drafter-devices", "cpu", "--tokens-per-batch",
                                         1024], tmp_path / "one.jsonl", calls))
    assert_ok(p1)
    ev2, ev1 = read_trace(tmp_path / "two.jsonl"), read_trace(tmp_path / "one.jsonl")
    # the same 4 samples: 2 batches of (B,S,A) (2, 256, 32) an epoch for 2 replicas, 1 of (4, 256, 32) for one -
    # a step is an epoch in both
    s2, s1 = load_state(two / "step_000003"), load_state(one / "step_000003")
    assert s2["identity"]["samples"] == s1["identity"]["samples"] == 4
    assert s2["batches_per_epoch_by_rank"] == [2] and s1["batches_per_epoch_by_rank"] == [1]
    assert s2["cursor"] == 6 and s1["cursor"] == 3
    shapes = lambda ev: {tuple(e["out"]["batch"]["shape"]) for e in _calls(ev, "train_dflash:load_batch", "return")}
    assert shapes(ev2) == {(2, 256, 32)} and shapes(ev1) == {(4, 256, 32)}, (shapes(ev2), shapes(ev1))
    # 2 drafter replicas, each with its thread, and 2 target threads
    threads = lambda ev: sorted(e["args"][1] for e in _calls(ev, "pipeline:Threads.start_thread")
                                if e["args"][1] != "checkpoint-writer")
    assert threads(ev2) == ["drafter-0:cpu", "drafter-1:cpu", "loader", "target-0:cpu", "target-1:cpu"], threads(ev2)
    assert threads(ev1) == ["drafter-0:cpu", "loader", "target-0:cpu"], threads(ev1)
    # grads: one flat fp32 buffer per replica summed across replicas; a lone replica takes each backward's own
    grads = _grad_buffers(ev2)
    assert grads and all(g["tensor"] == "torch.float32" and g["base"] == grads[0]["base"] for g in grads), grads
    assert sum(math.prod(g["shape"]) for g in grads) == 2 * grads[0]["base"]
    assert _grad_buffers(ev1) == []
    # the replicas were compared bit for bit at every logged step and at the end (with the log), and agreed
    checked = [e["args"][1:] for e in _calls(ev2, "replicas:Replicas.check", "return")]
    assert [a[0] for a in checked] == [1, 2, 3, 3] and len(checked[-1]) == 2, checked

    m2, m1 = metrics(two), metrics(one)
    assert [r["step"] for r in m2] == [r["step"] for r in m1] == [1, 2, 3]
    for r2, r1 in zip(m2, m1):
        assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-5), r2["step"]
        assert r2["grad_norm"] == pytest.approx(r1["grad_norm"], rel=1e-4), r2["step"]
        assert r2["acc"] == pytest.approx(r1["acc"], abs=1e-3), r2["step"]

    from safetensors.torch import load_file
    for step in (1, 2, 3):
        name = f"step_{step:06d}"
        s2, s1 = load_state(two / name), load_state(one / name)
        assert s2["step"] == s1["step"] == step
        for k in s1["master_weights"]:
            torch.testing.assert_close(s2["master_weights"][k], s1["master_weights"][k], rtol=0, atol=1e-5,
                                       msg=lambda s: f"step {step} {k}: {s}")
        # Adam's moments are the (clipped) summed gradients themselves: sensitive to any scale error,
        # which the first sign-like Adam update would hide
        o2, o1 = s2["optimizer"], s1["optimizer"]
        assert len(o2["exp_avg"]) == len(o1["exp_avg"]) > 0 and o2["step"] == o1["step"] == [step] * len(o1["step"])
        for i in range(len(o1["exp_avg"])):
            for key in ("exp_avg", "exp_avg_sq"):
                a, b = o2[key][i], o1[key][i]        # relative to the tensor's norm: summation order
                err = float((a - b).norm() / b.norm().clamp(min=1e-30))     # moves tiny entries
                assert err < 1e-5, (step, i, key, err)
        b2, b1 = load_file(two / name / "drafter" / "model.safetensors"), load_file(one / name / "drafter" / "model.safetensors")
        for k in b1:
            assert b1[k].dtype == torch.bfloat16
            torch.testing.assert_close(b2[k].float(), b1[k].float(), rtol=2 ** -7, atol=1e-5)


# -----------------------------------------------------------------------------
# failures and bad data


@pytest.mark.parametrize("where", ["target", "drafter"])
def test_exception_in_a_thread_stops_the_run_at_once_with_traceback_and_intact_checkpoint(
        where, llama, sharegpt, cache_dir, tmp_path):
    import dflash_model as dm
    out = tmp_path / "out"
    # drafter:4 raises at the start of step 4, so steps 1-3 (checkpoint 2) are done.
    # target:7 raises at the target thread's 7th batch. With --queue-depth 1 the reorder buffer holds
    # indices < taken + 2, so the target can only have fetched its 7th batch after putting batch 5,
    # i.e. after the drafter took batch 3 (= began step 4), so checkpoint 2 exists then as well.
    fail = {"target": "target:7", "drafter": "drafter:4"}[where]
    p = train(*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 60,
              "--max-steps", 40, "--ckpt-interval", 2, "--queue-depth", 1, "--out-dir", out,
              "--tensorboard", tmp_path / "tb", fault=fail)
    assert p.rc not in (0, None) and p.rc > 0, f"exit code {p.rc}\n{p.tail()}"
    # the failed thread's line, followed by its traceback down to the failure
    assert re.search(rf"\[FATAL\] thread {where}-0:cpu failed:\nTraceback \(most recent call last\):\n.*"
                     rf"RuntimeError: injected failure in {where} at", p.out, re.S), p.tail()
    fatal = re.search(r"\[FATAL\] run stopped\. Last intact checkpoint: (\S+)", p.out)
    assert fatal, p.tail()
    # it stops at the failure (by itself: rc > 0, not the test's timeout), not after training on: the target's
    # 7th batch is at most step 7's, the drafter's step 4 never ends
    trained = [r["step"] for r in metrics(out)]
    assert trained == list(range(1, len(trained) + 1)) and len(trained) < 7, trained
    if where == "drafter":
        assert trained == [1, 2, 3]
        assert [s for s, _ in tb_scalars(tmp_path / "tb")["loss"]] == [1, 2, 3]     # the events up to the failure
    logged = (out / "train.log").read_text()          # kept in train.log too, where a user greps for it
    assert re.search(rf"\[FATAL\] thread {where}-0:cpu failed:\n(.*\n)*RuntimeError: injected failure", logged)
    last = fatal.group(1)
    step = int(Path(last).name.split("_")[1])
    assert Path(last).name == checkpoints(out)[-1] and load_state(last)["step"] == step
    assert step >= 2 and step % 2 == 0 and (step == 2 if where == "drafter" else True)
    drafter = dm.load_drafter(str(Path(last) / "drafter"))
    master = load_state(last)["master_weights"]
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, master[k].to(torch.bfloat16).float()), k


def test_a_nan_gradient_stops_the_run_before_stepping_and_keeps_the_checkpoints(llama, sharegpt, cache_dir, tmp_path):
    """--lr 1e30: step 1 is finite, the weights then overflow and step 2's gradient norm is not: the run
    stops with an error naming the step, steps nothing, and the step-1 checkpoint stays."""
    out = tmp_path / "out"
    p = train(*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 12,
              "--max-steps", 5, "--ckpt-interval", 1, "--keep-last", 1, "--warmup-frac", 0, "--lr", 1e30,
              "--out-dir", out)
    assert p.rc != 0
    # the error names the step and says nothing was stepped (the [FATAL] line of the step loop, then its reason)
    assert re.search(r"\[FATAL\] thread step loop failed:\n(.*\n)*FloatingPointError: step 2: the gradient norm is "
                     r"(nan|inf) .*stopped without stepping", p.out), p.tail()
    assert checkpoints(out) == ["step_000001"] and [r["step"] for r in metrics(out)] == [1]
    assert all(torch.isfinite(w).all() for w in load_state(out / "step_000001")["master_weights"].values())


def test_malformed_lines_are_counted_not_fatal_and_every_batch_has_its_buckets_warmed_shape(llama, embedded, tok,
                                                                                            tmp_path):
    """Malformed JSONL lines and short samples are counted (the skip counts the log prints) and skipped; with 4
    rows per batch the short last batch of each bucket is filled up to the warmed shape (a ragged batch would
    be a shape the warm-up never compiled)."""
    import data_dflash
    clean, dirty = tmp_path / "clean.jsonl", tmp_path / "dirty.jsonl"
    with open(embedded[1]) as src:
        good = [line for _, line in zip(range(30), src)]
    clean.write_text("".join(good))
    garbage = ["this is not json\n",
               "[1, 2, 3]\n",                                              # JSON, not a record
               '{"conversations": "oops"}\n',
               '{"conversations": [{"from": "human", "value": 5}]}\n',
               '{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]}\n',
               '{"conversations": [{"from": "human", "value": "hello?"}]}\n',      # no reply
               '{"conversations": [{"from": "wizard", "value": "x"}, {"from": "gpt", "value": "y"}]}\n']
    dirty.write_text("".join(good[:10] + garbage[:4] + good[10:] + garbage[4:])
                     + '{"conversations": [{"from": "human", "val')                 # cut-off last line
    base = data_dflash.build_dataset(tok, [str(clean)], 256, 8, str(tmp_path / "c0"), min_supervised=32,
                                     log=lambda *_: None)["stats"]["skipped"]       # real ShareGPT's own skips
    expect = dict(base)
    for k, n in {"malformed record": 5, "too few supervised tokens": 1, "no assistant turn": 1,
                 "unknown role": 1}.items():
        expect[k] = expect.get(k, 0) + n
    out, trace = tmp_path / "out", tmp_path / "trace.jsonl"
    p = run_cmd(traced("train_dflash", [*TINY, "--target", llama, "--data", dirty, "--cache-dir", tmp_path / "c1",
                                        "--heldout", 0, "--tokens-per-batch", 1024, "--epochs", 2, "--out-dir", out],
                       trace, ["train_dflash:load_batch"]))
    assert_ok(p)
    # the skips as the run counted them: the tokenised cache it wrote, read back with its own settings (no new file)
    from transformers import AutoTokenizer
    state = load_state(out / checkpoints(out)[-1])
    cfg, cached = state["config"], sorted((tmp_path / "c1").rglob("*"))
    stats = data_dflash.build_dataset(AutoTokenizer.from_pretrained(cfg["target"]), [str(dirty)], cfg["max_length"],
                                      cfg["block_size"], cfg["cache_dir"], min_supervised=cfg["min_supervised"],
                                      log=lambda *_: None, max_conversations=cfg["max_samples"],
                                      heldout=cfg["heldout"])["stats"]
    assert sorted((tmp_path / "c1").rglob("*")) == cached, "not the run's cache"
    assert stats["skipped"] == expect and stats["samples"] == state["identity"]["samples"], (stats, expect)
    # every batch the loader made has its bucket's warmed shape (B,S,A) (4, S, 32), S one of the buckets 64, 128, 256:
    # 4 rows, the short last batch of each bucket filled up (an epoch's batches hold more rows than there are samples)
    shapes = {tuple(e["out"]["batch"]["shape"]) for e in _calls(read_trace(trace), "train_dflash:load_batch", "return")}
    assert len(shapes) >= 2 and shapes <= {(4, 64, 32), (4, 128, 32), (4, 256, 32)}, shapes
    assert 4 * state["batches_per_epoch_by_rank"][0] > stats["samples"], (state["batches_per_epoch_by_rank"], stats)
    assert all(math.isfinite(r["loss"]) for r in metrics(out)) and len(metrics(out)) >= 2


# -----------------------------------------------------------------------------
# torchrun


def test_torchrun_two_processes_keep_identical_replicas_and_resume_on_their_own_shards(llama, cache_dir, tmp_path):
    # 5 samples, one bucket, B=1: rank 0's shard has 3 batches/epoch, rank 1's has 2, so with --epochs 3
    # they would plan 9 and 6 steps: the ranks must agree (min: 6), or their lr schedules differ and
    # rank 0 waits forever in the all-reduce of step 7.
    data = short_chats(tmp_path / "chats5.jsonl", 5)
    out, script = tmp_path / "out", tmp_path / "train_traced.py"       # train_dflash.py, traced on each rank
    script.write_text(tracing_code("train_dflash", str(tmp_path / "trace.{rank}.jsonl"),
                                   ["torch.distributed:init_process_group", "replicas:Replicas.check"]))
    cmd = [str(c) for c in [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                            free_port(), script, *TINY, "--target", llama, "--data", data, "--cache-dir", cache_dir,
                            "--heldout", 0, "--buckets", 256, "--tokens-per-batch", 256, "--epochs", 3,
                            "--ckpt-interval", 3, "--tensorboard", tmp_path / "tb", "--out-dir", out]]
    p = run_cmd(cmd, timeout=180)
    assert_ok(p)
    ranks = [read_trace(tmp_path / f"trace.{r}.jsonl") for r in (0, 1)]
    # both ranks joined one gloo group, and compared their replicas bit for bit at the end (with the log): equal
    for ev in ranks:
        assert [e["args"][:1] for e in _calls(ev, "torch.distributed:init_process_group")] == [["gloo"]], ev
        checked = [e["args"][1:] for e in _calls(ev, "replicas:Replicas.check", "return")]
        assert checked and checked[-1][0] == 6 and len(checked[-1]) == 2, checked
    # rank > 0 logs to its own file, not stdout: none of the lines only rank 1 logged is printed
    own = set((out / "train.rank1.log").read_text().splitlines()) - set((out / "train.log").read_text().splitlines())
    assert own and not own & set(p.out.splitlines()), own
    # each rank's shard: rank 0 has 3 samples (3 batches of 1 an epoch), rank 1 2; both plan the smaller 6 steps
    state = load_state(out / "step_000006")
    assert state["batches_per_epoch_by_rank"] == [3, 2] and state["total_steps"] == 6 and state["step"] == 6
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5, 6]       # rank 0 only writes metrics
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1   # and TensorBoard events
    loss = tb_scalars(tmp_path / "tb")["loss"]
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5, 6]
    assert checkpoints(out) == ["step_000003", "step_000006"]

    # both ranks resume from step 3: each reads its data position against its own shard (rank 1 has 2
    # batches/epoch, rank 0 3), so the resumed run ends on the straight run's weights
    again = tmp_path / "again"
    shutil.copytree(out, again, ignore=shutil.ignore_patterns("step_000006"))
    kept = _lines(again)[:3]
    p2 = run_cmd(cmd[:-1] + [str(again), "--resume"], timeout=180)
    assert_ok(p2)
    assert "NOTICE" not in p2.out + (again / "train.rank1.log").read_text()    # no [resume] NOTICE on either rank
    # from checkpoint 3 (steps 1-3's records kept as written), to the straight run's final weights and moments
    assert _lines(again)[:3] == kept and [r["step"] for r in metrics(again)] == [1, 2, 3, 4, 5, 6]
    resumed = load_state(again / "step_000006")
    assert resumed["step"] == 6 and resumed["cursor"] == state["cursor"] == 6
    assert [resumed[k] for k in ("fingerprint", "resume_fingerprint")] == [state[k] for k in ("fingerprint",
                                                                                           "resume_fingerprint")]
    # the events of steps 4-6 from before the resume are hidden by those trained again: each step once
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2
    assert [s for s, _ in tb_scalars(tmp_path / "tb")["loss"]] == [1, 2, 3, 4, 5, 6]


# -----------------------------------------------------------------------------
# the loader's batches


def test_the_loaders_prepared_batch_is_what_the_step_would_compute_itself():
    """prepare_batch (the loader thread's host work) gives each batch its anchors (drawn per sample and epoch), its
    Batch of the run's loss (distillation's taught positions, D-PACE's weights of 1 where --gamma's would decay), and
    the step's sums (weights, tokens, FLOPs)."""
    import config
    import dflash_model as dm
    import train_dflash as tr
    S, bs, H, B = 128, 8, 64, 3
    torch.manual_seed(5)
    cfg = config.parse_args(["--num-anchors", "16", "--block-size", str(bs), "--distill", "0.5", "--max-length", "128",
                             "--dpace", "0.5"])
    dcfg = small_config(hidden_size=H, block_size=bs)
    lengths, ids = torch.tensor([128, 90, 41]), torch.randint(0, 255, (B, S))
    lm = (torch.arange(S)[None] < lengths[:, None]).long()
    keys = [(7, 0), (3, 1), (5, 0)]
    b = tr.prepare_batch(cfg, dcfg, keys, ids, lm, lengths, config.anchors_for(cfg, S))
    anchors, valid = tr.sample_anchors_for(cfg.seed, keys, lm, lengths, config.anchors_for(cfg, S), bs)
    want = dm.make_batch(ids, lm, anchors, valid, dcfg, dm.Loss(cfg.gamma, 0.5, 0.5))
    got = b["batch"]
    for k in ("block_ids", "block_pos", "labels", "weights", "anchors"):
        assert torch.equal(getattr(got, k), getattr(want, k)), k
    assert got.loss == dm.Loss(cfg.gamma, 0.5, 0.5) and got.shape == (B, S, config.anchors_for(cfg, S))
    w = got.weights[:, :, 1:]
    assert torch.equal(w, (w > 0).float()) and w.sum() > 0
    for g, w in zip(got.taught, dm.teacher_positions(anchors, valid, S, bs)):
        assert torch.equal(g, w)
    assert b["wsum"] == float(want.weights[:, :, 1:].sum())
    assert b["tokens"] == 259 and b["flops"] == dm.batch_flops(dcfg, S, anchors, valid, got.taught)
