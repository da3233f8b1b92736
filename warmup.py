"""Compile every (drafter device x shape bucket) serially, before any training thread starts.

    python warmup.py --drafter-devices cuda:5,cuda:6,cuda:7 --target Qwen/Qwen3-8B [shape options]

Why serially: while one thread compiles, torch.fx's process-global tracing flag is up, and a compiled
call in any other thread fails or (worse) silently runs the dense fallback (../shared/compile-race.md).
Warm-up runs the drafter forward AND backward (the backward compiles lazily) for each
shape on each device, one at a time, through the gate; then marks the gate warm (shared calls,
fail_on_recompile). The inductor/triton cache is persistent (default: <out_dir>/compile_cache), so a
second start hits it; the table says which shapes were cache hits and which were cold compiles.
The same options as train_dflash.py are accepted (only the model/shape ones matter here).

--warmup-workers N (N > 0, flex): the cache is first filled by up to N child processes at once, one
shape each, for one drafter device or, with fewer workers than pairs, several in turn (group_jobs()),
longest sequences first (see precompile()); meanwhile this process
warms each pair that is ready (on the warm list, or compiled by a child) where memory allows, and
after them the rest, all cache hits. -1 (the default) = auto_workers(): by free GPU memory and CPU
cores, 0 on CPU.
"""
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time

import torch

import dflash_model as dm
from master_adamw import cast_weights
from diagnose import CACHE_INFO_FILE as CACHE_INFO   # one name for the file both sides read/write


def use_compile_cache(cache_dir, log=print):
    """Point inductor and triton at a persistent cache; record which build fills it."""
    cache_dir = os.path.abspath(cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache_dir, "triton")
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    info_path = os.path.join(cache_dir, CACHE_INFO)
    build = {"torch": torch.__version__, "torch_git": torch.version.git_version,
             "cuda": torch.version.cuda, "triton": _triton_version(),
             "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    old = None
    if os.path.exists(info_path):
        try:
            with open(info_path) as f:
                old = json.load(f)
        except (OSError, ValueError) as e:     # only the notice below depends on it: say so, go on
            old = {"unreadable": f"{type(e).__name__}: {e}"}
        if {k: old.get(k) for k in build} != build:
            log(f"[warmup] NOTICE: compile cache {cache_dir} was filled by {old}, now running {build}: "
                "its entries will not match (expect cold compiles)")
    if old is None or {k: old.get(k) for k in build} != build:
        # (re)written only when this build starts filling it: filled_at is when, and the file's age is
        # the cache's. Several processes share one cache (torchrun ranks, warm-up children): each writes
        # its own temporary file and renames it over the old one, so a reader never sees half a file.
        _write_json_atomic(info_path, {**build, "filled_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return cache_dir


def _write_json_atomic(path, obj):
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def _triton_version():
    try:
        import triton
        return triton.__version__
    except ImportError:
        return "absent"


# The (device, shape) pairs a warm-up saw compiled into a cache, keyed on everything a compiled graph
# depends on. With --warmup-workers, a restart on a warm cache then starts no children (each would
# only load the cache, ~25 s each on an H200) and goes straight to the serial warm-up.
WARM_LIST = "dflash_warm_pairs.json"


@functools.lru_cache(maxsize=1)
def _source_digest():
    src = hashlib.sha256()
    for path in (dm.__file__, __file__):
        with open(path, "rb") as f:
            src.update(f.read())
    return src.hexdigest()


def pair_key(spec, shape):
    """A hash of what a cache hit of `shape` needs to match: the drafter's spec (config, device,
    layouts, grad mode, scope...), the shape, the torch/triton build and the source of this code."""
    spec = {k: v for k, v in spec.items() if k != "recompile_limit"}    # depends on the replica count only
    blob = json.dumps({"spec": spec, "shape": list(shape), "torch": torch.__version__,
                       "torch_git": torch.version.git_version, "triton": _triton_version(),
                       "source": _source_digest()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def read_warm_list():
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    path = cache and os.path.join(cache, WARM_LIST)
    if not path or not os.path.exists(path):
        return set()
    try:
        with open(path) as f:
            return set(json.load(f))
    except (OSError, ValueError):      # a damaged list only costs the workers' time: start them all
        return set()


def add_to_warm_list(keys):
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not cache or not keys:
        return
    path = os.path.join(cache, WARM_LIST)
    # Read-modify-write under an exclusive lock, so two ranks adding at once both keep their pairs;
    # the rename keeps readers (who take no lock) from seeing a half-written list.
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _write_json_atomic(path, sorted(read_warm_list() | set(keys)))


class Claims:
    """Which process compiles which (device, shape) pair of a shared compile cache: a lock file per pair
    (compiling-<key>.lock in the cache folder), held while that pair compiles. Processes that need the
    same pairs - torchrun ranks, each on its cuda:0 (train_dflash.pin_local_gpu) - so split the cold
    compiles between them: each takes the pairs no one holds, and afterwards waits for the others'
    and loads them from the cache. A further GPU then costs a warm start, not a compile of its own.
    A lock dies with its holder: a pair whose holder died unlisted is compiled by the next waiter.
    Without a cache folder every pair is this process's."""

    def __init__(self, log=print):
        self.cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        self.log = log
        self.held = {}

    def _open(self, key):
        return open(os.path.join(self.cache, f"compiling-{key}.lock"), "a+")

    def _hold(self, key, f):
        f.truncate(0)
        f.write(f"{os.getpid()} on {platform.node()}")
        f.flush()
        self.held[key] = f

    def take(self, key):
        """Claim the pair now if no other process holds it (True: this process compiles it)."""
        if not self.cache or key in self.held:
            return True
        f = self._open(key)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return False
        self._hold(key, f)
        return True

    def wait(self, key, what):
        """Block until the pair's holder lets go, then hold it (compile it if it is still unlisted)."""
        if not self.cache or key in self.held:
            return
        f = self._open(key)
        f.seek(0)
        holder = f.read().strip() or "?"
        self.log(f"[warmup] process {holder} is compiling {what} into {self.cache}: waiting for it, "
                 "then loading its graphs")
        t0 = time.time()
        fcntl.flock(f, fcntl.LOCK_EX)
        self.log(f"[warmup] waited {time.time() - t0:.1f}s for {what}")
        self._hold(key, f)

    def release(self, key):
        f = self.held.pop(key, None)
        if f is not None:
            f.close()

    def release_all(self):
        for key in list(self.held):
            self.release(key)


def _cache_counters():
    from torch._dynamo.utils import counters
    return (sum(counters["aot_autograd"].get(k, 0) for k in ("autograd_cache_hit",)),
            sum(counters["inductor"].get(k, 0) for k in ("fxgraph_cache_hit",)),
            sum(counters["inductor"].get(k, 0) for k in ("fxgraph_cache_miss",)))


def compile_phases():
    """Seconds per compile phase so far in this process, from dynamo's own timers (nested: the
    outer phases include the inner ones)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:          # a torch without the timers: no breakdown, nothing else changes
        return {}
    return {k: sum(v) for k, v in compilation_time_metrics.items()}


def format_phases(before, after, top=6):
    """Where a cold compile's time went: the `top` biggest phases between two compile_phases()."""
    d = sorted(((after[k] - before.get(k, 0.0), k) for k in after), reverse=True)
    return ", ".join(f"{k} {v:.1f}s" for v, k in d[:top] if v >= 0.05) or "-"


def warm_shape(drafter, shape, gamma, attn, chunk_rows, compile_scope="trunk"):
    """One forward + backward of the exact training computation at `shape` = (B, S, A)."""
    B, S, A = shape
    c, dev = drafter.config, drafter.fc.weight.device
    feats = torch.randn(B, S, len(c.target_layer_ids) * c.hidden_size, device=dev,
                        dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    ids = torch.randint(0, c.vocab_size, (B, S), device=dev)
    loss_mask = torch.ones(B, S, device=dev)
    anchors = torch.arange(A).mul(max(1, (S - c.block_size) // A)).expand(B, A).contiguous()
    valid = torch.ones(B, A, dtype=torch.bool)
    with autocast(dev):
        loss, _, _ = dm.drafter_forward_loss(drafter, feats, ids, loss_mask, anchors, valid, gamma,
                                             attn=attn, chunk_rows=chunk_rows, compile_scope=compile_scope)
    had_grad = [p.grad is not None for p in drafter.parameters()]
    if loss.requires_grad:          # a frozen drafter (or no-grad mode) has no backward to compile
        dm.backward(loss, dev, shape, attn)
    for p, had in zip(drafter.parameters(), had_grad):   # leave the grads as they were: a flat buffer's
        if had:                                          # views zeroed, absent ones absent again
            p.grad.zero_()
        else:
            p.grad = None
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def autocast(dev):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")


def warm_up(drafters, shapes, gamma, attn, chunk_rows=dm.CHUNK_ROWS, on_unwarmed="error", log=print,
            compile_scope="trunk", workers=0):
    """Warm every (replica, shape), size the recompile limit, then mark the gate warm.
    workers > 0: first cold-compile the shapes in up to that many child processes (precompile());
    workers < 0: as many as auto_workers() finds room for (0 on CPU). While the children compile,
    this process warms (loads from the cache) every pair that is ready - on the warm list, or just
    compiled by a child - where its GPU has memory to spare (room_to_warm): it would idle otherwise.
    Whatever is left is warmed after the children, in order. Every warm-up in this process is serial.

    Returns the table rows [(device, shape, seconds, 'cache hit' | 'cold compile' | 'eager')], in
    replica and shape order.
    """
    gate = dm.GATE
    # Each replica (= device) and shape is its own dynamo cache entry of each compiled function.
    limit = len(drafters) * len(shapes) * dm.ENTRIES_PER_SHAPE[compile_scope] + 2
    # One spec per device (its replicas are identical): what the workers rebuild, and what the warm
    # list's keys hash - so a listed pair is exactly what a worker would have compiled.
    specs, keys, known, from_workers, ready = {}, {}, set(), set(), []
    gate.set_recompile_limit(limit)
    gate.on_unwarmed = on_unwarmed
    done = {}                    # (replica index, shape) -> its table row

    def warm(i, shape):
        drafter = drafters[i]
        dev = drafter.fc.weight.device
        before, phases = _cache_counters(), compile_phases()
        t0 = time.time()
        warm_shape(drafter, shape, gamma, attn, chunk_rows, compile_scope)
        dt = time.time() - t0
        aot_hit, fx_hit, fx_miss = (a - b for a, b in zip(_cache_counters(), before))
        # no miss and no hit: dynamo reused a graph this process already holds (same shape on
        # another replica of the same device)
        kind = "eager (sdpa)" if attn != "flex" else (
            "cold compile" if fx_miss else "cache hit" if (aot_hit or fx_hit) else "reused (in process)")
        done[(i, tuple(shape))] = (str(dev), shape, dt, kind)
        if attn == "flex":      # listed at once: a start killed later still finds it (and so do waiters)
            add_to_warm_list([keys[(str(dev), tuple(shape))]])
        log(f"[warmup] {str(dev):8s} B={shape[0]:<3d} S={shape[1]:<5d} anchors={shape[2]:<4d} "
            f"{dt:7.1f}s  {kind}")
        if kind != "eager (sdpa)" and dt >= 2.0:     # where a slow load or cold compile spent its time
            log(f"[warmup]   compile phases: {format_phases(phases, compile_phases())}")
        if kind == "cold compile" and (str(dev), tuple(shape)) in from_workers:
            log(f"[warmup] NOTICE: {dev} {tuple(shape)} was precompiled by a worker but compiled cold "
                "again here: the worker's graph differed from this process's (its compile was wasted)")
        elif kind == "cold compile" and keys.get((str(dev), tuple(shape))) in known:
            log(f"[warmup] NOTICE: {dev} {tuple(shape)} is listed in {WARM_LIST} but compiled cold: "
                "the cache lost its entries (evicted, or partly deleted)")

    def warm_pair(pair):
        """Warm every replica on the pair's device at its shape; then the pair is listed: let go of it."""
        dev, shape = pair
        for i, drafter in enumerate(drafters):
            if str(drafter.fc.weight.device) == dev and (i, shape) not in done:
                warm(i, shape)
        if pair in keys:
            claims.release(keys[pair])

    def warm_one_ready(running):
        """precompile()'s idle hook: warm one ready pair whose GPU has room; False if none."""
        for pair in list(ready):
            dev, shape = pair
            if not room_to_warm(torch.device(dev), running):
                continue
            ready.remove(pair)
            warm_pair(pair)
            if torch.device(dev).type == "cuda":      # hand its activations' blocks back: children
                with torch.cuda.device(dev):          # started later were sized without them
                    torch.cuda.empty_cache()
            return True
        return False

    claims = Claims(log)      # the pairs this process compiles (others' compiles are waited for, then loaded)
    try:
        if attn == "flex":
            for drafter in drafters:
                specs.setdefault(str(drafter.fc.weight.device),
                                 worker_spec(drafter, gamma, attn, chunk_rows, compile_scope, limit))
            keys = {(dev, tuple(shape)): pair_key(spec, shape) for dev, spec in specs.items() for shape in shapes}
            known = read_warm_list()
            if workers < 0:
                workers = auto_workers(drafters, sum(k not in known for k in keys.values()))
                log(f"[warmup] --warmup-workers auto: {workers}")
            if workers > 0:
                todo = [pair for pair in job_order(list(specs), shapes) if keys[pair] not in known]
                if len(todo) < len(keys):
                    log(f"[warmup] {len(keys) - len(todo)} of {len(keys)} (device, shape) pairs were compiled into "
                        f"this cache before ({WARM_LIST}): no worker for them")
                ready += [pair for pair in keys if keys[pair] in known]    # cache hits: warm them meanwhile

                def compiled(pair):      # in the cache now: listed, and let go, so that waiters load it
                    add_to_warm_list([keys[pair]])
                    claims.release(keys[pair])
                precompile(specs, todo, workers, log, ready=ready, on_idle=warm_one_ready, done=from_workers,
                           claim=lambda pair: claims.take(keys[pair]), on_compiled=compiled)
        # the rest, in order (all of it without workers): first what this process compiles or finds
        # listed, then each pair another process holds - wait for it, load it (or compile it, if its
        # holder died without listing it). This process holds no pair while it waits: no deadlock.
        later = []
        for pair in dict.fromkeys((str(d.fc.weight.device), tuple(s)) for d in drafters for s in shapes):
            if pair not in keys or keys[pair] in read_warm_list() or claims.take(keys[pair]):
                warm_pair(pair)
            else:
                later.append(pair)
        for pair in later:
            claims.wait(keys[pair], f"{pair[0]} B={pair[1][0]} S={pair[1][1]} A={pair[1][2]}")
            warm_pair(pair)
        gate.mark_warm()
    finally:
        claims.release_all()
    return [done[(i, tuple(shape))] for i in range(len(drafters)) for shape in shapes]


def room_to_warm(dev, running):
    """May this process warm a shape on `dev` while children compile? On a GPU only if its free memory
    covers this warm-up and every child running there reaching its peak (CHILD_GIB each, whatever
    they hold now): a child out of memory costs its whole compile again, this process one a fatal
    error. `running`: the devices of the running children, one entry per child."""
    if dev.type != "cuda":
        return True
    return torch.cuda.mem_get_info(dev)[0] >= CHILD_GIB * 2**30 * (1 + running.count(str(dev)))


# -----------------------------------------------------------------------------
# Parallel cold precompile. Most of a cold compile is single-threaded Python (dynamo, AOT autograd,
# inductor lowering), so several processes compiling different shapes at once fill the on-disk cache
# much faster than one process compiling them in turn. Children are fresh processes: no compile gate,
# no FX-tracing flag and no threads shared with the parent (which holds nothing while they run). They
# inherit os.environ, i.e. the cache folders use_compile_cache() put there, and build a drafter the
# compiled graphs cannot tell from the parent's (worker_spec). Compiled artefacts are keyed by device
# index, so each drafter GPU needs a compile of its own (a child may do several GPUs in turn: group_jobs).


def precompile(specs, pairs, workers, log=print, ready=None, on_idle=None, done=None, claim=None, on_compiled=None):
    """Compile each (drafter device, shape) of `pairs` once, in child processes, `workers` at a time, in
    the pairs' order; `specs[device]` = worker_spec() of a drafter on that device.

    The compiled artefacts are cached per device index, so every drafter GPU needs a compile of its own.
    With fewer workers than pairs, one child compiles a shape for several GPUs in turn (group_jobs):
    after the first, a GPU costs it no process start and no Triton compile (its kernels are in Triton's
    cache by then), only dynamo, AOT autograd and inductor again. A child that fails (out of memory: N
    too high) is reported with the end of its output and skipped: the serial warm-up then compiles its
    pairs itself, and raises any real error. Each pair a child compiled is appended to `ready`; while it
    waits, on_idle(devices of the running children) may do other work (True if it did: no sleep then).
    Returns the (device, shape) pairs the children compiled: the set `done`, if given, filled as they
    finish (so on_idle already sees them). claim(pair): False if another process compiles the pair (no
    child for it here); on_compiled(pair): called for each pair of a child that succeeded."""
    pairs = list(pairs)
    ready = [] if ready is None else ready
    done = set() if done is None else done
    if len(pairs) < 2:      # one pair compiles no faster in a child than in the serial warm-up
        return done
    jobs = group_jobs(pairs, workers)
    per_device = max(1, -(-workers // len(specs)))       # children's memory lands on their own GPU
    env = dict(os.environ, DFLASH_PRECOMPILE_PARENT=str(os.getpid()))   # + the cache folders use_compile_cache() set
    log(f"[warmup] precompiling {len(pairs)} (device, shape) pairs in up to {workers} worker processes "
        f"(at most {per_device} per device, longest sequences first" +
        (f"; {len(jobs)} jobs, a child compiles a shape for up to {max(len(j[0]) for j in jobs)} GPUs in turn)"
         if len(jobs) < len(pairs) else ")"))
    t_all, running = time.time(), []
    with tempfile.TemporaryDirectory(prefix="dflash_precompile_") as tmp:
        spec_paths = {}
        for i, (dev, spec) in enumerate(specs.items()):
            spec_paths[dev] = os.path.join(tmp, f"spec{i}.json")
            with open(spec_paths[dev], "w") as f:
                json.dump(spec, f)
        try:
            while jobs or running:
                while len(running) < workers:
                    job = next_job(jobs, [r[1][0] for r in running], per_device)
                    if job is None:
                        break
                    jobs.remove(job)
                    devs, shape = job
                    if claim is not None:
                        mine = tuple(d for d in devs if claim((d, shape)))
                        for d in devs:
                            if d not in mine:
                                log(f"[warmup] {d} B={shape[0]} S={shape[1]} A={shape[2]}: another process is "
                                    "compiling it (loaded from the cache later)")
                        devs = mine
                    if not devs:
                        continue
                    out_path = os.path.join(tmp, "{}_B{}_S{}_A{}.log".format(devs[0].replace(":", ""), *shape))
                    with open(out_path, "w") as out:     # the child keeps its own copy of the descriptor
                        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--precompile-one",
                                              *map(str, shape), *(spec_paths[d] for d in devs)],
                                             stdout=out, stderr=subprocess.STDOUT, env=env)
                    running.append((p, devs, shape, out_path, time.time()))
                if not (on_idle and on_idle([d for r in running for d in r[1]])):
                    time.sleep(0.2)
                for job in [j for j in running if j[0].poll() is not None]:
                    running.remove(job)
                    p, devs, (B, S, A), out_path, t0 = job
                    with open(out_path) as f:
                        lines = f.readlines()
                    what = f"{','.join(devs)} B={B} S={S} A={A}"
                    if p.returncode == 0:
                        for d in devs:
                            done.add((d, (B, S, A)))
                            ready.append((d, (B, S, A)))
                            if on_compiled is not None:
                                on_compiled((d, (B, S, A)))
                        phases = [ln.rstrip() for ln in lines if ln.startswith("[warmup]   compile phases")]
                        log(f"[warmup] precompiled {what} in {time.time() - t0:.1f}s (worker)"
                            + "".join(f"\n{ln}" for ln in phases))
                        continue
                    tail = "".join(lines[-40:])
                    log(f"[warmup] WARNING: the worker for {what} failed (exit {p.returncode}); "
                        f"the serial warm-up compiles it instead. Its output ends:\n{tail}")
        finally:
            for p, *_ in running:    # an error or Ctrl-C here: leave no orphan compiling (and holding GPU memory)
                p.kill()
                p.wait()
    log(f"[warmup] precompiled {len(done)} pairs in {time.time() - t_all:.1f}s wall")
    return done


def job_order(devices, shapes):
    """Longest sequence first (a cold compile takes longer the longer the sequence: on an H200, 66 s at
    S 256 and 215 s at S 3072), devices interleaved: the slowest pairs start in the first wave instead
    of last, which bounds the wall time by the slowest pair rather than by a queue behind it."""
    order = sorted((tuple(s) for s in shapes), key=lambda s: (-s[1], -s[0] * s[1]))
    return [(dev, shape) for shape in order for dev in devices]


def group_jobs(pairs, workers):
    """The children's jobs, [(devices, shape)], from (device, shape) pairs in job_order's order. As many
    workers as pairs: a job per pair. Fewer: each shape's devices are split into as many jobs as the
    workers allow it (the longest shapes get the spare ones), and one child compiles its devices in
    turn. On 2 GPUs with 6 workers and 5 shapes, 10 one-pair children ran in two waves (102 s; ~50 s
    each); 6 jobs run in one. Each shape's devices are rotated so that children start on different GPUs
    (next_job counts a child on the GPU it starts on)."""
    if workers >= len(pairs):
        return [((d,), s) for d, s in pairs]
    shapes = list(dict.fromkeys(s for _, s in pairs))
    jobs = []
    for i, shape in enumerate(shapes):
        devs = [d for d, s in pairs if s == shape]
        devs = devs[i % len(devs):] + devs[: i % len(devs)]
        n = min(len(devs), max(1, workers // len(shapes) + (i < workers % len(shapes))))
        jobs += [(tuple(devs[k * len(devs) // n:(k + 1) * len(devs) // n]), shape) for k in range(n)]
    return jobs


def next_job(jobs, running_devices, per_device):
    """The first job whose (first) device has fewer than per_device children running (None: wait)."""
    for devs, shape in jobs:
        if running_devices.count(devs[0]) < per_device:
            return devs, shape
    return None


CHILD_GIB = 34    # what one child may need on its GPU at Qwen3-8B size (measured peak ~31 GiB at S 3072)


def auto_workers(drafters, n_pairs):
    """--warmup-workers -1: on CUDA, up to 3 children per drafter GPU as its free memory allows (each
    may need CHILD_GIB), at most one per 4 CPU cores and one per pair; 0 on CPU (no flex to compile)."""
    devices = list(dict.fromkeys(d.fc.weight.device for d in drafters))
    if devices[0].type != "cuda":
        return 0
    per_device = min(max(1, min(3, torch.cuda.mem_get_info(d)[0] // (CHILD_GIB * 2**30))) for d in devices)
    return int(min(per_device * len(devices), max(1, (os.cpu_count() or 4) // 4), n_pairs))


def _die_with_parent():
    # Linux: ask for SIGKILL when the parent dies for any reason (kill -9, a scheduler's time limit), so
    # no worker outlives the start it compiles for; if the parent is already gone, stop now. (Done in
    # the child at start-up, not with preexec_fn, which is unsafe in a parent that runs threads.)
    if sys.platform.startswith("linux"):
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG = 1
    if str(os.getppid()) != os.environ.get("DFLASH_PRECOMPILE_PARENT", str(os.getppid())):
        sys.exit("precompile worker: the parent process is gone")


def worker_spec(drafter, gamma, attn, chunk_rows, compile_scope, recompile_limit):
    """What a child needs to build a drafter its compiled graphs cannot tell from `drafter`: the same
    config, parameter dtype, device, buffer layout (shape, stride, storage offset and size: inductor
    keys GPU buffers on them), requires_grad, grad mode and (CPU) thread count. Values do not matter."""
    def layout(t):
        return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype),
                "offset": t.storage_offset(), "storage_bytes": t.untyped_storage().nbytes()}
    return {"config": dataclasses.asdict(drafter.config), "device": str(drafter.fc.weight.device),
            "param_dtype": str(next(drafter.parameters()).dtype),
            "embed_weight": layout(drafter.embed_weight), "lm_head_weight": layout(drafter.lm_head_weight),
            "tied": drafter.lm_head_weight.data_ptr() == drafter.embed_weight.data_ptr(),
            # tied as one tensor object, or as two views of one storage (the trainer's tied target):
            # dynamo tells them apart, so the child must build the same kind
            "same_object": drafter.lm_head_weight is drafter.embed_weight,
            "frozen": [n for n, p in drafter.named_parameters() if not p.requires_grad],
            "grad_enabled": torch.is_grad_enabled(), "recompile_limit": recompile_limit,
            "num_threads": torch.get_num_threads(),   # CPU kernels are generated for a thread count
            "gamma": gamma, "attn": attn, "chunk_rows": chunk_rows, "compile_scope": compile_scope,
            "flex_options": dict(dm.FLEX_OPTIONS)}


def precompile_one(shape, spec_paths):
    """Child of precompile(): for each spec in turn, rebuild the parent's drafter on its device, compile
    `shape`, free it; exit 0."""
    _die_with_parent()
    for path in spec_paths:
        t0, phases, dev = time.time(), compile_phases(), _precompile_on(path, shape)
        where = f" ({dev}, {time.time() - t0:.1f}s)" if len(spec_paths) > 1 else ""
        print(f"[warmup]   compile phases{where}: {format_phases(phases, compile_phases(), top=12)}", flush=True)


def _precompile_on(spec_path, shape):
    with open(spec_path) as f:
        spec = json.load(f)
    dev = torch.device(spec["device"])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dtype = lambda s: getattr(torch, s.removeprefix("torch."))

    def buffer(m):   # the parent's layout in a storage of the parent's size, and NOT a view (dynamo treats views apart)
        dt = dtype(m["dtype"])
        storage = torch.zeros(m["storage_bytes"] // dt.itemsize, dtype=dt, device=dev).untyped_storage()
        return torch.empty(0, dtype=dt, device=dev).set_(storage, m["offset"], m["shape"], m["stride"])
    with torch.device(dev):   # initialise on the device (a Qwen3-8B-sized drafter is slow to init on CPU)
        drafter = dm.DFlashDrafter(dm.DFlashConfig(**spec["config"]), embed_weight=torch.empty(0))
    cast_weights(drafter.parameters(), dtype(spec["param_dtype"]))     # as the parent's (rope tables stay fp32)
    drafter.embed_weight = buffer(spec["embed_weight"])
    if spec["tied"]:
        e = drafter.embed_weight
        drafter.lm_head_weight = e if spec.get("same_object", True) else e.detach()
    else:
        drafter.lm_head_weight = buffer(spec["lm_head_weight"])
    for name, p in drafter.named_parameters():
        p.requires_grad_(name not in spec["frozen"])
    torch.set_grad_enabled(spec["grad_enabled"])
    torch.set_num_threads(spec["num_threads"])
    dm.GATE.set_recompile_limit(spec["recompile_limit"])
    dm.set_flex_options(spec["flex_options"])
    warm_shape(drafter, shape, spec["gamma"], spec["attn"], spec["chunk_rows"], spec["compile_scope"])
    del drafter
    if dev.type == "cuda":      # the next device's compile starts from this GPU's memory handed back
        torch.cuda.empty_cache()
    return dev


def format_table(rows):
    lines = [f"{'device':10s} {'shape (B,S,A)':18s} {'seconds':>8s}  compile", "-" * 52]
    for dev, shape, dt, kind in rows:
        lines.append(f"{dev:10s} {str(tuple(shape)):18s} {dt:8.1f}  {kind}")
    lines.append(f"total {sum(r[2] for r in rows):.1f}s over {len(rows)} (device, shape) pairs")
    return "\n".join(lines)


def build_drafters(cfg):
    """The drafter replicas train_dflash.Trainer builds for `cfg`, one per drafter device. A compiled
    graph and the warm list key on the drafter's config (mask token included), its weight dtype and
    the dtype, device, layout and tying of the embedding and LM head it reads, so each is made with
    the trainer's own functions (mask_token_for, new_drafter). The
    target's weights are not loaded: its model on the meta device gives the shapes and whether
    embedding and head are one tensor, and empty tensors stand in (a compile never reads values)."""
    import train_dflash as tr
    from transformers import AutoModelForCausalLM
    tcfg, tok = tr.load_target_config(tr.target_path(cfg))
    tdevs, ddevs = tr.resolve_devices(cfg)
    vocab = getattr(tcfg, "text_config", tcfg).vocab_size
    dcfg = tr.make_drafter_config(cfg, tcfg, tr.mask_token_for(cfg, tok, vocab))
    tdtype = tr.param_dtype(tdevs[0])
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tcfg, dtype=tdtype)
    m_emb, m_head = meta.get_input_embeddings().weight, meta.get_output_embeddings().weight
    emb = torch.empty(m_emb.shape, dtype=tdtype, device=tdevs[0])     # the target's, on its first device
    # Tied: build_models' two .detach() calls give two tensor objects over one storage (dynamo treats
    # one object seen twice apart from two aliases), so a second view here too, not the same object.
    head = emb.detach() if m_head is m_emb else torch.empty(m_head.shape, dtype=tdtype, device=tdevs[0])
    drafters = []
    for d in ddevs:
        dr = tr.new_drafter(dcfg, emb, head, d, tdtype, cfg.seed)
        cast_weights(dr.parameters(), tr.param_dtype(d))     # the trainer's weight dtype (its optimiser casts them so)
        drafters.append(dr)
    return dcfg, drafters


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--precompile-one"]:      # a child of precompile(): B S A SPEC [SPEC ...]
        return precompile_one(tuple(map(int, argv[1:4])), argv[4:])
    import train_dflash as tr
    cfg = tr.parse_config(argv)
    use_compile_cache(cfg.compile_cache or os.path.join(cfg.out_dir, "compile_cache"))
    dm.set_flex_options(cfg.flex_options)
    attn = tr.resolve_attn(cfg, tr.resolve_devices(cfg)[1][0])
    dcfg, drafters = build_drafters(cfg)
    shapes = tr.shape_plan(cfg, dcfg.block_size)
    print(f"[warmup] {len(drafters)} drafter device(s) x {len(shapes)} shapes, attention={attn}")
    rows = warm_up(drafters, shapes, cfg.gamma or tr.default_gamma(dcfg.block_size), attn, cfg.chunk_rows,
                   cfg.on_unwarmed, compile_scope=cfg.compile_scope, workers=cfg.warmup_workers)
    print(format_table(rows))


if __name__ == "__main__":
    main()
