"""The compile race, measured (python diagnose.py --race-test): threads call one compiled function on a cold cache,
each at its own shape, so each thread's first call compiles while the others call, in a child process per mode:
  nogate  the compiled function called directly
  gate    through compiled.GATE before the warm-up: every compiled call exclusive
  warm    every shape compiled serially first, then GATE.mark_warm(): shared calls, no compiles
Who raises the FX flag is recorded with its stack (Tracer.trace patched), grouped by site."""
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter

import torch

from environment import HERE, _fx_flag, _fx_flag_thread_local, natural_race_expected

FX_ERROR = "Detected that you are using FX to symbolically trace"
MODES = ("nogate", "gate", "warm")
# Frames between "who wants a graph" and Tracer.trace: fx itself, decorators and context managers.
PLUMBING = ("torch/fx/", "torch/_compile.py", "torch/_dynamo/eval_frame.py", "torch/utils/_contextlib.py", "<stdlib>/")
FRAME_ROOTS = [(os.path.dirname(os.path.dirname(torch.__file__)) + os.sep, ""), (HERE + os.sep, ""),
               (os.path.dirname(os.__file__) + os.sep, "<stdlib>/"), ("", "")]   # cut from frames' file names

def _group_raises(events):
    """Per site that raised the flag, most frequent first; user_frame: the innermost frame outside torch."""
    groups = {}
    for thread, stack in events:
        frames = [next(label + f.filename[len(root):] for root, label in FRAME_ROOTS if f.filename.startswith(root))
                  + f":{f.lineno} in {f.name}" for f in stack[::-1]]   # innermost first
        key = (frames[0], next((f for f in frames if not f.startswith(PLUMBING)), None),
               next((f for f in frames if not f.startswith(("torch/", "<stdlib>"))), None))
        groups.setdefault(key, []).append(thread)
    return sorted(({"count": len(ts), "threads": Counter(ts), "tracing_frame": key[0], "requested_by": key[1],
                    "user_frame": key[2]} for key, ts in groups.items()), key=lambda gr: -gr["count"])

def run_exercise(mode, threads, seconds, device):
    """The threaded exercise in this process: meaningful only in a fresh one with a cold cache (run_child)."""
    import compiled
    from torch.nn.attention.flex_attention import create_block_mask
    thread_local = _fx_flag_thread_local()   # no other thread yet: safe
    gate, dev = compiled.GATE, torch.device(device)
    gate.set_recompile_limit(max(8, threads + 2))
    # the drafter's attention per thread (small on CPU: compiles dominate); eager create_block_mask: vmap, no FX flag
    B, H, D, L1, dtype = (1, 4, 64, 128, torch.float32) if dev.type == "cpu" else (1, 8, 128, 1024, torch.bfloat16)
    inputs = {f"worker-{i}-L{L}": (*(torch.randn(B, H, L, D, device=dev, dtype=dtype) for _ in range(3)),
                                   create_block_mask(lambda b, h, q, kv: q >= kv, B, None, L, L, device=dev))
              for i, L in enumerate(range(L1, L1 * (threads + 1), L1))}
    stats = {n: dict(name=n, shape=list(args[0].shape), calls=0, fx_errors=0, other_errors=0, exposed_calls=0)
             for n, args in inputs.items()}
    samples, called, barrier = [], set(), threading.Barrier(threads)

    def fn(*args):   # a call that STARTS while the flag is up is the one that fails (compiled.py's torch notes)
        if _fx_flag() and (s := stats.get(threading.current_thread().name)):
            s["exposed_calls"] += 1
        return compiled.compiled_flex(*args)

    @torch.no_grad()
    def one_call(x, *a):   # nogate: the compiled function called directly; x's shape tells the threads apart
        return fn(x, *a) if mode == "nogate" else gate.run("flex", x.device, x.shape, fn, x, *a)

    def worker(me, args):
        gate.configure_thread()   # dynamo's config is per thread (compiled.py's torch notes)
        barrier.wait()
        start, s = time.time(), stats[me]
        # until --seconds are up and every thread has made its first (compiling) call (or 10 more minutes)
        while time.time() < start + seconds or (len(called) < threads and time.time() < start + seconds + 600):
            try:
                one_call(*args)
                s["calls"] += 1
            except Exception as e:   # counted, and the thread carries on: how often does it happen?
                s["fx_errors" if FX_ERROR in str(e) else "other_errors"] += 1
                if len(samples) < 5:
                    samples.append(f"{me}: {type(e).__name__}: {str(e)[:300]}")
            called.add(me)
            time.sleep(0.001)   # the rest of a training step: threads that hammer starve the compiling one
        compiled.sync_device(dev)
        run_s = time.time() - start
        s.update(run_s=round(run_s, 3), calls_per_s=round(s["calls"] / run_s, 1))

    # Every rise of the FX flag, with its thread and stack: make_fx's tracer reaches Tracer.trace through super().
    events, trace = [], torch.fx.Tracer.trace

    @functools.wraps(trace)
    def recording_trace(tracer, *args, **kwargs):
        if not _fx_flag():   # up already: a nested trace, not a rise
            events.append((threading.current_thread().name, traceback.extract_stack()[:-1]))
        return trace(tracer, *args, **kwargs)
    torch.fx.Tracer.trace = recording_trace
    if mode == "warm":   # what warmup.py does: every shape, one at a time, before the threads start
        for args in inputs.values():
            one_call(*args)
        gate.mark_warm()
    workers = [threading.Thread(target=worker, args=(n, args), name=n) for n, args in inputs.items()]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    per, rates = list(stats.values()), [s["calls_per_s"] for s in stats.values()]
    return {"mode": mode, "exercise": "flex", "device": str(dev), "threads": threads, "seconds": seconds,
            "torch": torch.__version__, "torch_git": torch.version.git_version,
            "flex_fx_flag_thread_local": thread_local, "natural_race_expected": natural_race_expected(thread_local),
            **{k: sum(s[k] for s in per) for k in ("fx_errors", "other_errors", "exposed_calls")},
            "calls_per_s_per_thread": rates, "calls_per_s_total": round(sum(rates), 1),
            "per_thread": per, "error_samples": samples, "gate_stats": dict(gate.stats),
            "flag_raises": len(events), "flag_up_after_run": _fx_flag(), "raises": _group_raises(events)}

def run_child(**spec):
    print(f"[diagnose] mode {spec['mode']}: {spec['threads']} threads, flex on {spec['device']}, "
          f"{spec['seconds']:g} s, cold cache (compiles take a while)...", file=sys.stderr, flush=True)
    code = ("import json, sys, compile_race\n"
            "print(json.dumps(compile_race.run_exercise(**json.loads(sys.argv[1])), default=str))")
    with tempfile.TemporaryDirectory(prefix="dflash_diag_") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{tmp}/inductor", TRITON_CACHE_DIR=f"{tmp}/triton")
        try:
            r = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], cwd=HERE, env=env, capture_output=True,
                               text=True, timeout=spec["seconds"] + 1800)
        except subprocess.TimeoutExpired as e:
            return {"mode": spec["mode"], "failed": f"timed out after {e.timeout:g} s"}
    if r.returncode:
        return {"mode": spec["mode"], "failed": f"exit {r.returncode}: {r.stderr[-3000:]}"}
    return json.loads(r.stdout.splitlines()[-1])   # the child's last line: anything it logged comes before

def format_race_table(results):
    head = (f"{'mode':<7} {'FX err':>6} {'other':>5} {'exposed':>7}  {'calls per thread':<22} "
            f"{'calls/s per thread':<24} {'total/s':>8}")
    lines, ok = [head, "-" * len(head)], [r for r in results if not r.get("failed")]
    for r in results:
        col = lambda key: " / ".join(str(p[key]) for p in r["per_thread"])
        lines += [f"{r['mode']:<7} FAILED: {r['failed']}"] if r.get("failed") else [
            f"{r['mode']:<7} {r['fx_errors']:>6} {r['other_errors']:>5} {r['exposed_calls']:>7}  {col('calls'):<22} "
            f"{col('calls_per_s'):<24} {r['calls_per_s_total']:>8g}",
            *(f"        error: {s}" for s in r["error_samples"][:3])]
    for r in ok[:1]:   # what every mode shares
        lines += ["", f"torch {r['torch']} (git {str(r['torch_git'])[:12]}), {r['exercise']} on {r['device']}; "
                  f"natural race expected: {r['natural_race_expected']}",
                  "exposed = calls started while another thread held the FX flag up (the gate must show 0); "
                  "calls/s include the cold compiles and waits: raise --seconds for steady state"]
    for r in ok:     # who raised the FX flag, where, for whom
        stuck = "UP (stuck: every compiled call now fails or runs uncompiled)" if r["flag_up_after_run"] else "down"
        lines += ["", f"mode {r['mode']}: the FX flag rose {r['flag_raises']} times at {len(r['raises'])} sites; "
                  f"after the run it is {stuck}"]
        for gr in r["raises"]:
            threads = ", ".join(f"{t} ({n})" for t, n in sorted(gr["threads"].items()))
            lines.append(f"  {gr['count']}x in {threads}: traced at {gr['tracing_frame']}, for "
                         f"{gr['requested_by']}, called from {gr['user_frame']}")
    return "\n".join(lines)
