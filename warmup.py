"""Compile every (drafter device x shape bucket) serially, before any training thread starts.

    python warmup.py --drafter-devices cuda:5,cuda:6,cuda:7 --target Qwen/Qwen3-8B [shape options]

Why serially: while one thread compiles, torch.fx's process-global tracing flag is up, and a compiled
call in any other thread fails or (worse) silently runs the dense fallback (../shared/compile-race.md).
Warm-up runs block-mask creation, drafter forward AND backward (the backward compiles lazily) for each
shape on each device, one at a time, through the gate; then marks the gate warm (shared calls,
fail_on_recompile). The inductor/triton cache is persistent (default: <out_dir>/compile_cache), so a
second start hits it; the table says which shapes were cache hits and which were cold compiles.
The same options as train_dflash.py are accepted (only the model/shape ones matter here).

--warmup-workers N (N > 0, flex, several shapes): a cold cache is first filled by up to N child
processes at once, one shape each (see precompile()); the serial warm-up then finds cache hits.
"""
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import dflash_model as dm
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
    if os.path.exists(info_path):
        with open(info_path) as f:
            old = json.load(f)
        if {k: old.get(k) for k in build} != build:
            log(f"[warmup] NOTICE: compile cache {cache_dir} was filled by {old}, now running {build}: "
                "its entries will not match (expect cold compiles)")
    with open(info_path, "w") as f:
        json.dump({**build, "filled_at": time.strftime("%Y-%m-%dT%H:%M:%S")}, f, indent=1)
    return cache_dir


def _triton_version():
    try:
        import triton
        return triton.__version__
    except ImportError:
        return "absent"


def _cache_counters():
    from torch._dynamo.utils import counters
    return (sum(counters["aot_autograd"].get(k, 0) for k in ("autograd_cache_hit",)),
            sum(counters["inductor"].get(k, 0) for k in ("fxgraph_cache_hit",)),
            sum(counters["inductor"].get(k, 0) for k in ("fxgraph_cache_miss",)))


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
    if loss.requires_grad:          # a frozen drafter (or no-grad mode) has no backward to compile
        dm.backward(loss, dev, shape, attn)
    drafter.zero_grad(set_to_none=False)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def autocast(dev):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")


def warm_up(drafters, shapes, gamma, attn, chunk_rows=2048, on_unwarmed="error", log=print,
            compile_scope="trunk", workers=0):
    """Warm every (replica, shape) serially, size the recompile limit, then mark the gate warm.
    workers > 0: first cold-compile the shapes in up to that many child processes (precompile()).

    Returns the table rows [(device, shape, seconds, 'cache hit' | 'cold compile' | 'eager')].
    """
    gate = dm.GATE
    # Each replica (= device) and shape is its own dynamo cache entry of each compiled function.
    limit = len(drafters) * len(shapes) * dm.ENTRIES_PER_SHAPE[compile_scope] + 2
    if workers > 0 and attn == "flex" and len(shapes) > 1:
        precompile(drafters[0], shapes, gamma, attn, chunk_rows, compile_scope, limit, workers, log)
    gate.set_recompile_limit(limit)
    gate.on_unwarmed = on_unwarmed
    rows = []
    for drafter in drafters:
        dev = drafter.fc.weight.device
        for shape in shapes:
            before = _cache_counters()
            t0 = time.time()
            warm_shape(drafter, shape, gamma, attn, chunk_rows, compile_scope)
            dt = time.time() - t0
            aot_hit, fx_hit, fx_miss = (a - b for a, b in zip(_cache_counters(), before))
            # no miss and no hit: dynamo reused a graph this process already holds (same shape on
            # another replica of the same device)
            kind = "eager (sdpa)" if attn != "flex" else (
                "cold compile" if fx_miss else "cache hit" if (aot_hit or fx_hit) else "reused (in process)")
            rows.append((str(dev), shape, dt, kind))
            log(f"[warmup] {str(dev):8s} B={shape[0]:<3d} S={shape[1]:<5d} anchors={shape[2]:<4d} "
                f"{dt:7.1f}s  {kind}")
    gate.mark_warm()
    return rows


# -----------------------------------------------------------------------------
# Parallel cold precompile. Most of a cold compile is single-threaded Python (dynamo, AOT autograd,
# inductor lowering), so several processes compiling different shapes at once fill the on-disk cache
# much faster than one process compiling them in turn. Children are fresh processes: no compile gate,
# no FX-tracing flag and no threads shared with the parent (which holds nothing while they run). They
# inherit os.environ, i.e. the cache folders use_compile_cache() put there, and build a drafter the
# compiled graphs cannot tell from the parent's: the same config, parameter dtype, buffer shapes,
# strides and dtypes, tying, requires_grad and grad mode (dynamo guards and the cache keys see these;
# values they do not, so the weights are random and the buffers zeros).


def precompile(drafter, shapes, gamma, attn, chunk_rows, compile_scope, recompile_limit, workers, log=print):
    """Compile each shape once on `drafter`'s device, in child processes, `workers` at a time."""
    dev = drafter.fc.weight.device
    meta = lambda t: {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype)}
    spec = {"config": dataclasses.asdict(drafter.config), "device": str(dev),
            "param_dtype": str(next(drafter.parameters()).dtype),
            "embed_weight": meta(drafter.embed_weight), "lm_head_weight": meta(drafter.lm_head_weight),
            "tied": drafter.lm_head_weight.data_ptr() == drafter.embed_weight.data_ptr(),
            "frozen": [n for n, p in drafter.named_parameters() if not p.requires_grad],
            "grad_enabled": torch.is_grad_enabled(), "recompile_limit": recompile_limit,
            "gamma": gamma, "attn": attn, "chunk_rows": chunk_rows, "compile_scope": compile_scope}
    log(f"[warmup] precompiling {len(shapes)} shapes on {dev} in up to {workers} worker processes")
    t_all, todo, running = time.time(), list(shapes), []
    with tempfile.TemporaryDirectory(prefix="dflash_precompile_") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        try:
            while todo or running:
                while todo and len(running) < workers:
                    shape = todo.pop(0)
                    out_path = os.path.join(tmp, "B{}_S{}_A{}.log".format(*shape))
                    with open(out_path, "w") as out:     # the child keeps its own copy of the descriptor
                        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--precompile-one",
                                              spec_path, *map(str, shape)], stdout=out, stderr=subprocess.STDOUT)
                    running.append((p, shape, out_path, time.time()))
                time.sleep(0.2)
                for job in [j for j in running if j[0].poll() is not None]:
                    running.remove(job)
                    p, (B, S, A), out_path, t0 = job
                    if p.returncode != 0:
                        with open(out_path) as f:
                            tail = "".join(f.readlines()[-40:])
                        raise RuntimeError(f"[warmup] precompile of shape B={B} S={S} A={A} on {dev} failed "
                                           f"(worker exit code {p.returncode}); its output ends:\n{tail}")
                    log(f"[warmup] precompiled B={B} S={S} A={A} in {time.time() - t0:.1f}s (worker)")
        finally:
            for p, *_ in running:    # failure or Ctrl-C: leave no orphan compiling (and holding GPU memory)
                p.kill()
                p.wait()
    log(f"[warmup] precompile of {len(shapes)} shapes done in {time.time() - t_all:.1f}s wall")


def precompile_one(spec_path, shape):
    """Child of precompile(): rebuild the parent's drafter from the spec, compile one shape, exit 0."""
    with open(spec_path) as f:
        spec = json.load(f)
    dev = torch.device(spec["device"])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dtype = lambda s: getattr(torch, s.removeprefix("torch."))
    buffer = lambda m: torch.empty_strided(m["shape"], m["stride"], dtype=dtype(m["dtype"]), device=dev).zero_()
    with torch.device(dev):   # initialise on the device (a Qwen3-8B-sized drafter is slow to init on CPU)
        drafter = dm.DFlashDrafter(dm.DFlashConfig(**spec["config"]), embed_weight=torch.empty(0))
    drafter.to(dtype(spec["param_dtype"]))
    drafter.embed_weight = buffer(spec["embed_weight"])
    drafter.lm_head_weight = drafter.embed_weight if spec["tied"] else buffer(spec["lm_head_weight"])
    for name, p in drafter.named_parameters():
        p.requires_grad_(name not in spec["frozen"])
    torch.set_grad_enabled(spec["grad_enabled"])
    dm.GATE.set_recompile_limit(spec["recompile_limit"])
    warm_shape(drafter, shape, spec["gamma"], spec["attn"], spec["chunk_rows"], spec["compile_scope"])


def format_table(rows):
    lines = [f"{'device':10s} {'shape (B,S,A)':18s} {'seconds':>8s}  compile", "-" * 52]
    for dev, shape, dt, kind in rows:
        lines.append(f"{dev:10s} {str(tuple(shape)):18s} {dt:8.1f}  {kind}")
    lines.append(f"total {sum(r[2] for r in rows):.1f}s over {len(rows)} (device, shape) pairs")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--precompile-one"]:      # a child of precompile(): SPEC B S A
        return precompile_one(argv[1], tuple(map(int, argv[2:5])))
    import train_dflash as tr
    cfg = tr.parse_config(argv)
    use_compile_cache(cfg.compile_cache or os.path.join(cfg.out_dir, "compile_cache"))
    tcfg, _ = tr.load_target_config(tr.target_path(cfg))
    drafter_devs = tr.resolve_devices(cfg)[1]
    attn = tr.resolve_attn(cfg, drafter_devs[0])
    dcfg = tr.make_drafter_config(cfg, tcfg, mask_token_id=max(cfg.mask_token_id, 0))
    shapes = tr.shape_plan(cfg, dcfg.block_size)
    drafters = []
    for d in drafter_devs:
        torch.manual_seed(cfg.seed)
        drafters.append(dm.DFlashDrafter(dcfg).to(d))
    print(f"[warmup] {len(drafters)} drafter device(s) x {len(shapes)} shapes, attention={attn}")
    rows = warm_up(drafters, shapes, cfg.gamma or tr.default_gamma(dcfg.block_size), attn, cfg.chunk_rows,
                   cfg.on_unwarmed, compile_scope=cfg.compile_scope, workers=cfg.warmup_workers)
    print(format_table(rows))


if __name__ == "__main__":
    main()
