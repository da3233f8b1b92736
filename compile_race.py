"""The compile race, measured (python diagnose.py --race-test): threads call compiled flex attention on a cold cache,
each at its own shape, so each thread's first call compiles while the others call, in a child process per mode:
  nogate  the compiled function called directly
  gate    through compiled.GATE before the warm-up: every compiled call exclusive
Every rise of the FX-tracing flag is recorded with its thread and stack (Tracer.trace wrapped), grouped by site."""
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

from environment import HERE

FX_ERROR = "Detected that you are using FX to symbolically trace"
MODES = ("nogate", "gate")
TORCH_ROOT = os.path.dirname(os.path.dirname(torch.__file__)) + os.sep
# Frames between "who wants a graph" and Tracer.trace: fx itself, decorators, context managers (and the stdlib's).
PLUMBING = ("torch/fx/", "torch/_compile.py", "torch/_dynamo/eval_frame.py", "torch/utils/_contextlib.py", "/")

def natural_race_expected():   # compiled.py's torch notes
    version = tuple(int(x) for x in torch.__version__.split(".")[:2])
    return ("no: the FX-tracing flag is per thread" if version >= (2, 14) else
            "masked: torch 2.12/2.13 hide the FX flag from other threads while anything compiles; 0 errors here "
            "says nothing about torch 2.11" if version >= (2, 12) else
            "yes: a compile in one thread fails compiled calls in other threads (the compile gate keeps them apart)")

def fx_flag():   # read directly where it is a module global: is_fx_tracing() logs a warning
    flag = getattr(torch.fx._symbolic_trace, "_is_fx_tracing_flag", None)
    return flag if isinstance(flag, bool) else bool(torch.fx._symbolic_trace.is_fx_tracing())

def _sites(events):
    """Per site that raised the flag, most frequent first: the frame that traced, the innermost one outside the
    plumbing (who asked for the graph) and outside torch (whose call it was), torch's and this folder's paths cut."""
    groups = {}
    for thread, stack in events:
        frames = [next((f.filename[len(r):] for r in (TORCH_ROOT, HERE + os.sep) if f.filename.startswith(r)),
                       f.filename) + f":{f.lineno} in {f.name}" for f in reversed(stack)]   # innermost first
        key = (frames[0], next((f for f in frames if not f.startswith(PLUMBING)), None),
               next((f for f in frames if not f.startswith(("torch/", "/"))), None))
        groups.setdefault(key, Counter())[thread] += 1
    return sorted(({"count": sum(ts.values()), "threads": ts, "tracing_frame": k[0], "requested_by": k[1],
                    "user_frame": k[2]} for k, ts in groups.items()), key=lambda g: -g["count"])

def record_fx_rises():
    """From now on every rise of the FX tracing flag goes into the list returned: (thread name, stack)."""
    events, trace = [], torch.fx.Tracer.trace   # make_fx's tracer reaches Tracer.trace through super()

    @functools.wraps(trace)
    def recording_trace(tracer, *args, **kwargs):
        if not fx_flag():   # up already: a nested trace, not a rise
            events.append((threading.current_thread().name, traceback.extract_stack()[:-1]))
        return trace(tracer, *args, **kwargs)
    torch.fx.Tracer.trace = recording_trace
    return events

def run_exercise(mode, threads, seconds, device):
    """The threaded exercise in this process: meaningful only in a fresh one with a cold cache (run_child)."""
    import compiled
    from torch.nn.attention.flex_attention import create_block_mask
    gate, dev = compiled.GATE, torch.device(device)
    gate.set_recompile_limit(max(8, threads + 2))
    # the drafter's attention per thread (small on CPU: compiles dominate); eager create_block_mask: vmap, no FX flag
    B, H, D, L1, dtype = (1, 4, 64, 128, torch.float32) if dev.type == "cpu" else (1, 8, 128, 1024, torch.bfloat16)
    inputs = {f"worker-{i}-L{L}": (*(torch.randn(B, H, L, D, device=dev, dtype=dtype) for _ in range(3)),
                                   create_block_mask(lambda b, h, q, kv: q >= kv, B, None, L, L, device=dev))
              for i, L in enumerate(range(L1, L1 * (threads + 1), L1))}
    calls, errors, samples, called, barrier = Counter(), Counter(), [], set(), threading.Barrier(threads)

    @torch.no_grad()
    def one_call(x, *a):   # x's shape tells the threads apart
        f = compiled.compiled_attention
        return f(x, *a) if mode == "nogate" else gate.run("flex", x.device, x.shape, f, x, *a)

    def worker(me, args):
        gate.configure_thread()   # dynamo's config is per thread (compiled.py's torch notes)
        barrier.wait()
        start = time.time()
        # until --seconds are up and every thread has made its first (compiling) call (or 10 more minutes)
        while time.time() < start + seconds or (len(called) < threads and time.time() < start + seconds + 600):
            try:
                one_call(*args)
                calls[me] += 1
            except Exception as e:   # counted, and the thread carries on: how often does it happen?
                errors["fx_errors" if FX_ERROR in str(e) else "other_errors"] += 1
                if len(samples) < 5:
                    samples.append(f"{me}: {type(e).__name__}: {str(e)[:300]}")
            called.add(me)
            time.sleep(0.001)   # the rest of a training step: threads that hammer starve the compiling one
        compiled.sync_device(dev)

    events = record_fx_rises()
    t0, workers = time.time(), [threading.Thread(target=worker, args=item, name=item[0]) for item in inputs.items()]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return {"mode": mode, "device": str(dev), "threads": threads, "seconds": seconds, "torch": torch.__version__,
            "torch_git": torch.version.git_version, "natural_race_expected": natural_race_expected(),
            "calls": [calls[n] for n in inputs], "calls_per_s": round(sum(calls.values()) / (time.time() - t0), 1),
            "fx_errors": errors["fx_errors"], "other_errors": errors["other_errors"], "error_samples": samples,
            "flag_raises": len(events), "flag_up_after_run": fx_flag(), "sites": _sites(events)}

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
    lines = [f"{'mode':<7} {'FX err':>6} {'other':>5}  {'calls per thread':<22} {'calls/s':>8}", "-" * 53]
    for r in results:
        lines += [f"{r['mode']:<7} FAILED: {r['failed']}"] if r.get("failed") else [
            f"{r['mode']:<7} {r['fx_errors']:>6} {r['other_errors']:>5}  {' / '.join(map(str, r['calls'])):<22} "
            f"{r['calls_per_s']:>8g}", *(f"        error: {s}" for s in r["error_samples"][:3])]
    for i, r in enumerate(r for r in results if not r.get("failed")):
        if i == 0:   # what every mode shares
            lines += ["", f"torch {r['torch']} (git {str(r['torch_git'])[:12]}), flex on {r['device']}; natural race "
                      f"expected: {r['natural_race_expected']}; calls/s include the cold compiles and waits"]
        stuck = "UP (stuck: every compiled call now fails or runs uncompiled)" if r["flag_up_after_run"] else "down"
        lines += ["", f"mode {r['mode']}: the FX flag rose {r['flag_raises']} times at {len(r['sites'])} sites; "
                  f"after the run it is {stuck}"]
        lines += [f"  {g['count']}x in {', '.join(f'{t} ({n})' for t, n in sorted(g['threads'].items()))}: traced "
                  f"at {g['tracing_frame']}, for {g['requested_by']}, called from {g['user_frame']}"
                  for g in r["sites"]]
    return "\n".join(lines)
