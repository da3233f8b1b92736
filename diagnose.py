"""What a DFlash training run runs on, what changed since a checkpoint, and the threaded compile race.

    python diagnose.py                               this machine's environment + the 15 newest packages
    python diagnose.py --against out/step_000690     what changed since that checkpoint's env.json
    python diagnose.py --race-test [--threads 3 --seconds 20 --modes nogate,gate,warm --exercise tiny]
                                                     threads compiling flex at once, without and with the
                                                     gate: errors, calls/s, and who raises the FX flag
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
import contextlib
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
from pathlib import Path

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
SECRET_VALUE = "<set>"
NVIDIA_SMI_FIELDS = ("index", "name", "driver_version", "memory.total")
# Packages people overwrite in place (a copied build, a patched torch/__init__.py) without touching
# their dist-info: the newest of their top-level files counts as an install too.
PACKAGE_DIRS = {"torch": "torch", "triton": "triton", "pytorch-triton": "triton", "transformers": "transformers"}
MODES = ("nogate", "gate", "warm")

# -----------------------------------------------------------------------------
# 1. The environment


def collect_env(cache_dir=None):
    """Everything that decides whether a run reproduces: versions, GPUs, variables, compile cache, code.
    Never raises (a part that fails records its error: a fingerprint with a hole beats a crashed
    checkpoint) and starts no compile and no python: the trainer calls it at every start and save."""
    now = time.time()
    env = {"time": datetime.datetime.fromtimestamp(now).astimezone().isoformat(timespec="seconds"), "time_unix": now}
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
    env["natural_race_expected"] = natural_race_expected(torch.__version__)
    return env


def _version(*dists):
    # from the installed metadata, without importing the package: "absent" is an answer, not a crash
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            pass
        except Exception as e:
            return f"error: {e}"
    return "absent"


def _versions():
    try:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception as e:   # a cuDNN that does not match torch raises here: that is the finding
        cudnn = f"error: {e}"
    v = {"python": platform.python_version(), "torch": torch.__version__,
         "torch_git": getattr(torch.version, "git_version", None), "cuda": torch.version.cuda, "cudnn": cudnn,
         "triton": _version("triton", "pytorch-triton", "pytorch-triton-rocm", "triton-xpu")}
    return v | {d: _version(d) for d in ("transformers", "datasets", "numpy", "safetensors")}


def _gpus():
    g = {"cuda_available": False, "count": 0, "names": [], "memory_gib": [], "capability": [], "driver": None,
         "nvidia_smi": []}
    try:
        g["cuda_available"] = torch.cuda.is_available()
        g["count"] = torch.cuda.device_count() if g["cuda_available"] else 0
        for p in map(torch.cuda.get_device_properties, range(g["count"])):
            g["names"].append(p.name)
            g["memory_gib"].append(round(p.total_memory / 2**30, 1))
            g["capability"].append(f"{p.major}.{p.minor}")
    except Exception as e:
        g["error"] = f"{type(e).__name__}: {e}"
    return g | (_nvidia_smi() if shutil.which("nvidia-smi") else {})


def _nvidia_smi():
    """GPU lines and driver. When nvidia-smi fails, its own message (driver/library mismatch, no
    device) is the diagnosis: kept, truncated, rather than a parse error."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=" + ",".join(NVIDIA_SMI_FIELDS), "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    except Exception as e:
        return {"nvidia_smi": [f"error: {type(e).__name__}: {e}"]}
    lines = [l.strip() for l in r.stdout.splitlines() if l.strip()]
    fields = [[x.strip() for x in l.split(",")] for l in lines]
    if r.returncode == 0 and lines and all(len(f) == len(NVIDIA_SMI_FIELDS) for f in fields):
        return {"nvidia_smi": lines, "driver": fields[0][2]}
    first = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[0][:200]
    why = f"exit {r.returncode}" if r.returncode else "unexpected output"
    return {"nvidia_smi": [f"error: {why}: {first}"]}


def _env_vars():
    env = {k: (SECRET_VALUE if any(m in k.upper() for m in SECRET_MARKERS) else v)
           for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}
    # importing torch._dynamo exports inductor's default cache dir into this variable: nobody chose it
    if os.path.abspath(env.get("TORCHINDUCTOR_CACHE_DIR", "-")) == _default_cache_dir():
        del env["TORCHINDUCTOR_CACHE_DIR"]
    return env


def _default_cache_dir():
    # inductor's rule, without importing inductor (seconds) or calling its cache_dir(), which creates
    # the folder and exports the variable
    try:
        user = getpass.getuser()
    except Exception:
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def _cache_state(cache_dir=None):
    """Where the compile cache is, how big and how old, and which build filled it."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache_dir:
        path, source = cache_dir, "argument"
    elif chosen and os.path.abspath(chosen) != _default_cache_dir():
        path, source = chosen, "TORCHINDUCTOR_CACHE_DIR"
    else:
        path, source = _default_cache_dir(), "inductor default"
    c = {"path": os.path.abspath(path), "source": source, "exists": os.path.isdir(path), "size_bytes": 0,
         "file_count": 0, "oldest_mtime": None, "newest_mtime": None, "info": None}
    for root, _, files in os.walk(c["path"]):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue   # inductor renames and removes files while we walk
            c["size_bytes"] += st.st_size
            c["file_count"] += 1
            if not name.endswith(".lock"):   # some filelock versions truncate a lock file (new mtime) at each lock
                c["oldest_mtime"] = min(c["oldest_mtime"] or st.st_mtime, st.st_mtime)
                c["newest_mtime"] = max(c["newest_mtime"] or st.st_mtime, st.st_mtime)
    info = os.path.join(c["path"], CACHE_INFO_FILE)
    if os.path.isfile(info):
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

    def git(*args, text=True):
        try:
            r = subprocess.run(["git", "-C", path, *args], capture_output=True, text=text, timeout=30)
        except Exception as e:
            errors.append(f"git {args[0]}: {type(e).__name__}: {e}")
            return None
        if r.returncode:
            err = r.stderr if text else r.stderr.decode(errors="replace")
            errors.append(f"git {args[0]}: " + (err.strip().splitlines() or [f"exit {r.returncode}"])[0][:200])
            return None
        return r.stdout

    head = git("rev-parse", "HEAD")
    if head is not None:
        g["commit"] = head.strip()
        if (status := git("status", "--porcelain", "--untracked-files=no")) is not None:
            files = [l[3:] for l in status.splitlines() if l.strip()]
            g["dirty"], g["dirty_files"] = bool(files), files[:20]
        # names alone miss a further edit of a file that is already dirty: hash the diff itself (binary
        # too; no external diff or textconv, which a user's git config can switch on)
        diff = git("diff", "HEAD", "--binary", "--no-ext-diff", "--no-textconv", "--no-color", text=False)
        if diff is not None:
            g["diff_sha256"] = hashlib.sha256(diff).hexdigest()
        # untracked and not ignored: a new module the code may import (out/ and logs are ignored)
        if (others := git("ls-files", "--others", "--exclude-standard")) is not None:
            names = sorted(l for l in others.splitlines() if l.strip())
            g["untracked_files"], g["untracked_count"] = names[:50], len(names)
    if errors:
        g["error"] = "; ".join(errors)
    return g


def installed_packages():
    """[(name, version, mtime)] of every installed distribution, newest first. mtime is that of the
    dist-info folder, which pip creates at each install; for PACKAGE_DIRS also of their top-level files."""
    rows, seen = [], set()
    for d in importlib.metadata.distributions():
        try:
            name, path = d.metadata["Name"], getattr(d, "_path", None)
        except Exception:   # unreadable metadata: not a package anyone can import by it
            continue
        if not name or name.lower() in seen:
            continue   # shadowed by the same package earlier on sys.path, which is the one in use
        if path is not None and "_vendor" in Path(path).parts:
            continue   # bundled inside another package (setuptools' _vendor joins sys.path once imported)
        seen.add(name.lower())
        try:
            mtime = os.path.getmtime(path) if path is not None else 0.0
        except OSError:
            mtime = 0.0
        if path is not None and name.lower() in PACKAGE_DIRS:
            mtime = max(mtime, _newest_file_mtime(Path(path).parent / PACKAGE_DIRS[name.lower()]))
        rows.append((name, d.version, mtime))
    return sorted(rows, key=lambda r: -r[2])


def _newest_file_mtime(folder):
    # files only, no .pyc: any import writes those, and a folder's mtime moves with its __pycache__
    try:
        return max((e.stat(follow_symlinks=False).st_mtime for e in os.scandir(folder)
                    if e.is_file(follow_symlinks=False) and not e.name.endswith(".pyc")), default=0.0)
    except OSError:
        return 0.0   # no such folder (a namespace or renamed package): the dist-info alone decides


def natural_race_expected(torch_version, fx_flag_thread_local=None):
    """Does the cold-cache compile race show by itself on this build? By the thread probe's measurement
    where there is one, else by version."""
    try:
        major, minor = (int(x) for x in torch_version.split("+")[0].split(".")[:2])
    except ValueError:
        return "unknown torch version"
    if fx_flag_thread_local or (fx_flag_thread_local is None and (major, minor) >= (2, 14)):
        return "no: the FX-tracing flag is per thread (torch >= 2.14)"
    if (major, minor) >= (2, 14):
        return "yes: the FX-tracing flag measured process-global on this build, although torch >= 2.14"
    if (major, minor) >= (2, 12):
        return ("masked: torch 2.12/2.13 keep a process-global 'is compiling' flag up during a compile, "
                "which hides the FX flag from other threads; 0 errors here says nothing about torch 2.11")
    return "yes: a compile in one thread makes compiled calls in other threads fail (torch <= 2.11)"

# -----------------------------------------------------------------------------
# 2. What changed, and the report

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
    for k in sorted(set(fo) | set(fn)):
        a, b = fo.get(k, MISSING), fn.get(k, MISSING)
        if a == b or k in IGNORED or (k in TRAINER_SET_VARS and same_cache):
            continue
        if k in TRAINER_DEFAULT_VARS and {a, b} == {MISSING, TRAINER_DEFAULT_VARS[k]}:
            continue
        if (a is None and b is MISSING and any(x.startswith(k + ".") for x in fn)) or \
                (b is None and a is MISSING and any(x.startswith(k + ".") for x in fo)):
            continue   # None on one side, a dict on the other (the cache info appeared): its keys say it
        rows.append((k, a, b))
    if same_cache:
        rows += _cache_rows(old.get("compile_cache") or {}, new.get("compile_cache") or {})
    return rows


def _cache_rows(oc, nc):
    """A cache rebuilt or emptied since the checkpoint means cold compiles again (the race window). A
    healthy cache only gains files, so the oldest file recorded at the checkpoint is still there: an
    oldest file newer than that now says the cache was rebuilt, fewer files that some were removed."""
    if not (oc.get("exists") and nc.get("exists") and oc.get("oldest_mtime")):
        return []
    if (nc.get("oldest_mtime") or 0) > oc["oldest_mtime"]:
        return [("compile_cache.rebuilt", "no", f"yes: its oldest file is from {_fmt_time(nc['oldest_mtime'])}, "
                 f"at the checkpoint from {_fmt_time(oc['oldest_mtime'])}")]
    if (nc.get("file_count") or 0) < (oc.get("file_count") or 0):
        return [("compile_cache.shrank", f"{oc['file_count']} files", f"{nc.get('file_count')} files (some removed)")]
    return []


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():   # an empty dict leaves no key: {} and absent are the same state
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _fmt_time(t):
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def _fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def format_report(env):
    v, g, c, p = (env.get(k) or {} for k in ("versions", "gpus", "compile_cache", "project"))
    lines = [f"DFlash environment  {env.get('time')}  host {env.get('hostname')}  ({env.get('platform')}, "
             f"{env.get('cpu_count')} CPUs)",
             f"  python {v.get('python')}  {env.get('python_executable')}  (prefix {env.get('python_prefix')})",
             f"  torch {v.get('torch')}  git {str(v.get('torch_git'))[:12]}  CUDA {v.get('cuda')}  "
             f"cuDNN {v.get('cudnn')}",
             "  " + "  ".join(f"{k} {v.get(k)}" for k in ("triton", "transformers", "datasets", "numpy",
                                                           "safetensors"))]
    if g.get("count"):
        names = ", ".join(f"{n} x {name}" for name, n in Counter(g.get("names", [])).items())
        lines.append(f"  GPUs: {names} ({', '.join(map(str, sorted(set(g.get('memory_gib', [])))))} GiB), driver "
                     f"{g.get('driver')}, capability {','.join(sorted(set(g.get('capability', []))))}")
    else:
        lines.append(f"  GPUs: none visible to torch (CUDA available: {g.get('cuda_available')})"
                     + (f"; nvidia-smi: {g['nvidia_smi']}" if g.get("nvidia_smi") else ""))
    dirty = ""
    if p.get("commit") and p.get("dirty") is None:
        dirty = "  dirty: unknown"
    elif p.get("dirty"):
        dirty = f"  DIRTY: {', '.join(p.get('dirty_files', []))} (diff sha256 {str(p.get('diff_sha256'))[:12]})"
    lines.append(f"  project {p.get('dir')}  commit {p.get('commit') or p.get('error')}{dirty}")
    if p.get("commit") and p.get("error"):
        lines.append(f"    git error: {p['error']}")
    if p.get("untracked_count"):
        more = f" (+{p['untracked_count'] - 50} more)" if p["untracked_count"] > 50 else ""
        lines.append(f"    untracked: {', '.join(p.get('untracked_files') or [])}{more}")
    lines.append(f"  compile cache {c.get('path')} ({c.get('source')}): " + (
        f"{_fmt_bytes(c.get('size_bytes', 0))} in {c.get('file_count')} files, oldest "
        f"{_fmt_time(c.get('oldest_mtime'))}, newest {_fmt_time(c.get('newest_mtime'))}" if c.get("exists")
        else "does not exist -> every shape compiles cold"))
    if info := c.get("info"):
        lines.append(f"    filled by ({CACHE_INFO_FILE}): {json.dumps(info, sort_keys=True)[:400]}")
        other = [f"{k} {info[k]} (now {v[k]})" for k in ("torch", "torch_git", "triton", "cuda")
                 if isinstance(info, dict) and k in info and k in v and str(info[k]) != str(v[k])]
        if other:
            lines.append(f"    WARNING: filled by another build ({'; '.join(other)}): its entries will miss")
    elif c.get("exists"):
        lines.append(f"    no {CACHE_INFO_FILE}: unknown which build filled it")
    if "flex_fx_flag_thread_local" in env:   # the thread probes: only the command line runs them
        yn = lambda x, yes, no: "unknown (probe failed)" if x is None else (yes if x else no)
        lines += ["  FX-tracing flag: " + yn(env["flex_fx_flag_thread_local"], "per thread",
                                              "PROCESS-GLOBAL (a compile in one thread is seen by all)"),
                  "  dynamo config: " + yn(env.get("dynamo_config_thread_local"),
                                           "per thread (set it in every worker thread)", "process-global")]
        lines += [f"    probe error: {env['probe_error']}"] if env.get("probe_error") else []
    ev = env.get("env_vars") or {}
    lines += [f"  natural compile race expected: {env.get('natural_race_expected')}",
              "  env: " + ("  ".join(f"{k}={x}" for k, x in ev.items()) or "(none of the recorded variables)")]
    return "\n".join(lines)


def format_packages(rows, title):
    return "\n".join([title] + ([f"  {_fmt_time(t)}  {n} {ver}" for n, ver, t in rows] or ["  (none)"]))


def load_checkpoint_env(folder):
    """env.json of a checkpoint folder, with a clear error when it is not there."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    if not os.path.isfile(path := os.path.join(folder, "env.json")):
        raise FileNotFoundError(f"{folder} has no env.json (not a checkpoint folder written by train_dflash.py)")
    with open(path) as f:
        return json.load(f)

# -----------------------------------------------------------------------------
# 3. Thread probes and the FX-flag recorder. Both raise the FX flag or change dynamo config for real,
# so they run only where no other thread runs compiled code: the command line, the exercise's child.


def _fx_flag():
    """This thread's view of the FX-tracing flag (read directly where it is a module global, because
    is_fx_tracing() logs a deprecation warning)."""
    flag = getattr(torch.fx._symbolic_trace, "_is_fx_tracing_flag", None)
    return flag if isinstance(flag, bool) else bool(torch.fx._symbolic_trace.is_fx_tracing())


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), name="probe")
    t.start()
    t.join()
    return out[0] if out else None


def _thread_probes():
    """Are the FX flag and dynamo config per thread? Measured by behaviour: another thread reads the
    flag while this one traces, and reads a config value that this one changed."""
    import torch._dynamo.config as dcfg
    out, seen = {"flex_fx_flag_thread_local": None}, {}

    def traced(x):
        seen["self"], seen["other"] = _fx_flag(), _in_thread(_fx_flag)
        return x + 1
    try:
        torch.fx.symbolic_trace(traced)
        if seen["self"]:   # the flag was up where this thread could see it
            out["flex_fx_flag_thread_local"] = not seen["other"]
    except Exception as e:
        out["probe_error"] = f"fx: {type(e).__name__}: {e}"
    key = "recompile_limit" if hasattr(dcfg, "recompile_limit") else "cache_size_limit"
    old = getattr(dcfg, key)
    setattr(dcfg, key, old + 1234)
    try:
        out["dynamo_config_thread_local"] = _in_thread(lambda: getattr(dcfg, key)) != old + 1234
    finally:
        setattr(dcfg, key, old)
    return out


@contextlib.contextmanager
def recording_fx_raises(events):
    """Appends (thread, stack) to events at every rise of the FX flag. Tracer.trace raises it, and
    make_fx's tracer reaches it through super() at call time: replacing the class attribute catches
    every subclass."""
    st = torch.fx._symbolic_trace
    orig = st.Tracer.__dict__["trace"]

    @functools.wraps(orig)
    def trace(tracer, *args, **kwargs):
        if not _fx_flag():   # up already: a nested trace, not a rise
            events.append((threading.current_thread().name, traceback.extract_stack()[:-1]))
        return orig(tracer, *args, **kwargs)
    st.Tracer.trace = trace
    try:
        yield events
    finally:
        st.Tracer.trace = orig


# Frames between "who wants a graph" and Tracer.trace: fx itself, decorators and context managers.
PLUMBING = ("torch/fx/", "torch/_compile.py", "torch/_dynamo/eval_frame.py", "torch/utils/_contextlib.py",
            "<stdlib>/")
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
        key = (frames[0] if frames else None, next((f for f in frames if not f.startswith(PLUMBING)), None),
               next((f for f in frames if not f.startswith(("torch/", "<stdlib>"))), None))
        gr = groups.setdefault(key, {"count": 0, "threads": Counter(), "tracing_frame": key[0],
                                     "requested_by": key[1], "user_frame": key[2]})
        gr["count"] += 1
        gr["threads"][thread] += 1
    return sorted(({**gr, "threads": dict(gr["threads"])} for gr in groups.values()), key=lambda gr: -gr["count"])

# -----------------------------------------------------------------------------
# 4. The threaded exercise, in a child process with an empty compile cache. Every thread calls one
# compiled function at its own shape, so each thread's first call compiles while the others call.
#   nogate  the compiled function called directly (GATE.enabled = False)
#   gate    through dflash_model.GATE before warm-up: every compiled call exclusive
#   warm    every shape compiled serially first, then GATE.mark_warm(): shared calls, no compiles

def _exercise_inputs(kind, dev, n):
    """Per thread: (label, shape, args). flex: the drafter's attention; tiny: a pointwise function."""
    from torch.nn.attention.flex_attention import create_block_mask
    out = []
    for i in range(n):
        if kind == "tiny":
            x = torch.randn(64 * (i + 1), device=dev)
            out.append((f"n{x.numel()}", tuple(x.shape), (x,)))
            continue
        # flex works on 128 x 128 tiles; small shapes on CPU, where the compile dominates anyway
        B, H, D, L = (1, 4, 64, 128 * (i + 1)) if dev.type == "cpu" else (1, 8, 128, 1024 * (i + 1))
        dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
        q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=dtype) for _ in range(3))
        # eager create_block_mask uses vmap, never make_fx: it does not raise the FX flag
        bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, B, None, L, L, device=dev)
        out.append((f"L{L}", tuple(q.shape), (q, k, v, bm)))
    return out


def run_exercise(kind="flex", mode="nogate", threads=3, seconds=20.0, device="cpu"):
    """The threaded exercise in this process: meaningful only in a fresh one with a cold cache (_run_child)."""
    sys.path.insert(0, HERE)
    import dflash_model as dm
    assert mode in MODES, mode
    probes = _thread_probes()   # no other thread yet: safe
    gate, dev = dm.GATE, torch.device(device)
    gate.log = lambda *a: print(*a, file=sys.stderr)
    gate.set_recompile_limit(max(8, threads + 2))
    gate.enabled = mode != "nogate"
    inputs = _exercise_inputs(kind, dev, threads)
    names = [f"worker-{i}-{label}" for i, (label, _, _) in enumerate(inputs)]
    stats = {n: dict(calls=0, fx_errors=0, other_errors=0, exposed_calls=0, first_call_s=None, run_s=0.0)
             for n in names}
    samples, called, events = [], set(), []
    sync = lambda: torch.cuda.synchronize(dev) if dev.type == "cuda" else None

    def exposed(fn):   # a call that STARTS while the flag is up is the one that fails on torch 2.11
        def call(*args):
            if _fx_flag() and (s := stats.get(threading.current_thread().name)):
                s["exposed_calls"] += 1
            return fn(*args)
        return call
    if kind == "flex":
        dm.compiled_flex = direct = exposed(dm.compiled_flex)   # gated_flex_attention looks it up per call
        gated = dm.gated_flex_attention
    else:
        direct = exposed(torch.compile(lambda x: torch.sin(x) * 2 + torch.cos(x), dynamic=False, fullgraph=True))
        gated = lambda x: gate.run("tiny", x.device, tuple(x.shape), direct, x)
    one_call = direct if mode == "nogate" else gated
    barrier = threading.Barrier(threads)

    @torch.no_grad()
    def worker(args):
        me = threading.current_thread().name
        s = stats[me]
        gate.configure_thread()   # dynamo config is per thread on torch >= 2.12
        barrier.wait()
        start = time.time()
        # until --seconds are up and every thread has made its first (compiling) call: the others'
        # compiles are the windows (a thread starved for 10 more minutes gives up)
        while time.time() < start + seconds or (len(called) < threads and time.time() < start + seconds + 600):
            tc = time.time()
            try:
                one_call(*args)
                if s["first_call_s"] is None:
                    sync()
                    s["first_call_s"] = round(time.time() - tc, 3)
                s["calls"] += 1
            except Exception as e:   # counted, and the thread carries on: how often does it happen?
                msg = f"{type(e).__name__}: {e}"
                s["fx_errors" if FX_ERROR in msg else "other_errors"] += 1
                if len(samples) < 5:
                    samples.append(f"{me}: {msg[:300]}")
            called.add(me)
            time.sleep(0.001)   # the rest of a training step: threads that hammer starve the compiling one
        sync()
        s["run_s"] = round(time.time() - start, 3)

    workers = [threading.Thread(target=worker, args=(args,), name=n) for n, (_, _, args) in zip(names, inputs)]
    with recording_fx_raises(events), torch.no_grad():
        t0 = time.time()
        if mode == "warm":   # what warmup.py does: every shape, one at a time, before the threads start
            for _, _, args in inputs:
                one_call(*args)
            gate.mark_warm()
        warm_s = time.time() - t0
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    per_thread = [dict(name=n, shape=list(shape), **stats[n],
                       calls_per_s=round(stats[n]["calls"] / max(stats[n]["run_s"], 1e-9), 1))
                  for n, (_, shape, _) in zip(names, inputs)]
    total = lambda key: sum(s[key] for s in stats.values())
    return {"mode": mode, "exercise": kind, "device": str(dev), "threads": threads, "seconds": seconds,
            "torch": torch.__version__, "torch_git": getattr(torch.version, "git_version", None),
            **probes, "natural_race_expected": natural_race_expected(torch.__version__,
                                                                     probes["flex_fx_flag_thread_local"]),
            "fx_errors": total("fx_errors"), "other_errors": total("other_errors"),
            "exposed_calls": total("exposed_calls"), "calls_per_s_per_thread": [p["calls_per_s"] for p in per_thread],
            "calls_per_s_total": round(sum(p["calls_per_s"] for p in per_thread), 1), "per_thread": per_thread,
            "never_called": [n for n in names if stats[n]["calls"] == 0], "error_samples": samples,
            "warmup_s": round(warm_s, 3), "gate_stats": dict(gate.stats), "flag_raises": len(events),
            "flag_up_after_run": _fx_flag(), "raises": _group_raises(events)}

# -----------------------------------------------------------------------------
# 5. --race-test: one child process per mode, each with an empty compile cache


def _run_child(spec, timeout):
    """run_exercise(**spec) in a fresh interpreter whose inductor and triton caches are an empty temp dir."""
    with tempfile.TemporaryDirectory(prefix="dflash_diag_") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec), "--child-out", out]
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"mode": spec["mode"], "failed": f"timed out after {timeout} s"}
        if r.returncode or not os.path.isfile(out):
            return {"mode": spec["mode"], "failed": f"exit {r.returncode}: {r.stderr[-3000:]}"}
        with open(out) as f:
            return json.load(f)


def format_race_table(results):
    head = (f"{'mode':<7} {'FX err':>6} {'other':>5} {'exposed':>7}  {'calls per thread':<22} "
            f"{'calls/s per thread':<24} {'total/s':>8}  first call s")
    lines = [head, "-" * len(head)]
    for r in results:
        if r.get("failed"):
            lines.append(f"{r['mode']:<7} FAILED: {r['failed']}")
            continue
        col = lambda key: " / ".join(str(p[key]) for p in r["per_thread"])
        lines.append(f"{r['mode']:<7} {r['fx_errors']:>6} {r['other_errors']:>5} {r['exposed_calls']:>7}  "
                     f"{col('calls'):<22} {col('calls_per_s'):<24} {r['calls_per_s_total']:>8g}  {col('first_call_s')}")
        lines += [f"        error: {s}" for s in r["error_samples"][:3]]
        if r["never_called"]:
            lines.append(f"        never completed a call (starved?): {', '.join(r['never_called'])}")
    if ref := next((r for r in results if not r.get("failed")), None):
        lines += ["", f"torch {ref['torch']} (git {str(ref['torch_git'])[:12]}), {ref['exercise']} on "
                  f"{ref['device']}, {ref['threads']} threads, each {ref['seconds']:g} s and until every thread has "
                  "compiled; shapes " + ", ".join(str(p["shape"]) for p in ref["per_thread"]),
                  f"natural race expected on this build: {ref['natural_race_expected']}",
                  "exposed = compiled calls that started while another thread held the FX flag up: an error on "
                  "torch 2.11, masked on 2.12/2.13; the gate must show 0.",
                  "calls/s include each thread's cold compile (and, with the gate, the wait for the others'); "
                  "raise --seconds to see steady state."]
    for r in (r for r in results if not r.get("failed")):     # who raised the FX flag, where, for whom
        stuck = "UP (stuck: every compiled call now fails or runs uncompiled)" if r["flag_up_after_run"] else "down"
        lines += ["", f"mode {r['mode']}: the FX flag rose {r['flag_raises']} times at {len(r['raises'])} sites; "
                  f"after the run it is {stuck}"]
        for gr in r["raises"]:
            threads = ", ".join(f"{t} ({n})" for t, n in sorted(gr["threads"].items()))
            lines += [f"  {gr['count']}x in {threads}: traced at {gr['tracing_frame']}, for "
                      f"{gr['requested_by']}, called from {gr['user_frame']}"]
    return "\n".join(lines)

# -----------------------------------------------------------------------------
# 6. Command line


def _packages_json(rows):
    return [{"name": n, "version": v, "mtime": t, "time": _fmt_time(t)} for n, v, t in rows]


def _against(folder, cache_dir):
    """(JSON object, text) of what changed since the checkpoint in folder."""
    old = load_checkpoint_env(folder)
    # the cache that run used, unless another one is named
    diffs = diff_env(old, collect_env(cache_dir or (old.get("compile_cache") or {}).get("path")))
    during, t_old = old.get("changed_during_run") or [], old.get("time_unix")
    newer = [r for r in installed_packages() if t_old is None or r[2] > t_old]
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
             "packages_after": _packages_json(newer)}, "\n".join(text))


def main(argv=None):
    ap = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", metavar="CHECKPOINT", help="checkpoint folder with env.json: what changed since")
    ap.add_argument("--race-test", action="store_true", help="threaded cold-cache compile race, without and with "
                    "the gate; who raises the FX flag, where")
    ap.add_argument("--threads", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0, help="per mode")
    ap.add_argument("--modes", default="nogate,gate", help="comma list of nogate,gate,warm")
    ap.add_argument("--exercise", choices=("flex", "tiny"), default="flex",
                    help="compiled function: the drafter's flex attention, or a tiny pointwise one (quick)")
    ap.add_argument("--device", default=None, help="default cuda:0 when available, else cpu")
    ap.add_argument("--cache-dir", default=None, help="compile cache to describe (default: with --against the "
                    "checkpoint's, else TORCHINDUCTOR_CACHE_DIR or inductor's default)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    emit = lambda obj, text: print(json.dumps(obj, indent=1, default=str) if a.json else text)

    if a.child:
        with open(a.child_out, "w") as f:
            json.dump(run_exercise(**json.loads(a.child)), f, default=str)
        return 0
    if a.race_test:
        device, seconds, modes = a.device or ("cuda:0" if torch.cuda.is_available() else "cpu"), a.seconds, a.modes.split(",")
        if bad := [m for m in modes if m not in MODES]:
            ap.error(f"unknown mode(s) {bad}: use {', '.join(MODES)}")
        results = []
        for mode in modes:
            if not a.json:
                print(f"[diagnose] mode {mode}: {a.threads} threads, {a.exercise} on {device}, {seconds:g} s, "
                      "cold cache (compiles take a while)...", file=sys.stderr, flush=True)
            spec = dict(kind=a.exercise, mode=mode, threads=a.threads, seconds=seconds, device=device)
            results.append(_run_child(spec, timeout=int(seconds) + 1800))
        emit({"command": "race-test", "device": device, "modes": results}, format_race_table(results))
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
    env.update(_thread_probes())   # this process runs no other thread: safe here
    env["natural_race_expected"] = natural_race_expected(torch.__version__, env["flex_fx_flag_thread_local"])
    recent = installed_packages()[:15]
    emit({"env": env, "recent_packages": _packages_json(recent)},
         format_report(env) + "\n" + format_packages(recent, "15 most recently installed/modified packages:"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
