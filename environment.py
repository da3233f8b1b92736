"""What a DFlash training run runs on, and what changed since a checkpoint: train_dflash.py writes collect_env() into
every checkpoint (env.json) and format_report() atop every log; diagnose.py prints them and compares (--against)."""
import datetime
import getpass
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from contextlib import suppress

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_", "TORCHDYNAMO_", "TRITON_", "CUDA_VISIBLE_DEVICES", "NCCL_", "PYTORCH_",
                "OMP_NUM_THREADS", "CUDA_LAUNCH_BLOCKING", "HF_")   # with ENV_NAMES: what changes speed or numerics
ENV_NAMES = {"LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "CUDA_DEVICE_MAX_CONNECTIONS", "NVIDIA_TF32_OVERRIDE",
             "CUBLAS_WORKSPACE_CONFIG", "CUDA_MODULE_LOADING", "MKL_NUM_THREADS"}
SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")   # logs get shared: recorded as <set>
LIBRARIES = ("transformers", "datasets", "numpy", "safetensors")   # versions recorded besides torch and triton
NVIDIA_SMI_FIELDS = ("index", "name", "driver_version", "memory.total")

def collect_env(cache_dir=None):
    """Everything that decides whether a run reproduces. Never raises (a failing part records its error: a hole beats
    a crashed run) and starts no compile and no python: the trainer calls it at every start."""
    now = datetime.datetime.now().astimezone()
    env = {"time": now.isoformat(timespec="seconds"), "time_unix": now.timestamp()}
    parts = {"hostname": socket.gethostname, "platform": platform.platform, "cpu_count": os.cpu_count,
             # as is: a venv's python is a symlink to the base interpreter, and the venv is what runs
             "python_executable": lambda: sys.executable, "python_prefix": lambda: sys.prefix,
             "versions": _versions, "gpus": _gpus, "env_vars": _env_vars, "project": _git_state,
             "compile_cache": lambda: cache_state(cache_dir),
             "packages": lambda: {n: v for n, v, _ in sorted(installed_packages(), key=lambda r: r[0].lower())}}
    for key, fn in parts.items():
        try:
            env[key] = fn()
        except Exception as e:
            env[key] = {"error": f"{type(e).__name__}: {e}"}
    return env

def _versions():
    # a distribution's version without importing it, the first found on sys.path: "absent" is an answer
    installed = lambda *ds: next((x.version for d in ds for x in importlib.metadata.distributions(name=d)), "absent")
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
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=" + ",".join(NVIDIA_SMI_FIELDS), "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    except Exception as e:   # FileNotFoundError: no NVIDIA driver here, nothing to ask
        return g if isinstance(e, FileNotFoundError) else g | {"nvidia_smi": [f"error: {type(e).__name__}: {e}"]}
    lines = [line.strip() for line in r.stdout.splitlines() if line.strip()]
    if r.returncode == 0 and lines and all(line.count(",") == len(NVIDIA_SMI_FIELDS) - 1 for line in lines):
        return g | {"nvidia_smi": lines, "driver": lines[0].split(",")[2].strip()}
    first = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[0][:200]   # its message: the diagnosis
    return g | {"nvidia_smi": [f"error: {f'exit {r.returncode}' if r.returncode else 'unexpected output'}: {first}"]}

def _env_vars():
    env = {k: ("<set>" if any(m in k.upper() for m in SECRET_MARKERS) else v)
           for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}
    if os.path.abspath(env.get("TORCHINDUCTOR_CACHE_DIR", "-")) == _default_cache_dir():
        del env["TORCHINDUCTOR_CACHE_DIR"]   # importing torch._dynamo exports inductor's default here: nobody chose it
    return env

def _default_cache_dir():   # inductor's rule, without importing inductor (seconds, and it exports the variable)
    try:
        user = getpass.getuser()
    except Exception:   # a container's uid without a passwd entry
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))

def with_cache(env, cache_dir):
    """`env` with the compile cache as it is now (a checkpoint's env.json: the start's code and packages)."""
    return {**env, "compile_cache": cache_state(cache_dir)}

def cache_state(cache_dir):
    """Where the compile cache is and how much it holds (how its entries serve a run: the warm-up's log says)."""
    chosen = cache_dir or _env_vars().get("TORCHINDUCTOR_CACHE_DIR")   # as recorded: inductor's export is no choice
    source = "argument" if cache_dir else "TORCHINDUCTOR_CACHE_DIR" if chosen else "inductor default"
    path, sizes = os.path.abspath(chosen or _default_cache_dir()), []
    for root, _, names in os.walk(path):
        for name in names:
            with suppress(OSError):   # inductor renames and removes files while we walk
                sizes.append(os.lstat(os.path.join(root, name)).st_size)
    return {"path": path, "source": source, "exists": os.path.isdir(path), "size_bytes": sum(sizes),
            "file_count": len(sizes)}

def _git_state(path=HERE):
    """A git command that fails leaves its fields None and says why in "error": a failure must not read as clean."""
    g = {"dir": path, "commit": None, "dirty": None, "dirty_files": [], "diff_sha256": None,
         "untracked_files": None, "untracked_count": None}
    errors = []

    def git(*args):   # stdout as bytes (the diff is hashed as it is); on failure None, and the reason in errors
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
        # names miss a further edit of a dirty file: hash the diff (binary too; no ext-diff/textconv from git config)
        if (diff := git("diff", "HEAD", "--binary", "--no-ext-diff", "--no-textconv", "--no-color")) is not None:
            g["diff_sha256"] = hashlib.sha256(diff).hexdigest()
        # untracked and not ignored: a new module the code may import (out/ and logs are ignored)
        if (others := git("ls-files", "--others", "--exclude-standard")) is not None:
            names = sorted(line for line in others.decode(errors="replace").splitlines() if line.strip())
            g["untracked_files"], g["untracked_count"] = names[:50], len(names)
    return g | {"error": "; ".join(errors)} if errors else g

def installed_packages():
    """[(name, version, mtime of its dist-info folder, which pip creates at each install)], newest first."""
    rows = {}
    for d in importlib.metadata.distributions():
        # skipped: a package shadowed by one earlier on sys.path, and copies in setuptools' _vendor once imported
        if (name := d.metadata["Name"]) and name.lower() not in rows and f"{os.sep}_vendor{os.sep}" not in str(d._path):
            rows[name.lower()] = (name, d.version, os.path.getmtime(d._path))
    return sorted(rows.values(), key=lambda r: -r[2])

# --- What changed, and the report. IGNORED: what changes at every call or grows in a healthy run.
IGNORED = {"time", "time_unix", "compile_cache.size_bytes", "compile_cache.file_count"}
MISSING = "(missing)"

def diff_env(old, new):
    fo, fn = (_flatten(json.loads(json.dumps(env, default=str))) for env in (old, new))   # compared as in env.json
    rows = [(k, fo.get(k, MISSING), fn.get(k, MISSING)) for k in sorted(fo | fn) if k not in IGNORED]
    return [(k, a, b) for k, a, b in rows if a != b]

def _flatten(d, prefix=""):   # an empty dict leaves no key: {} and absent are the same state
    return {key: x for k, v in d.items()
            for key, x in (_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}).items()}

def format_report(env):
    v, g, c, p = (env.get(k) or {} for k in ("versions", "gpus", "compile_cache", "project"))
    lines = [f"DFlash environment  {env.get('time')}  host {env.get('hostname')}  ({env.get('platform')}, "
             f"{env.get('cpu_count')} CPUs)",
             f"  python {v.get('python')}  {env.get('python_executable')}  (prefix {env.get('python_prefix')})",
             f"  torch {v.get('torch')}  git {str(v.get('torch_git'))[:12]}  CUDA {v.get('cuda')}  "
             f"cuDNN {v.get('cudnn')}",
             "  " + "  ".join(f"{k} {v.get(k)}" for k in ("triton", *LIBRARIES))]
    kinds = Counter(zip(g.get("names", []), g.get("memory_gib", []), g.get("capability", [])))
    gpus = ", ".join(f"{n} x {name} ({mem} GiB, capability {cap})" for (name, mem, cap), n in kinds.items())
    lines.append(f"  GPUs: {gpus}, driver {g.get('driver')}" if g.get("count") else
                 f"  GPUs: none visible to torch (CUDA available: {g.get('cuda_available')})"
                 + (f"; nvidia-smi: {g['nvidia_smi']}" if g.get("nvidia_smi") else ""))
    dirty = ("dirty: unknown" if p.get("dirty") is None else "clean" if not p["dirty"] else
             f"DIRTY: {', '.join(p['dirty_files'])} (diff sha256 {str(p.get('diff_sha256'))[:12]})")
    lines.append(f"  project {p.get('dir')}  commit {p.get('commit')}  {dirty}")
    lines += [f"    git error: {p['error']}"] if p.get("error") else []
    if p.get("untracked_count"):
        lines.append(f"    {p['untracked_count']} untracked: {', '.join(p['untracked_files'])}")
    lines.append(f"  compile cache {c.get('path')} ({c.get('source')}): " + (
        f"{c.get('size_bytes', 0) / 2**20:,.1f} MiB in {c.get('file_count')} files" if c.get("exists")
        else "does not exist -> every shape compiles cold"))
    variables = "  ".join(f"{k}={x}" for k, x in (env.get("env_vars") or {}).items())
    lines.append(f"  env: {variables or '(none of the recorded variables)'}")
    return "\n".join(lines)

def format_packages(rows, title):
    when = lambda t: datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")
    return "\n".join([title] + ([f"  {when(t)}  {n} {ver}" for n, ver, t in rows] or ["  (none)"]))
