"""What a DFlash training run runs on, what changed since a checkpoint, and the threaded compile race.

    python diagnose.py                            this machine's environment + the 15 newest packages
    python diagnose.py --against out/step_000690  what changed since that checkpoint's env.json
    python diagnose.py --race-test [--threads 3 --seconds 20 --modes nogate,gate,warm --exercise tiny]
        threads compiling at once, without and with the gate: errors, calls/s, who raises the FX flag
    --json prints one JSON object instead; --cache-dir describes another compile cache.

train_dflash.py writes collect_env() into every checkpoint (env.json) and format_report() at the top
of every log; warmup.py writes CACHE_INFO_FILE into the compile cache it fills.

The race: torch.fx keeps one process-wide "FX tracing" flag up while make_fx traces, which every
compile that misses the AOTAutograd cache does. A compiled call that another thread starts meanwhile
fails ("Detected that you are using FX to symbolically trace a dynamo-optimized function") or runs
uncompiled; torch 2.12/2.13 mask the flag while anything compiles, and 2.14 makes it per thread.
dflash_model.GATE keeps compiles exclusive; --race-test measures calls with and without it.
"""
import argparse
import datetime
import functools
import getpass
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE_INFO_FILE = "dflash_cache_info.json"   # which build filled the compile cache; warmup.py writes it
FX_ERROR = "Detected that you are using FX to symbolically trace"
# Recorded variables: these prefixes, and names outside them that change speed or numerics (TF32,
# cuBLAS workspace, stream count, a preloaded or differently found library, code on the import path).
ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_", "TORCHDYNAMO_", "TRITON_", "CUDA_VISIBLE_DEVICES", "NCCL_",
                "PYTORCH_", "OMP_NUM_THREADS", "CUDA_LAUNCH_BLOCKING", "HF_")
ENV_NAMES = {"LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "CUDA_DEVICE_MAX_CONNECTIONS", "NVIDIA_TF32_OVERRIDE",
             "CUBLAS_WORKSPACE_CONFIG", "CUDA_MODULE_LOADING", "MKL_NUM_THREADS"}
# env.json and the logs get shared: a credential (HF_TOKEN, ...) is recorded as set, never by value.
SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")
LIBRARIES = ("transformers", "datasets", "numpy", "safetensors")   # versions recorded besides torch and triton
NVIDIA_SMI_FIELDS = ("index", "name", "driver_version", "memory.total")
MODES = ("nogate", "gate", "warm")


# --- 1. The environment ----------------------------------------------------------------------------------
def collect_env(cache_dir=None):
    """Everything that decides whether a run reproduces: versions, GPUs, variables, compile cache, code.
    Never raises (a part that fails records its error: a fingerprint with a hole beats a crashed
    checkpoint) and starts no compile and no python: the trainer calls it at every start and save."""
    now = datetime.datetime.now().astimezone()
    env = {"time": now.isoformat(timespec="seconds"), "time_unix": now.timestamp()}
    parts = {"hostname": socket.gethostname, "platform": platform.platform, "cpu_count": os.cpu_count,
             # as is: a venv's python is a symlink to the base interpreter, and the venv is what runs
             "python_executable": lambda: sys.executable, "python_prefix": lambda: sys.prefix,
             "versions": _versions, "gpus": _gpus, "env_vars": _env_vars,
             "compile_cache": lambda: _cache_state(cache_dir), "project": _git_state,
             "packages": lambda: {n: v for n, v, _ in sorted(installed_packages(), key=lambda r: r[0].lower())}}
    for key, fn in parts.items():
        try:
            env[key] = fn()
        except Exception as e:
            env[key] = {"error": f"{type(e).__name__}: {e}"}
    env["natural_race_expected"] = natural_race_expected()
    return env


def _versions():
    def installed(*dists):   # the first found on sys.path, without importing it: "absent" is an answer
        return next((x.version for d in dists for x in importlib.metadata.distributions(name=d)), "absent")

    try:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception as e:   # a cuDNN that does not match torch raises here: that is the finding
        cudnn = f"error: {e}"
    return {"python": platform.python_version(), "torch": torch.__version__, "torch_git": torch.version.git_version,
            "cuda": torch.version.cuda, "cudnn": cudnn,
            "triton": installed("triton", "pytorch-triton", "pytorch-triton-rocm", "triton-xpu"),
            **{d: installed(d) for d in LIBRARIES}}


def _gpus():
    g = {"cuda_available": False, "count": 0, "names": [], "memory_gib": [], "capability": [], "driver": None,
         "nvidia_smi": []}
    try:   # a CUDA that fails to initialise raises here; nvidia-smi below may say why
        g["cuda_available"] = torch.cuda.is_available()
        g["count"] = torch.cuda.device_count() if g["cuda_available"] else 0
        for p in map(torch.cuda.get_device_properties, range(g["count"])):
            g["names"].append(p.name)
            g["memory_gib"].append(round(p.total_memory / 2**30, 1))
            g["capability"].append(f"{p.major}.{p.minor}")
    except Exception as e:
        g["error"] = f"{type(e).__name__}: {e}"
    if not shutil.which("nvidia-smi"):
        return g
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=" + ",".join(NVIDIA_SMI_FIELDS), "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    except Exception as e:
        return g | {"nvidia_smi": [f"error: {type(e).__name__}: {e}"]}
    lines = [line.strip() for line in r.stdout.splitlines() if line.strip()]
    if r.returncode == 0 and lines and all(line.count(",") == len(NVIDIA_SMI_FIELDS) - 1 for line in lines):
        return g | {"nvidia_smi": lines, "driver": lines[0].split(",")[2].strip()}
    # nvidia-smi's own message (driver/library mismatch, no device) is the diagnosis: kept, truncated
    first = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[0][:200]
    why = f"exit {r.returncode}" if r.returncode else "unexpected output"
    return g | {"nvidia_smi": [f"error: {why}: {first}"]}


def _env_vars():
    env = {k: ("<set>" if any(m in k.upper() for m in SECRET_MARKERS) else v)
           for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}
    # importing torch._dynamo exports inductor's default cache dir into this variable: nobody chose it
    if os.path.abspath(env.get("TORCHINDUCTOR_CACHE_DIR", "-")) == _default_cache_dir():
        del env["TORCHINDUCTOR_CACHE_DIR"]
    return env


def _default_cache_dir():
    # inductor's rule, without importing inductor (seconds, and it exports the variable)
    try:
        user = getpass.getuser()
    except Exception:   # a container's uid without a passwd entry
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def _cache_state(cache_dir=None):
    path, source = cache_dir, "argument"
    if not cache_dir:
        chosen = _env_vars().get("TORCHINDUCTOR_CACHE_DIR")   # as recorded: inductor's own export is no choice
        path, source = (chosen, "TORCHINDUCTOR_CACHE_DIR") if chosen else (_default_cache_dir(), "inductor default")
    c = {"path": os.path.abspath(path), "source": source, "exists": os.path.isdir(path), "info": None}
    sizes, mtimes = [], []
    for root, _, files in os.walk(c["path"]):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue   # inductor renames and removes files while we walk
            sizes.append(st.st_size)
            if not name.endswith(".lock"):   # some filelock versions truncate a lock file (new mtime) at each lock
                mtimes.append(st.st_mtime)
    c.update(size_bytes=sum(sizes), file_count=len(sizes), oldest_mtime=min(mtimes, default=None),
             newest_mtime=max(mtimes, default=None))
    if os.path.isfile(info := os.path.join(c["path"], CACHE_INFO_FILE)):
        try:
            with open(info) as f:
                c["info"] = json.load(f)
        except Exception as e:
            c["info"] = {"error": f"unreadable {CACHE_INFO_FILE}: {e}"}
    return c


def _git_state(path=HERE):
    """Commit, dirty files, a hash of the uncommitted diff, untracked names. A git command that fails
    leaves its fields None and says why in "error": a failure must not read as a clean tree."""
    g = {"dir": path, "commit": None, "dirty": None, "dirty_files": [], "diff_sha256": None,
         "untracked_files": None, "untracked_count": None}
    errors = []

    def git(*args):   # stdout as bytes (the diff is hashed as it is); None, and the reason in errors, on failure
        try:
            return subprocess.run(["git", "-C", path, *args], capture_output=True, timeout=30, check=True).stdout
        except subprocess.CalledProcessError as e:
            why = e.stderr.decode(errors="replace").strip().splitlines() or [f"exit {e.returncode}"]
            errors.append(f"git {args[0]}: {why[0][:200]}")
        except Exception as e:   # no git, or it hangs
            errors.append(f"git {args[0]}: {type(e).__name__}: {e}")

    if (head := git("rev-parse", "HEAD")) is not None:
        g["commit"] = head.decode().strip()
        if (status := git("status", "--porcelain", "--untracked-files=no")) is not None:
            files = [line[3:] for line in status.decode(errors="replace").splitlines() if line.strip()]
            g["dirty"], g["dirty_files"] = bool(files), files[:20]
        # names alone miss a further edit of a file that is already dirty: hash the diff itself (binary
        # too; no external diff or textconv, which a user's git config can switch on)
        if (diff := git("diff", "HEAD", "--binary", "--no-ext-diff", "--no-textconv", "--no-color")) is not None:
            g["diff_sha256"] = hashlib.sha256(diff).hexdigest()
        # untracked and not ignored: a new module the code may import (out/ and logs are ignored)
        if (others := git("ls-files", "--others", "--exclude-standard")) is not None:
            names = sorted(line for line in others.decode(errors="replace").splitlines() if line.strip())
            g["untracked_files"], g["untracked_count"] = names[:50], len(names)
    if errors:
        g["error"] = "; ".join(errors)
    return g


def installed_packages():
    """[(name, version, mtime of its dist-info folder, which pip creates at each install)], newest first."""
    rows, seen = [], set()
    for d in importlib.metadata.distributions():
        name, path = d.metadata["Name"], d._path
        if not name or name.lower() in seen:
            continue   # shadowed by the same package earlier on sys.path, which is the one in use
        if f"{os.sep}_vendor{os.sep}" in str(path):
            continue   # bundled inside another package (setuptools' _vendor joins sys.path once imported)
        seen.add(name.lower())
        rows.append((name, d.version, os.path.getmtime(path)))
    return sorted(rows, key=lambda r: -r[2])


def natural_race_expected(fx_flag_thread_local=None):
    # does the cold-cache compile race show by itself? By the thread probe where it ran, else by version
    version = tuple(int(x) for x in torch.__version__.split(".")[:2])
    if fx_flag_thread_local or (fx_flag_thread_local is None and version >= (2, 14)):
        return "no: the FX-tracing flag is per thread"
    if (2, 12) <= version < (2, 14):
        return ("masked: torch 2.12/2.13 hide the FX flag from other threads while anything compiles; "
                "0 errors here says nothing about torch 2.11")
    return "yes: a compile in one thread makes compiled calls in other threads fail"


# --- 2. What changed, and the report -------------------------------------------------------------------
# Fields that change on every call or grow in any healthy run, and the trainer's own note
# changed_during_run (shown apart): a row for them says nothing.
IGNORED = {"time", "time_unix", "changed_during_run", "compile_cache.size_bytes", "compile_cache.file_count",
           "compile_cache.oldest_mtime", "compile_cache.newest_mtime"}
MISSING = "(missing)"
# warmup.use_compile_cache() sets these in the trainer's process from the cache path, which is compared
# on its own: in a checkpoint's env.json and not in a shell is no change.
TRAINER_SET_VARS = {"env_vars.TORCHINDUCTOR_CACHE_DIR", "env_vars.TRITON_CACHE_DIR"}
# It only defaults these: absent on one side and the default on the other is no change, while a user's
# own value (the FX graph or autograd cache off) takes effect and is one.
TRAINER_DEFAULT_VARS = {"env_vars.TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "env_vars.TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


def diff_env(old, new):
    """[(dotted field, old value, new value)] for every field that differs, sorted by field."""
    # a JSON round trip makes tuples lists and keys strings on both sides, as in env.json
    old, new = json.loads(json.dumps(old, default=str)), json.loads(json.dumps(new, default=str))
    fo, fn = _flatten(old), _flatten(new)
    same_cache = fo.get("compile_cache.path") == fn.get("compile_cache.path")
    rows = []
    for k in sorted(fo | fn):
        a, b = fo.get(k, MISSING), fn.get(k, MISSING)
        if a == b or k in IGNORED or (k in TRAINER_SET_VARS and same_cache):
            continue
        if k in TRAINER_DEFAULT_VARS and {a, b} == {MISSING, TRAINER_DEFAULT_VARS[k]}:
            continue
        if None in (a, b) and MISSING in (a, b) and any(x.startswith(k + ".") for x in fo | fn):
            continue   # None on one side, a dict on the other (the cache info appeared): its keys say it
        rows.append((k, a, b))
    # A healthy cache only gains files: an oldest file newer than the checkpoint's says it was rebuilt (cold
    # compiles again: the race window), fewer files that some were removed.
    oc, nc = old.get("compile_cache") or {}, new.get("compile_cache") or {}
    if same_cache and oc.get("exists") and nc.get("exists") and oc.get("oldest_mtime"):
        if (nc.get("oldest_mtime") or 0) > oc["oldest_mtime"]:
            rows.append(("compile_cache.rebuilt", "no", f"yes: oldest file from {_fmt_time(nc['oldest_mtime'])}, "
                         f"at the checkpoint from {_fmt_time(oc['oldest_mtime'])}"))
        elif (nc.get("file_count") or 0) < (oc.get("file_count") or 0):
            rows.append(("compile_cache.shrank", f"{oc['file_count']} files",
                         f"{nc.get('file_count')} files (some removed)"))
    return rows


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():   # an empty dict leaves no key: {} and absent are the same state
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _fmt_time(t):
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def format_report(env):
    v, g, c, p = (env.get(k) or {} for k in ("versions", "gpus", "compile_cache", "project"))
    lines = [f"DFlash environment  {env.get('time')}  host {env.get('hostname')}  ({env.get('platform')}, "
             f"{env.get('cpu_count')} CPUs)",
             f"  python {v.get('python')}  {env.get('python_executable')}  (prefix {env.get('python_prefix')})",
             f"  torch {v.get('torch')}  git {str(v.get('torch_git'))[:12]}  CUDA {v.get('cuda')}  "
             f"cuDNN {v.get('cudnn')}",
             "  " + "  ".join(f"{k} {v.get(k)}" for k in ("triton", *LIBRARIES))]
    if g.get("count"):
        kinds = Counter(zip(g["names"], g["memory_gib"], g["capability"]))
        lines.append("  GPUs: " + ", ".join(f"{n} x {name} ({mem} GiB, capability {cap})"
                                            for (name, mem, cap), n in kinds.items()) + f", driver {g['driver']}")
    else:
        lines.append(f"  GPUs: none visible to torch (CUDA available: {g.get('cuda_available')})"
                     + (f"; nvidia-smi: {g['nvidia_smi']}" if g.get("nvidia_smi") else ""))
    if p.get("dirty"):
        dirty = f"DIRTY: {', '.join(p['dirty_files'])} (diff sha256 {str(p.get('diff_sha256'))[:12]})"
    else:
        dirty = "dirty: unknown" if p.get("dirty") is None else "clean"
    lines.append(f"  project {p.get('dir')}  commit {p.get('commit')}  {dirty}")
    if p.get("error"):
        lines.append(f"    git error: {p['error']}")
    if p.get("untracked_count"):
        lines.append(f"    {p['untracked_count']} untracked: {', '.join(p['untracked_files'])}")
    lines.append(f"  compile cache {c.get('path')} ({c.get('source')}): " + (
        f"{c.get('size_bytes', 0) / 2**20:,.1f} MiB in {c.get('file_count')} files, oldest "
        f"{_fmt_time(c.get('oldest_mtime'))}, newest {_fmt_time(c.get('newest_mtime'))}" if c.get("exists")
        else "does not exist -> every shape compiles cold"))
    if info := c.get("info"):
        lines.append(f"    filled by ({CACHE_INFO_FILE}): {json.dumps(info, sort_keys=True)[:400]}")
        other = [f"{k} {info[k]} (now {v[k]})" for k in ("torch", "torch_git", "triton", "cuda")
                 if k in info and k in v and str(info[k]) != str(v[k])]
        lines += [f"    WARNING: filled by another build ({'; '.join(other)}): its entries will miss"] if other else []
    elif c.get("exists"):
        lines.append(f"    no {CACHE_INFO_FILE}: unknown which build filled it")
    if "flex_fx_flag_thread_local" in env:   # the thread probe: only the command line runs it
        flag = {None: "unknown (not seen even by the tracing thread)", True: "per thread",
                False: "PROCESS-GLOBAL (a compile in one thread is seen by all)"}[env["flex_fx_flag_thread_local"]]
        lines.append(f"  FX-tracing flag: {flag}")
    variables = "  ".join(f"{k}={x}" for k, x in (env.get("env_vars") or {}).items())
    lines += [f"  natural compile race expected: {env.get('natural_race_expected')}",
              f"  env: {variables or '(none of the recorded variables)'}"]
    return "\n".join(lines)


def format_packages(rows, title):
    return "\n".join([title] + ([f"  {_fmt_time(t)}  {n} {ver}" for n, ver, t in rows] or ["  (none)"]))


def load_checkpoint_env(folder):
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    if not os.path.isfile(path := os.path.join(folder, "env.json")):
        raise FileNotFoundError(f"{folder} has no env.json (not a checkpoint folder written by train_dflash.py)")
    with open(path) as f:
        return json.load(f)


# --- 3. The thread probe and the FX-flag recorder. Both raise the FX flag for real, so they run only where
# no other thread runs compiled code: the command line, the exercise's child.
def _fx_flag():
    # this thread's view; read directly where it is a module global: is_fx_tracing() logs a warning
    flag = getattr(torch.fx._symbolic_trace, "_is_fx_tracing_flag", None)
    return flag if isinstance(flag, bool) else bool(torch.fx._symbolic_trace.is_fx_tracing())


def _fx_flag_thread_local():
    """Is the FX flag per thread? Measured by behaviour: another thread reads it while this one traces."""
    seen = []

    def traced(x):
        with ThreadPoolExecutor(1) as other:
            seen.append((_fx_flag(), other.submit(_fx_flag).result()))
        return x + 1
    torch.fx.symbolic_trace(traced)
    here, there = seen[0]
    return (not there) if here else None   # None: not up even where the trace runs, so "there" says nothing


def record_fx_raises():
    """A list that from now on gets (thread, stack) at every rise of the FX flag in this process. Tracer.trace
    raises it, and make_fx's tracer reaches it through super() at call time: patching the class catches all."""
    events, orig = [], torch.fx.Tracer.trace

    @functools.wraps(orig)
    def trace(tracer, *args, **kwargs):
        if not _fx_flag():   # up already: a nested trace, not a rise
            events.append((threading.current_thread().name, traceback.extract_stack()[:-1]))
        return orig(tracer, *args, **kwargs)
    torch.fx.Tracer.trace = trace
    return events


# Frames between "who wants a graph" and Tracer.trace: fx itself, decorators and context managers.
PLUMBING = ("torch/fx/", "torch/_compile.py", "torch/_dynamo/eval_frame.py", "torch/utils/_contextlib.py", "<stdlib>/")
FRAME_ROOTS = [(os.path.dirname(os.path.dirname(torch.__file__)) + os.sep, ""), (HERE + os.sep, ""),
               (os.path.dirname(os.__file__) + os.sep, "<stdlib>/")]


def _group_raises(events):
    """One dict per distinct site that raised the flag, most frequent first: the threads, the tracing
    frame, who asked for the graph, and the innermost frame outside torch."""
    groups = {}
    for thread, stack in events:
        frames = []
        for f in stack[::-1]:     # innermost first, without the site-packages, project or stdlib folder
            root, label = next(((r, lab) for r, lab in FRAME_ROOTS if f.filename.startswith(r)), ("", ""))
            frames.append(f"{label}{f.filename[len(root):]}:{f.lineno} in {f.name}")
        key = (frames[0], next((f for f in frames if not f.startswith(PLUMBING)), None),
               next((f for f in frames if not f.startswith(("torch/", "<stdlib>"))), None))
        gr = groups.setdefault(key, {"count": 0, "threads": Counter(), "tracing_frame": key[0],
                                     "requested_by": key[1], "user_frame": key[2]})
        gr["count"] += 1
        gr["threads"][thread] += 1
    return sorted(groups.values(), key=lambda gr: -gr["count"])


# --- 4. The threaded exercise, in a child process with an empty compile cache. Every thread calls one
# compiled function at its own shape, so each thread's first call compiles while the others call.
#   nogate  the compiled function called directly (GATE.enabled = False)
#   gate    through dflash_model.GATE before warm-up: every compiled call exclusive
#   warm    every shape compiled serially first, then GATE.mark_warm(): shared calls, no compiles
def _exercise_inputs(kind, dev, n):
    """Per thread: (label, args). flex: the drafter's attention; tiny: a pointwise function."""
    from torch.nn.attention.flex_attention import create_block_mask
    if kind == "tiny":
        return [(f"n{64 * i}", (torch.randn(64 * i, device=dev),)) for i in range(1, n + 1)]
    # flex works on 128 x 128 tiles; small shapes on CPU, where the compile dominates anyway
    B, H, D, L1 = (1, 4, 64, 128) if dev.type == "cpu" else (1, 8, 128, 1024)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    out = []
    for L in range(L1, L1 * (n + 1), L1):
        q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=dtype) for _ in range(3))
        # eager create_block_mask uses vmap, never make_fx: it does not raise the FX flag
        bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, B, None, L, L, device=dev)
        out.append((f"L{L}", (q, k, v, bm)))
    return out


def run_exercise(kind="flex", mode="nogate", threads=3, seconds=20.0, device="cpu"):
    """The threaded exercise in this process: meaningful only in a fresh one with a cold cache (_run_child)."""
    import compiled   # the child runs this file as a script: its folder is on sys.path
    thread_local = _fx_flag_thread_local()   # no other thread yet: safe
    gate, dev = compiled.GATE, torch.device(device)
    gate.set_recompile_limit(max(8, threads + 2))
    inputs = {f"worker-{i}-{label}": args for i, (label, args) in enumerate(_exercise_inputs(kind, dev, threads))}
    stats = {n: dict(name=n, shape=list(args[0].shape), calls=0, fx_errors=0, other_errors=0, exposed_calls=0)
             for n, args in inputs.items()}
    samples, called = [], set()

    def exposed(fn):   # a call that STARTS while the flag is up is the one that fails on torch 2.11
        def call(*args):
            if _fx_flag() and (s := stats.get(threading.current_thread().name)):
                s["exposed_calls"] += 1
            return fn(*args)
        return call
    if kind == "flex":
        fn, name = exposed(compiled.compiled_flex), "flex"
    else:
        fn, name = exposed(torch.compile(lambda x: torch.sin(x) * 2 + torch.cos(x), dynamic=False, fullgraph=True)), "tiny"
    # nogate: the compiled function called directly
    one_call = fn if mode == "nogate" else lambda x, *a: gate.run(name, x.device, tuple(x.shape) + tuple(
        a[0].shape if a else ()), fn, x, *a)
    barrier = threading.Barrier(threads)

    @torch.no_grad()
    def worker(me, args):
        gate.configure_thread()   # dynamo config is per thread on torch >= 2.12
        barrier.wait()
        start = time.time()
        # until --seconds are up and every thread has made its first (compiling) call: the others'
        # compiles are the windows (a thread starved for 10 more minutes gives up)
        while time.time() < start + seconds or (len(called) < threads and time.time() < start + seconds + 600):
            try:
                one_call(*args)
                stats[me]["calls"] += 1
            except Exception as e:   # counted, and the thread carries on: how often does it happen?
                stats[me]["fx_errors" if FX_ERROR in str(e) else "other_errors"] += 1
                if len(samples) < 5:
                    samples.append(f"{me}: {type(e).__name__}: {str(e)[:300]}")
            called.add(me)
            time.sleep(0.001)   # the rest of a training step: threads that hammer starve the compiling one
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        run_s = time.time() - start
        stats[me].update(run_s=round(run_s, 3), calls_per_s=round(stats[me]["calls"] / run_s, 1))

    events = record_fx_raises()
    if mode == "warm":   # what warmup.py does: every shape, one at a time, before the threads start
        with torch.no_grad():
            for args in inputs.values():
                one_call(*args)
        gate.mark_warm()
    workers = [threading.Thread(target=worker, args=(n, args), name=n) for n, args in inputs.items()]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return {"mode": mode, "exercise": kind, "device": str(dev), "threads": threads, "seconds": seconds,
            "torch": torch.__version__, "torch_git": torch.version.git_version,
            "flex_fx_flag_thread_local": thread_local, "natural_race_expected": natural_race_expected(thread_local),
            **{k: sum(s[k] for s in stats.values()) for k in ("fx_errors", "other_errors", "exposed_calls")},
            "calls_per_s_per_thread": [s["calls_per_s"] for s in stats.values()],
            "calls_per_s_total": round(sum(s["calls_per_s"] for s in stats.values()), 1),
            "per_thread": list(stats.values()), "error_samples": samples, "gate_stats": dict(gate.stats),
            "flag_raises": len(events), "flag_up_after_run": _fx_flag(), "raises": _group_raises(events)}


# --- 5. Command line. --race-test runs one child process per mode, each with an empty compile cache.
def _run_child(spec):
    print(f"[diagnose] mode {spec['mode']}: {spec['threads']} threads, {spec['kind']} on {spec['device']}, "
          f"{spec['seconds']:g} s, cold cache (compiles take a while)...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="dflash_diag_") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
        cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=spec["seconds"] + 1800)
        except subprocess.TimeoutExpired as e:
            return {"mode": spec["mode"], "failed": f"timed out after {e.timeout:g} s"}
    if r.returncode:
        return {"mode": spec["mode"], "failed": f"exit {r.returncode}: {r.stderr[-3000:]}"}
    return json.loads(r.stdout.splitlines()[-1])   # the child's last line: anything it logged comes before


def format_race_table(results):
    head = (f"{'mode':<7} {'FX err':>6} {'other':>5} {'exposed':>7}  {'calls per thread':<22} "
            f"{'calls/s per thread':<24} {'total/s':>8}")
    lines = [head, "-" * len(head)]
    ok = [r for r in results if not r.get("failed")]
    for r in results:
        if r.get("failed"):
            lines.append(f"{r['mode']:<7} FAILED: {r['failed']}")
            continue
        col = lambda key: " / ".join(str(p[key]) for p in r["per_thread"])
        lines.append(f"{r['mode']:<7} {r['fx_errors']:>6} {r['other_errors']:>5} {r['exposed_calls']:>7}  "
                     f"{col('calls'):<22} {col('calls_per_s'):<24} {r['calls_per_s_total']:>8g}")
        lines += [f"        error: {s}" for s in r["error_samples"][:3]]
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


def _against(folder, cache_dir):
    """(JSON object, text) of what changed since the checkpoint in folder."""
    old = load_checkpoint_env(folder)
    # the cache that run used, unless another one is named
    diffs = diff_env(old, collect_env(cache_dir or (old.get("compile_cache") or {}).get("path")))
    during, t_old = old.get("changed_during_run") or [], old["time_unix"]
    newer = [r for r in installed_packages() if r[2] > t_old]
    show, w = functools.partial(json.dumps, default=str), max([len(k) for k, _, _ in diffs] + [10])
    text = [f"Changes since {folder} (its env.json: the environment of the run that wrote it, recorded "
            f"{old.get('time')} on {old.get('hostname')}):"]
    text += [f"  {k:<{w}}  {show(o)}  ->  {show(n)}" for k, o, n in diffs] or ["  no field differs"]
    if during:   # the run kept what it loaded at its start: the left side above
        text.append(f"While that run was going, {len(during)} field(s) changed (the run kept the first value):")
        text += [f"  {k}  {show(o)}  ->  {show(n)}" for k, o, n in during]
    text.append(format_packages(newer, f"Packages installed or modified after the checkpoint ({len(newer)}):"))
    return ({"checkpoint": folder, "checkpoint_time": old.get("time"), "changed_during_run": during,
             "differences": [{"field": k, "old": o, "new": n} for k, o, n in diffs],
             "packages_after": [{"name": n, "version": v, "mtime": t} for n, v, t in newer]}, "\n".join(text))


def main(argv=None):
    ap = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", metavar="CHECKPOINT", help="checkpoint folder with env.json: what changed since")
    ap.add_argument("--race-test", action="store_true", help="threaded cold-cache compile race, without and with gate")
    ap.add_argument("--threads", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0, help="per mode")
    ap.add_argument("--modes", default="nogate,gate", help="comma list of nogate,gate,warm")
    ap.add_argument("--exercise", choices=("flex", "tiny"), default="flex", help="tiny: a pointwise function (quick)")
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu", help="default: %(default)s")
    ap.add_argument("--cache-dir", help="compile cache to describe (default: the checkpoint's, or the current one)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--child", help=argparse.SUPPRESS)   # one --race-test mode, in the process _run_child starts
    a = ap.parse_args(argv)
    emit = lambda obj, text: print(json.dumps(obj, indent=1, default=str) if a.json else text)
    if a.child:
        print(json.dumps(run_exercise(**json.loads(a.child)), default=str))
        return 0
    if a.race_test:
        if bad := set(a.modes.split(",")) - set(MODES):
            ap.error(f"unknown mode(s) {sorted(bad)}: use {', '.join(MODES)}")
        results = [_run_child(dict(kind=a.exercise, mode=m, threads=a.threads, seconds=a.seconds, device=a.device))
                   for m in a.modes.split(",")]
        emit({"command": "race-test", "device": a.device, "modes": results}, format_race_table(results))
        return 1 if any(r.get("failed") for r in results) else 0
    if a.against:
        try:
            obj, text = _against(a.against, a.cache_dir)
        except (OSError, ValueError) as e:   # no such folder, no env.json, or not JSON
            if a.json:
                print(json.dumps({"error": str(e)}))
            print(f"error: {e}", file=sys.stderr)
            return 2
        emit(obj, text)
        return 0
    env = collect_env(a.cache_dir)
    env["flex_fx_flag_thread_local"] = _fx_flag_thread_local()   # this process runs no other thread: safe here
    env["natural_race_expected"] = natural_race_expected(env["flex_fx_flag_thread_local"])
    recent = installed_packages()[:15]
    emit({"env": env, "recent_packages": [{"name": n, "version": v, "mtime": t} for n, v, t in recent]},
         format_report(env) + "\n" + format_packages(recent, "15 most recently installed/modified packages:"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
