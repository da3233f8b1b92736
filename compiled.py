"""The compile machinery: 1. the gate every compiled call passes, 2. the compiled calls (the drafter's flex trunk and
backward, the target's layers and CUDA graphs), 3. the persistent compile cache, 4. the warm-up, 5. streams, timers.

What torch does, by version (the one place this is written down):
  * Every compile that misses the AOTAutograd cache raises a process-global "FX tracing" flag (per thread from
    torch 2.14): a compiled call another thread starts meanwhile fails ("Detected that you are using FX to
    symbolically trace a dynamo-optimized function") or, with error_on_nested_fx_trace=False, runs uncompiled
    (flex: its dense path, silently). 2.12 and 2.13 hide the flag from other threads while anything compiles.
  * dynamo's config is per thread from torch 2.12: every thread passing the gate sets it and reads it back.
  * Two threads at once in one code object's dynamo cache entry can see a spurious recompile ("runtime guards failed
    even though they passed"): a code object per target, a GPU per compiled drafter replica (config.resolve_attn).
  * CPU inductor (torch 2.13) miscompiles a chain of boolean masks and flex tiles cut short: the DFlash mask is
    two comparisons, and flex shapes are multiples of 128.
"""
import functools
import itertools
import os
import statistics
import threading
import time
import types
from contextlib import contextmanager

import torch

import config
import dflash_model as dm
from errors import UserError

# ---- 1. The gate: exclusive (one compiled call at a time, process-wide) until the warm-up has compiled every key the
# run uses; then warmed keys share it and may not compile ("fail_on_recompile" stance); an unwarmed key is an error.

class UnwarmedShapeError(RuntimeError):
    pass

class CompileGate:
    def __init__(self):
        self.cond, self.local = threading.Condition(), threading.local()
        self.readers, self.writer, self.waiting = 0, None, 0     # threads in shared calls; the exclusive holder
        self.warm, self.warmed = False, set()
        self.recompile_limit, self.generation = 8, 0   # the limit: sized by the warm-up

    def configure_thread(self):
        """Set and verify the dynamo settings in the calling thread (idempotent)."""
        if getattr(self.local, "generation", -1) == self.generation:
            return
        import torch._dynamo.config as dynamo_cfg
        wanted = {"error_on_nested_fx_trace": True,      # never silently run uncompiled
                  "fail_on_recompile_limit_hit": True,   # never silently fall back to eager
                  "recompile_limit": self.recompile_limit,
                  "accumulated_recompile_limit": max(256, 4 * self.recompile_limit)}
        for k, v in wanted.items():
            setattr(dynamo_cfg, k, v)
        if (got := {k: getattr(dynamo_cfg, k) for k in wanted}) != wanted:
            raise RuntimeError(f"dynamo config did not take in thread {threading.current_thread().name}: "
                               f"wanted {wanted}, got {got}")
        self.local.generation = self.generation

    def set_recompile_limit(self, n):
        self.recompile_limit, self.generation = int(n), self.generation + 1   # every thread re-applies it
        self.configure_thread()

    @contextmanager
    def exclusive(self):
        with self.cond:
            self.waiting += 1
            self.cond.wait_for(lambda: self.writer is None and self.readers == 0)
            self.waiting -= 1
            self.writer = threading.current_thread()
        try:
            yield
        finally:
            with self.cond:
                self.writer = None
                self.cond.notify_all()

    @contextmanager
    def shared(self):
        # the hot path of every compiled call after the warm-up: its exit wakes others only for a writer
        with self.cond:
            self.cond.wait_for(lambda: self.writer is None and self.waiting == 0)
            self.readers += 1
        try:
            yield
        finally:
            with self.cond:
                self.readers -= 1
                if self.readers == 0 and self.waiting:
                    self.cond.notify_all()

    def run(self, name, device, shape, fn, *args, **kwargs):
        """Call the compiled `fn` for key (name, device, shape) under the gate's rules."""
        self.configure_thread()
        if getattr(self.local, "inside", False):      # nested in a call that holds the gate already
            return fn(*args, **kwargs)
        key, self.local.inside = self.key(name, device, shape), True
        try:
            if self.warm and key in self.warmed:
                with self.shared():
                    try:
                        return fn(*args, **kwargs)
                    except RuntimeError as e:
                        if "fail_on_recompile" not in str(e):
                            raise
                        raise UnwarmedShapeError(
                            f"compiled call '{name}' {tuple(shape)} on {device} was warmed, but dynamo wants to "
                            "recompile it now (a guard changed: dtype, grad mode, module or a Python constant). "
                            f"Refusing: under the warm gate nothing may compile. ({e})") from e
            if self.warm:
                raise UnwarmedShapeError(
                    f"compiled call '{name}' with shape {tuple(shape)} on {device} was not warmed up. "
                    f"Warmed keys: {sorted(k for k in self.warmed if k[1] == str(device))}. "
                    "Every shape the run uses must be in the warm-up's shape plan.")
            with self.exclusive():
                out = fn(*args, **kwargs)
            self.warmed.add(key)
            return out
        finally:
            self.local.inside = False

    @staticmethod
    def key(name, device, shape):
        # grad mode and autocast are dynamo guards, so they are part of the key too
        return (name, str(device), tuple(shape), torch.is_grad_enabled(),
                torch.is_autocast_enabled("cuda") if str(device).startswith("cuda") else False)

    def mark_warm(self, log=print):
        """Warm-up done: from now on compiled calls share the gate and may not recompile."""
        with self.exclusive():
            torch.compiler.set_stance("fail_on_recompile")
            self.warm = True
        log(f"[gate] warm: {len(self.warmed)} compiled keys, recompile_limit={self.recompile_limit}, "
            "unwarmed shapes -> error")

GATE = CompileGate()

# ---- 2. The compiled calls, only through GATE.run; dynamic=False: an entry per shape (length buckets keep them few).

def _trunk(drafter, *args):
    return type(drafter).trunk(drafter, *args)

# The trunk is one graph: inductor fuses norms, rope and activations around the matmuls across layers. One code
# object serves every replica: a GPU per compiled replica (see the top).
compiled_trunk = torch.compile(_trunk, dynamic=False, fullgraph=True)
compiled_attention = torch.compile(dm.attention, dynamic=False, fullgraph=True)   # flex alone (tests, the race demo)

def compile_drafter(drafter):
    """The drafter's trunk compiled, with flex attention on the tile-level BlockMask, and called through GATE; its
    backward goes through GATE too (backward). The model is unchanged otherwise: it calls its trunk as before."""
    bs = drafter.config.block_size

    def gated(target_feats, block_ids, ctx_pos, block_pos, mask):
        (B, S), A = ctx_pos.shape, block_ids.shape[1] // bs
        return GATE.run("drafter_fwd", ctx_pos.device, (B, S, A, bs), compiled_trunk, drafter, target_feats,
                        block_ids, ctx_pos, block_pos, mask)
    drafter.trunk, drafter.block_mask = gated, True
    return drafter

def backward(drafter, loss, shape):
    """loss.backward(); a compiled drafter's through the gate (its compiled backward compiles on the first call)."""
    if not torch.is_grad_enabled():   # a forward-only pass the caller chose (CPU flex has no backward)
        return
    if drafter.block_mask:
        GATE.run("drafter_bwd", loss.device, shape, loss.backward)
    else:
        loss.backward()

def _layer_forward(layer, hidden_states, *args, **kwargs):
    return type(layer).forward(layer, hidden_states, *args, **kwargs)

_TARGET_NUMBERS = itertools.count()

def compile_target_layers(target):
    """Compile the target's decoder layers (one graph per shape for all of them, a code object per target: see the
    top), called through GATE. A full-attention layer gets no mask (rows are right-padded): SDPA's causal kernel, and
    one graph per shape also under a CUDA-graph capture, where transformers builds the mask as a tensor."""
    code = _layer_forward.__code__.replace(co_name=f"target_layers_{next(_TARGET_NUMBERS)}")
    fn = torch.compile(types.FunctionType(code, globals()), dynamic=False, fullgraph=True)

    def gated(layer, causal, hidden_states, *args, **kwargs):
        if causal:
            kwargs["attention_mask"] = None
        return GATE.run("target_layer", hidden_states.device, tuple(hidden_states.shape), fn, layer,
                        hidden_states, *args, **kwargs)
    for layer in target.model.layers:
        layer.forward = functools.partial(gated, layer, getattr(layer.self_attn, "sliding_window", None) is None)

def replay(graphs, key, fn, device):
    """fn() on a CPU; on a GPU a replay of the CUDA graph captured from fn under `key` (fn touches only tensors that
    outlive it; one dict's graphs share a memory pool: they never run at the same time)."""
    if device.type != "cuda":
        return fn()
    if key not in graphs:
        s = torch.cuda.Stream(device)       # warm up on a side stream (lazy inits, the kernels' checks), capture
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream(device).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=graphs.get("pool")):
            out = fn()
        graphs["pool"], graphs[key] = g.pool(), (g, out)
    g, out = graphs[key]
    g.replay()
    return out

class GraphedTarget:
    """dm.target_forward as a CUDA-graph replay per (B, S) captured at the warm-up: a small target is bound by launching
    kernels under the GIL the drafter threads share. Off CUDA or uncaptured it runs gated (refusing unwarmed shapes)."""
    def __init__(self, target, layer_ids, final):
        self.target, self.layer_ids, self.final = target, list(layer_ids), final
        self.device, self.graphs, self.inputs = next(target.parameters()).device, {}, {}

    def forward(self, ids):
        with torch.no_grad():
            return dm.target_forward(self.target, ids, self.layer_ids, self.final)

    def capture(self, B, S):
        if self.device.type == "cuda":
            ids = self.inputs[(B, S)] = torch.zeros(B, S, dtype=torch.long, device=self.device)
            replay(self.graphs, (B, S), lambda: self.forward(ids), self.device)

    def __call__(self, ids):
        static = self.inputs.get(tuple(ids.shape))
        if static is None:
            return self.forward(ids.to(self.device, non_blocking=True))
        static.copy_(ids, non_blocking=True)
        # a copy: the next replay overwrites the graph's output, and the trainer queues features ahead
        return replay(self.graphs, tuple(ids.shape), None, self.device).clone()

# ---- 3. The compile cache

def use_compile_cache(cache_dir):
    """Point inductor and triton at a persistent cache (an entry of another torch/triton/CUDA build or GPU misses:
    the warm-up's log says which shapes compiled cold)."""
    cache_dir = os.path.abspath(cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
    os.environ.update(TORCHINDUCTOR_CACHE_DIR=cache_dir, TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    return cache_dir

def _cache_counters():
    from torch._dynamo.utils import counters
    return (counters["aot_autograd"].get("autograd_cache_hit", 0), counters["inductor"].get("fxgraph_cache_hit", 0),
            counters["inductor"].get("fxgraph_cache_miss", 0))

# ---- 4. The warm-up

def warm_shape(drafter, shape, step, loss):
    """The training step's forward + backward at `shape` = (B, S, A): step(drafter, [(features, Batch)], weight_sum)
    (replicas.forward_backward, the trainer's own) on random features and anchors spread over the sequence."""
    (B, S, A), c, dev = shape, drafter.config, drafter.fc.weight.device
    width = (len(c.target_layer_ids) + (loss.distill > 0)) * c.hidden_size      # distillation: the teacher's too
    feats = torch.randn(B, S, width, device=dev, dtype=config.param_dtype(dev))
    ids = torch.randint(0, c.vocab_size, (B, S), device=dev)
    anchors = torch.arange(A).mul(max(1, (S - c.block_size) // A)).expand(B, A).contiguous()
    batch = dm.make_batch(ids, torch.ones(B, S, device=dev), anchors, torch.ones(B, A, dtype=torch.bool), c, loss)
    step(drafter, [(feats, batch)], None)
    sync_device(dev)

def warm_target(graphed, B, S):
    """Compile the target's layers at (B, S), capture its graph, check its features against eager ones: returns the
    worst row's median relative error. A wrong mask or layer moves most positions by order 1; bf16 most by ~1e-2 and
    a few random tokens by order 1 (outliers forming on one path only): a row's median is held to 0.1 (fp32: 1e-4)."""
    dev, dtype = graphed.device, next(graphed.target.parameters()).dtype
    ids = torch.randint(0, graphed.target.config.vocab_size, (B, S), device=dev)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    graphed.forward(ids)                                   # compiles, outside the capture
    graphed.capture(B, S)
    got = graphed(ids).float()
    with torch.compiler.set_stance("force_eager"):         # the reference, deliberately eager
        want = graphed.forward(ids).float()
    err = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)       # (B, S): each position's
    worst = float(err.median(dim=1).values.max())
    if not worst <= tol:
        raise UserError(f"the compiled target's features at (B, S) = {(B, S)} differ from the eager "
                        f"target's: a row's median position by {worst:.2e} (relative; {dtype} allows "
                        f"{tol:g}): refusing to train on them. Report it with `python diagnose.py` output")
    return worst

def warm_up(drafters, shapes, step, loss, log=print, targets=()):
    """Warm every (target, (B, S)) of compiled targets (GraphedTarget) and every (replica, shape) in turn (warm_shape:
    the real step; the gradients it leaves are the caller's to zero), size the recompile limit, then mark the gate
    warm. Returns a row per pair: [(device, shape, seconds, how)]."""
    target_shapes = sorted({(B, S) for B, S, _ in shapes})
    # dynamo entries: per (replica, shape) on the drafter's code object, per ((B, S), layer kind) on a target's
    kinds = len(set(getattr(targets[0].target.config, "layer_types", None) or [0])) if targets else 0
    GATE.set_recompile_limit(max(len(drafters) * len(shapes), kinds * len(target_shapes)) + 2)
    rows, t_start = [], time.time()
    n = len(targets) * len(target_shapes) + len(drafters) * len(shapes)

    def timed(dev, shape, fn, compiled):
        before, t0 = _cache_counters(), time.time()
        note = fn()
        aot_hit, fx_hit, fx_miss = (a - b for a, b in zip(_cache_counters(), before))
        how = ("eager (sdpa)" if not compiled else "cold compile" if fx_miss else
               "cache hit" if aot_hit or fx_hit else "reused (in process)")   # reused: a graph of this process
        how += "" if note is None else f", features {note:.0e} from eager"
        rows.append((dev, tuple(shape), time.time() - t0, how))
        eta = (time.time() - t_start) / len(rows) * (n - len(rows))   # a cold compile takes tens of seconds
        log(f"[warmup] {len(rows)}/{n} {dev:14s} {str(rows[-1][1]):18s} {rows[-1][2]:7.1f}s  {rows[-1][3]}"
            + (f" | ETA {eta:.0f}s" if len(rows) < n else ""))
    for graphed, (B, S) in itertools.product(targets, target_shapes):
        timed(f"{graphed.device} target", (B, S), lambda: warm_target(graphed, B, S), True)
    for drafter, shape in itertools.product(drafters, shapes):
        timed(str(drafter.fc.weight.device), shape, lambda: warm_shape(drafter, shape, step, loss),
              drafter.block_mask)
    GATE.mark_warm(log)
    return rows

# ---- 5. Streams and timers

@contextmanager
def own_stream(dev):
    """The thread's work on its own CUDA stream (None off CUDA): threads sharing a GPU overlap, sync_device waits for
    its own work. Hand a tensor on after sync_device, drop it after the reader's: no stream reads reused memory."""
    if torch.device(dev).type != "cuda":
        yield None
        return
    torch.cuda.set_device(dev)
    stream = torch.cuda.Stream(dev)
    with torch.cuda.stream(stream):
        yield stream

def host_threads(devices):
    """One intra-op CPU thread where every device is a GPU: host ops are small bookkeeping in several threads, whose
    thread teams would contend for the cores (an op waiting milliseconds). Set before any compile: dynamo guards on
    it (inductor's disk cache only for CPU kernels: warmup.py's GPU compiles still serve)."""
    if all(torch.device(d).type == "cuda" for d in devices):
        torch.set_num_threads(1)

def sync_device(dev):
    if torch.device(dev).type == "cuda":
        torch.cuda.current_stream(dev).synchronize()

def autocast(dev):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.device(dev).type == "cuda")

def median_time(fn, n, dev, rounds=1):
    """(median, [min, max]) seconds per call of `rounds` rounds of `n` calls back to back, after 2 untimed ones."""
    for _ in range(2):
        fn()
    per_call = []
    for _ in range(rounds):
        sync_device(dev)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync_device(dev)
        per_call.append((time.perf_counter() - t0) / n)
    return statistics.median(per_call), [min(per_call), max(per_call)]

def measure_peak_flops(dev):
    """Matmul rate measured now, on this device (the MFU's denominator)."""
    n, dtype = (8192, torch.bfloat16) if dev.type == "cuda" else (1024, torch.float32)
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    return 2 * n ** 3 / median_time(lambda: a @ b, 10, dev)[0]
