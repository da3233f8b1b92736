"""Compile every (drafter device x shape bucket) serially, before any training thread starts.

    python warmup.py --target Qwen/Qwen3-8B --drafter-devices cuda:5,cuda:6,cuda:7 [train_dflash.py options]

While one thread compiles, torch.fx's process-global tracing flag is up, and a compiled call in any other
thread fails or, worse, silently runs the dense fallback. So the warm-up runs the drafter's forward AND
backward (compiled lazily) for each shape on each device, one at a time, through the compile gate, then
marks the gate warm: from then on calls share it and nothing may compile. The trainer's warm-up also
compiles the target's decoder layers on each target GPU (one graph per shape, shared by the layers) and
checks their features against the eager target's. The inductor/triton cache persists (--compile-cache,
default <out_dir>/compile_cache), so a later start loads every shape in seconds. train_dflash.py runs
this warm-up before its threads start; this script fills the cache ahead (the target's layers on random
weights of its shape: a compile reads shapes, never values).
"""
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

import config
import data_dflash
import dflash_model as dm
from diagnose import CACHE_INFO_FILE
from master_adamw import cast_weights


def use_compile_cache(cache_dir, log=print):
    """Point inductor and triton at a persistent cache, and record which build fills it: a cache filled
    by another torch/triton/CUDA build or GPU misses every entry (a cold start), which is said here."""
    cache_dir = os.path.abspath(cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
    os.environ.update(TORCHINDUCTOR_CACHE_DIR=cache_dir, TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    import triton
    info_path = os.path.join(cache_dir, CACHE_INFO_FILE)
    build = {"torch": torch.__version__, "torch_git": torch.version.git_version, "cuda": torch.version.cuda,
             "triton": triton.__version__, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    old = None
    if os.path.exists(info_path):
        try:
            with open(info_path) as f:
                old = json.load(f)
        except (OSError, ValueError) as e:     # only the notice depends on it: say so, go on
            old = {"unreadable": f"{type(e).__name__}: {e}"}
    same_build = old is not None and {k: old.get(k) for k in build} == build
    if old is not None and not same_build:
        log(f"[warmup] NOTICE: compile cache {cache_dir} was filled by {old}, now running {build}: "
            "its entries will not match (expect cold compiles)")
    if not same_build:
        # torchrun ranks share the cache: each writes its own temporary file and renames it (no half files)
        data_dflash.write_json(info_path, {**build, "filled_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return cache_dir


def autocast(dev):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")


def warm_shape(drafter, shape, gamma, attn):
    """One forward + backward of the exact training computation at `shape` = (B, S, A); the drafter's
    gradients are left as they were (absent ones absent, a flat buffer's views zeroed)."""
    B, S, A = shape
    c, dev = drafter.config, drafter.fc.weight.device
    feats = torch.randn(B, S, len(c.target_layer_ids) * c.hidden_size, device=dev, dtype=config.param_dtype(dev))
    ids = torch.randint(0, c.vocab_size, (B, S), device=dev)
    loss_mask = torch.ones(B, S, device=dev)
    anchors = torch.arange(A).mul(max(1, (S - c.block_size) // A)).expand(B, A).contiguous()
    valid = torch.ones(B, A, dtype=torch.bool)
    with autocast(dev):
        loss, _, _ = dm.drafter_forward_loss(drafter, feats, ids, loss_mask, anchors, valid, gamma, attn=attn)
    had_grad = [p.grad is not None for p in drafter.parameters()]
    if loss.requires_grad:          # no-grad mode has no backward to compile
        dm.backward(loss, dev, shape, attn)
    for p, had in zip(drafter.parameters(), had_grad):
        p.grad = p.grad.zero_() if had else None
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def warm_target(target, B, S, layer_ids):
    """Compile the target's layers at (B, S), once with no row padded and once with one (transformers
    passes a mask only then: two graphs), and check the compiled features against eager ones of the same
    batch. Returns the larger relative error. In bf16 the two round differently (1.3e-2 over 34 random
    layers on CPU); a wrong mask or layer differs by order 1, so 0.1 is the bound (fp32: 1e-4)."""
    dev, dtype = next(target.parameters()).device, next(target.parameters()).dtype
    ids = torch.randint(0, target.config.vocab_size, (B, S), device=dev)
    tol, errs = (1e-4 if dtype == torch.float32 else 0.1), []
    for last_len in (S, S // 2):
        lengths = torch.full((B, 1), S, device=dev)
        lengths[-1] = last_len
        am = torch.arange(S, device=dev)[None] < lengths
        with torch.no_grad():
            got = dm.target_forward(target, ids, am, layer_ids).float()
            with torch.compiler.set_stance("force_eager"):
                want = dm.target_forward(target, ids, am, layer_ids).float()
        errs.append(float((got - want).norm() / want.norm()))
        if not errs[-1] <= tol:
            raise RuntimeError(f"the compiled target's features at (B, S) = {(B, S)} differ from the eager "
                               f"target's by {errs[-1]:.2e} (relative; {dtype} allows {tol:g}): refusing to train "
                               "on them. Report it with `python diagnose.py` output")
    return max(errs)


def time_shapes(target, drafter, shapes, gamma, attn, path, key):
    """{shape: (seconds of one target forward, of one drafter step)} for the layout advisor, each timed
    once after two untimed calls on the first target and drafter device; kept in `path` under `key` (GPU,
    builds, models, shapes), so a restart reads them instead of timing again."""
    try:
        with open(path) as f:
            saved = json.load(f)
        if saved["key"] == key:
            return {tuple(s): tuple(t) for s, t in saved["times"]}
    except (OSError, ValueError, KeyError):   # none yet, or unreadable: timed again and rewritten below
        pass
    tdev, times = next(target.parameters()).device, {}
    for shape in shapes:
        ids = torch.randint(0, target.config.vocab_size, shape[:2], device=tdev)
        am = torch.ones(shape[:2], dtype=torch.bool, device=tdev)

        def forward():
            with torch.no_grad():
                dm.target_forward(target, ids, am, drafter.config.target_layer_ids)
        step = lambda: warm_shape(drafter, shape, gamma, attn)   # noqa: E731
        times[tuple(shape)] = (median_time(forward, 1, tdev)[0], median_time(step, 1, drafter.fc.weight.device)[0])
    data_dflash.write_json(path, {"key": key, "times": [[list(s), list(t)] for s, t in times.items()]})
    return times


def median_time(fn, n, dev, rounds=1):
    """(median, [min, max]) seconds per call: after 2 untimed calls, `rounds` rounds of `n` calls back
    to back, each timed as a whole (a device sync at its two ends only)."""
    from train_dflash import sync_device      # the trainer's: busy times and these timings sync alike
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


def _cache_counters():
    from torch._dynamo.utils import counters
    return (counters["aot_autograd"].get("autograd_cache_hit", 0), counters["inductor"].get("fxgraph_cache_hit", 0),
            counters["inductor"].get("fxgraph_cache_miss", 0))


def warm_up(drafters, shapes, gamma, attn, on_unwarmed="error", log=print, targets=()):
    """Warm every (replica, shape) in turn, and every (target, (B, S)) of compiled targets
    (dm.compile_target_layers), size the recompile limit, then mark the gate warm.
    Returns the table rows [(device, shape, seconds, 'cache hit' | 'cold compile' | ...)]."""
    target_shapes = sorted({(B, S) for B, S, _ in shapes})
    # dynamo entries: one per (replica, shape) on the drafter's code object; on each target's own code
    # object, one per ((B, S), padded or not, kind of layer)
    layer_kinds = len(set(getattr(targets[0].config, "layer_types", None) or [0])) if targets else 0
    n_target = 2 * layer_kinds * len(target_shapes)
    dm.GATE.set_recompile_limit(max(len(drafters) * len(shapes), n_target) + 2)
    dm.GATE.on_unwarmed = on_unwarmed
    rows = []

    def kind_of(before, compiled):    # neither a hit nor a miss: dynamo reused a graph of this process
        aot_hit, fx_hit, fx_miss = (a - b for a, b in zip(_cache_counters(), before))
        return "eager (sdpa)" if not compiled else (
            "cold compile" if fx_miss else "cache hit" if aot_hit or fx_hit else "reused (in process)")
    for target in targets:
        dev = next(target.parameters()).device
        for B, S in target_shapes:
            before, t0 = _cache_counters(), time.time()
            err = warm_target(target, B, S, sorted(target.hooked))
            rows.append((f"{dev} target", (B, S), time.time() - t0,
                         f"{kind_of(before, True)}, features {err:.0e} from eager"))
            log(f"[warmup] {str(dev):8s} target B={B:<3d} S={S:<5d} {rows[-1][2]:7.1f}s  {rows[-1][3]}")
    for drafter in drafters:
        dev = drafter.fc.weight.device
        for shape in shapes:
            before, t0 = _cache_counters(), time.time()
            warm_shape(drafter, shape, gamma, attn)
            rows.append((str(dev), tuple(shape), time.time() - t0, kind_of(before, attn == "flex")))
            log(f"[warmup] {str(dev):8s} B={shape[0]:<3d} S={shape[1]:<5d} anchors={shape[2]:<4d} "
                f"{rows[-1][2]:7.1f}s  {rows[-1][3]}")
    dm.GATE.mark_warm()
    return rows


def format_table(rows):
    lines = [f"{'device':14s} {'shape (B,S,A)':18s} {'seconds':>8s}  compile", "-" * 56]
    lines += [f"{dev:14s} {str(shape):18s} {dt:8.1f}  {kind}" for dev, shape, dt, kind in rows]
    lines.append(f"total {sum(r[2] for r in rows):.1f}s over {len(rows)} (device, shape) pairs")
    return "\n".join(lines)


def build_drafters(cfg):
    """The drafter replicas and the shape plan train_dflash.py builds for `cfg`, without the target's
    weights: its model on the meta device gives the embedding and LM head shapes and whether they are one
    tensor, and empty tensors of the target's dtype stand in (a compile reads layouts, never values)."""
    from transformers import AutoModelForCausalLM
    tcfg, tok = config.load_target_config(config.target_path(cfg))
    tdevs, ddevs = config.resolve_devices(cfg)
    dcfg = config.make_drafter_config(cfg, tcfg, tok)
    tdtype = config.param_dtype(tdevs[0])
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tcfg, dtype=tdtype)
    m_emb, m_head = meta.get_input_embeddings().weight, meta.get_output_embeddings().weight
    emb = torch.empty(m_emb.shape, dtype=tdtype, device=tdevs[0])
    # tied: a second view, not the same object, as the trainer's two .detach() calls (dynamo guards on it)
    head = emb.detach() if m_head is m_emb else torch.empty(m_head.shape, dtype=tdtype, device=tdevs[0])
    drafters = []
    for d in ddevs:
        drafters.append(config.new_drafter(dcfg, emb, head, d, cfg.seed))
        cast_weights(drafters[-1].parameters(), config.param_dtype(d))     # as the trainer's optimiser does
    return dcfg, drafters, config.shape_plan(cfg, dcfg, config.batch_memory(dcfg, tcfg, tdevs, ddevs))


def main(argv=None):
    cfg = config.parse_args(sys.argv[1:] if argv is None else argv)
    cfg = dataclasses.replace(cfg, target=config.target_path(cfg))   # the embedded default prepared once
    dcfg, drafters, shapes = build_drafters(cfg)
    attn = config.resolve_attn(cfg, [d.fc.weight.device for d in drafters])
    targets = []
    if attn == "flex":        # the target's compiled layers too, on random weights of its shape
        use_compile_cache(cfg.compile_cache or os.path.join(cfg.out_dir, "compile_cache"))
        for d in config.resolve_devices(cfg)[0]:
            targets.append(config.load_target(cfg.target, d, config.param_dtype(d), dcfg.target_layer_ids,
                                              random_weights=True))
            dm.compile_target_layers(targets[-1])
    print(f"[warmup] {len(drafters)} drafter device(s) x {len(shapes)} shapes, {len(targets)} compiled target(s), "
          f"attention {attn}")
    rows = warm_up(drafters, shapes, cfg.gamma or config.default_gamma(dcfg.block_size), attn, cfg.on_unwarmed,
                   targets=targets)
    print(format_table(rows))


if __name__ == "__main__":
    main()
