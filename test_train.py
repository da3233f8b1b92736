"""CPU tests of the threaded trainer (train_dflash.py), end to end, as subprocesses.

    python -m pytest -q test_train.py -x          # a few minutes on 2 CPU cores

Every training run is tiny: a random 4-layer Llama/Qwen3 target (hidden 64) with the SmolLM2
tokenizer, a 2-layer drafter, a handful of steps. What each test asserts is in its name:
  1. SIGKILL + --resume reproduces the straight run's per-step losses and final weights
  2. R drafter replicas (and 2 target threads) == one replica on the concatenated batch
  3. an exception in a target / drafter thread: non-zero exit within seconds, traceback, [FATAL],
     the last checkpoint intact and loadable
  4. unknown / mistyped options and bad values are errors that name the option
  5. malformed JSONL lines and short samples are counted in the log, not fatal
  6. torchrun, 2 processes (gloo): weights bit-identical across ranks after several steps
  7. start_training.sh's embedded-default path end to end (135M SmolLM2 target, 2 steps)
  8. the tools: warm-up workers (cache, warm list, schedule), bench.py at toy size, the eval CLI
"""
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent
TRAIN = str(REPO / "train_dflash.py")
TIMEOUT = 120

# The tiny run every test starts from (options are --kebab-case TrainConfig fields).
TINY = ["--max-length", "256", "--num-anchors", "32", "--block-size", "8", "--num-draft-layers", "2",
        "--log-interval", "1"]


# -----------------------------------------------------------------------------
# helpers


@dataclass
class Proc:
    rc: int
    lines: list          # (monotonic time the line was read, line)
    t_start: float
    t_end: float         # when the process had exited

    @property
    def out(self):
        return "".join(line for _, line in self.lines)

    def time_of(self, needle):
        for t, line in self.lines:
            if needle in line:
                return t
        raise AssertionError(f"no line containing {needle!r} in the output:\n{self.tail()}")

    def tail(self, n=60):
        return "".join(line for _, line in self.lines[-n:])


def child_env(**extra):
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")       # 2 shared cores: no oversubscription
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_cmd(cmd, timeout=TIMEOUT, env=None, cwd=REPO):
    """Run `cmd`, timestamp every output line as it arrives, and kill its process group on timeout."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=cwd, env=env or child_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []

    def reader():
        for line in p.stdout:
            lines.append((time.monotonic(), line))

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGTERM)      # torchrun passes it on to its workers (own sessions)
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        th.join(5)
        pytest.fail(f"{cmd[:3]}... did not finish within {timeout}s; output tail:\n"
                    + "".join(x for _, x in lines[-60:]))
    t_end = time.monotonic()
    th.join(10)
    return Proc(rc, lines, t0, t_end)


def train(*args, timeout=TIMEOUT):
    return run_cmd([sys.executable, TRAIN, *map(str, args)], timeout=timeout)


def metrics(out_dir):
    with open(Path(out_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_state(ckpt):
    return torch.load(Path(ckpt) / "state.pt", map_location="cpu", weights_only=False)


def checkpoints(out_dir):
    return sorted(p.name for p in Path(out_dir).iterdir()
                  if p.name.startswith("step_") and (p / "DONE").exists())


def assert_ok(proc):
    assert proc.rc == 0, f"exit code {proc.rc}; output tail:\n{proc.tail()}"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -----------------------------------------------------------------------------
# fixtures: tokenizer, tiny targets, data


@pytest.fixture(scope="module")
def embedded():
    """(SmolLM2 folder, ShareGPT JSONL) of the embedded default: reused if prepared, else built once."""
    cache = REPO / ".cache"
    model, data = cache / "SmolLM2-135M-Instruct", cache / "sharegpt_v3.jsonl"
    if not (model.is_dir() and data.is_file()):
        import data_dflash
        model, data = map(Path, data_dflash.prepare_embedded_default(str(cache)))
    return model, data


def _save_tiny(path, cfg_cls, model_cls, tok, **extra):
    torch.manual_seed(0)
    cfg = cfg_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                  max_position_embeddings=1024, **extra)
    model_cls(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tok(embedded):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(embedded[0])


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tok):
    from transformers import LlamaConfig, LlamaForCausalLM
    return _save_tiny(tmp_path_factory.mktemp("llama"), LlamaConfig, LlamaForCausalLM, tok)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, tok):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return _save_tiny(tmp_path_factory.mktemp("qwen3"), Qwen3Config, Qwen3ForCausalLM, tok, head_dim=16)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))        # tokenised-data cache shared by the tests


@pytest.fixture(scope="module")
def sharegpt(tmp_path_factory, embedded):
    """The first 120 ShareGPT records (real chats: long, short, truncated, skipped ones)."""
    path = tmp_path_factory.mktemp("data") / "sharegpt120.jsonl"
    with open(embedded[1]) as src, open(path, "w") as dst:
        for _, line in zip(range(120), src):
            dst.write(line)
    return str(path)


WORDS = ("alpha beta gamma delta river stone cloud green quick slow bright dark table window "
         "garden music number letter simple answer question model token train draft block "
         "target layer anchor mask loss step batch queue thread device paper light water").split()


def short_chats(path, n, seed=0):
    """n chats that all tokenise to well under 256 tokens with >= 32 supervised tokens."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            q = f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(10)) + "?"
            a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 80))) + "."
            f.write(json.dumps({"conversations": [{"from": "human", "value": q},
                                                  {"from": "gpt", "value": a}]}) + "\n")
    return str(path)


# -----------------------------------------------------------------------------
# 1. resume


def test_sigkill_then_resume_reproduces_the_straight_run_losses(llama, sharegpt, cache_dir, tmp_path):
    # 12 conversations -> a few samples -> a few batches per epoch: 6 steps x grad_accum 2 cross
    # epoch boundaries, so the cursor, the per-epoch batch order and per-(sample, epoch) anchors
    # all have to come back right after the kill.
    common = [*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 12,
              "--grad-accum", 2, "--max-steps", 6, "--ckpt-interval", 3]
    straight, cut = tmp_path / "straight", tmp_path / "cut"

    # ckpt_lag:2: checkpoint 3 is written in the background only after step 5 has run - it must hold
    # step 3's state all the same (the snapshot is a copy; compared with the cut run's below)
    p = train(*common, "--out-dir", straight, "--debug-fail", "ckpt_lag:2")
    assert_ok(p)
    assert p.out.index("step_000003 (written in") > p.out.index("step 5/6"), p.tail()
    assert "grads: one flat fp32 buffer per replica" in p.out     # micro-batches are added in fp32
    m = re.search(r"\[data\] \d+ samples on this node, (\d+) batches/epoch", p.out)
    assert m and int(m.group(1)) < 12, "the run should cross an epoch boundary"

    killed = train(*common, "--out-dir", cut, "--debug-fail", "kill:3")
    assert killed.rc == -signal.SIGKILL, f"expected SIGKILL, got {killed.rc}\n{killed.tail()}"
    assert "[debug] SIGKILL after step 3" in killed.out
    assert checkpoints(cut) == ["step_000003"]
    assert [r["step"] for r in metrics(cut)] == [1, 2, 3]

    resumed = train(*common, "--out-dir", cut, "--resume")
    assert_ok(resumed)
    assert re.search(r"\[resume\] .*step_000003: step 3, batch cursor 6", resumed.out), resumed.tail()

    a, b = metrics(straight), metrics(cut)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a, b):
        for key in ("loss", "grad_norm", "lr"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-12), (ra["step"], key, ra[key], rb[key])
        assert ra["acc"] == rb["acc"]
    for step in ("step_000003", "step_000006"):
        sa, sb = load_state(straight / step), load_state(cut / step)
        assert sa["resume_fingerprint"] == sb["resume_fingerprint"] or step == "step_000006"
        wa, wb = sa["master_weights"], sb["master_weights"]
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=1e-6, atol=1e-7, msg=lambda s: f"{step} {k}: {s}")
        for key in ("exp_avg", "exp_avg_sq"):
            for x, y in zip(sa["optimizer"][key], sb["optimizer"][key]):
                torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-9, msg=lambda s: f"{step} {key}: {s}")


def test_checkpoints_are_written_in_the_background_and_a_failed_write_stops_the_run(llama, sharegpt, cache_dir,
                                                                                     tmp_path):
    """A checkpoint's files are written by a thread while training goes on: a write that fails stops
    the run like any thread (non-zero exit, its traceback, the previous checkpoint intact and named,
    the half-written folder removed); the log lines report the step loop's pause for the snapshot
    apart from the rates."""
    out = tmp_path / "out"
    p = train(*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 60,
              "--max-steps", 40, "--ckpt-interval", 2, "--out-dir", out, "--debug-fail", "ckpt:4")
    assert p.rc not in (0, None) and p.rc > 0, f"exit code {p.rc}\n{p.tail()}"
    assert "[FATAL] thread checkpoint-writer failed" in p.out and "injected failure in ckpt at 4" in p.out, p.tail()
    assert re.search(r"\[FATAL\] run stopped\. Last intact checkpoint: \S+step_000002", p.out), p.tail()
    assert checkpoints(out) == ["step_000002"]
    assert sorted(p.name for p in out.glob("step_*")) == ["step_000002"], "the failed write's folder is left"
    assert "[ckpt] the write of checkpoint 4 failed" in p.out and "its partial folder was removed" in p.out, p.tail()
    assert "step 40/40" not in p.out
    state = load_state(out / "step_000002")    # the masters by name are the optimiser's, stored once
    shared = {t.untyped_storage().data_ptr() for t in state["master_weights"].values()}
    assert all(m.untyped_storage().data_ptr() in shared for m in state["optimizer"]["master"])
    # checkpoint 2 is snapshotted after step 2's line: its pause is in step 3's
    assert re.search(r"step 3/40 .*\| checkpoint pause \d+\.\d\ds \(not in the rates\)", p.out), p.tail()


def test_a_full_disk_is_an_error_at_start_up_and_before_a_checkpoint_is_written(llama, sharegpt, cache_dir, tmp_path):
    """Disk space for the checkpoints is checked before the warm-up (an error, nothing trained) and
    again before each write (the run stops, the last intact checkpoint named, nothing half-written);
    not torch.save's 'unexpected pos' after the disk filled up. disk:N pretends 1 MiB free from
    checkpoint N on (N = 0: at start-up)."""
    common = [*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 60,
              "--max-steps", 40, "--ckpt-interval", 2]
    out = tmp_path / "full"
    p = train(*common, "--out-dir", out, "--debug-fail", "disk:0")
    assert p.rc not in (0, None), p.tail()
    m = re.search(r"error: not enough disk space for this run's checkpoints: ~([\d.]+) MiB needed \(4 of ~([\d.]+) "
                  r"MiB at once, 0 there already\), 1\.0 MiB free", p.out)
    assert m and float(m.group(1)) == pytest.approx(4 * float(m.group(2)), abs=0.2), p.tail()
    assert "[warmup] done" not in p.out and "step 1/40" not in p.out and checkpoints(out) == []
    out = tmp_path / "fills"
    p = train(*common, "--out-dir", out, "--debug-fail", "disk:4")
    assert p.rc not in (0, None), p.tail()
    assert re.search(r"checkpoint 4 needs ~[\d.]+ MiB and \S+ file system has 1\.0 MiB free: not written", p.out), p.tail()
    assert re.search(r"\[FATAL\] run stopped\. Last intact checkpoint: \S+step_000002", p.out), p.tail()
    assert sorted(x.name for x in out.glob("step_*")) == ["step_000002"]


def test_checkpoint_count_and_disk_peak_follow_the_rotation():
    """planned_checkpoints: every interval and the last step; checkpoints_at_once: a write lands before
    the oldest beyond keep_last goes, and a resume's old checkpoints (more than keep_last, too) stay
    until the first write. Checked against a simulation of the rotation."""
    import train_dflash as tr
    assert tr.planned_checkpoints(0, 80, 25) == 4            # 25, 50, 75, 80
    assert tr.planned_checkpoints(25, 80, 25) == 3 and tr.planned_checkpoints(0, 75, 25) == 3
    for n_old in range(6):
        for n_new in range(6):
            for keep in range(1, 5):
                on_disk, peak = n_old, n_old
                for _ in range(n_new):
                    on_disk += 1                               # written ...
                    peak = max(peak, on_disk)
                    on_disk = min(on_disk, keep)               # ... then the oldest beyond keep_last go
                assert tr.checkpoints_at_once(n_old, n_new, keep) == peak, (n_old, n_new, keep)


def test_a_checkpoint_that_waits_for_the_previous_write_says_so(llama, sharegpt, cache_dir, tmp_path):
    """One write at a time: when checkpoints come faster than the disk writes them, the save waits for
    the previous write, and the log says so (else a slow disk would read as a slow GPU). ckpt_lag:3
    with --ckpt-interval 3 holds each write back until the next save has begun. The start-up line
    gives the size and number of checkpoints."""
    out = tmp_path / "out"
    p = train(*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 60,
              "--max-steps", 7, "--ckpt-interval", 3, "--out-dir", out, "--debug-fail", "ckpt_lag:3")
    assert_ok(p)
    assert re.search(r"\[ckpt\] ~[\d.]+ MiB per checkpoint; this run writes up to 3 and keeps 3", p.out), p.tail()
    for step, prev in ((6, 3), (7, 6)):
        assert re.search(rf"\[ckpt\] step {step}: waited [\d.]+s for the write of checkpoint {prev} \(one write at a "
                         r"time", p.out), p.tail()
    assert "step 3: waited" not in p.out
    assert checkpoints(out) == ["step_000003", "step_000006", "step_000007"]


def test_checkpoint_snapshots_reuse_their_host_buffers_and_never_alias_the_live_tensors():
    """The snapshot's host buffers (HostPool) are the same from one checkpoint to the next (no ~15 GB
    allocated per checkpoint), hold copies (training on does not change them), keep a tensor shared
    in the state shared (written once), and are replaced where a tensor's shape or dtype changed."""
    import train_dflash
    w, m = torch.arange(6.0), torch.ones(2, 3)
    pool = train_dflash.HostPool()
    memo = {}
    first = train_dflash.to_host({"w": w, "opt": [w, m], "n": 3}, memo, pool.start())
    pool.finish()
    assert first["w"] is first["opt"][0] and first["n"] == 3
    assert first["w"].data_ptr() != w.data_ptr() and torch.equal(first["w"], w)
    kept = [t.data_ptr() for t in pool.bufs]
    w += 1                                                  # training goes on
    assert torch.equal(first["w"], torch.arange(6.0))
    second = train_dflash.to_host({"w": w, "opt": [w, m], "n": 3}, {}, pool.start())
    pool.finish()
    assert [t.data_ptr() for t in pool.bufs] == kept        # the same buffers, refilled
    assert torch.equal(second["w"], torch.arange(6.0) + 1) and torch.equal(second["opt"][1], m)
    third = train_dflash.to_host({"w": w.double(), "opt": [m]}, {}, pool.start())
    assert third["w"].dtype == torch.float64 and pool.bufs[0].data_ptr() != kept[0]
    assert torch.equal(third["opt"][0], m)


def test_resume_on_a_larger_dataset_continues_with_a_notice(llama, sharegpt, cache_dir, tmp_path):
    """Resuming with more data than the checkpoint saw: accepted, announced, same epoch position."""
    common = [*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--ckpt-interval", 2,
              "--out-dir", tmp_path / "out"]
    assert_ok(train(*common, "--max-samples", 12, "--max-steps", 2))
    p = train(*common, "--max-samples", 40, "--max-steps", 4, "--resume")
    assert_ok(p)
    assert "[resume] NOTICE: the data set changed" in p.out, p.tail()
    assert re.search(r"\[resume\] .*step_000002: step 2, batch cursor 2", p.out), p.tail()
    assert [r["step"] for r in metrics(tmp_path / "out")] == [1, 2, 3, 4]


def test_resume_refuses_a_checkpoint_whose_optimiser_state_differs_from_its_saved_fingerprint(llama, sharegpt, cache_dir,
                                                                                   tmp_path):
    """state.pt records a fingerprint of the optimiser state a resume restores (fp32 masters, moments). A
    checkpoint that still loads but whose masters or moments changed by one ulp is refused on resume,
    naming the checkpoint; one without a fingerprint (an older trainer) resumes with a NOTICE."""
    import shutil
    common = [*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 12,
              "--ckpt-interval", 2]
    good = tmp_path / "good"
    assert_ok(train(*common, "--max-steps", 2, "--out-dir", good))
    state = load_state(good / "step_000002")
    assert re.fullmatch(r"[0-9a-f]{16}", state["resume_fingerprint"]), state["resume_fingerprint"]

    def variant(name, edit):
        out = tmp_path / name
        shutil.copytree(good, out)
        st = load_state(out / "step_000002")
        edit(st)
        torch.save(st, out / "step_000002" / "state.pt")
        return train(*common, "--max-steps", 3, "--out-dir", out, "--resume")

    def nudge(key, i):             # one value, one ulp up: loads fine, trains fine, is not what was saved
        def edit(st):
            t = st["optimizer"][key][i].view(-1)       # what the optimiser resumes from
            t[-1] = torch.nextafter(t[-1], torch.tensor(math.inf))
        return edit

    for name, key, i in (("master", "master", 0), ("moment", "exp_avg_sq", -1)):
        p = variant(name, nudge(key, i))
        assert p.rc != 0
        assert "do not match the fingerprint saved with them" in p.out and "step_000002" in p.out, p.tail()
        assert checkpoints(tmp_path / name) == ["step_000002"]          # nothing trained on the wrong state

    p = variant("older", lambda st: st.pop("resume_fingerprint"))
    assert_ok(p)
    assert "[resume] NOTICE: " in p.out and "has no resume fingerprint" in p.out, p.tail()
    assert [r["step"] for r in metrics(tmp_path / "older")] == [1, 2, 3]


def test_every_batch_has_its_buckets_warmed_shape_even_the_last_of_an_epoch(llama, sharegpt, cache_dir, tmp_path):
    """--anchor-density length gives several rows per batch in the short buckets (B 4 / 2 / 1 at S 64 /
    128 / 256), and 30 real chats leave each bucket a short last batch per epoch: those are filled up
    to the planned rows (a ragged batch is a shape warm-up never compiled: an UnwarmedShapeError on
    a GPU, and on every path the trainer's own check)."""
    p = train(*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 30,
              "--anchor-density", "length", "--epochs", 2, "--ckpt-interval", 1000, "--out-dir", tmp_path / "out")
    assert_ok(p)
    m = re.search(r"shapes \(B,S,A\) (\[.*?\]), ", p.out)
    assert m and m.group(1) == "[(4, 64, 16), (2, 128, 16), (1, 256, 32)]", p.tail()
    assert "not in the warmed shape plan" not in p.out


def test_the_run_log_states_the_effective_flex_options_and_lm_head_chunk(llama, sharegpt, cache_dir, tmp_path):
    """--flex-options "" means this version's defaults, which can change: the log says what was used
    (the given options over the defaults) and the chunk of the LM head + CE."""
    p = train(*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 30,
              "--max-steps", 1, "--flex-options", '{"bwd_num_stages": 2}', "--chunk-rows", 512,
              "--out-dir", tmp_path / "out")
    assert_ok(p)
    assert '[flex] options {"GQA_EXPAND": true, "bwd_num_stages": 2}; LM head + CE in chunks of up to 512 rows' in p.out


def test_a_nan_gradient_stops_the_run_before_stepping_and_keeps_the_checkpoints(llama, sharegpt, cache_dir, tmp_path):
    """--lr 1e30: step 1 is finite, the weights then overflow and step 2's gradient norm is not:
    the run stops with an error naming the step, steps nothing, and the step-1 checkpoint stays."""
    out = tmp_path / "out"
    p = train(*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 12,
              "--max-steps", 5, "--ckpt-interval", 1, "--keep-last", 1, "--warmup-frac", 0, "--lr", 1e30,
              "--out-dir", out)
    assert p.rc != 0
    assert re.search(r"FloatingPointError: step 2: the gradient norm is (nan|inf)", p.out), p.tail()
    assert "stopped without stepping" in p.out
    assert checkpoints(out) == ["step_000001"] and [r["step"] for r in metrics(out)] == [1]
    assert all(torch.isfinite(w).all() for w in load_state(out / "step_000001")["master_weights"].values())


def test_an_out_dir_with_checkpoints_needs_resume_and_resume_keeps_lr_budget_and_metrics(llama, sharegpt, cache_dir,
                                                                                          tmp_path):
    """Without --resume, an out dir holding checkpoints is an error before any work (a new run would
    interleave its checkpoints with the old ones). With it: a different --lr is an error (the
    optimiser's settings come from the checkpoint), the --max-minutes budget counts the time the
    resumed runs used, and metrics.jsonl loses the records of steps after the checkpoint."""
    common = [*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 12,
              "--ckpt-interval", 2, "--out-dir", tmp_path / "out"]
    assert_ok(train(*common, "--max-steps", 2))
    state = load_state(tmp_path / "out" / "step_000002")
    assert state["train_seconds"] > 0 and state["batches_per_epoch_by_rank"] == [state["batches_per_epoch"]]

    p = train(*common, "--max-steps", 4, timeout=60)
    assert p.rc != 0 and "holds checkpoints of an earlier run" in p.out and "--resume" in p.out, p.tail()
    assert "[data]" not in p.out                          # refused before the data or the models
    p = train(*common, "--max-steps", 4, "--resume", "--lr", 1e-5)
    assert p.rc != 0 and "--lr 1e-05 (checkpoint: 0.0006)" in p.out, p.tail()

    with open(tmp_path / "out" / "metrics.jsonl", "a") as f:     # a killed run's steps after the checkpoint
        f.write(json.dumps({"step": 3, "loss": 1.0}) + "\n" + '{"step": 4, "lo')
    state["train_seconds"] = 90.0                          # this run had used 1.5 of a 1-minute budget
    torch.save(state, tmp_path / "out" / "step_000002" / "state.pt")
    p = train(*common, "--max-steps", 4, "--resume", "--max-minutes", 1)
    assert_ok(p)
    assert "min budget (--max-minutes, resumes included) was used up by step 2: nothing to do" in p.out, p.tail()
    p = train(*common, "--max-steps", 4, "--resume")
    assert_ok(p)
    assert [r["step"] for r in metrics(tmp_path / "out")] == [1, 2, 3, 4]


# -----------------------------------------------------------------------------
# 2. replicas


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
              "--max-steps", 3, "--ckpt-interval", 1, "--keep-last", 3]
    two, one = tmp_path / "two", tmp_path / "one"
    p2 = train(*common, "--out-dir", two, "--drafter-devices", "cpu,cpu", "--target-devices", "cpu,cpu",
               "--tokens-per-batch", 512)
    assert_ok(p2)
    p1 = train(*common, "--out-dir", one, "--drafter-devices", "cpu", "--tokens-per-batch", 1024)
    assert_ok(p1)
    assert "[data] 4 samples on this node, 2 batches/epoch, buckets [256], shapes (B,S,A) [(2, 256, 32)]" in p2.out
    assert "[data] 4 samples on this node, 1 batches/epoch, buckets [256], shapes (B,S,A) [(4, 256, 32)]" in p1.out
    assert "2 drafter replica(s)" in p2.out and "2 target + 2 drafter threads started" in p2.out
    assert "grads: one flat fp32 buffer per replica" in p2.out and "grads: handed over by each backward" in p1.out
    assert "[replicas] 2 replica(s) x 1 rank(s) bit-identical after step 3" in p2.out, p2.tail()

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
        fps = s2["replica_fingerprints"]
        assert len(fps) == 2 and fps[0] == fps[1], fps
        assert s2["step"] == s1["step"] == step
        # fp32 master weights after the step
        for k in s1["master_weights"]:
            torch.testing.assert_close(s2["master_weights"][k], s1["master_weights"][k], rtol=0, atol=1e-5,
                                       msg=lambda s: f"step {step} {k}: {s}")
        # Adam's moments are the (clipped) summed gradients themselves: sensitive to any scale error,
        # which the first sign-like Adam update would hide.
        o2, o1 = s2["optimizer"], s1["optimizer"]
        assert len(o2["exp_avg"]) == len(o1["exp_avg"]) > 0 and o2["step"] == o1["step"] == [step] * len(o1["step"])
        for i in range(len(o1["exp_avg"])):
            for key in ("exp_avg", "exp_avg_sq"):
                a, b = o2[key][i], o1[key][i]        # relative to the tensor's norm: summation order
                err = float((a - b).norm() / b.norm().clamp(min=1e-30))     # moves tiny entries
                assert err < 1e-5, (step, i, key, err)
        # the saved serving weights (bf16): equal up to one bf16 rounding step
        b2, b1 = load_file(two / name / "drafter" / "model.safetensors"), load_file(one / name / "drafter" / "model.safetensors")
        for k in b1:
            assert b1[k].dtype == torch.bfloat16
            torch.testing.assert_close(b2[k].float(), b1[k].float(), rtol=2 ** -7, atol=1e-5)


# -----------------------------------------------------------------------------
# 3. failures in threads


@pytest.mark.parametrize("where", ["target", "drafter"])
def test_exception_in_a_thread_exits_nonzero_within_seconds_with_traceback_and_intact_checkpoint(
        where, llama, sharegpt, cache_dir, tmp_path):
    import dflash_model as dm
    out = tmp_path / "out"
    # drafter:4 raises at the start of step 4, so steps 1-3 (checkpoint 2) are done.
    # target:7 raises at the target thread's 7th batch. With --queue-depth 1 the reorder buffer holds
    # indices < taken + 2, so the target can only have fetched its 7th batch after putting batch 5,
    # i.e. after the drafter took batch 3 (= began step 4), so checkpoint 2 exists then as well.
    fail = {"target": "target:7", "drafter": "drafter:4"}[where]
    p = train(*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 60,
              "--max-steps", 40, "--ckpt-interval", 2, "--queue-depth", 1, "--out-dir", out, "--debug-fail", fail)
    assert p.rc not in (0, None) and p.rc > 0, f"exit code {p.rc}\n{p.tail()}"
    assert "injected failure" in p.out and "Traceback" in p.out, p.tail()
    assert re.search(rf"\[FATAL\] thread {where}-0:cpu failed", p.out), p.tail()
    assert "[FATAL] run stopped" in p.out
    # Stops within seconds: the failure happens after warm-up ends (threads start after it), so
    # "warm-up done -> exit" bounds "failure -> exit" from above.
    assert p.t_end - p.time_of("[warmup] done") < 30, p.tail()
    if where == "drafter":
        assert p.t_end - p.time_of("step 3/40") < 30
        assert "step 4/40" not in p.out
    log = (out / "train.log").read_text()
    assert "injected failure" in log and "[FATAL]" in log

    last = re.search(r"\[FATAL\] run stopped\. Last intact checkpoint: (\S+)", p.out).group(1)
    assert last != "none"
    step = int(Path(last).name.split("_")[1])
    assert step >= 2 and step % 2 == 0 and (step == 2 if where == "drafter" else True)
    drafter = dm.load_drafter(str(Path(last) / "drafter"))
    master = load_state(last)["master_weights"]
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, master[k].to(torch.bfloat16).float()), k


# -----------------------------------------------------------------------------
# 4. options


def test_unknown_or_mistyped_option_and_bad_value_are_errors(tmp_path):
    p = train("--max-step", 3, "--out-dir", tmp_path / "a", timeout=60)
    assert p.rc != 0
    assert "unknown option --max-step" in p.out and "--max-steps" in p.out, p.out   # names it, suggests
    p = train("--max-steps", "three", "--out-dir", tmp_path / "b", timeout=60)
    assert p.rc != 0
    assert "bad value for --max-steps" in p.out and "three" in p.out, p.out
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()   # nothing started

    import train_dflash as tr
    for argv, needle in [(["--lr"], "bad value for --lr"),
                         (["--epochs", "1", "2"], "bad value for --epochs"),
                         (["--resume", "maybe"], "bad value for --resume"),
                         (["--attn", "flexx"], "--attn must be auto|flex|sdpa"),
                         (["--debug-fail", "loader:3"], "--debug-fail"),
                         (["--debug-fail", "ckpt_lag:6", "--ckpt-interval", "5"], "ckpt_lag:N needs 0 < N <= --ckpt-interval"),
                         (["--block-size", "1"], "block_size >= 2"),
                         (["--data", "/no/such/file.jsonl"], "data file not found"),
                         (["max-steps", "3"], "unexpected argument 'max-steps'"),
                         (["--num_anchors_x", "3"], "unknown option --num_anchors_x"),
                         (["--flex-options", '{"BLOCK_Q": 64}'], "--flex-options: unknown flex kernel option"),
                         (["--clip", "0"], "--clip must be > 0"),
                         (["--queue-depth", "0"], "--queue-depth must be >= 1"),
                         (["--lr", "-1e-4"], "need lr > 0"),
                         (["--buckets", "1024,4096"], "max_length] = [32, 3072], got 1024,4096"),
                         (["--buckets", "1k"], "--buckets must be comma-separated integers")]:
        with pytest.raises(SystemExit) as e:
            tr.parse_config(argv)
        assert needle in str(e.value), (argv, str(e.value))
    cfg = tr.parse_config(["--max-steps", "3", "--resume", "--data", "a.jsonl", "b.jsonl", "--lr", "1e-3"])
    assert (cfg.max_steps, cfg.resume, cfg.data, cfg.lr) == (3, True, ["a.jsonl", "b.jsonl"], 1e-3)


# -----------------------------------------------------------------------------
# 5. bad data


def _skips(text):
    m = re.search(r"\| skipped: (.*)", text)
    assert m, text
    return {} if m.group(1).strip() == "none" else {
        k: int(v) for k, v in (kv.split("=") for kv in m.group(1).strip().split(", "))}


def test_malformed_jsonl_lines_and_short_samples_are_counted_not_fatal(llama, embedded, tok, tmp_path):
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
    # the clean file's own skips (real ShareGPT has some), computed the same way
    base = data_dflash.build_dataset(tok, [str(clean)], 256, 8, str(tmp_path / "c0"), min_supervised=32,
                                     log=lambda *_: None)["stats"]["skipped"]
    expect = dict(base)
    for k, n in {"malformed record": 5, "too few supervised tokens": 1, "no assistant turn": 1,
                 "unknown role": 1}.items():
        expect[k] = expect.get(k, 0) + n

    out = tmp_path / "out"
    p = train(*TINY, "--target", llama, "--data", dirty, "--cache-dir", tmp_path / "c1", "--max-steps", 2,
              "--out-dir", out)
    assert_ok(p)
    assert _skips(p.out) == expect, p.out
    assert [r["step"] for r in metrics(out)] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in metrics(out))


def test_replica_check_compares_bytes_and_names_the_diverged_tensor():
    """The end-of-run check must catch a difference a checksum misses: two entries that differ by
    +e and -e leave the sum unchanged, and -0.0 == 0.0 for torch.equal but not byte for byte."""
    import train_dflash as tr
    tr_ = tr.Trainer.__new__(tr.Trainer)
    logged = []
    tr_.log, tr_.world, tr_.last, tr_.step = logged.append, 1, {"step": 7}, 0
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    tr_.drafters = [a, b]
    tr_.check_replicas_identical()
    assert "[replicas] 2 replica(s) x 1 rank(s) bit-identical after step 7 (20 parameters each" in logged[-1]
    with torch.no_grad():
        b.weight[0, 0] += 0.5
        b.weight[0, 1] -= 0.5          # the same sum (up to rounding), different bytes
        b.bias.copy_(a.bias)
    with pytest.raises(RuntimeError, match=r"diverged after step 7: 1 parameter tensor\(s\) differ.*replica 1: weight"):
        tr_.check_replicas_identical()
    with torch.no_grad():
        b.weight.copy_(a.weight)
        a.bias[0], b.bias[0] = 0.0, -0.0
    assert torch.equal(a.bias, b.bias)               # what a value comparison would accept
    with pytest.raises(RuntimeError, match="replica 1: bias"):
        tr_.check_replicas_identical()


def test_replica_fingerprints_every_log_interval_catch_a_divergence_at_the_next_step():
    """The in-run check: fingerprints queued after step k are compared at step k+1; equal replicas
    pass, and one that differs (even by offsetting +-e, or -0.0 against 0.0) stops the run naming the
    tensor and the step."""
    import train_dflash as tr
    t = tr.Trainer.__new__(tr.Trainer)
    t.world = 1
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    t.drafters = [a, b]
    t.check_fingerprints()                   # nothing queued yet: nothing to compare
    t.queue_fingerprints(10)
    t.check_fingerprints()
    with torch.no_grad():
        b.weight[0, 0] += 0.5
        b.weight[0, 1] -= 0.5
    t.queue_fingerprints(20)
    with pytest.raises(RuntimeError, match=r"diverged by step 20: 1 tensor fingerprint\(s\) differ, first \['replica 1: weight'\]"):
        t.check_fingerprints()
    with torch.no_grad():
        b.weight.copy_(a.weight)
        a.bias[0], b.bias[0] = 0.0, -0.0
    t.queue_fingerprints(30)
    with pytest.raises(RuntimeError, match=r"by step 30: .*replica 1: bias"):
        t.check_fingerprints()


@pytest.mark.parametrize("clip", [1e-3, 1e3])        # the scaling pass runs / is skipped
def test_a_lone_replica_steps_on_handed_over_grads_and_clips_exactly_like_clip_grad_norm(clip):
    """reduce_and_step for one replica without a flat buffer (MasterAdamW, the clip factor applied
    inside its pass): the same parameters, byte for byte, and the same norm as clip_grad_norm_ +
    torch's AdamW.step; grads None afterwards (the next backward's grads are
    handed over, not added to zeros); the step's stats already on the host (read before the optimiser)."""
    from types import SimpleNamespace
    import train_dflash as tr
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 8)
    opt_a = tr.MasterAdamW(a.parameters(), lr=0.1, param_dtype=torch.float32)
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.1, foreach=False)
    for m in (a, b):
        m(x).square().sum().backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(b.parameters(), clip))
    opt_b.step()
    t = tr.Trainer.__new__(tr.Trainer)
    t.drafters, t.opts, t.flat_grads, t.grads, t.world = [a], [opt_a], [None], [None], 1
    t.scheds = [torch.optim.lr_scheduler.LambdaLR(opt_a, lambda s: 1.0)]
    t.cfg = SimpleNamespace(clip=clip, max_minutes=0)
    gnorm, stats = t.reduce_and_step([torch.tensor([1.0, 2.0])])
    assert gnorm == ref_norm and (ref_norm > clip) == (clip < 1)
    assert stats.device.type == "cpu" and stats.tolist() == [1.0, 2.0]
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert pa.grad is None
        assert torch.equal(dm_bytes(pa), dm_bytes(pb))


def test_a_nan_or_inf_gradient_norm_raises_with_nothing_stepped_and_the_next_step_is_the_first():
    """clip_and_step queues the update before it reads the norm (on a GPU the host must not wait for
    the norm first), so a bad norm has to make the update a no-op: FloatingPointError, and weights,
    masters, moments and step counts as they were; a good step afterwards is then step 1 (the bias
    correction) and equals a fresh optimiser's."""
    import train_dflash as tr
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    b.load_state_dict(a.state_dict())
    opt_a = tr.MasterAdamW(a.parameters(), lr=0.1, param_dtype=torch.float32)
    opt_b = tr.MasterAdamW(b.parameters(), lr=0.1, param_dtype=torch.float32)
    state = lambda opt: [t.clone() for p in opt.params() for t in (p.detach(), *(opt.state[p][k] for k in
                                                                                ("master", "exp_avg", "exp_avg_sq")))]
    before = state(opt_a)
    for bad in (float("nan"), float("inf")):
        grads = [torch.randn_like(p) for p in a.parameters()]
        grads[1][0] = bad
        with pytest.raises(FloatingPointError, match="the gradient norm is"):
            tr.clip_and_step(opt_a, grads, 1.0)
        assert all(torch.equal(x, y) for x, y in zip(before, state(opt_a)))
        assert [opt_a.state[p]["step"] for p in opt_a.params()] == [0, 0]
    grads = [torch.randn_like(p) for p in a.parameters()]
    assert tr.clip_and_step(opt_a, grads, 1.0) == tr.clip_and_step(opt_b, [g.clone() for g in grads], 1.0)
    assert all(torch.equal(x, y) for x, y in zip(state(opt_a), state(opt_b)))


def dm_bytes(t):
    import train_dflash as tr
    return tr.as_bytes(t)


def test_warm_shape_leaves_the_grads_as_it_found_them():
    """Absent grads stay absent (a lone replica's next backward hands its grads over); a flat buffer's
    views stay those views, zeroed."""
    import dflash_model as dm
    import warmup
    c = dm.DFlashConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=16, vocab_size=64, num_target_layers=4, max_position_embeddings=128,
                        num_draft_layers=1)
    d = dm.DFlashDrafter(c, embed_weight=torch.randn(64, 32), lm_head_weight=torch.randn(64, 32))
    warmup.warm_shape(d, (1, 64, 4), 7.0, "sdpa", 2048)
    assert all(p.grad is None for p in d.parameters())
    params = list(d.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    off = 0
    for p in params:
        p.grad = flat[off: off + p.numel()].view_as(p)
        off += p.numel()
    warmup.warm_shape(d, (1, 64, 4), 7.0, "sdpa", 2048)
    assert all(p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in params)
    assert not flat.any()


def test_max_length_beyond_the_targets_positions_is_an_early_error():
    from transformers import Qwen3Config
    import train_dflash as tr
    tcfg = Qwen3Config(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, num_hidden_layers=4, vocab_size=64, max_position_embeddings=512)
    assert tr.make_drafter_config(tr.parse_config(["--max-length", "512"]), tcfg, 0).max_position_embeddings == 512
    with pytest.raises(SystemExit, match="--max-length 1024 exceeds the target's max_position_embeddings"):
        tr.make_drafter_config(tr.parse_config(["--max-length", "1024"]), tcfg, 0)


def test_an_impossible_mfu_is_reported_once():
    """A peak measured while the GPU was busy (seen on a shared H200: 344 instead of ~790 TFLOP/s) makes
    every MFU figure of the run wrong; the first one above 100% says so, once."""
    import train_dflash as tr
    t = tr.Trainer.__new__(tr.Trainer)
    logged = []
    t.log, t.peak_flops, t.ddevs = logged.append, 344e12, [torch.device("cpu")]
    t.check_mfu(0.64)
    assert logged == []
    t.check_mfu(1.38)
    t.check_mfu(1.39)
    assert len(logged) == 1 and logged[0].startswith("WARNING: MFU above 100%: the matmul peak measured at the "
                                                     "start (344 TFLOP/s on cpu) was too low"), logged


def test_matmul_flops_of_the_mfu_equal_torchs_flop_counter_on_a_real_step():
    """The MFU's analytic matmul FLOPs are what a drafter forward+backward really runs: torch's FLOP
    counter over one step of a tiny drafter (SDPA path: the counter sees the matmuls, not attention)
    counts exactly drafter_matmul_flops. (The fc over the frozen target features has no input grad.)"""
    import dflash_model as dm
    import train_dflash as tr
    from torch.utils.flop_counter import FlopCounterMode
    S, A, bs, H = 256, 16, 16, 64
    torch.manual_seed(7)
    cfg = dm.DFlashConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, vocab_size=256, num_target_layers=6, num_draft_layers=3, block_size=bs,
                          mask_token_id=255)
    drafter = dm.DFlashDrafter(cfg, embed_weight=torch.randn(256, H), lm_head_weight=torch.randn(256, H))
    feats = torch.randn(1, S, len(cfg.target_layer_ids) * H)
    ids, lm = torch.randint(0, 255, (1, S)), torch.ones(1, S)
    anchors, valid = dm.sample_anchors(lm, torch.tensor([S]), A, bs, torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        loss, _, _ = dm.drafter_forward_loss(drafter, feats, ids, lm, anchors, valid, 7.0, attn="sdpa")
        loss.backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    matmuls = sum(n for op, n in counts.items() if op in ("aten.mm", "aten.addmm", "aten.bmm"))
    assert matmuls == tr.drafter_matmul_flops(cfg, S, A), counts
    ctx = 100.0
    assert tr.drafter_step_flops(cfg, S, A, ctx) == matmuls + 3 * 3 * 4 * A * bs * 64 * (ctx + bs)
    # the trainer's MFU numerator: per row, attention from that row's VALID anchors only (padding
    # anchors do not move it), all A anchors and the bucket's S in the matmuls
    anchors2 = torch.tensor([[10, 30, 0], [50, 0, 0]])
    valid2 = torch.tensor([[True, True, False], [True, False, False]])
    assert tr.batch_flops(cfg, S, anchors2, valid2) == (tr.drafter_step_flops(cfg, S, 3, ctx=20.0)
                                                        + tr.drafter_step_flops(cfg, S, 3, ctx=50.0))


# -----------------------------------------------------------------------------
# 6. torchrun


def test_nccl_rank_sets_its_gpu_before_the_process_group_starts(monkeypatch):
    """On GPUs (NCCL) each torchrun rank must select cuda:LOCAL_RANK before init_process_group, and name
    it as the group's device: else every rank's collectives run on cuda:0 and NCCL fails ("invalid
    usage", seen on 2 H200s). CPU CI has no NCCL, so the calls are recorded instead of made."""
    import torch.distributed as dist
    import train_dflash as tr
    calls = []

    class Started(Exception):
        pass

    def init_process_group(backend, **kw):
        calls.append(("init_process_group", backend, kw))
        raise Started
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    trainer = tr.Trainer(tr.parse_config([]), log=lambda m: None)
    with pytest.raises(Started):
        trainer.setup()
    assert calls == [("set_device", 1), ("init_process_group", "nccl", {"device_id": torch.device("cuda", 1)})]


def torchrun_cmd(llama, data, cache_dir, out, *extra):
    """2 CPU ranks of the trainer on `data` in one bucket, B=1, 3 epochs."""
    return [str(c) for c in [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             free_port(), TRAIN, *TINY, "--target", llama, "--data", data, "--cache-dir", cache_dir,
                             "--buckets", 256, "--tokens-per-batch", 256, "--epochs", 3, *extra, "--out-dir", out]]


def test_torchrun_two_processes_keep_identical_replicas(llama, cache_dir, tmp_path):
    # 5 samples, one bucket, B=1: rank 0's shard has 3 batches/epoch, rank 1's has 2, so with
    # --epochs 3 they would plan 9 and 6 steps: the ranks must agree (min: 6), or their lr schedules
    # differ and rank 0 waits forever in the all-reduce of step 7.
    data = short_chats(tmp_path / "chats5.jsonl", 5)
    out = tmp_path / "out"
    cmd = torchrun_cmd(llama, data, cache_dir, out, "--ckpt-interval", 3)
    p = run_cmd(cmd, timeout=180)
    assert_ok(p)
    rank1 = (out / "train.rank1.log").read_text()        # rank > 0 logs to its own file, not stdout
    assert "[dist] rank 0/2 backend gloo" in p.out and "[dist] rank 1/2 backend gloo" in rank1
    assert "[dist] rank 1/2" not in p.out
    assert re.search(r"\[data\] 3 samples on this node, 3 batches/epoch.*, 6 steps planned", p.out), p.out
    assert re.search(r"\[data\] 2 samples on this node, 2 batches/epoch.*, 6 steps planned", rank1), rank1
    m = re.search(r"\[replicas\] 1 replica\(s\) x 2 rank\(s\) bit-identical after step 6 .*fingerprint (\w+)\)",
                  p.out)
    assert m, p.tail()
    # the fingerprint is that of the saved final weights and masters
    assert m.group(1) == load_state(out / "step_000006")["replica_fingerprints"][0]
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5, 6]       # rank 0 only writes metrics
    assert checkpoints(out) == ["step_000003", "step_000006"]

    # Resume both ranks from step 3: each reads its data position against its own shard (rank 1 has
    # 2 batches/epoch, rank 0 3), so the resumed run ends on the straight run's weights.
    import shutil
    again = tmp_path / "again"
    shutil.copytree(out, again, ignore=shutil.ignore_patterns("step_000006", "compile_cache"))
    p2 = run_cmd(cmd[:-1] + [str(again), "--resume"], timeout=180)
    assert_ok(p2)
    rank1 = (again / "train.rank1.log").read_text()
    assert "step_000003: step 3, batch cursor 3" in p2.out and "step_000003: step 3, batch cursor 3" in rank1, rank1
    assert "data set changed" not in p2.out + rank1
    m2 = re.search(r"bit-identical after step 6 .*fingerprint (\w+)\)", p2.out)
    assert m2 and m2.group(1) == m.group(1), p2.tail()
    assert [r["step"] for r in metrics(again)] == [1, 2, 3, 4, 5, 6]


def test_torchrun_every_rank_stops_on_rank_0s_disk_verdict(llama, cache_dir, tmp_path):
    """Rank 0 writes the checkpoints and checks the disk at start-up; the other ranks stop on its
    verdict at the same point (before the warm-up), not later when torchrun takes them down."""
    data = short_chats(tmp_path / "chats5.jsonl", 5)
    out = tmp_path / "out"
    p = run_cmd(torchrun_cmd(llama, data, cache_dir, out, "--debug-fail", "disk:0"), timeout=180)
    assert p.rc not in (0, None), p.tail()
    assert "error: not enough disk space for this run's checkpoints: ~" in p.out, p.tail()
    assert "error: not enough disk space for this run's checkpoints (rank 0's log says more)" in p.out, p.tail()
    rank1 = (out / "train.rank1.log").read_text()
    assert "[warmup]" not in p.out and "[warmup]" not in rank1 and checkpoints(out) == []


# -----------------------------------------------------------------------------
# 7. the one command


def test_start_training_sh_embedded_default_end_to_end(embedded, tmp_path):
    """No --target / --data: the embedded default (SmolLM2-135M-Instruct + ShareGPT) through
    start_training.sh, with a tmp cache holding links to the prepared model and a 260-record ShareGPT
    (the last 200 are held out), so the test neither re-tokenises ShareGPT nor writes into .cache."""
    import dflash_model as dm
    from transformers import AutoModelForCausalLM
    script = REPO / "start_training.sh"
    assert "DFLASH_SKIP_INSTALL" in script.read_text()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "SmolLM2-135M-Instruct").symlink_to(embedded[0])
    with open(embedded[1]) as src, open(cache / "sharegpt_v3.jsonl", "w") as dst:
        for _, line in zip(range(260), src):
            dst.write(line)
    out = tmp_path / "out"
    env = child_env(DFLASH_SKIP_INSTALL="1", PYTHON=sys.executable)
    p = run_cmd(["bash", str(script), "--max-steps", "2", "--max-length", "128", "--num-anchors", "8",
                 "--max-samples", "20", "--log-interval", "1", "--cache-dir", str(cache), "--out-dir", str(out)],
                timeout=300, env=env)
    logfile = re.search(r"\[start\] logging to (\S+)", p.out)
    try:
        assert_ok(p)
        assert f"[target] {cache}/SmolLM2-135M-Instruct on cpu" in p.out
        assert (cache / "sharegpt_v3.train.jsonl").is_file() and (cache / "sharegpt_v3.heldout.jsonl").is_file()
        assert "sharegpt_v3.heldout.jsonl" in p.out              # the eval command uses held-out prompts
        assert "summary" in p.out and "[ckpt]" in p.out
        assert [r["step"] for r in metrics(out)] == [1, 2]
        assert all(math.isfinite(r["loss"]) for r in metrics(out))
        assert logfile and "summary" in (REPO / logfile.group(1)).read_text()
        target = AutoModelForCausalLM.from_pretrained(embedded[0])
        drafter = dm.load_drafter(str(out / "step_000002" / "drafter"), target=target)
        assert drafter.config.vocab_size == target.config.vocab_size
        assert drafter.config.target_layer_ids and drafter.config.num_draft_layers == 5
    finally:
        if logfile and (REPO / logfile.group(1)).is_file():
            (REPO / logfile.group(1)).unlink()        # our run's copy of the log in logs/


def test_ranks_preparing_the_embedded_default_at_once_all_get_the_same_complete_split(embedded, tmp_path):
    """torchrun ranks on one node each call embedded_default() on the same cache folder: the
    train/held-out split is written by each into its own temporary file and renamed, so every rank
    starts, and the files hold every line once (held-out: the last 200)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "SmolLM2-135M-Instruct").symlink_to(Path(embedded[0]).resolve())
    (cache / "sharegpt_v3.jsonl").symlink_to(Path(embedded[1]).resolve())
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); import train_dflash as tr; print(tr.embedded_default({str(cache)!r}))"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(4)]
    outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outs
    assert len({o.strip().splitlines()[-1] for o in outs}) == 1, outs
    lines = Path(embedded[1]).read_text().splitlines(keepends=True)
    assert (cache / "sharegpt_v3.heldout.jsonl").read_text() == "".join(lines[-200:])
    assert (cache / "sharegpt_v3.train.jsonl").read_text() == "".join(lines[:-200])
    assert sorted(p.name for p in cache.iterdir() if "tmp" in p.name) == []


def test_device_lists_auto_split_and_local_rank(monkeypatch):
    """auto = the original 5 target + 3 drafter split on 8 GPUs; cuda:local = this torchrun process's GPU."""
    import torch
    import train_dflash as tr
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    t, d = tr.resolve_devices(tr.parse_config([]))
    assert [str(x) for x in t] == [f"cuda:{i}" for i in range(5)]
    assert [str(x) for x in d] == ["cuda:5", "cuda:6", "cuda:7"]
    monkeypatch.setenv("LOCAL_RANK", "3")
    t, d = tr.resolve_devices(tr.parse_config(["--target-devices", "cuda:local", "--drafter-devices", "cuda:local"]))
    assert [str(x) for x in t] == ["cuda:3"] and [str(x) for x in d] == ["cuda:3"]
    with pytest.raises(SystemExit, match="only 8 CUDA device"):
        tr.resolve_devices(tr.parse_config(["--target-devices", "cuda:9"]))


def test_checkpoints_record_the_start_environment_and_what_changed_during_the_run(tmp_path, monkeypatch):
    """A checkpoint's env.json is the environment the run started in (what --against compares with),
    the compile cache as it is at the save, and the fields that changed since the start, announced
    once."""
    import diagnose
    import train_dflash as tr
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    logged = []
    trainer = tr.Trainer(tr.parse_config(["--out-dir", str(tmp_path)]), log=logged.append)
    trainer.compile_cache = str(tmp_path / "compile_cache")
    trainer.env_at_start = diagnose.collect_env(trainer.compile_cache)
    assert trainer.checkpoint_env()["changed_during_run"] == [] and logged == []
    monkeypatch.setenv("NCCL_DEBUG", "INFO")           # e.g. set for a later run in the same shell
    (tmp_path / "compile_cache").mkdir()
    (tmp_path / "compile_cache" / "entry").write_text("x")
    for _ in range(2):
        env = trainer.checkpoint_env()
    assert env["changed_during_run"] == [["env_vars.NCCL_DEBUG", "(missing)", "INFO"]]
    assert "NCCL_DEBUG" not in env["env_vars"]                        # the start's environment
    assert env["compile_cache"]["file_count"] == 1                     # the cache as it is now
    assert len(logged) == 1 and logged[0].startswith("WARNING: the environment changed while this run was going")


def test_anchors_per_sequence_capped_by_length_and_rows_by_the_block_budget():
    """The spec's recipe (512 anchors per sequence, fewer only where a sequence has fewer start
    positions), with each batch holding no more blocks than a max_length batch (one step costs the
    drafter about the same in every bucket); --anchor-density length keeps the anchors per token."""
    import train_dflash as tr
    cfg = tr.parse_config([])
    assert tr.shape_plan(cfg, 16) == [(2, 256, 248), (1, 512, 504), (1, 1024, 512), (1, 2048, 512), (1, 3072, 512)]
    cfg = tr.parse_config(["--tokens-per-batch", "6144"])          # two max_length rows per batch
    assert tr.shape_plan(cfg, 16) == [(4, 256, 248), (2, 512, 504), (2, 1024, 512), (2, 2048, 512), (2, 3072, 512)]
    cfg = tr.parse_config(["--anchor-density", "length"])
    assert tr.shape_plan(cfg, 16) == [(12, 256, 48), (6, 512, 88), (3, 1024, 176), (1, 2048, 344), (1, 3072, 512)]
    with pytest.raises(SystemExit, match="--anchor-density must be sequence|length"):
        tr.parse_config(["--anchor-density", "token"])


def test_warmup_cli_prints_the_table_and_records_the_build(llama, tmp_path):
    """warmup.py: every (device, shape) in a table; the cache folder says which build filled it."""
    p = run_cmd([sys.executable, str(REPO / "warmup.py"), *TINY, "--target", llama, "--drafter-devices", "cpu,cpu",
                 "--out-dir", str(tmp_path / "out")])
    assert_ok(p)
    rows = re.findall(r"^cpu\s+\((\d+), (\d+), (\d+)\)\s+[\d.]+\s+eager \(sdpa\)$", p.out, re.M)
    assert [tuple(map(int, r)) for r in rows] == [(1, 64, 32), (1, 128, 32), (1, 256, 32)] * 2, p.out
    info = json.loads((tmp_path / "out" / "compile_cache" / "dflash_cache_info.json").read_text())
    assert info["torch"] == torch.__version__ and info["torch_git"] == torch.version.git_version


def test_shared_compile_cache_files_survive_concurrent_writers_and_damage(tmp_path, monkeypatch):
    """Ranks and warm-up children share one compile cache. Its build-info file is replaced whole (a
    reader never sees a half-written one: the torchrun test once failed on an empty file), a damaged
    one is a notice, not a crash, and warm-list additions made at once are all kept."""
    import warmup
    for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"):
        monkeypatch.delenv(k, raising=False)      # use_compile_cache sets them; restored after the test
    cache = tmp_path / "compile_cache"
    cache.mkdir()
    info = cache / "dflash_cache_info.json"
    info.write_text("")                           # what a reader of a half-written file used to see
    lines = []
    warmup.use_compile_cache(str(cache), log=lines.append)
    assert len(lines) == 1 and "NOTICE" in lines[0] and "unreadable" in lines[0], lines
    assert json.loads(info.read_text())["torch"] == torch.__version__

    errors, keys = [], [[f"t{t}-k{i}" for i in range(40)] for t in range(4)]

    def hammer(mine):
        try:
            for k in mine:
                warmup.use_compile_cache(str(cache), log=errors.append)    # a notice here is an error too
                warmup.add_to_warm_list([k])
        except Exception as e:                    # noqa: BLE001 - the test reports it below
            errors.append(repr(e))

    threads = [threading.Thread(target=hammer, args=(mine,)) for mine in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert warmup.read_warm_list() == {k for mine in keys for k in mine}
    before = info.read_text()
    warmup.use_compile_cache(str(cache), log=errors.append)     # the same build again: the record stays
    assert info.read_text() == before and errors == []
    assert sorted(p.name for p in cache.iterdir()) == ["dflash_cache_info.json", "dflash_warm_pairs.json",
                                                       "dflash_warm_pairs.json.lock"]    # no temporaries left


def test_pair_claims_one_process_compiles_a_pair_the_others_wait_and_load_it(tmp_path, monkeypatch):
    """Claims: a pair another process holds cannot be taken; wait() returns once its holder lets go
    (after the holder's pid was logged), then this process holds it. Synchronised on the child's output."""
    import warmup
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    mine = warmup.Claims()
    assert mine.take("pair-a") and mine.take("pair-a")        # taking a pair it holds again: still its own
    child_code = ("import warmup; c = warmup.Claims(log=lambda m: print(m, flush=True)); "
                  "print('a', c.take('pair-a'), 'b', c.take('pair-b'), flush=True); c.wait('pair-a', 'pair a'); "
                  "print('holds a:', 'pair-a' in c.held, flush=True)")
    p = subprocess.Popen([sys.executable, "-c", child_code], cwd=REPO, env=dict(os.environ),
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().split() == ["a", "False", "b", "True"]
    waiting = p.stdout.readline()        # printed once the child found the pair held, before it blocks
    assert f"process {os.getpid()} on" in waiting and "is compiling pair a" in waiting, waiting
    assert not mine.take("pair-b")       # the child holds pair b
    mine.release("pair-a")               # its holder is done (or died): the child goes on
    rest = p.stdout.read()
    assert p.wait() == 0 and "waited" in rest and rest.strip().endswith("holds a: True"), rest
    assert mine.take("pair-b")           # the child's locks died with it


def frozen_flex_drafter_on_a_fresh_cache(tmp_path, monkeypatch):
    """A tiny frozen drafter and an empty compile cache. FlexAttention has no backward on CPU: a frozen
    drafter warms (and warm-up children precompile) the forward only."""
    import dflash_model as dm
    import warmup
    for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"):
        monkeypatch.delenv(k, raising=False)      # use_compile_cache sets them; restored after the test
    warmup.use_compile_cache(str(tmp_path / "compile_cache"))
    cfg = dm.DFlashConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, vocab_size=64, num_target_layers=4, num_draft_layers=1, block_size=16,
                          mask_token_id=63)
    return dm, warmup, dm.DFlashDrafter(cfg, embed_weight=torch.randn(64, 32)).requires_grad_(False)


def test_warm_up_compiles_its_free_pairs_first_then_waits_for_a_pair_another_process_holds(tmp_path, monkeypatch):
    """Two processes that need the same pairs split them: while another holds (compiles) one pair,
    warm_up compiles the others - in workers and serially - then waits for that pair; here its holder
    lets go without listing it (as if it died), so warm_up compiles it itself."""
    dm, warmup, drafter = frozen_flex_drafter_on_a_fresh_cache(tmp_path, monkeypatch)
    spec = warmup.worker_spec(drafter, 7.0, "flex", dm.CHUNK_ROWS, "trunk", 0)   # warm_up's default chunk
    other = warmup.Claims()                        # "another process": its own lock files, so flock excludes
    for workers, shapes in ((0, [(1, 128, 8), (1, 256, 8)]), (2, [(1, 640, 8), (1, 384, 8)])):
        held = shapes[0]                           # a pair no earlier round compiled or listed
        name = "cpu B={} S={} A={}".format(*held)
        torch._dynamo.reset()
        dm.GATE.reset()
        assert other.take(warmup.pair_key(spec, held))
        lines = []

        def log(msg):
            lines.append(msg)
            if f"is compiling {name} " in msg:     # the warm-up is about to block on it
                other.release(warmup.pair_key(spec, held))
        try:
            rows = warmup.warm_up([drafter], shapes, 7.0, "flex", log=log, workers=workers)
        finally:
            dm.GATE.reset()
        text = "\n".join(lines)
        wait = text.index(f"is compiling {name} ")
        for B, S, A in shapes[1:]:
            assert text.index(f"cpu      B={B:<3d} S={S:<5d}") < wait, text     # its free pairs first
        if workers:
            assert f"{name}: another process is compiling it" in text, text    # no worker for it
            assert f"precompiled {name}" not in text, text
        assert text.index(f"cpu      B={held[0]:<3d} S={held[1]:<5d}") > wait, text
        assert [(r[1], r[3]) for r in rows] == [(held, "cold compile")] + [(s, "cache hit" if workers else "cold compile")
                                                                            for s in shapes[1:]], text
        assert set(warmup.read_warm_list()) >= {warmup.pair_key(spec, s) for s in shapes}


def test_torchrun_ranks_list_their_gpu_first_so_every_rank_is_cuda0():
    """pin_local_gpu: under torchrun with cuda:local, this rank's GPU goes first in
    CUDA_VISIBLE_DEVICES (the others stay, in order), the value found is kept for env comparisons, and
    cuda:local resolves to cuda:0; without torchrun, or with explicit indices in either list (they keep
    meaning the node's numbering), nothing changes; a rank with no GPU of its own is an error."""
    import train_dflash as tr
    import diagnose
    cfg = tr.TrainConfig(target_devices="cuda:local", drafter_devices="cuda:local")
    cases = [({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}, "2,0,1,3"),
             ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, "5,4,6,7"),
             ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}, "GPU-aa,GPU-bb")]
    try:
        for env, want in cases:
            tr.PINNED.clear()
            before = env.get("CUDA_VISIBLE_DEVICES", "(unset)")
            assert tr.pin_local_gpu(cfg, env) == want and env["CUDA_VISIBLE_DEVICES"] == want
            assert env[diagnose.UNPINNED_VAR] == before          # what "what changed?" compares
            assert tr.local_gpu() == 0
            assert tr.pin_local_gpu(cfg, env) is None and env["CUDA_VISIBLE_DEVICES"] == want   # once per process
        tr.PINNED.clear()
        env = {"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0,1"}
        with pytest.raises(SystemExit, match="LOCAL_RANK 3"):
            tr.pin_local_gpu(cfg, env)
        for c, env in ((tr.TrainConfig(target_devices="cuda:0", drafter_devices="cuda:1"), {"LOCAL_RANK": "1"}),
                       (tr.TrainConfig(target_devices="cuda:local", drafter_devices="cuda:7"), {"LOCAL_RANK": "1"}),
                       (cfg, {})):
            assert tr.pin_local_gpu(c, env) is None and "CUDA_VISIBLE_DEVICES" not in env
    finally:
        tr.PINNED.clear()


def test_warmup_workers_precompile_each_shape_in_a_child_then_the_warm_up_hits_the_cache(tmp_path, monkeypatch):
    """warm_up(workers=2): each flex shape cold-compiles in its own process into the shared cache, the
    in-process warm-up then only loads it; a failing child is reported (its shape and output) and the
    serial warm-up, compiling that shape itself, raises the real error."""
    dm, warmup, drafter = frozen_flex_drafter_on_a_fresh_cache(tmp_path, monkeypatch)

    def warm(shapes, workers):
        torch._dynamo.reset()     # forget in-process compiles: only the disk cache can make a 'cache hit'
        dm.GATE.reset()
        lines = []
        try:
            rows = warmup.warm_up([drafter], shapes, 7.0, "flex", log=lines.append, workers=workers)
        finally:
            dm.GATE.reset()
        return rows, "\n".join(lines)

    shapes = [(1, 128, 8), (1, 256, 8)]
    rows, log = warm(shapes, workers=2)
    for B, S, A in shapes:
        assert re.search(rf"precompiled cpu B={B} S={S} A={A} in [\d.]+s \(worker\)\n\[warmup\]   compile phases: "
                         r"\S+ [\d.]+s", log), log     # where each child's compile time went
    assert "precompiled 2 pairs in" in log, log
    assert [(r[0], r[1], r[3]) for r in rows] == [("cpu", s, "cache hit") for s in shapes], log
    assert "NOTICE" not in log, log        # the workers' graphs were the parent's: nothing compiled twice

    # a child given several specs compiles the shape for each in turn (one GPU after another; here the
    # same CPU twice: the second is dynamo's in-process reuse) and times each
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(warmup.worker_spec(drafter, 7.0, "flex", 2048, "trunk", 8)))
    p = run_cmd([sys.executable, warmup.__file__, "--precompile-one", "1", "128", "8", str(spec), str(spec)],
                timeout=300)
    assert_ok(p)
    assert len(re.findall(r"\[warmup\]   compile phases \(cpu, [\d.]+s\): ", p.out)) == 2, p.out

    rows, log = warm(shapes, workers=0)               # today's path: no children, the same table
    assert "worker" not in log and [r[3] for r in rows] == ["cache hit"] * 2, log

    # a restart on this (now warm) cache starts no children: the pairs are on the cache's warm list
    rows, log = warm(shapes, workers=2)
    assert f"2 of 2 (device, shape) pairs were compiled into this cache before ({warmup.WARM_LIST})" in log, log
    assert "precompil" not in log and [r[3] for r in rows] == ["cache hit"] * 2, log
    # ... and a change to what the graphs depend on (here the grad mode) is not on the list: workers run
    with torch.no_grad():
        rows, log = warm(shapes[:1] + [(1, 384, 8)], workers=2)
    assert "were compiled into this cache before" not in log and "precompiled 2 pairs in" in log, log
    # listed pairs and new ones: the listed ones are warmed (loaded) WHILE the children compile the
    # new ones, not after; the table keeps the shapes' order
    more = shapes + [(1, 384, 8), (1, 512, 8)]
    rows, log = warm(more, workers=2)
    assert "2 of 4 (device, shape) pairs were compiled into this cache before" in log, log
    first_child = log.index("[warmup] precompiled cpu")
    for B, S, A in shapes:
        assert log.index(f"[warmup] cpu      B={B:<3d} S={S:<5d}") < first_child, log
    assert [(r[1], r[3]) for r in rows] == [(s, "cache hit") for s in more], log

    os.remove(tmp_path / "compile_cache" / warmup.WARM_LIST)     # below: both pairs go to workers
    lines = []
    dm.GATE.reset()
    with pytest.raises(ValueError, match="multiples of 128"):   # S=200 breaks flex's 128-tile rule
        warmup.warm_up([drafter], [(1, 128, 8), (1, 200, 8)], 7.0, "flex", log=lines.append, workers=2)
    dm.GATE.reset()
    log = "\n".join(lines)
    assert re.search(r"WARNING: the worker for cpu B=1 S=200 A=8 failed \(exit 1\)", log), log
    assert "multiples of 128" in log and "Traceback" in log, log     # the child's own output, reported


def test_precompile_schedule_is_longest_first_interleaved_and_capped_per_device():
    """Workers start the slowest compiles (longest sequences) first, alternate devices, and never run
    more than the per-device cap on one GPU (their memory lands there); with fewer workers than pairs a
    job holds a shape's GPUs, split as the workers allow; auto means none on CPU."""
    import dflash_model as dm
    import warmup
    jobs = warmup.job_order(["cuda:0", "cuda:1"], [(12, 256, 48), (1, 3072, 512), (3, 1024, 176)])
    assert jobs == [("cuda:0", (1, 3072, 512)), ("cuda:1", (1, 3072, 512)), ("cuda:0", (3, 1024, 176)),
                    ("cuda:1", (3, 1024, 176)), ("cuda:0", (12, 256, 48)), ("cuda:1", (12, 256, 48))]
    one = warmup.group_jobs(jobs, workers=6)       # a worker per pair: a job per pair
    assert one == [((d,), s) for d, s in jobs]
    assert warmup.next_job(one, [], 2) == (("cuda:0",), (1, 3072, 512))
    assert warmup.next_job(one[1:], ["cuda:0", "cuda:0"], 2) == (("cuda:1",), (1, 3072, 512))
    assert warmup.next_job(one[2:], ["cuda:0", "cuda:1"], 1) is None       # both GPUs at their cap
    # fewer workers than pairs: a child compiles a shape for several GPUs in turn; the longest shapes
    # get the spare workers; each shape's GPUs are rotated, so children start on different GPUs
    assert warmup.group_jobs(jobs, workers=4) == [
        (("cuda:0",), (1, 3072, 512)), (("cuda:1",), (1, 3072, 512)),
        (("cuda:1", "cuda:0"), (3, 1024, 176)), (("cuda:0", "cuda:1"), (12, 256, 48))]
    three = warmup.job_order(["cuda:5", "cuda:6", "cuda:7"], [(1, 3072, 512), (1, 2048, 512)])
    assert warmup.group_jobs(three, workers=3) == [
        (("cuda:5",), (1, 3072, 512)), (("cuda:6", "cuda:7"), (1, 3072, 512)),
        (("cuda:6", "cuda:7", "cuda:5"), (1, 2048, 512))]
    assert warmup.group_jobs(three, workers=1) == [
        (("cuda:5", "cuda:6", "cuda:7"), (1, 3072, 512)), (("cuda:6", "cuda:7", "cuda:5"), (1, 2048, 512))]
    for workers in range(1, 8):              # every pair in exactly one job
        got = [(d, s) for devs, s in warmup.group_jobs(three, workers) for d in devs]
        assert sorted(got) == sorted(three), workers
    cfg = dm.DFlashConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, vocab_size=64, num_target_layers=4, num_draft_layers=1, block_size=16,
                          mask_token_id=63)
    assert warmup.auto_workers([dm.DFlashDrafter(cfg, embed_weight=torch.randn(64, 32))], n_pairs=5) == 0


def test_the_parent_warms_during_precompile_only_where_memory_covers_it_and_its_children(monkeypatch):
    """While children compile, the parent loads a ready shape on a GPU only if the free memory covers
    its own warm-up plus every child running on that GPU at its peak (CHILD_GIB each); other GPUs'
    children do not count; on CPU there is no such limit."""
    import warmup
    free = {}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (free[str(d)], 141 * 2**30))
    gib = warmup.CHILD_GIB * 2**30
    free["cuda:1"] = 2 * gib
    assert warmup.room_to_warm(torch.device("cuda:1"), ["cuda:1", "cuda:0", "cuda:0"])
    assert not warmup.room_to_warm(torch.device("cuda:1"), ["cuda:1", "cuda:1"])
    free["cuda:1"] = 2 * gib - 1
    assert not warmup.room_to_warm(torch.device("cuda:1"), ["cuda:1"])
    assert warmup.room_to_warm(torch.device("cpu"), ["cpu"] * 8)


def test_bench_tiny_reports_every_figure_its_profile_and_a_two_replica_layout(tmp_path):
    """bench.py at toy size on CPU: every figure of the table lands in --json (values are timings,
    not asserted), the profile groups the step's time, and --pipeline-only runs the real loop on a
    2-replica layout whose replicas end bit-identical."""
    bench = str(REPO / "bench.py")
    out = tmp_path / "bench.json"
    p = run_cmd([sys.executable, bench, "--tiny", "--device", "cpu", "--steps", "1", "--rounds", "1", "--profile",
                 "--pipeline-steps", "10", "--json", str(out)], timeout=300)
    assert_ok(p)
    res = json.loads(out.read_text())
    for key in ("target_ms", "target_tok_s", "target_mfu", "drafter_ms", "drafter_mfu", "warmup_cold_s",
                "sum_of_parts_tok_s", "pipeline_tok_s", "pipeline_vs_sum_of_parts", "warmup_warm_cache_s"):
        assert isinstance(res[key], float) and math.isfinite(res[key]), (key, res.get(key))
    assert set(res["spread_ms"]) == {"target_ms", "drafter_ms"}          # no naive step without flex
    prof = res["profile"]
    assert prof["by_class_ms"] and prof["top_ms"] and "[bench] profile of one step" in p.out
    assert sum(prof["by_class_ms"].values()) == pytest.approx(prof["device_busy_ms"], rel=0.01)

    out2 = tmp_path / "layout.json"
    p = run_cmd([sys.executable, bench, "--tiny", "--device", "cpu", "--pipeline-only", "--target-devices", "cpu",
                 "--drafter-devices", "cpu,cpu", "--pipeline-steps", "4", "--json", str(out2)], timeout=300)
    assert_ok(p)
    res = json.loads(out2.read_text())
    assert res["pipeline_devices"] == {"target": "cpu", "drafter": "cpu,cpu"}
    assert res["pipeline_replicas"].startswith("[replicas] 2 replica(s) x 1 rank(s) bit-identical after step 4"), res


def test_bench_optimizer_times_both_optimisers_and_the_matmul_rate(tmp_path):
    """bench.py --optimizer at toy size on CPU: MasterAdamW and torch's AdamW step, both norms and the
    burst matmul rate land in --json (timings, not asserted)."""
    out = tmp_path / "opt.json"
    p = run_cmd([sys.executable, str(REPO / "bench.py"), "--tiny", "--device", "cpu", "--optimizer", "--steps", "1",
                 "--rounds", "1", "--json", str(out)], timeout=300)
    assert_ok(p)
    res = json.loads(out.read_text())
    assert res["optimizer_params"] > 0
    for key in ("master_adamw_step_ms", "total_norm_ms", "clip_and_step_ms", "torch_adamw_step_ms", "clip_grad_norm_ms"):
        assert isinstance(res[key], float) and res[key] > 0, (key, res.get(key))
    assert len(res["matmul_burst_tflops"]) == 3


def test_eval_cli_reports_tau_histogram_speedup_and_losslessness(llama, tmp_path):
    """eval_dflash.py end to end (tiny target, untrained drafter, ShareGPT prompts): every prompt is
    lossless, the JSON is complete and consistent with the printout; a time budget stops after the
    first prompt and reports that one, marked incomplete; --merge adds up runs over disjoint prompt
    ranges into the one run's figures and refuses overlapping ones."""
    import dflash_model as dm
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(llama)
    cfg = dm.DFlashConfig.from_target_config(target.config, num_draft_layers=1, block_size=4,
                                             mask_token_id=target.config.vocab_size - 1)
    torch.manual_seed(0)
    dm.save_drafter(dm.DFlashDrafter(cfg).attach_target(target), str(tmp_path / "drafter"))
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(3):
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"Question {i}: what is {i} + {i}?"},
                                                  {"from": "gpt", "value": "An answer."}]}) + "\n")
    base = [sys.executable, str(REPO / "eval_dflash.py"), "--target", llama, "--drafter", str(tmp_path / "drafter"),
            "--prompts", str(prompts), "--max-new-tokens", "12", "--device", "cpu"]

    p = run_cmd(base + ["--num-prompts", "3", "--json", str(tmp_path / "all.json")])
    assert_ok(p)
    res = res_all = json.loads((tmp_path / "all.json").read_text())
    assert res["prompts"] == res["requested"] == 3 and res["complete"] and res["lossless"] == 3, res
    assert res["mismatches"] == [] and "lossless: 3/3 prompts identical" in p.out
    assert sum(res["histogram"].values()) == res["rounds"] > 0
    tau = sum(int(k) * v for k, v in res["histogram"].items()) / res["rounds"]
    assert abs(tau - res["mean_tau"]) < 1e-9 and 1 <= tau <= 4
    assert f"mean acceptance length tau = {tau:.3f}" in p.out and "speed-up:" in p.out

    p = run_cmd(base + ["--num-prompts", "3", "--max-minutes", "1e-9", "--json", str(tmp_path / "cut.json")])
    assert_ok(p)
    res = json.loads((tmp_path / "cut.json").read_text())
    assert res["prompts"] == 1 and res["requested"] == 3 and not res["complete"], res
    assert "time budget of 1e-09 min reached after 1 of 3 prompts" in p.out and "(incomplete: 1 of 3" in p.out

    # the same 3 prompts in two runs (1 + 2), added up: the rounds and histogram of the one run (greedy
    # decoding is deterministic), each rate as total tokens over total seconds
    p = run_cmd(base + ["--skip", "1", "--num-prompts", "2", "--json", str(tmp_path / "rest.json")])
    assert_ok(p)
    merged = tmp_path / "merged.json"
    p = run_cmd([sys.executable, str(REPO / "eval_dflash.py"), "--merge", str(tmp_path / "rest.json"),
                 str(tmp_path / "cut.json"), "--json", str(merged)])
    assert_ok(p)
    m, parts = json.loads(merged.read_text()), [json.loads((tmp_path / n).read_text()) for n in ("cut.json", "rest.json")]
    assert m["prompts"] == 3 and m["lossless"] == 3 and m["histogram"] == res_all["histogram"], (m, res_all)
    assert m["rounds"] == res_all["rounds"] and abs(m["mean_tau"] - res_all["mean_tau"]) < 1e-9
    assert m["complete"] and m["requested"] == 3, m       # the cut part's missing prompts are the other's
    secs = sum(r["target_seconds"] for r in parts)
    assert abs(m["target_tok_s"] - sum(r["target_tokens"] for r in parts) / secs) < 1e-6
    assert "merged 2 results: prompts 1-3" in p.out and "lossless: 3/3 prompts identical" in p.out
    p = run_cmd([sys.executable, str(REPO / "eval_dflash.py"), "--merge", str(tmp_path / "all.json"),
                 str(tmp_path / "rest.json")])
    assert p.rc != 0 and "(prompts 1-3) and" in p.out and "(prompts 2-3) overlap" in p.out, p.tail()


def _adamw_pair(param_dtype):
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    b.load_state_dict(a.state_dict())
    import train_dflash as tr
    opt_a = tr.MasterAdamW(a.parameters(), lr=0.1, betas=(0.9, 0.95), weight_decay=0.1, param_dtype=param_dtype)
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.1, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    return a, b, opt_a, opt_b


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
        assert torch.equal(dm_bytes(m), dm_bytes(ref.detach()))
        assert torch.equal(dm_bytes(p), dm_bytes(m.to(param_dtype)))


def test_master_adamw_state_round_trip_keeps_the_masters_in_fp32_and_checks_what_it_loads():
    """A checkpoint's optimiser state restores masters, moments and steps exactly into an optimiser of
    bf16 weights (torch.optim's own load would round them to the parameters' dtype), writes the
    weights from the masters, and the next step is the same as the uninterrupted optimiser's.
    Another optimiser's state or another model's is a clear error."""
    import train_dflash as tr
    a, _, opt_a, _ = _adamw_pair(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=gen) for p in a.parameters()] for _ in range(2)]
    opt_a.step(grads=grads[0])
    sd = opt_a.state_dict()
    torch.manual_seed(5)
    c = torch.nn.Linear(8, 8)
    opt_c = tr.MasterAdamW(c.parameters(), lr=0.5, param_dtype=torch.bfloat16)
    opt_c.load_state_dict(sd)
    assert opt_c.param_groups[0]["lr"] == 0.1
    for m_c, m_a, p_c in zip(opt_c.masters(), opt_a.masters(), c.parameters()):
        assert m_c.dtype == torch.float32 and torch.equal(dm_bytes(m_c), dm_bytes(m_a))
        assert torch.equal(dm_bytes(p_c), dm_bytes(m_a.to(torch.bfloat16)))
    opt_a.step(grads=grads[1])
    opt_c.step(grads=grads[1])
    for m_c, m_a in zip(opt_c.masters(), opt_a.masters()):
        assert torch.equal(dm_bytes(m_c), dm_bytes(m_a))
    with pytest.raises(ValueError, match="not a master_adamw/1 optimiser state"):
        opt_c.load_state_dict(torch.optim.AdamW(c.parameters()).state_dict())
    d = torch.nn.Linear(8, 4)
    with pytest.raises(ValueError, match="has shape"):
        tr.MasterAdamW(d.parameters()).load_state_dict(sd)
    with pytest.raises(ValueError, match="takes fp32 parameters"):
        tr.MasterAdamW(c.parameters())            # already bf16: the masters would be rounded


def test_gradients_summed_in_the_flat_buffer_by_the_hooks():
    """Where grads are summed (replicas, ranks, micro-batches), each backward's gradient is added into
    the replica's fp32 buffer by a hook and freed; two backward passes sum there."""
    import train_dflash as tr
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    params = list(lin.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    views = [g.view_as(p) for g, p in zip(torch.split(flat, [p.numel() for p in params]), params)]
    for p, v in zip(params, views):
        p.register_post_accumulate_grad_hook(tr.add_into(v))
    x1, x2 = torch.randn(2, 4), torch.randn(5, 4)
    lin(x1).sum().backward()
    lin(x2).sum().backward()
    assert all(p.grad is None for p in params)
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(lin.state_dict())
    ref(torch.cat([x1, x2])).sum().backward()
    for v, p in zip(views, ref.parameters()):
        torch.testing.assert_close(v, p.grad)


def test_a_torch_adamw_checkpoint_state_converts_and_continues_the_same_run():
    """An optimiser state of this trainer before MasterAdamW (torch's AdamW over fp32 parameters,
    with a LambdaLR schedule) converts: its parameters become the masters, its moments and steps
    carry over, and the next step equals torch AdamW's next step byte for byte (CPU, fp32)."""
    import train_dflash as tr
    a, b, opt_a, opt_b = _adamw_pair(torch.float32)
    sched_b = torch.optim.lr_scheduler.LambdaLR(opt_b, lambda s: 0.5)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        for p in b.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt_b.step()
        sched_b.step()
    sd = tr.from_torch_adamw_state(opt_b.state_dict(), [p.detach().clone() for p in b.parameters()])
    opt_a.load_state_dict(sd)
    assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"] == 0.05
    assert [opt_a.state[p]["step"] for p in a.parameters()] == [2, 2]
    grads = [torch.randn(p.shape, generator=gen) for p in b.parameters()]
    for p, g in zip(b.parameters(), grads):
        p.grad = g
    opt_b.step()
    opt_a.step(grads=grads)
    for m, p in zip(opt_a.masters(), b.parameters()):
        assert torch.equal(dm_bytes(m), dm_bytes(p.detach()))
    with pytest.raises(ValueError, match="2 tensors, 1 master weights"):
        tr.from_torch_adamw_state(opt_b.state_dict(), [torch.zeros(1)])
