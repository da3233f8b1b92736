"""Diagnose the environment of a DFlash training run: versions, compile cache, what changed, the FX race.

    python diagnose.py                                   fingerprint of this machine + 15 newest packages
    python diagnose.py --against out/step_000690         what changed since that checkpoint's env.json
    python diagnose.py --fx-trace [--exercise tiny]      who raises the global FX-tracing flag, and where
    python diagnose.py --race-test [--threads 3 --seconds 20] [--modes nogate,gate,warm]
    add --json to any of them for one machine-readable JSON object on stdout; --cache-dir to look at
    a compile cache other than TORCHINDUCTOR_CACHE_DIR / inductor's default.

The trainer imports collect_env() (written as env.json into every checkpoint and printed at the top of
every log), installed_packages(), diff_env() and format_report().

Background (../shared/compile-race.md): torch.fx keeps a process-global "FX tracing" flag up while
make_fx traces (every compile that misses the AOTAutograd cache). A compiled call in another thread
that starts meanwhile raises "Detected that you are using FX to symbolically trace a dynamo-optimized
function" on torch 2.11, or silently runs the dense fallback with error_on_nested_fx_trace=False.
torch 2.12/2.13 mask it, torch 2.14 makes the flag thread-local. --fx-trace and --race-test show the
windows where it can happen even on a build that masks it ("exposed calls").

Sections: 1. environment fingerprint  2. diff + report  3. FX-flag recorder  4. threaded exercise
(runs in a child process with a cold cache)  5. --fx-trace / --race-test  6. command line
"""
import argparse
import datetime
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
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
FX_ERROR = "Detected that you are using FX to symbolically trace"
CACHE_INFO_FILE = "dflash_cache_info.json"   # written by warmup.py into the cache it filled
ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_", "TORCHDYNAMO_", "TRITON_", "CUDA_VISIBLE_DEVICES", "NCCL_",
                "PYTORCH_", "OMP_NUM_THREADS", "CUDA_LAUNCH_BLOCKING", "HF_")
# Outside those prefixes but able to change speed or numerics (TF32, cuBLAS workspace, stream count,
# a preloaded or differently found library, other code on the import path): recorded by exact name.
# train_dflash.pin_local_gpu() rotates CUDA_VISIBLE_DEVICES in each torchrun rank (its GPU first) and
# keeps the value it found here: comparisons use that one (the rotation is the trainer's, not a change)
UNPINNED_VAR = "DFLASH_CUDA_VISIBLE_DEVICES_UNPINNED"
ENV_NAMES = {UNPINNED_VAR, "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "CUDA_DEVICE_MAX_CONNECTIONS", "NVIDIA_TF32_OVERRIDE",
             "CUBLAS_WORKSPACE_CONFIG", "CUDA_MODULE_LOADING", "MKL_NUM_THREADS"}
# env.json goes into every checkpoint and the fingerprint into every log, which people share: a
# credential (HF_TOKEN, ...) is recorded as set, never by value.
SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")
SECRET_VALUE = "<set>"
NVIDIA_SMI_FIELDS = ("index", "name", "driver_version", "memory.total")
# 2: the diff hash and untracked names of the project, ENV_NAMES and HF_ variables. An env.json
# without it predates them, and --against does not list them as new (see _predates).
FINGERPRINT_VERSION = 2

# -----------------------------------------------------------------------------
# 1. Environment fingerprint


def _dist_version(*names):
    # importlib.metadata reads the installed metadata without importing the package: cheap, never
    # runs package code, and "absent" is an answer, not a crash.
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception as e:   # broken metadata should not break a checkpoint
            return f"error: {e}"
    return "absent"


def _versions():
    v = {"python": platform.python_version(), "torch": torch.__version__,
         "torch_git": getattr(torch.version, "git_version", None), "cuda": torch.version.cuda,
         "cudnn": None}
    try:
        v["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception as e:
        v["cudnn"] = f"error: {e}"
    # triton ships as "triton" or, in nightlies / some wheels, "pytorch-triton"
    v["triton"] = _dist_version("triton", "pytorch-triton", "pytorch-triton-rocm", "triton-xpu")
    for name in ("transformers", "datasets", "numpy", "safetensors"):
        v[name] = _dist_version(name)
    return v


def _gpus():
    g = {"cuda_available": False, "count": 0, "names": [], "memory_gib": [], "capability": [],
         "driver": None, "nvidia_smi": []}
    try:
        g["cuda_available"] = torch.cuda.is_available()
        if g["cuda_available"]:
            g["count"] = torch.cuda.device_count()
            for i in range(g["count"]):
                p = torch.cuda.get_device_properties(i)
                g["names"].append(p.name)
                g["memory_gib"].append(round(p.total_memory / 2**30, 1))
                g["capability"].append(f"{p.major}.{p.minor}")
    except Exception as e:
        g["error"] = f"{type(e).__name__}: {e}"
    if shutil.which("nvidia-smi"):
        g.update(_nvidia_smi())
    return g


def _nvidia_smi():
    """nvidia-smi's GPU lines and driver; on a failure its own message (a driver/library mismatch, no
    device) is the diagnosis, so it is kept, raw and truncated, instead of a parse error."""
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
    why = f"exit {r.returncode}" if r.returncode != 0 else "unexpected output"
    return {"nvidia_smi": [f"error: {why}: {first}"],
            "nvidia_smi_raw": {"returncode": r.returncode, "stdout": r.stdout[:1000], "stderr": r.stderr[:1000]}}


def _env_vars():
    env = {k: (SECRET_VALUE if any(m in k.upper() for m in SECRET_MARKERS) else v)
           for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}
    # importing torch._dynamo exports inductor's default cache dir into this variable: that is not a
    # choice anyone made, and whether it is there depends on import order, so leave it out
    if os.path.abspath(env.get("TORCHINDUCTOR_CACHE_DIR", "-")) == _default_cache_dir():
        del env["TORCHINDUCTOR_CACHE_DIR"]
    return env


def _default_cache_dir():
    # inductor's rule (torch/_inductor/runtime/cache_dir_utils.py), without importing inductor (seconds)
    # and without its cache_dir()'s side effects (it creates the folder and exports the variable)
    import getpass
    import re
    try:
        user = getpass.getuser()
    except Exception:
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def _cache_state(cache_dir=None):
    if cache_dir:
        path, source = cache_dir, "argument"
    elif os.environ.get("TORCHINDUCTOR_CACHE_DIR") and (
            os.path.abspath(os.environ["TORCHINDUCTOR_CACHE_DIR"]) != _default_cache_dir()):
        # (importing torch._dynamo exports inductor's default into this variable: that is no choice)
        path, source = os.environ["TORCHINDUCTOR_CACHE_DIR"], "TORCHINDUCTOR_CACHE_DIR"
    else:
        path, source = _default_cache_dir(), "inductor default"
    path = os.path.abspath(path)
    c = {"path": path, "source": source, "exists": os.path.isdir(path), "size_bytes": 0, "file_count": 0,
         "oldest_mtime": None, "newest_mtime": None, "info": None}
    if not c["exists"]:
        return c
    stack = [path]
    while stack:   # os.scandir walk: tens of thousands of files in well under a second
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue   # a folder removed while we walk (inductor writes/renames concurrently)
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif e.is_file(follow_symlinks=False):
                    st = e.stat(follow_symlinks=False)
                    c["size_bytes"] += st.st_size
                    c["file_count"] += 1
                    c["oldest_mtime"] = min(c["oldest_mtime"] or st.st_mtime, st.st_mtime)
                    c["newest_mtime"] = max(c["newest_mtime"] or st.st_mtime, st.st_mtime)
            except OSError:
                continue
    info = os.path.join(path, CACHE_INFO_FILE)
    if os.path.isfile(info):
        try:
            with open(info) as f:
                c["info"] = json.load(f)
        except Exception as e:
            c["info"] = {"error": f"unreadable {CACHE_INFO_FILE}: {e}"}
    return c


def _git_state(path=HERE):
    """Commit, dirty files, a hash of the uncommitted diff, untracked names. A git command that fails
    leaves its fields None (unknown) and says so in "error": a failure must not read as a clean tree."""
    failed = []

    def git(*args, text=True):
        r = subprocess.run(["git", "-C", path, *args], capture_output=True, text=text, timeout=30)
        if r.returncode != 0:
            err = r.stderr.decode(errors="replace") if isinstance(r.stderr, bytes) else r.stderr
            msg = (err.strip().splitlines() or [f"exit {r.returncode}"])[0][:200]
            failed.append(f"git {args[0]}: {msg}")
            return None
        return r.stdout
    g = {"dir": path, "commit": None, "dirty": None, "dirty_files": [], "diff_sha256": None,
         "untracked_files": None, "untracked_count": None}
    try:
        out = git("rev-parse", "HEAD")
        if out is None:
            g["error"] = failed[0]
            return g
        g["commit"] = out.strip()
        out = git("status", "--porcelain", "--untracked-files=no")
        if out is not None:
            files = [l[3:] for l in out.splitlines() if l.strip()]
            g["dirty"] = bool(files)
            g["dirty_files"] = files[:20]
        # file names alone miss a further edit of a file that was already dirty: hash the diff itself
        # (binary too; no external diff or textconv, which a user's git config could switch on)
        out = git("diff", "HEAD", "--binary", "--no-ext-diff", "--no-textconv", "--no-color", text=False)
        if out is not None:
            g["diff_sha256"] = hashlib.sha256(out).hexdigest()
        # untracked, not ignored: a new module the code may import (out/, logs are in .gitignore)
        out = git("ls-files", "--others", "--exclude-standard")
        if out is not None:
            names = sorted(l for l in out.splitlines() if l.strip())
            g["untracked_files"], g["untracked_count"] = names[:50], len(names)
    except Exception as e:
        failed.append(f"{type(e).__name__}: {e}")
    if failed:
        g["error"] = "; ".join(failed)
    return g


def _fx_flag():
    """This thread's view of the FX-tracing flag, whatever this build stores it in."""
    st = torch.fx._symbolic_trace
    if not getattr(_fx_flag, "primed", False):
        # is_fx_tracing() logs a one-time deprecation warning (lru_cache'd); trigger it silently once
        lg = logging.getLogger(st.__name__)
        old, lg.disabled = lg.disabled, True
        try:
            getattr(st, "is_fx_tracing_warning", lambda: None)()
        finally:
            lg.disabled = old
        _fx_flag.primed = True
    return bool(st.is_fx_tracing())


def _thread_probes():
    """Measure, by behaviour, whether the FX flag and the dynamo config are per thread in this build.

    Raises the FX flag for real (fx.symbolic_trace of a function that waits inside the trace) and
    changes dynamo config: only safe in a process where no other thread runs compiled code. That is
    why collect_env() runs it in a child process unless it already has the answer."""
    import torch.fx
    out = {"flex_fx_flag_thread_local": None, "dynamo_config_thread_local": None}
    seen, inside, done = {}, threading.Event(), threading.Event()

    def reader():
        if inside.wait(30):
            seen["other"] = _fx_flag()
        done.set()

    def traced(x):
        seen["self"] = _fx_flag()
        inside.set()
        done.wait(30)
        return x + 1

    t = threading.Thread(target=reader, name="probe-reader")
    t.start()
    try:
        torch.fx.symbolic_trace(traced)
    except Exception as e:
        out["probe_error"] = f"fx: {type(e).__name__}: {e}"
    finally:
        inside.set()
        t.join()
    if seen.get("self") is True and "other" in seen:   # the trace did raise it where we could see it
        out["flex_fx_flag_thread_local"] = not seen["other"]

    import torch._dynamo.config as dcfg
    key = "recompile_limit" if hasattr(dcfg, "recompile_limit") else "cache_size_limit"
    old = getattr(dcfg, key)
    setattr(dcfg, key, old + 1234)
    try:
        got = {}
        w = threading.Thread(target=lambda: got.setdefault("v", getattr(dcfg, key)), name="probe-config")
        w.start()
        w.join()
        out["dynamo_config_thread_local"] = got.get("v") != old + 1234
    finally:
        setattr(dcfg, key, old)
    return out


_PROBES = None


def _probes():
    """The thread probes, measured once per process, in a child process (see _thread_probes)."""
    global _PROBES
    if _PROBES is None:
        try:
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe-threads"],
                               capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                raise RuntimeError(f"probe exited {r.returncode}: {r.stderr.strip()[-300:]}")
            _PROBES = json.loads(r.stdout.strip().splitlines()[-1])
        except Exception as e:   # remembered too: it would fail the same way next time
            _PROBES = {"flex_fx_flag_thread_local": None, "dynamo_config_thread_local": None,
                       "probe_error": f"{type(e).__name__}: {e}"}
    return dict(_PROBES)


# Packages whose own files people overwrite in place (a copied build, a patched torch/__init__.py,
# an editable-install swap) without touching dist-info: their top-level files' mtimes count too.
# Top-level files only, no .pyc and no folders (a folder's mtime moves when Python writes __pycache__):
# one scandir each, a few ms.
PACKAGE_DIRS = {"torch": "torch", "triton": "triton", "pytorch-triton": "triton", "transformers": "transformers"}


def _newest_file_mtime(folder):
    newest = 0.0
    try:
        for e in os.scandir(folder):
            if e.is_file(follow_symlinks=False) and not e.name.endswith(".pyc"):
                newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
    except OSError:
        pass   # no such folder (a namespace or renamed package): dist-info alone decides
    return newest


def installed_packages():
    """[(name, version, mtime)] of every installed distribution, newest first.

    mtime is the dist-info folder's: pip creates it (and so stamps it) when it installs or upgrades;
    for PACKAGE_DIRS the newest of that and the package's top-level files."""
    rows, seen = [], set()
    for d in importlib.metadata.distributions():
        try:
            name = d.metadata["Name"]
        except Exception:
            continue
        if not name or name.lower() in seen:
            continue   # the same package further down sys.path is shadowed: the first one is in use
        path = getattr(d, "_path", None)
        if path is not None and "_vendor" in Path(path).parts:
            # a copy bundled inside another package (setuptools puts its _vendor folder on sys.path
            # once imported, e.g. by inductor's CPU compiler): not installed, and listing it would
            # make a report written after a compile differ from one written before
            continue
        seen.add(name.lower())
        try:
            mtime = os.path.getmtime(path) if path is not None else 0.0
        except OSError:
            mtime = 0.0
        if path is not None and name.lower() in PACKAGE_DIRS:
            mtime = max(mtime, _newest_file_mtime(Path(path).parent / PACKAGE_DIRS[name.lower()]))
        rows.append((name, d.version, mtime))
    rows.sort(key=lambda r: -r[2])
    return rows


def natural_race_expected(torch_version, fx_flag_thread_local=None):
    """Is the cold-cache compile race expected to show by itself on this torch build?"""
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


def collect_env(cache_dir=None):
    """Everything that decides whether a run reproduces: versions, GPUs, compile cache, code. Never raises."""
    now = time.time()
    env = {"time": datetime.datetime.fromtimestamp(now).astimezone().isoformat(timespec="seconds"),
           "time_unix": now, "fingerprint_version": FINGERPRINT_VERSION}
    parts = {"hostname": socket.gethostname, "platform": platform.platform, "cpu_count": os.cpu_count,
             "python_executable": lambda: os.path.realpath(sys.executable), "versions": _versions, "gpus": _gpus,
             "env_vars": _env_vars, "compile_cache": lambda: _cache_state(cache_dir),
             "project": _git_state,
             "packages": lambda: {n: v for n, v, _ in sorted(installed_packages(), key=lambda r: r[0].lower())}}
    for key, fn in parts.items():
        try:
            env[key] = fn()
        except Exception as e:   # a fingerprint with a hole beats a crashed checkpoint
            env[key] = {"error": f"{type(e).__name__}: {e}"}
    env.update(_probes())
    env["natural_race_expected"] = natural_race_expected(torch.__version__, env.get("flex_fx_flag_thread_local"))
    return env


# -----------------------------------------------------------------------------
# 2. Diff and report

# Fields that change on every call or grow during any run: comparing them says nothing.
ALWAYS_CHANGE = {"time", "time_unix", "compile_cache.size_bytes", "compile_cache.file_count",
                 "compile_cache.oldest_mtime", "compile_cache.newest_mtime",
                 "changed_during_run"}    # a checkpoint's own note (train_dflash), reported on its own
MISSING = "(missing)"


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):   # an empty dict leaves no key: {} and "absent" are the same state
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


# Variables warmup.use_compile_cache() sets inside the training process from the cache path (which is
# compared on its own): their presence in a checkpoint's env.json and absence in a shell is no change.
TRAINER_SET_VARS = {"env_vars.TRITON_CACHE_DIR"}
# Variables it only defaults (os.environ.setdefault): absent on one side and the default on the other
# is no change, but a user's own value (FX graph / autograd cache off: "0") takes effect and is one.
TRAINER_DEFAULT_VARS = {"env_vars.TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "env_vars.TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


def _predates(key, old_flat):
    """Is key a field that old's fingerprint version did not record (so "(missing)" there is no change)?
    The fingerprint_version row itself still says that the old side recorded less."""
    if old_flat.get("fingerprint_version", 1) >= 2:
        return False
    name = key[len("env_vars."):] if key.startswith("env_vars.") else None
    return key in ("project.diff_sha256", "project.untracked_files", "project.untracked_count") or (
        name is not None and (name in ENV_NAMES or name.startswith("HF_")))


def diff_env(old, new):
    """[(dotted field, old value, new value)] for every field that differs, sorted by field."""
    # a JSON round trip makes tuples lists and keys strings on both sides, as in env.json
    old, new = json.loads(json.dumps(old, default=str)), json.loads(json.dumps(new, default=str))
    fo, fn = _flatten(old), _flatten(new)
    for flat in (fo, fn):     # a rank's pinned CUDA_VISIBLE_DEVICES: compare the value the user set
        unpinned = flat.pop("env_vars." + UNPINNED_VAR, None)
        if unpinned is not None:
            flat.pop("env_vars.CUDA_VISIBLE_DEVICES", None)
            if unpinned != "(unset)":
                flat["env_vars.CUDA_VISIBLE_DEVICES"] = unpinned
    same_cache = fo.get("compile_cache.path") == fn.get("compile_cache.path")
    rows = []
    for k in sorted(set(fo) | set(fn)):
        if k in ALWAYS_CHANGE:
            continue
        if k == "env_vars.TORCHINDUCTOR_CACHE_DIR" and same_cache:
            continue   # inductor exports its default into os.environ on first compile: same cache, no change
        if k in TRAINER_SET_VARS and same_cache:
            continue   # warmup.use_compile_cache sets these for the run itself: not the user's environment
        a, b = fo.get(k, MISSING), fn.get(k, MISSING)
        if k in TRAINER_DEFAULT_VARS and {a, b} == {MISSING, TRAINER_DEFAULT_VARS[k]}:
            continue   # the trainer's own default on one side, nothing (so that default) on the other
        if a is MISSING and _predates(k, fo):
            continue
        if (a is None and b is MISSING and any(x.startswith(k + ".") for x in fn)) or \
                (b is None and a is MISSING and any(x.startswith(k + ".") for x in fo)):
            continue   # None on one side, a dict on the other (cache info appeared): its keys say it
        if a != b:
            rows.append((k, a, b))
    # The cache's size only grows in a healthy run; a cache emptied or rebuilt after the checkpoint
    # means cold compiles (the race window) and is worth saying even though its raw numbers are ignored.
    oc, nc = old.get("compile_cache") or {}, new.get("compile_cache") or {}
    if same_cache and oc.get("exists") and nc.get("exists"):
        t_old = old.get("time_unix") or 0
        if (nc.get("oldest_mtime") or 0) > t_old > 0:
            rows.append(("compile_cache.rebuilt", "no", f"yes: its oldest file is from "
                         f"{_fmt_time(nc['oldest_mtime'])}, after the checkpoint"))
        elif (nc.get("file_count") or 0) < (oc.get("file_count") or 0):
            rows.append(("compile_cache.shrank", f"{oc.get('file_count')} files",
                         f"{nc.get('file_count')} files (partly cleared)"))
    return rows


def _fmt_time(t):
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def _fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _cache_build_mismatch(env):
    """Fields where the build that filled the cache differs from the one running now."""
    info, v = (env.get("compile_cache") or {}).get("info") or {}, env.get("versions") or {}
    if not isinstance(info, dict):
        return []
    built = {k: x for k, x in info.items() if not isinstance(x, dict)}
    if isinstance(info.get("versions"), dict):   # warmup.py may store collect_env()["versions"] as is
        built.update(info["versions"])
    return [f"{k} {built[k]} (now {v[k]})" for k in ("torch", "torch_git", "triton", "cuda")
            if k in built and k in v and str(built[k]) != str(v[k])]


def format_report(env):
    v, g, c, p = (env.get(k) or {} for k in ("versions", "gpus", "compile_cache", "project"))
    lines = [f"DFlash environment  {env.get('time')}  host {env.get('hostname')}  ({env.get('platform')}, "
             f"{env.get('cpu_count')} CPUs)",
             f"  python {v.get('python')}  {env.get('python_executable')}",
             f"  torch {v.get('torch')}  git {str(v.get('torch_git'))[:12]}  CUDA {v.get('cuda')}  "
             f"cuDNN {v.get('cudnn')}",
             "  " + "  ".join(f"{k} {v.get(k)}" for k in ("triton", "transformers", "datasets", "numpy",
                                                           "safetensors"))]
    if g.get("count"):
        names = Counter(g.get("names", []))
        desc = ", ".join(f"{n} x {name}" for name, n in names.items())
        lines.append(f"  GPUs: {desc} ({', '.join(str(m) for m in sorted(set(g.get('memory_gib', []))))} GiB), "
                     f"driver {g.get('driver')}, capability {','.join(sorted(set(g.get('capability', []))))}")
    else:
        lines.append(f"  GPUs: none visible to torch (CUDA available: {g.get('cuda_available')})"
                     + (f"; nvidia-smi: {g['nvidia_smi']}" if g.get("nvidia_smi") else ""))
    dirty = "" if not p.get("dirty") else (f"  DIRTY: {', '.join(p.get('dirty_files', []))} "
                                           f"(diff sha256 {str(p.get('diff_sha256'))[:12]})")
    if p.get("commit") and p.get("dirty") is None:
        dirty = "  dirty: unknown"
    lines.append(f"  project {p.get('dir')}  commit {p.get('commit') or p.get('error')}{dirty}")
    if p.get("commit") and p.get("error"):
        lines.append(f"    git error: {p['error']}")
    if p.get("untracked_count"):
        lines.append(f"    untracked: {', '.join(p.get('untracked_files') or [])}"
                     + (f" (+{p['untracked_count'] - 50} more)" if p["untracked_count"] > 50 else ""))
    if c.get("exists"):
        lines.append(f"  compile cache {c.get('path')} ({c.get('source')}): {_fmt_bytes(c.get('size_bytes', 0))} "
                     f"in {c.get('file_count')} files, oldest {_fmt_time(c.get('oldest_mtime'))}, "
                     f"newest {_fmt_time(c.get('newest_mtime'))}")
    else:
        lines.append(f"  compile cache {c.get('path')} ({c.get('source')}): does not exist -> every shape "
                     "compiles cold")
    if c.get("info"):
        lines.append(f"    filled by ({CACHE_INFO_FILE}): {json.dumps(c['info'], sort_keys=True)[:400]}")
        mism = _cache_build_mismatch(env)
        if mism:
            lines.append(f"    WARNING: filled by another build ({'; '.join(mism)}): its entries will miss")
    elif c.get("exists"):
        lines.append(f"    no {CACHE_INFO_FILE}: unknown which build filled it")

    def yn(x, yes, no):
        return "unknown (probe failed)" if x is None else (yes if x else no)
    lines.append("  FX-tracing flag: " + yn(env.get("flex_fx_flag_thread_local"), "per thread",
                                             "PROCESS-GLOBAL (a compile in one thread is seen by all)"))
    lines.append("  dynamo config: " + yn(env.get("dynamo_config_thread_local"),
                                           "per thread (set it in every worker thread)", "process-global"))
    if env.get("probe_error"):
        lines.append(f"    probe error: {env['probe_error']}")
    lines.append(f"  natural compile race expected: {env.get('natural_race_expected')}")
    ev = env.get("env_vars") or {}
    lines.append("  env: " + ("  ".join(f"{k}={x}" for k, x in ev.items()) if ev else "(none of the recorded variables)"))
    return "\n".join(lines)


def format_packages(rows, title):
    lines = [title]
    lines += [f"  {_fmt_time(t)}  {n} {ver}" for n, ver, t in rows] or ["  (none)"]
    return "\n".join(lines)


def load_checkpoint_env(folder):
    """env.json of a checkpoint folder, with a clear error when it is not there."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    path = os.path.join(folder, "env.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} has no env.json (not a checkpoint folder written by "
                                "train_dflash.py, or written before env.json existed)")
    with open(path) as f:
        return json.load(f)


def _env_time(env):
    if env.get("time_unix"):
        return float(env["time_unix"])
    try:
        return datetime.datetime.fromisoformat(env["time"]).timestamp()
    except Exception:
        return None


# -----------------------------------------------------------------------------
# 3. FX-flag recorder (diagnosis only: opt-in, changes no behaviour)
#
# Tracer.trace is where torch.fx raises the flag (make_fx -> PythonKeyTracer.trace -> super().trace,
# resolved at call time, so replacing the class attribute catches every tracer subclass). A few
# places outside fx also write the flag as a module attribute (torch/_higher_order_ops/utils.py saves,
# clears and RESTORES it: an interleaved restore can leave it stuck up); a ModuleType subclass sees
# those writes. Writes inside _symbolic_trace itself (the `global` statement) cannot be hooked,
# hence the Tracer.trace wrapper.


class FxFlagRecorder:
    def __init__(self, busy=None):
        self.busy = busy or (lambda: [])   # names of threads inside a compiled call right now
        self.lock = threading.Lock()
        self.events = []                   # (thread, how, stack frames, busy threads)
        self.already_up = Counter()        # thread -> Tracer.trace entries with the flag already up

    def _record(self, how):
        stack = traceback.extract_stack()[:-2]   # drop _record and the hook itself
        me = threading.current_thread().name
        busy = [b for b in self.busy() if b != me]
        with self.lock:
            self.events.append((me, how, stack, busy))

    def __enter__(self):
        st = self.st = torch.fx._symbolic_trace
        self.orig_trace = orig = st.Tracer.__dict__["trace"]
        rec = self

        @functools.wraps(orig)
        def trace(tracer, *args, **kwargs):
            if _fx_flag():
                with rec.lock:
                    rec.already_up[threading.current_thread().name] += 1
            else:
                rec._record("Tracer.trace")
            return orig(tracer, *args, **kwargs)
        st.Tracer.trace = trace

        self.orig_class = None
        if isinstance(getattr(st, "_is_fx_tracing_flag", None), bool):
            self.orig_class = base = type(st)

            class Watched(base):
                def __setattr__(mod, name, value):
                    if name == "_is_fx_tracing_flag" and value and not mod.__dict__.get(name):
                        rec._record("attribute write")
                    base.__setattr__(mod, name, value)
            st.__class__ = Watched
        return self

    def __exit__(self, *exc):
        self.st.Tracer.trace = self.orig_trace
        if self.orig_class is not None:
            self.st.__class__ = self.orig_class
        return False

    def groups(self):
        """Distinct stacks, most frequent first: one dict per stack, with the threads that raised it."""
        by_stack = {}
        for thread, how, stack, busy in self.events:
            key = (how,) + tuple((f.filename, f.lineno, f.name) for f in stack)
            gr = by_stack.setdefault(key, {"how": how, "count": 0, "threads": Counter(), "busy": Counter(),
                                           "stack": [_frame_str(f) for f in stack]})
            gr["count"] += 1
            gr["threads"][thread] += 1
            gr["busy"].update(busy)
        out = []
        for gr in sorted(by_stack.values(), key=lambda g: -g["count"]):
            frames = gr["stack"]
            gr.update(tracing_frame=frames[-1] if frames else None,
                      requested_by=next((f for f in reversed(frames) if not f.startswith(PLUMBING)), None),
                      user_frame=next((f for f in reversed(frames) if not f.startswith("torch/")
                                       and not f.startswith("<stdlib>")), None),
                      threads=dict(gr["threads"]), busy=dict(gr["busy"]))
            out.append(gr)
        return out


_ROOTS = None
# frames between "who wants a graph" and Tracer.trace: fx itself, and decorators/context managers
PLUMBING = ("torch/fx/", "torch/_compile.py", "torch/_dynamo/eval_frame.py", "torch/utils/_contextlib.py",
            "<stdlib>/")


def _frame_str(f):
    """file:line in function, with the site-packages / project / stdlib prefixes cut off."""
    global _ROOTS
    if _ROOTS is None:
        _ROOTS = [(os.path.dirname(os.path.dirname(torch.__file__)) + os.sep, ""),
                  (HERE + os.sep, ""), (os.path.dirname(os.__file__) + os.sep, "<stdlib>/")]
    path = f.filename
    for root, label in _ROOTS:
        if path.startswith(root):
            path = label + path[len(root):]
            break
    return f"{path}:{f.lineno} in {f.name}"


# -----------------------------------------------------------------------------
# 4. The threaded exercise (runs in a child process with its own, cold, TORCHINDUCTOR_CACHE_DIR)
#
# Every thread calls the same compiled function with its own shape, so each thread's first call
# compiles while the others call. Modes:
#   nogate  compiled function called directly (GATE.enabled = False): the original, unprotected run
#   gate    through dflash_model's gate before warm-up: every compiled call exclusive
#   warm    gate, every shape compiled serially first, then GATE.mark_warm(): shared calls, no compiles


STARVED_AFTER_S = 600   # a thread still without its first call this long after --seconds is starved


def _tiny(x):
    return torch.sin(x) * 2 + torch.cos(x)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _exercise_inputs(kind, device, n):
    """Per thread: (label, shape, args). flex: the drafter's attention; tiny: a pointwise function."""
    from torch.nn.attention.flex_attention import create_block_mask
    dev = torch.device(device)
    out = []
    for i in range(n):
        if kind == "tiny":
            x = torch.randn(64 * (i + 1), device=dev)
            out.append((f"n{x.numel()}", tuple(x.shape), (x,)))
            continue
        # flex works on 128 x 128 tiles: lengths are multiples of 128 (CPU: small, the compile dominates)
        B, H, D, L = (1, 4, 64, 128 * (i + 1)) if dev.type == "cpu" else (1, 8, 128, 1024 * (i + 1))
        dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
        q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=dtype) for _ in range(3))
        # eager create_block_mask uses vmap, not make_fx: it never raises the FX flag
        bm = create_block_mask(_causal, B, None, L, L, device=dev)
        out.append((f"L{L}", tuple(q.shape), (q, k, v, bm)))
    return out


def run_exercise(kind="flex", mode="nogate", threads=3, seconds=20.0, device="cpu", pace_ms=0.0):
    """The threaded compiled-call exercise in THIS process; returns a JSON-able result.

    Only meaningful in a fresh process with a cold cache: use _run_child()."""
    sys.path.insert(0, HERE)
    import dflash_model as dm
    global _PROBES
    _PROBES = _PROBES or _thread_probes()   # no compiled calls running yet: safe in-process
    gate = dm.GATE
    gate.log = lambda *a: print(*a, file=sys.stderr)
    gate.set_recompile_limit(max(8, threads + 2))
    dev = torch.device(device)
    inputs = _exercise_inputs(kind, device, threads)
    names = [f"worker-{i}-{lab}" for i, (lab, _, _) in enumerate(inputs)]
    stats = {n: {"calls": 0, "fx_errors": 0, "other_errors": 0, "exposed_calls": 0, "first_call_s": None,
                 "run_s": 0.0} for n in names}
    inside = {n: False for n in names}
    samples = []

    # Wrap the compiled function: note a call that STARTS while the FX flag is up (the condition that
    # fails on torch 2.11), and which threads are inside a compiled call (for the recorder).
    def tracked(fn):
        def call(*args):
            me = threading.current_thread().name
            if me in stats and _fx_flag():
                stats[me]["exposed_calls"] += 1
            inside[me] = True
            try:
                return fn(*args)
            finally:
                inside[me] = False
        return call

    if kind == "flex":
        dm.compiled_flex = tracked(dm.compiled_flex)   # gated_flex_attention looks it up at call time
        direct = dm.compiled_flex
        gated = dm.gated_flex_attention
    else:
        direct = tracked(torch.compile(_tiny, dynamic=False, fullgraph=True))
        gated = lambda x: gate.run("tiny", x.device, tuple(x.shape), direct, x)
    if mode == "nogate":
        gate.enabled = False
        one_call = direct
    elif mode in ("gate", "warm"):
        one_call = gated
    else:
        raise ValueError(f"mode must be nogate, gate or warm, got {mode!r}")

    barrier = threading.Barrier(threads)
    first_done = []   # threads whose first call (the compile) has finished, well or not

    def worker(args):
        me = threading.current_thread().name
        s = stats[me]
        gate.configure_thread()   # dynamo config is per thread on torch >= 2.12
        barrier.wait()
        start = time.time()
        deadline = start + seconds
        with torch.no_grad():
            while True:
                tc = time.time()
                try:
                    one_call(*args)
                    if s["first_call_s"] is None:
                        if dev.type == "cuda":
                            torch.cuda.synchronize(dev)
                        s["first_call_s"] = round(time.time() - tc, 3)
                    s["calls"] += 1
                except Exception as e:   # counted, and the thread carries on: how often does it happen?
                    msg = f"{type(e).__name__}: {e}"
                    s["fx_errors" if FX_ERROR in msg else "other_errors"] += 1
                    if len(samples) < 5:
                        samples.append(f"{me}: {msg[:300]}")
                if len(first_done) < threads and me not in first_done:
                    first_done.append(me)
                # keep calling until every thread has compiled: the others' compiles are the windows
                if pace_ms:
                    time.sleep(pace_ms / 1000)
                now = time.time()
                if now >= deadline and (len(first_done) >= threads or now >= deadline + STARVED_AFTER_S):
                    break
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        s["run_s"] = round(time.time() - start, 3)

    ths = [threading.Thread(target=worker, args=(args,), name=n) for n, (_, _, args) in zip(names, inputs)]
    with FxFlagRecorder(busy=lambda: [n for n, b in inside.items() if b]) as rec:
        t0 = time.time()
        if mode == "warm":   # what warmup.py does: every shape, one at a time, before the threads start
            with torch.no_grad():
                for _, _, args in inputs:
                    one_call(*args)
            gate.mark_warm()
        warm_s = time.time() - t0
        for t in ths:
            t.start()
        for t in ths:
            t.join()
    flag_up_after = _fx_flag()

    per_thread = [dict(name=n, shape=list(sh), **stats[n],
                       calls_per_s=round(stats[n]["calls"] / max(stats[n]["run_s"], 1e-9), 1))
                  for n, (_, sh, _) in zip(names, inputs)]
    groups = rec.groups()
    return {
        "mode": mode, "exercise": kind, "device": str(dev), "threads": threads, "seconds": seconds,
        "pace_ms": pace_ms,
        "torch": torch.__version__, "torch_git": getattr(torch.version, "git_version", None),
        "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"), **_PROBES,
        "natural_race_expected": natural_race_expected(torch.__version__, _PROBES.get("flex_fx_flag_thread_local")),
        "fx_errors": sum(s["fx_errors"] for s in stats.values()),
        "other_errors": sum(s["other_errors"] for s in stats.values()),
        "exposed_calls": sum(s["exposed_calls"] for s in stats.values()),
        "calls_per_s_per_thread": [p["calls_per_s"] for p in per_thread],
        "calls_per_s_total": round(sum(p["calls_per_s"] for p in per_thread), 1),
        "per_thread": per_thread, "error_samples": samples, "warmup_s": round(warm_s, 3),
        "never_called": [n for n in names if stats[n]["calls"] == 0], "gate_stats": dict(gate.stats),
        "flag_raises": sum(g["count"] for g in groups),
        "entries_with_flag_already_up": dict(rec.already_up),
        "flag_up_after_run": flag_up_after, "raises": groups,
    }


# -----------------------------------------------------------------------------
# 5. --fx-trace and --race-test: one child process per mode, each with a fresh (cold) compile cache


def _run_child(spec, timeout):
    """run_exercise(**spec) in a fresh interpreter whose inductor + triton caches are an empty temp dir."""
    with tempfile.TemporaryDirectory(prefix="dflash_diag_") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec), "--child-out", out]
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"mode": spec["mode"], "failed": f"timed out after {timeout} s"}
        if r.returncode != 0 or not os.path.isfile(out):
            return {"mode": spec["mode"], "failed": f"exit {r.returncode}: {r.stderr[-3000:]}"}
        with open(out) as f:
            return json.load(f)


def _default_device(device):
    return device or ("cuda:0" if torch.cuda.is_available() else "cpu")


def run_modes(modes, kind, threads, seconds, device, pace_ms=0.0, quiet=False):
    results = []
    for mode in modes:
        if not quiet:
            print(f"[diagnose] mode {mode}: {threads} threads, {kind} on {device}, {seconds:g} s, cold cache "
                  "(compiles take a while)...", file=sys.stderr, flush=True)
        spec = dict(kind=kind, mode=mode, threads=threads, seconds=seconds, device=device, pace_ms=pace_ms)
        results.append(_run_child(spec, timeout=int(seconds) + 1800))
    return results


def format_fx_trace(results, depth):
    lines = []
    for r in results:
        if r.get("failed"):
            lines.append(f"mode {r['mode']}: FAILED: {r['failed']}")
            continue
        lines.append(f"FX-flag rises: mode {r['mode']}, exercise {r['exercise']} on {r['device']}, {r['threads']} "
                     f"threads, {r['seconds']:g} s, cold cache; torch {r['torch']} (git {str(r['torch_git'])[:12]})")
        lines.append(f"  {r['flag_raises']} rises in {len(r['raises'])} distinct stacks; Tracer.trace entered with "
                     f"the flag already up: {sum(r['entries_with_flag_already_up'].values())}; flag after the run: "
                     f"{'UP (stuck: every compiled call now fails or runs dense)' if r['flag_up_after_run'] else 'down'}")
        lines.append(f"  compiled calls that started while the flag was up: {r['exposed_calls']}; FX errors: "
                     f"{r['fx_errors']}; other errors: {r['other_errors']}")
        lines.append(f"  natural race on this build: {r['natural_race_expected']}")
        for i, g in enumerate(r["raises"], 1):
            threads = ", ".join(f"{t} ({n})" for t, n in sorted(g["threads"].items()))
            lines.append(f"  [{i}] {g['count']}x raised via {g['how']} in thread {threads}")
            lines.append(f"      tracing frame: {g['tracing_frame']}")
            lines.append(f"      requested by:  {g['requested_by']}")
            lines.append(f"      user frame:    {g['user_frame']}")
            if g["busy"]:
                lines.append("      meanwhile inside a compiled call (running it, or queued for dynamo's compile lock): "
                             + ", ".join(f"{t} ({n})" for t, n in sorted(g["busy"].items())))
            frames = g["stack"]
            # from just above the innermost user frame down to the tracer; the thread bootstrap is noise
            start = max((j for j, f in enumerate(frames) if f == g["user_frame"]), default=2)
            frames = frames[start - 2:]
            if len(frames) > depth:
                frames = frames[:3] + [f"... {len(frames) - depth} frames ..."] + frames[-(depth - 3):]
            lines.append("      stack (innermost last):")
            lines += [f"        {f}" for f in frames]
    return "\n".join(lines)


def format_race_table(results):
    head = (f"{'mode':<7} {'FX err':>6} {'other':>5} {'exposed':>7}  {'calls per thread':<22} "
            f"{'calls/s per thread':<24} {'total/s':>8}  first call s")
    lines = [head, "-" * len(head)]
    ref = next((r for r in results if not r.get("failed")), None)
    for r in results:
        if r.get("failed"):
            lines.append(f"{r['mode']:<7} FAILED: {r['failed']}")
            continue
        calls = " / ".join(str(p["calls"]) for p in r["per_thread"])
        per = " / ".join(f"{x:g}" for x in r["calls_per_s_per_thread"])
        first = " / ".join(f"{p['first_call_s']}" for p in r["per_thread"])
        lines.append(f"{r['mode']:<7} {r['fx_errors']:>6} {r['other_errors']:>5} {r['exposed_calls']:>7}  "
                     f"{calls:<22} {per:<24} {r['calls_per_s_total']:>8g}  {first}")
        lines += [f"        error: {s}" for s in r["error_samples"][:3]]
        if r.get("never_called"):
            lines.append(f"        never completed a call (starved?): {', '.join(r['never_called'])}")
    if ref:
        lines += ["",
                  f"torch {ref['torch']} (git {str(ref['torch_git'])[:12]}), {ref['exercise']} on {ref['device']}, "
                  f"{ref['threads']} threads, each {ref['seconds']:g} s and until every thread has compiled; "
                  "shapes " + ", ".join(str(p["shape"]) for p in ref["per_thread"]),
                  f"natural race expected on this build: {ref['natural_race_expected']}",
                  "exposed = compiled calls that started while another thread held the FX flag up: an error on "
                  "torch 2.11 (or a silent dense fallback with error_on_nested_fx_trace=False), masked on "
                  "2.12/2.13; the gate must show 0.",
                  "calls/s include each thread's cold compile (and, with the gate, the wait for the others'); "
                  "raise --seconds to see steady state."]
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# 6. Command line


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", metavar="CHECKPOINT", help="checkpoint folder with env.json: what changed since")
    ap.add_argument("--fx-trace", action="store_true", help="record who raises the FX-tracing flag during a "
                    "threaded cold compile")
    ap.add_argument("--race-test", action="store_true", help="threaded cold-cache compile race, without and "
                    "with the gate")
    ap.add_argument("--threads", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=None, help="per mode (default: 20 race test, 3 fx trace)")
    ap.add_argument("--modes", default=None, help="comma list of nogate,gate,warm (default: race test "
                    "nogate,gate; fx trace nogate)")
    ap.add_argument("--exercise", choices=("flex", "tiny"), default="flex",
                    help="compiled function: the drafter's flex attention, or a tiny pointwise one (quick)")
    ap.add_argument("--pace-ms", type=float, default=0.0, help="sleep between a thread's calls (the rest of "
                    "a training step). 0 hammers: on a small CPU the callers then starve the compiling thread "
                    "of the GIL and its compile takes ~10x longer")
    ap.add_argument("--device", default=None, help="default cuda:0 when available, else cpu")
    ap.add_argument("--stack-depth", type=int, default=30, help="frames per stack printed by --fx-trace")
    ap.add_argument("--cache-dir", default=None, help="compile cache to describe (default: with --against the "
                    "checkpoint's, else TORCHINDUCTOR_CACHE_DIR or inductor's default)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--probe-threads", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    def emit(obj, text):
        print(json.dumps(obj, indent=1, default=str) if a.json else text)

    if a.probe_threads:
        print(json.dumps(_thread_probes()))
        return 0
    if a.child:
        result = run_exercise(**json.loads(a.child))
        with open(a.child_out, "w") as f:
            json.dump(result, f, default=str)
        return 0

    global _PROBES
    if a.fx_trace or a.race_test:
        device = _default_device(a.device)
        seconds = a.seconds if a.seconds is not None else (20.0 if a.race_test else 3.0)
        modes = (a.modes or ("nogate,gate" if a.race_test else "nogate")).split(",")
        bad = [m for m in modes if m not in ("nogate", "gate", "warm")]
        if bad:
            ap.error(f"unknown mode(s) {bad}: use nogate, gate, warm")
        results = run_modes(modes, a.exercise, a.threads, seconds, device, a.pace_ms, quiet=a.json)
        obj = {"command": "race-test" if a.race_test else "fx-trace", "device": device, "modes": results}
        text = format_race_table(results) if a.race_test else format_fx_trace(results, a.stack_depth)
        emit(obj, text)
        return 1 if any(r.get("failed") for r in results) else 0

    if a.against:
        try:
            old = load_checkpoint_env(a.against)
        except (OSError, ValueError) as e:
            if a.json:
                print(json.dumps({"error": str(e)}))
            print(f"error: {e}", file=sys.stderr)
            return 2
    _PROBES = _thread_probes()   # the CLI is single-threaded: measure in-process, no child needed
    cache_dir = a.cache_dir
    if a.against and not cache_dir:   # the question is about the cache that run used (train_dflash's own)
        cache_dir = (old.get("compile_cache") or {}).get("path")
    env = collect_env(cache_dir)
    if a.against:
        t_old = _env_time(old)
        diffs = diff_env(old, env)
        newer = [r for r in installed_packages() if t_old is None or r[2] > t_old]
        text = [f"Changes since {a.against} (its env.json: the environment of the run that wrote it, recorded "
                f"{old.get('time')} on {old.get('hostname')}):"]
        w = max([len(k) for k, _, _ in diffs] + [10])
        text += [f"  {k:<{w}}  {json.dumps(o, default=str)}  ->  {json.dumps(n, default=str)}" for k, o, n in diffs]
        if not diffs:
            text.append("  no field differs")
        during = old.get("changed_during_run") or []
        if during:   # the run kept what it had loaded at its start (the left side above)
            text.append(f"While that run was going, {len(during)} field(s) changed (the run kept the first value):")
            text += [f"  {k}  {json.dumps(o, default=str)}  ->  {json.dumps(n, default=str)}" for k, o, n in during]
        text.append(format_packages(newer, f"Packages installed or modified after the checkpoint ({len(newer)}):"))
        emit({"checkpoint": a.against, "checkpoint_time": old.get("time"), "changed_during_run": during,
              "differences": [{"field": k, "old": o, "new": n} for k, o, n in diffs],
              "packages_after": [{"name": n, "version": v, "mtime": t, "time": _fmt_time(t)} for n, v, t in newer]},
             "\n".join(text))
        return 0
    recent = installed_packages()[:15]
    emit({"env": env, "recent_packages": [{"name": n, "version": v, "mtime": t, "time": _fmt_time(t)}
                                          for n, v, t in recent]},
         format_report(env) + "\n" + format_packages(recent, "15 most recently installed/modified packages:"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
