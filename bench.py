"""Benchmark on one device: target forward (compiled and eager), drafter step, warm-up, the threaded pipeline.

    python bench.py                    # Qwen3-8B-shaped random target, 5-layer drafter, S 3072, 512 anchors
    python bench.py --tiny             # the same code at toy size (CPU: seconds)
    python bench.py --pipeline-only --target-devices cuda:0 --drafter-devices cuda:1   # the loop, any layout
    python bench.py --embedded --json main_job.json   # the main job's parts on the embedded default (GPU)
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

import torch

import checkpoint
import compiled
import config
import data_dflash
import dflash_model as dm
import errors
import models
import replicas
from master_adamw import MasterAdamW

QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
HERE = os.path.dirname(os.path.abspath(__file__))
BUSY = r"busy\s+(target .*?) \(share"      # the summary's busy line, as train_dflash.py writes it
MFU = r"MFU drafter ([\d.]+% \(real tokens [\d.]+%\))"     # a log line's
TINY = dict(QWEN3_8B, vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)

def parse_args(argv):
    p = config.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy sizes (the default on CPU)")
    p.add_argument("--target-config", default="", metavar="JSON",
                   help="a target's config.json (random weights of its shape) instead of Qwen3-8B's")
    p.add_argument("--seq", type=int, default=0, help="sequence length (default 3072; tiny 256)")
    p.add_argument("--anchors", type=int, default=0, help="anchors per sequence (default 512; tiny 16)")
    p.add_argument("--steps", type=int, default=10, help="timed calls back to back per round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds; the median time per call is reported")
    p.add_argument("--pipeline-steps", type=int, default=40, help="optimiser steps of the pipeline run")
    p.add_argument("--no-pipeline", action="store_true", help="skip the threaded pipeline")
    p.add_argument("--pipeline-only", action="store_true", help="only the threaded pipeline")
    p.add_argument("--target-devices", default="", help="pipeline target devices (default: --device)")
    p.add_argument("--drafter-devices", default="", help="pipeline drafter devices (default: --device)")
    p.add_argument("--cache", default="", help="compile cache (default: a fresh temporary folder = cold)")
    p.add_argument("--device", default="", help="device of the one-device measurements (default cuda:0, or cpu)")
    p.add_argument("--distill", type=float, default=0.0, help="the step's KL weight, as train_dflash.py --distill")
    p.add_argument("--json", default="", help="also write the results to this file")
    p.add_argument("--embedded", action="store_true",
                   help="the main job on the embedded default, on a GPU: start_training.sh from a fresh cache and "
                        "output folder (regeneration, tokenising, warm-up, --train-minutes of training: their rates "
                        "and times), then eval_dflash.py --eval-runs times on its drafter (tau, batch-1 speed-ups)")
    p.add_argument("--train-minutes", type=float, default=3.0,
                   help="--embedded: the training budget (the main job's: 15)")
    p.add_argument("--eval-runs", type=int, default=3,
                   help="--embedded: eval_dflash.py runs (their spread is reported)")
    a = p.parse_args(argv)
    if min(a.steps, a.rounds, a.eval_runs) < 1 or a.train_minutes <= 0:
        p.error("--steps, --rounds and --eval-runs must be >= 1, --train-minutes > 0")
    if a.embedded and not torch.cuda.is_available():
        p.error("--embedded needs a GPU: the main job's recipe runs there (on a CPU start_training.sh trains a short "
                "CPU run, with no regeneration)")
    for option in ("device", "target_devices", "drafter_devices"):
        config.devices(getattr(a, option), "--" + option.replace("_", "-"))
    if a.json:      # where the results go, before the work that makes them
        config.writable_file(a.json, "--json")
    if a.target_config:
        try:
            with open(a.target_config) as f:
                a.spec = {k: v for k, v in json.load(f).items() if k not in ("architectures", "torch_dtype", "dtype")}
        except (OSError, ValueError) as e:
            p.error(f"--target-config {a.target_config}: {e}")
    return a

@errors.script
def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    # the runs' checkpoints and caches go with it: a Qwen3-8B-sized drafter's state alone is over 10 GB
    with tempfile.TemporaryDirectory(prefix="dflash_bench_") as tmp:
        cache = compiled.use_compile_cache(a.cache or os.path.join(tmp, "compile_cache"))   # before any compile
        dev = torch.device(a.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        log = lambda m: print(m, flush=True)
        if a.embedded:
            import transformers
            import triton
            return report(a, {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                              "triton": triton.__version__, "transformers": transformers.__version__}
                          | main_job(a, tmp, log))
        spec = a.spec if a.target_config else TINY if a.tiny or dev.type == "cpu" else QWEN3_8B
        S, A = a.seq or (256 if spec is TINY else 3072), a.anchors or (16 if spec is TINY else 512)
        cfg_path = os.path.join(tmp, "target_config.json")
        data_dflash.write_json(cfg_path, spec)
        run_cfg = config.TrainConfig(target="random:" + cfg_path, max_length=S, num_anchors=A, distill=a.distill)
        res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
               "torch_git": torch.version.git_version, "S": S, "anchors": A, "target_hidden": spec["hidden_size"],
               "rounds": a.rounds, "steps_per_round": a.steps, "spread_ms": {}}
        if a.pipeline_only:
            return report(a, res | pipeline(a, run_cfg, cache, tmp, S, A, dev, log))
        peak = compiled.measure_peak_flops(dev)
        res["peak_tflops"] = peak / 1e12
        log(f"[bench] {res['device']} torch {torch.__version__}: matmul peak {peak / 1e12:.0f} TFLOP/s")

        def timed(name, fn):      # median seconds per call, in ms; the rounds' min-max goes to res["spread_ms"]
            t, spread = compiled.median_time(fn, a.steps, dev, a.rounds)
            res[name], res["spread_ms"][name] = 1e3 * t, [round(1e3 * s, 2) for s in spread]
            return t
        # the models, then the trainer's cold warm-up: the drafter's shapes, and the target's on a GPU
        tcfg, _ = models.load_target_config(run_cfg.target)
        dcfg = models.make_drafter_config(run_cfg, tcfg, None)
        target = models.load_target(run_cfg.target, dev, config.param_dtype(dev), dcfg.target_layer_ids, log,
                                    whole=run_cfg.teacher)
        plan = config.shape_plan(run_cfg, dcfg, config.batch_memory(dcfg, tcfg, [dev], [dev]))
        B = res["B"] = next(b for b, s, _ in plan if s == S)        # the trainer's rows for this length on this device
        drafter = models.new_drafter(dcfg, target.get_input_embeddings().weight.detach(),
                                     target.get_output_embeddings().weight.detach(), dev, 0)
        opt = MasterAdamW(drafter.parameters(), lr=1e-5, param_dtype=config.param_dtype(dev))
        attn = "flex" if dev.type == "cuda" else "sdpa"
        if attn == "flex":
            compiled.compile_target_layers(target)
            compiled.compile_drafter(drafter)
        graphed = compiled.GraphedTarget(target, dcfg.target_layer_ids, final=run_cfg.teacher)
        t0 = time.time()
        rows = compiled.warm_up([drafter], [(B, S, A)], replicas.forward_backward, dm.Loss(7.0, a.distill), log=log,
                                targets=[graphed] if attn == "flex" else ())
        opt.zero_grad(set_to_none=True)
        res.update(warmup_cold_s=time.time() - t0, warmup_rows=[[r[0], list(r[1]), round(r[2], 1), r[3]] for r in rows])
        ids = torch.randint(0, spec["vocab_size"], (B, S), device=dev)

        def target_eager():       # the eager baseline, deliberately uncompiled: only timed against the compiled one
            with torch.compiler.set_stance("force_eager"):
                return graphed.forward(ids)
        t_target, t_eager = timed("target_ms", lambda: graphed(ids)), timed("target_eager_ms", target_eager)
        n_params = sum(p.numel() for n, p in target.model.named_parameters() if "embed" not in n)
        res.update(target_tok_s=B * S / t_target, target_mfu=2 * n_params * B * S / t_target / peak)
        log(f"[bench] target forward ({len(target.model.layers)} layers, {B} x {S} tokens, {attn}): "
            f"{1e3 * t_target:.1f} ms = {B * S / t_target:,.0f} tok/s, MFU {res['target_mfu']:.1%} "
            f"(eager {1e3 * t_eager:.1f} ms)")
        feats = graphed(ids)
        lm = torch.ones(B, S, device=dev)
        lm[:, : S // 10] = 0
        anchors, valid = dm.sample_anchors(lm, torch.full((B,), S), A, dcfg.block_size,
                                           torch.Generator().manual_seed(0))
        batch = dm.make_batch(ids, lm, anchors, valid, dcfg, dm.Loss(7.0, a.distill))      # the loader's work

        def step():
            replicas.forward_backward(drafter, [(feats, batch)], None)
            replicas.clip_and_step(opt, [p.grad for p in drafter.parameters()], 1.0)   # the trainer's lone-replica step
            opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t_drafter = timed("drafter_ms", step)
        flops = dm.batch_flops(dcfg, S, anchors, valid, batch.taught)
        mem = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
        res.update(drafter_tok_s=B * S / t_drafter, drafter_mfu=flops / t_drafter / peak,
                   drafter_tflop_per_step=flops / 1e12, drafter_peak_mem_gib=mem)
        log(f"[bench] drafter step: {1e3 * t_drafter:.1f} ms = {B * S / t_drafter:,.0f} target tok/s, "
            f"MFU {res['drafter_mfu']:.1%}" + (f", peak mem {mem:.1f} GiB" if mem is not None else ""))
        res["sum_of_parts_tok_s"] = B * S / (t_target + t_drafter)
        del target, graphed, drafter, opt, feats
        torch.cuda.empty_cache()       # a no-op where CUDA never started
        if not a.no_pipeline:          # the real train_dflash loop, on the same, now warm, compile cache
            res.update(pipeline(a, run_cfg, cache, tmp, S, A, dev, log))
            res["pipeline_vs_sum_of_parts"] = res["pipeline_tok_s"] / res["sum_of_parts_tok_s"]
            log(f"[bench] pipeline {res['pipeline_tok_s']:,.0f} tok/s vs sum of parts "
                f"{res['sum_of_parts_tok_s']:,.0f} tok/s: {res['pipeline_vs_sum_of_parts']:.1%}")
        return report(a, res)

def report(a, res):
    print(json.dumps(res, indent=1))
    if a.json:
        data_dflash.write_json(a.json, res)
    return res

def pipeline(a, run_cfg, cache, tmp, S, A, dev, log):
    """train_dflash.py on synthetic full-length samples: median tokens/s after its first log line, warm-up, busy."""
    devices = {"target": a.target_devices or str(dev), "drafter": a.drafter_devices or str(dev)}
    cmd = [sys.executable, "-u", os.path.join(HERE, "train_dflash.py"),
           "--target", run_cfg.target, "--data", "synthetic:256", "--max-length", str(S), "--num-anchors", str(A),
           "--buckets", str(S), "--target-devices", devices["target"], "--drafter-devices", devices["drafter"],
           "--log-interval", "5", "--max-steps", str(a.pipeline_steps), "--ckpt-interval", "100000",
           "--compile-cache", cache, "--out-dir", os.path.join(tmp, "pipeline_out")]
    t0 = time.time()
    text = run(cmd, dict(os.environ), log)
    wall = time.time() - t0
    rates = [float(x.replace(",", "")) for x in re.findall(r"\| ([\d,]+) tok/s \|", text)]
    warm = re.search(r"\[warmup\] done in ([\d.]+)s", text)
    busy = re.search(BUSY, text)
    for line in text.splitlines():
        if line.startswith(("step ", "[warmup]", "[replicas]", "[run] start-up")) or "busy" in line:
            log("  | " + line)
    return {"pipeline_tok_s": statistics.median(rates[1:]) if len(rates) > 1 else float("nan"),
            "pipeline_tok_s_spread": [min(rates[1:]), max(rates[1:])] if len(rates) > 2 else None,
            "warmup_warm_cache_s": float(warm.group(1)) if warm else None,
            "pipeline_busy": busy.group(1) if busy else None, "pipeline_wall_s": wall, "pipeline_devices": devices}

def main_job(a, tmp, log):
    """start_training.sh with a fresh cache (the embedded default's converted model and ShareGPT file linked in, as
    prepared in .cache) and output folder: its regeneration, start-up and training figures; then eval_dflash.py's
    tau and batch-1 speed-ups of the drafter it trained, --eval-runs times."""
    model, chats = data_dflash.prepare_embedded_default(os.path.join(HERE, ".cache"))
    cache, out = os.path.join(tmp, "cache"), os.path.join(tmp, "out")
    os.makedirs(cache)
    for path in (model, chats):
        os.symlink(path, os.path.join(cache, os.path.basename(path)))
    env = dict(os.environ, DFLASH_SKIP_INSTALL="1", PYTHON=sys.executable)
    t0 = time.time()
    text = run(["bash", os.path.join(HERE, "start_training.sh"), "--cache-dir", cache, "--out-dir", out,
                "--max-minutes", str(a.train_minutes)], env, log)
    res = {"main_job_s": time.time() - t0, "train_minutes": a.train_minutes,
           **main_job_figures(text, out, os.path.join(cache, "sharegpt_v3_sampled.jsonl.manifest.json"))}
    drafter = os.path.join(checkpoint.list_checkpoints(out)[-1], "drafter")
    runs = []
    for i in range(a.eval_runs):
        run([sys.executable, "-u", os.path.join(HERE, "eval_dflash.py"), "--target", model, "--drafter", drafter,
             "--prompts", os.path.join(out, "heldout.jsonl"), "--json", os.path.join(tmp, f"eval_{i}.json")], env, log)
        runs.append(data_dflash.read_json(os.path.join(tmp, f"eval_{i}.json")))
    return res | eval_figures(runs)

def run(cmd, env, log):
    """cmd's output; a failure ends the benchmark with its tail."""
    log("[bench] " + " ".join(cmd))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode:
        print((p.stdout + p.stderr)[-5000:])
        script = next(os.path.basename(c) for c in cmd if c.endswith((".py", ".sh")))
        raise SystemExit(f"error: {script} failed (exit {p.returncode}); its output's tail is above")
    return p.stdout + p.stderr

def main_job_figures(text, out, manifest):
    """Regeneration (its manifest), start-up and training (the log, metrics.jsonl: steps/s after the first fifth)."""
    gen = data_dflash.read_json(manifest)
    find = lambda pattern: (m := re.search(pattern, text)) and m.group(1)
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    first, last = recs[len(recs) // 5], recs[-1]
    return {"regen_tok_s": gen["this_run"]["tok_s"], "regen_s": gen["this_run"]["generation_seconds"],
            "regen_tokens": gen["counts"]["generated_tokens"], "startup_s": float(find(r"\[run\] start-up ([\d.]+)s")),
            "warmup_s": float(find(r"\[warmup\] done in ([\d.]+)s")), "train_steps": last["step"],
            "train_steps_s": (last["step"] - first["step"]) / max(last["time"] - first["time"], 1e-9),
            "train_busy": find(BUSY), "train_mfu_last_line": (re.findall(MFU, text) or [None])[-1],
            "optimiser_sync_share": find(r"optimiser step \+ gradient sync (\d+%)")}

def eval_figures(runs):
    """Per method: tau, and the batch-1 speed-up (mean, min, max over the runs) and its ratio to tau."""
    out = {"eval_prompts": runs[0]["prompts"], "lossless": {m: r["lossless"] for m, r in runs[0]["methods"].items()}}
    for name in runs[0]["speed"]["methods"]:
        ups = [r["speed"]["methods"][name]["speedup"] for r in runs]
        tau = runs[0]["methods"].get(name, {}).get("mean_tau")
        out[name] = {"tau": tau, "speedup": statistics.mean(ups), "speedup_range": [min(ups), max(ups)],
                     "tok_s": statistics.mean(r["speed"]["methods"][name]["tok_s"] for r in runs),
                     "speedup_per_tau": statistics.mean(ups) / tau if tau else None}
    return out

if __name__ == "__main__":
    main()
