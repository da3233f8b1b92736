"""Benchmark on one device: target forward, drafter step (ours vs the naive setup), warm-up, pipeline.

    python bench.py                    # Qwen3-8B-shaped random target, 5-layer drafter, S 3072, 512 anchors
    python bench.py --tiny             # the same code at toy size (CPU: seconds)
    python bench.py --profile          # + where a drafter step's device time goes (kernel classes, top kernels)
    python bench.py --gate-overhead    # microseconds a warm gate adds to each compiled call
    python bench.py --race-loop        # the compile race on the REAL loop: 3 drafter threads, one GPU,
                                       # cold caches, several buckets, with and without the gate
    python bench.py --pipeline-only --target-devices cuda:0 --drafter-devices cuda:1 --pipeline-steps 100
                                       # only the real loop, on any device layout (several GPUs)
    python bench.py --optimizer        # only the optimiser side at the drafter's size (MasterAdamW vs
                                       # torch's fused AdamW, the gradient norm) and the matmul rate,
                                       # burst (the MFU denominator) vs sustained for seconds

Ours:  block mask built from the anchors at tile level, whole drafter trunk compiled (flex inside).
Naive: what public DFlash trainers run: only flex_attention compiled, the rest of the drafter eager,
       the block mask built every step by uncompiled create_block_mask.
Both are timed in the same process, on the same weights and inputs. The threaded pipeline
(train_dflash.py, target and drafter threads sharing the device) runs as a subprocess on the same
compile cache, which also measures a warm-cache start. Results: a table, and --json FILE.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY = dict(model_type="qwen3", vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
            rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--seq", type=int, default=0, help="sequence length (default 3072; tiny 256)")
    p.add_argument("--anchors", type=int, default=0, help="anchors per sequence (default 512; tiny 16)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round (median of each round)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per measurement, each of --steps "
                   "steps back to back: the median of the rounds is reported, with their min-max as the spread")
    p.add_argument("--all-shapes", action="store_true", help="cold warm-up of every default bucket")
    p.add_argument("--pipeline-steps", type=int, default=40, help="optimiser steps of the pipeline run")
    p.add_argument("--no-pipeline", action="store_true")
    p.add_argument("--cache", default="", help="compile cache (default: a fresh temporary folder = cold)")
    p.add_argument("--race-loop", action="store_true", help="only the real-loop race check")
    p.add_argument("--gate-overhead", action="store_true", help="only: cost of one warm GATE.run (1 and 3 threads)")
    p.add_argument("--optimizer", action="store_true", help="only: the optimiser step and gradient norm at the "
                   "drafter's size, and the matmul rate in a burst vs sustained")
    p.add_argument("--compile-scope", default="trunk", choices=["trunk", "layer", "flex"],
                   help="trunk: the whole drafter is one compiled graph; layer: one graph reused per layer; "
                        "flex: only flex_attention compiled (eager layers); also for --race-loop")
    p.add_argument("--warmup-workers", type=int, default=0,
                   help="with --all-shapes: cold-compile the shapes in up to N parallel processes first")
    p.add_argument("--device", default="", help="device of the one-device measurements (default cuda:0, or cpu)")
    p.add_argument("--pipeline-only", action="store_true",
                   help="only the threaded pipeline (train_dflash.py), on --target-devices / --drafter-devices")
    p.add_argument("--target-devices", default="", help="pipeline target devices (default: --device)")
    p.add_argument("--drafter-devices", default="", help="pipeline drafter devices (default: --device)")
    p.add_argument("--flex-options", default="", help="JSON kernel_options of our compiled flex attention "
                   "(as train_dflash.py --flex-options; the naive setup keeps torch's defaults)")
    p.add_argument("--chunk-rows", type=int, default=0, help="LM head + CE rows per chunk of ours (as "
                   "train_dflash.py --chunk-rows; default its default; the naive setup keeps 2048)")
    p.add_argument("--profile", action="store_true",
                   help="also profile steps of ours: device time by kernel class, top kernels, busy share")
    p.add_argument("--profile-steps", type=int, default=3, help="with --profile: steps recorded, after 3 "
                   "recorded-and-dropped ones back to back (the GPU at its sustained clock, no sync between)")
    p.add_argument("--trace", default="", help="with --profile: also write the profiled steps as a Chrome "
                   "trace (.json or .json.gz) to open in Perfetto / chrome://tracing")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    if (a.target_devices or a.drafter_devices) and not a.pipeline_only:
        p.error("--target-devices / --drafter-devices need --pipeline-only")
    if a.trace and not a.profile:
        p.error("--trace needs --profile")
    if a.steps < 1 or a.rounds < 1 or a.profile_steps < 1 or a.chunk_rows < 0:
        p.error("--steps, --rounds and --profile-steps must be >= 1, --chunk-rows >= 0")
    if a.warmup_workers and not (a.all_shapes or a.pipeline_only):
        p.error("--warmup-workers needs --all-shapes or --pipeline-only (one shape on one device has nothing "
                "to compile in parallel)")
    return a


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    tmp = tempfile.mkdtemp(prefix="dflash_bench_")
    if a.race_loop:
        return race_loop(a, tmp)
    if a.gate_overhead:
        return gate_overhead()
    import warmup
    cache = warmup.use_compile_cache(a.cache or os.path.join(tmp, "compile_cache"))   # before any compile
    import torch
    import dflash_model as dm
    import train_dflash as tr
    try:
        dm.set_flex_options(a.flex_options)
    except ValueError as e:
        raise SystemExit(f"error: --flex-options: {e}")

    dev = torch.device(a.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    spec = TINY if a.tiny or dev.type == "cpu" else QWEN3_8B
    S = a.seq or (3072 if spec is QWEN3_8B else 256)
    A = a.anchors or (512 if spec is QWEN3_8B else 16)
    cfg_path = os.path.join(tmp, "target_config.json")
    with open(cfg_path, "w") as f:
        json.dump(spec, f)
    tcfg = tr.TrainConfig(target="random:" + cfg_path, max_length=S, num_anchors=A)
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "flex_options": dm.FLEX_OPTIONS,
           "torch": torch.__version__, "torch_git": torch.version.git_version, "S": S, "anchors": A,
           "target_hidden": spec["hidden_size"]}
    log = lambda m: print(m, flush=True)
    if a.pipeline_only:
        res.update(pipeline(a, tcfg, cache, tmp, S, A, dev, log))
        return report(a, res)
    if a.optimizer:
        res.update(optimizer_bench(a, tcfg, spec, dev, log))
        return report(a, res)
    peak = tr.measure_peak_flops(dev)
    res["peak_tflops"] = peak / 1e12
    log(f"[bench] {res['device']} torch {torch.__version__}: matmul peak {peak / 1e12:.0f} TFLOP/s")

    # --- target forward alone
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target_cfg, _ = tr.load_target_config(tcfg.target)
    dcfg = tr.make_drafter_config(tcfg, target_cfg, mask_token_id=spec["vocab_size"] - 1)
    target = tr.load_target(tcfg.target, dev, dtype, dcfg.target_layer_ids, log)
    ids = torch.randint(0, spec["vocab_size"], (1, S), device=dev)
    def target_fwd():
        with torch.no_grad():
            hs = target.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
            return dm.target_features(hs, dcfg.target_layer_ids)
    res["spread_ms"] = {}

    def timed(name, fn):      # median seconds per call; the rounds' min-max goes to res["spread_ms"][name]
        t, spread = median_time(fn, a.steps, dev, a.rounds)
        res["spread_ms"][name] = [round(1e3 * s, 2) for s in spread]
        return t
    t_target = timed("target_ms", target_fwd)
    n_params = sum(p.numel() for n, p in target.model.named_parameters() if "embed" not in n)
    res.update(target_ms=1e3 * t_target, target_tok_s=S / t_target, target_mfu=2 * n_params * S / t_target / peak)
    log(f"[bench] target forward ({len(target.model.layers)} layers): {1e3 * t_target:.1f} ms = "
        f"{S / t_target:,.0f} tok/s, MFU {res['target_mfu']:.1%}")
    feats = target_fwd()

    # --- drafter, ours: cold warm-up then timed steps
    torch.manual_seed(0)
    drafter = dm.DFlashDrafter(dcfg).to(dev)
    drafter.embed_weight = target.get_input_embeddings().weight.detach()
    drafter.lm_head_weight = target.get_output_embeddings().weight.detach()
    # the trainer's optimiser: fp32 masters, bf16 weights on a GPU, one fused update pass
    opt = tr.MasterAdamW(drafter.parameters(), lr=1e-5, param_dtype=tr.param_dtype(dev))
    shapes = tr.shape_plan(tcfg, dcfg.block_size) if a.all_shapes else [(1, S, A)]
    attn = "flex" if dev.type == "cuda" else "sdpa"
    if dev.type == "cuda":
        torch.cuda.empty_cache()     # the target forward's cached blocks: free memory for the warm-up workers
    t0 = time.time()
    chunk_rows = a.chunk_rows or tr.TrainConfig.chunk_rows
    res["chunk_rows"] = chunk_rows
    rows = warmup.warm_up([drafter], shapes, 7.0, attn, chunk_rows, log=log, compile_scope=a.compile_scope,
                          workers=a.warmup_workers)
    res["compile_scope"], res["warmup_workers"] = a.compile_scope, a.warmup_workers
    res["warmup_cold_s"] = time.time() - t0
    res["warmup_rows"] = [[r[0], list(r[1]), round(r[2], 1), r[3]] for r in rows]
    log(warmup.format_table(rows))
    lm = torch.ones(1, S, device=dev)
    lm[:, : S // 10] = 0
    anchors, valid = dm.sample_anchors(lm, torch.tensor([S]), A, dcfg.block_size, torch.Generator().manual_seed(0))

    def step(naive=False):
        with warmup.autocast(dev):
            if naive:
                loss = naive_loss(dm, drafter, feats, ids, lm, anchors, valid, dev)
            else:
                loss, _, _ = dm.drafter_forward_loss(drafter, feats, ids, lm, anchors, valid, 7.0, attn=attn,
                                                     chunk_rows=chunk_rows, compile_scope=a.compile_scope)
        if naive:   # its compiled flex backward compiles lazily: also through the gate
            dm.GATE.run("naive_bwd", dev, (1, S, A), loss.backward)
        else:
            dm.backward(loss, dev, (1, S, A), attn)
        # the trainer's lone-replica step: clip to the default 1.0 (its norm read by the host), then the update
        tr.clip_and_step(opt, [p.grad for p in drafter.parameters()], tr.TrainConfig.clip)
        opt.zero_grad(set_to_none=True)       # as the trainer's lone replica: the next backward's grads are handed over
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t_ours = timed("drafter_ms", step)
    # the trainer's count of a step: attention from this run's anchors (a block sees its anchor's
    # position in context keys)
    flops = tr.batch_flops(dcfg, S, anchors, valid)
    res.update(drafter_ms=1e3 * t_ours, drafter_samples_s=1 / t_ours, drafter_tok_s=S / t_ours,
               drafter_mfu=flops / t_ours / peak, drafter_tflop_per_step=flops / 1e12,
               drafter_peak_mem_gib=torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None)
    log(f"[bench] drafter step (ours): {1e3 * t_ours:.1f} ms = {S / t_ours:,.0f} target tok/s, "
        f"MFU {res['drafter_mfu']:.1%}" + (f", peak mem {res['drafter_peak_mem_gib']:.1f} GiB"
                                            if res["drafter_peak_mem_gib"] is not None else ""))
    if a.profile:
        res["profile"] = profile(step, dev, log, steps=a.profile_steps, trace=a.trace)

    # --- drafter, naive (compiled flex only; eager mask and trunk): its flex compile is an unwarmed
    # key for the (already warm) gate, so the gate compiles it exclusively and logs that.
    if attn == "flex":
        dm.GATE.on_unwarmed = "compile"
        t0 = time.time()
        step(naive=True)
        res["naive_first_step_s"] = time.time() - t0
        t_naive = timed("naive_ms", lambda: step(naive=True))
        res.update(naive_ms=1e3 * t_naive, naive_mfu=flops / t_naive / peak, speedup_vs_naive=t_naive / t_ours)
        log(f"[bench] drafter step (naive): {1e3 * t_naive:.1f} ms, MFU {res['naive_mfu']:.1%}; "
            f"ours is {t_naive / t_ours:.2f}x faster")
    res["sum_of_parts_tok_s"] = S / (t_target + t_ours)
    del target, drafter, opt, feats
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    # --- the threaded pipeline (real train_dflash loop) on the same, now warm, compile cache
    if not a.no_pipeline:
        res.update(pipeline(a, tcfg, cache, tmp, S, A, dev, log))
        res["pipeline_vs_sum_of_parts"] = res["pipeline_tok_s"] / res["sum_of_parts_tok_s"]
        log(f"[bench] pipeline {res['pipeline_tok_s']:,.0f} tok/s vs sum of parts "
            f"{res['sum_of_parts_tok_s']:,.0f} tok/s: {res['pipeline_vs_sum_of_parts']:.1%}")
    res["rounds"], res["steps_per_round"] = a.rounds, a.steps
    return report(a, res)


def report(a, res):
    """The results as JSON on stdout, and in --json FILE."""
    print(json.dumps(res, indent=1))
    save_json(a, res)
    return res


def save_json(a, obj):
    if a.json:
        with open(a.json, "w") as f:
            json.dump(obj, f, indent=1)


def naive_loss(dm, drafter, feats, ids, lm, anchors, valid, dev):
    """The public trainers' setup: eager trunk, compiled flex only, eager create_block_mask per step."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    global _naive_flex
    if "_naive_flex" not in globals():
        _naive_flex = torch.compile(flex_attention, dynamic=False)
    c = drafter.config
    B, S = ids.shape
    A = anchors.shape[1]
    block_ids, block_pos, labels, weights = dm.make_blocks(ids, lm, anchors, valid, c.block_size, c.mask_token_id, 7.0)
    bm = create_block_mask(dm.make_mask_mod(anchors.to(dev), S, c.block_size), B, None, A * c.block_size,
                           S + A * c.block_size, device=dev)
    attend = lambda q, k, v: dm.GATE.run("naive_flex", dev, tuple(q.shape) + tuple(k.shape), _naive_flex,
                                         q, k, v, block_mask=bm, enable_gqa=True)
    hidden = drafter.body(feats, block_ids, torch.arange(S, device=dev).expand(B, S), block_pos, attend)
    return dm.dflash_loss(hidden, drafter.lm_head_weight, labels, weights, chunk_rows=2048)[0]   # as in sessions 1-12


# Kernel classes, by the first pattern found in a kernel's name (lower case), in this order.
KERNEL_CLASSES = (("flex attention", ("flex", "attention")),
                  ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "::mm", "addmm", "bmm")),
                  ("optimizer", ("adam",)),
                  ("LM-head cross entropy (Triton)", ("_ce_rows",)),
                  ("communication", ("nccl",)),
                  ("fused pointwise / reductions (inductor)", ("triton",)),
                  ("copies / fills", ("copy", "memcpy", "memset", "fill")))


def profile(fn, dev, log, steps=3, top=20, trace="", lead=3):
    """Where a step's device time goes: kernels grouped by class, the top kernels, and the device's busy
    share of the (profiled) wall time; what is not busy is launch overhead, host syncs or idle.
    The profiler runs `lead` steps first and drops them, then records `steps`, all back to back as in
    the timed rounds: no sync before the recorded steps, so the GPU is at the clock it sustains under
    load (after a pause it boosts for a while, and short kernels look faster than in training).
    On CPU (no kernels), the top operators by self CPU time instead."""
    import torch
    from torch.profiler import ProfilerActivity, schedule
    from torch.profiler import profile as torch_profile
    from train_dflash import sync_device
    cuda = dev.type == "cuda"
    fn()
    sync_device(dev)
    with torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                       schedule=schedule(wait=0, warmup=lead, active=steps, repeat=1)) as prof:
        for i in range(lead + steps):
            if i == lead:
                t0 = time.perf_counter()
            fn()
            if i == lead + steps - 1:
                sync_device(dev)
            prof.step()
    wall_us = (time.perf_counter() - t0) * 1e6 / steps
    if trace:
        prof.export_chrome_trace(trace)
        log(f"[bench] profile trace: {trace}")
    per_name = {}
    if cuda:
        for e in prof.events():
            # kernels only: a record_function range (e.g. "Optimizer.step#AdamW.step") also shows on the
            # device timeline, around the kernels it launched, and would count them twice
            if (e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
                    and not e.name.startswith("ProfilerStep")):
                per_name[e.name] = per_name.get(e.name, 0.0) + e.time_range.elapsed_us() / steps
    else:
        for e in prof.key_averages():
            if not e.key.startswith("ProfilerStep"):     # the schedule's range around each step
                per_name[e.key] = e.self_cpu_time_total / steps
    busy = sum(per_name.values())
    classes = {}
    for name, us in per_name.items():
        cls = next((c for c, pats in KERNEL_CLASSES if any(p in name.lower() for p in pats)), "other")
        classes[cls] = classes.get(cls, 0.0) + us
    res = {"wall_ms_profiled": wall_us / 1e3, "device_busy_ms": busy / 1e3,
           "busy_share": busy / wall_us if cuda else None,
           "by_class_ms": {c: round(us / 1e3, 2) for c, us in sorted(classes.items(), key=lambda kv: -kv[1])},
           "top_ms": [[n[:120], round(us / 1e3, 3)] for n, us in sorted(per_name.items(), key=lambda kv: -kv[1])[:top]]}
    log(f"[bench] profile of one step ({steps} profiled): wall {res['wall_ms_profiled']:.1f} ms, "
        + (f"device busy {res['device_busy_ms']:.1f} ms ({res['busy_share']:.0%})" if cuda else
           f"CPU operators {res['device_busy_ms']:.1f} ms"))
    for c, ms in res["by_class_ms"].items():
        log(f"[bench]   {c:42s} {ms:8.2f} ms  {ms / max(busy / 1e3, 1e-9):5.1%}")
    for n, ms in res["top_ms"]:
        log(f"[bench]   top: {ms:8.3f} ms  {n}")
    return res


def optimizer_bench(a, tcfg, spec, dev, log):
    """The optimiser side of a drafter step at the drafter's size, eager: MasterAdamW's update pass
    (bf16 weights and grads on a GPU) against torch's AdamW over fp32 weights and grads (fused on a
    GPU), the gradient norm both ways; then the matmul rate as the trainer measures it (a burst of
    ten products) and sustained for 1 and 3 s (a GPU at its power limit clocks down)."""
    import torch
    import dflash_model as dm
    import train_dflash as tr
    from master_adamw import cast_weights
    target_cfg, _ = tr.load_target_config(tcfg.target)
    dcfg = tr.make_drafter_config(tcfg, target_cfg, mask_token_id=spec["vocab_size"] - 1)
    with torch.device(dev):          # initialise on the device: 1B parameters are slow to initialise on a CPU
        drafter = dm.DFlashDrafter(dcfg, embed_weight=torch.empty(0))
    params = list(drafter.parameters())
    n = sum(p.numel() for p in params)
    res = {"optimizer_params": n}

    def timed(name, fn, nbytes=None):
        s, _ = median_time(fn, a.steps, dev, a.rounds)
        res[name] = 1e3 * s
        log(f"[bench] {name:28s} {1e3 * s:8.2f} ms" + (f"  {nbytes / s / 1e12:.2f} TB/s" if nbytes else ""))
    opt = tr.MasterAdamW(params, lr=1e-5, param_dtype=tr.param_dtype(dev))
    grads = [torch.randn_like(p) for p in params]
    wbytes = params[0].element_size()        # master, exp_avg, exp_avg_sq read and written; weight written, grad read
    timed("master_adamw_step_ms", lambda: opt.step(grads=grads), nbytes=n * (24 + 2 * wbytes))
    timed("total_norm_ms", lambda: tr.total_norm(grads), nbytes=n * wbytes)
    timed("clip_and_step_ms", lambda: tr.clip_and_step(opt, grads, 1.0))
    del opt, grads
    cast_weights(params, torch.float32)
    for p in params:
        p.grad = torch.randn_like(p)
    ref = torch.optim.AdamW(params, lr=1e-5, fused=dev.type == "cuda", foreach=False if dev.type != "cuda" else None)
    timed("torch_adamw_step_ms", ref.step, nbytes=n * 28)
    timed("clip_grad_norm_ms", lambda: torch.nn.utils.clip_grad_norm_(params, 1e9))
    del ref, params, drafter
    res["matmul_burst_tflops"] = [round(tr.measure_peak_flops(dev) / 1e12, 1) for _ in range(3)]
    log(f"[bench] matmul burst (the trainer's measure_peak_flops): {res['matmul_burst_tflops']} TFLOP/s")
    if dev.type == "cuda":
        N = 8192
        x, y = (torch.randn(N, N, device=dev, dtype=torch.bfloat16) for _ in range(2))
        for secs in (1, 3):
            tr.sync_device(dev)
            t0, k = time.perf_counter(), 0
            while time.perf_counter() - t0 < secs:     # the launch queue bounds how far the host runs ahead;
                for _ in range(50):                    # the final sync ends the timing
                    x @ y
                k += 50
            tr.sync_device(dev)
            rate = 2 * N ** 3 * k / (time.perf_counter() - t0) / 1e12
            res[f"matmul_sustained_{secs}s_tflops"] = round(rate, 1)
            log(f"[bench] matmul sustained {secs} s: {rate:.0f} TFLOP/s (SM clock, power now: {gpu_clocks(dev)})")
    return res


def gpu_clocks(dev):
    """SM clock and power draw from nvidia-smi ("?" where it cannot be asked)."""
    try:
        return subprocess.run(["nvidia-smi", "-i", str(dev.index or 0), "--query-gpu=clocks.sm,power.draw",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def median_time(fn, n, dev, rounds=1):
    """(median, [min, max]) seconds per call: after 2 untimed calls, `rounds` rounds of `n` calls back
    to back, each round timed as a whole (a device sync at its two ends only, like a training loop that
    does not wait for the device between steps: the host prepares step i+1 while step i's tail runs);
    the median of the rounds' per-call times and their min-max (the spread)."""
    from train_dflash import sync_device
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


def pipeline(a, tcfg, cache, tmp, S, A, dev, log):
    out = os.path.join(tmp, "pipeline_out")
    cmd = [sys.executable, "-u", os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_dflash.py"),
           "--target", tcfg.target, "--data", "synthetic:256", "--max-length", str(S),
           # --all-shapes: every default bucket is warmed (= the warm-cache start of all shapes);
           # the synthetic samples all have length S, so only the S bucket ever trains
           *([] if a.all_shapes else ["--buckets", str(S)]),
           "--num-anchors", str(A), "--target-devices", a.target_devices or str(dev),
           "--drafter-devices", a.drafter_devices or str(dev), "--warmup-workers", str(a.warmup_workers),
           "--max-steps", str(a.pipeline_steps), "--log-interval", "5", "--ckpt-interval", "100000",
           "--compile-scope", a.compile_scope, "--flex-options", a.flex_options,
           *(["--chunk-rows", str(a.chunk_rows)] if a.chunk_rows else []),
           "--compile-cache", cache, "--out-dir", out]
    log("[bench] pipeline: " + " ".join(cmd))
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    text = p.stdout + p.stderr
    with open(os.path.join(tmp, "pipeline.log"), "w") as f:
        f.write(text)
    if p.returncode:
        print(text[-5000:])
        raise SystemExit(f"pipeline run failed (exit {p.returncode})")
    rates = [float(x.replace(",", "")) for x in re.findall(r"\| ([\d,]+) tok/s \|", text)]
    warm = re.search(r"\[warmup\] done in ([\d.]+)s", text)
    busy = re.search(r"busy\s+target \[(.*?)\] drafter \[(.*?)\]", text)
    same = re.search(r"\[replicas\] .*", text)
    mfu = [float(x) for x in re.findall(r"MFU drafter ([\d.]+)%", text)]
    res = {"pipeline_tok_s": statistics.median(rates[1:]) if len(rates) > 1 else float("nan"),
           "pipeline_tok_s_spread": [min(rates[1:]), max(rates[1:])] if len(rates) > 2 else None,
           "warmup_warm_cache_s": float(warm.group(1)) if warm else None,
           "pipeline_busy": busy.group(0) if busy else None, "pipeline_wall_s": wall,
           "pipeline_devices": {"target": a.target_devices or str(dev), "drafter": a.drafter_devices or str(dev)},
           "pipeline_replicas": same.group(0) if same else None,
           "pipeline_mfu_pct": statistics.median(mfu[1:]) if len(mfu) > 1 else None}
    for line in text.splitlines():
        if line.startswith("step ") or "[warmup]" in line or "busy" in line or "[replicas]" in line:
            log("  | " + line)
    return res


def gate_overhead(n=100_000):
    """Microseconds one warm, shared GATE.run adds around a call (an identity function), alone and
    with 3 threads calling at once: the price every compiled call pays after warm-up."""
    import threading
    import torch
    import dflash_model as dm
    fn, x = (lambda t: t), torch.zeros(1)
    dm.GATE.run("overhead", "cpu", (1,), fn, x)
    dm.GATE.mark_warm()

    def per_call(gated, threads):
        def work():
            for _ in range(n):
                dm.GATE.run("overhead", "cpu", (1,), fn, x) if gated else fn(x)
        ts = [threading.Thread(target=work) for _ in range(threads)]
        t0 = time.perf_counter()
        [t.start() for t in ts]
        [t.join() for t in ts]
        return (time.perf_counter() - t0) / (n * threads) * 1e6
    res = {}
    for threads in (1, 3):
        plain = min(per_call(False, threads) for _ in range(3))
        gated = min(per_call(True, threads) for _ in range(3))
        res[threads] = gated - plain
        print(f"[bench] gate overhead, {threads} thread(s): {gated - plain:.2f} us per call")
    return res


def race_loop(a, tmp):
    """train_dflash.py with 3 drafter replicas on one device and 3 length buckets, each mode from an
    empty compile cache. Without the gate the replicas compile different shapes while the others
    run compiled code (the original failure); with it, warm-up compiles serially first.
    `--compile-scope flex` runs the original failure's layout: compiled flex entered from eager layers
    all through the step (with the compiled trunk, a replica enters compiled code only at a step's
    start, and the race has not shown there)."""
    import torch
    dev = a.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    cfg_path = os.path.join(tmp, "tiny.json")
    with open(cfg_path, "w") as f:
        json.dump(TINY, f)
    rows = {}
    for mode in ("gate", "no-gate"):
        out = os.path.join(tmp, "race_" + mode)
        cmd = [sys.executable, "-u", os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_dflash.py"),
               "--target", "random:" + cfg_path, "--data", "synthetic:96:varied", "--max-length", "1024",
               "--buckets", "256,512,1024", "--num-anchors", "128", "--num-draft-layers", "1",
               "--target-devices", dev, "--drafter-devices", ",".join([dev] * 3), "--max-steps", "24",
               "--log-interval", "4", "--ckpt-interval", "100000", "--compile-cache", os.path.join(out, "cc"),
               "--compile-scope", a.compile_scope,
               "--out-dir", out] + (["--no-gate"] if mode == "no-gate" else [])
        t0 = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True)
        text = p.stdout + p.stderr
        with open(os.path.join(tmp, f"race_{mode}.log"), "w") as f:
            f.write(text)
        rates = [float(x.replace(",", "")) for x in re.findall(r"\| ([\d,]+) tok/s \|", text)]
        rows[mode] = {"exit": p.returncode, "fx_errors": text.count("Detected that you are using FX"),
                      "uncompiled_errors": text.count("ran uncompiled"), "wall_s": round(time.time() - t0, 1),
                      "median_tok_s": statistics.median(rates[1:]) if len(rates) > 1 else None,
                      "log": os.path.join(tmp, f"race_{mode}.log")}
    print(f"{'mode':8s} {'exit':>4s} {'FX errors':>9s} {'uncompiled':>10s} {'tok/s':>9s} {'wall s':>7s}")
    for mode, r in rows.items():
        print(f"{mode:8s} {r['exit']:4d} {r['fx_errors']:9d} {r['uncompiled_errors']:10d} "
              f"{r['median_tok_s'] or 0:9,.0f} {r['wall_s']:7.1f}   {r['log']}")
    save_json(a, rows)
    return rows


if __name__ == "__main__":
    main()
