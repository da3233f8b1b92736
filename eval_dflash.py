"""Measure trained drafters: acceptance length, losslessness and the speed-up at batch 1, on real prompts.

    python eval_dflash.py --target PATH_OR_HUB_NAME --drafter out/step_000690/drafter --prompts out/heldout.jsonl
    python eval_dflash.py --target ... --drafter out/step_000*/drafter --prompts ...   # compare checkpoints

Each prompt (a conversation up to its first reply) is decoded greedily, side by side in --dtype, by the target
alone, by n-gram prompt lookup and by each drafter; an output unequal to the target's makes the exit status 1. Then
the speed as served: --speed-prompts prompts, each alone, in --speed-dtype (on a GPU: compiled layers and CUDA graphs).
"""
import argparse
import collections
import os
import sys
import time

import torch

import compiled
import config
import data_dflash
import decoding
import dflash_model as dm
import errors
import models

DTYPES = ["float32", "bfloat16", "float16"]

def parse_args(argv):
    p = config.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", nargs="+", required=True, metavar="PATH", help="drafter folders, all of one block size")
    p.add_argument("--prompts", nargs="+", required=True, help="ShareGPT JSON/JSONL or chat JSONL")
    p.add_argument("--num-prompts", type=int, default=None, help="default: 100 on a GPU, 5 on a CPU")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: 128 on a GPU, 32 on a CPU")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="of tau and losslessness: float32 keeps verifying a block and decoding one token aligned")
    p.add_argument("--speed-dtype", default="bfloat16", choices=DTYPES, help="of the batch-1 speed (as served)")
    p.add_argument("--speed-prompts", type=int, default=None,
                   help="the first N prompts timed at batch 1 (default: 20 on a GPU, 1 on a CPU; 0 = no speed table)")
    p.add_argument("--json", default="", help="also write the results to this JSON file")
    a = p.parse_args(argv)
    # a short name per drafter: step_000690 of .../step_000690/drafter, else the folder's name; else the paths
    parts = [os.path.normpath(f).split(os.sep) for f in a.drafter]
    short = [q[-2] if q[-1] == "drafter" and len(q) > 1 else q[-1] for q in parts]
    a.drafters = dict(zip(short if len(set(short)) == len(short) else map(os.path.normpath, a.drafter), a.drafter))
    if len(a.drafters) < len(a.drafter):
        p.error(f"a drafter is given twice: {' '.join(a.drafter)}")
    if errs := config.data_errors(a.prompts):
        p.error(f"--prompts: {'; '.join(errs)}")
    if min(1 if x is None else x for x in (a.num_prompts, a.max_new_tokens, a.max_prompt_tokens)) < 1 \
            or (a.speed_prompts or 0) < 0:
        p.error("--num-prompts, --max-new-tokens and --max-prompt-tokens must be >= 1, --speed-prompts >= 0")
    config.check_devices([a.device])
    if a.json:      # where the results go, before the work that makes them
        config.writable_file(a.json, "--json")
    gpu = a.gpu = torch.device(a.device).type == "cuda"
    a.num_prompts = a.num_prompts or (100 if gpu else 5)
    a.max_new_tokens = a.max_new_tokens or (128 if gpu else 32)
    a.speed_prompts = min(a.num_prompts, (20 if gpu else 1) if a.speed_prompts is None else a.speed_prompts)
    return a

def prompts_from(files, tokenizer, n, max_tokens):
    """The ids of the first n usable prompts (each conversation up to its first reply)."""
    out = []
    for msgs in data_dflash.load_conversations(files)[0]:
        first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")   # not 0: leading replies are dropped
        if ids := data_dflash.prompt_ids(tokenizer, [msgs[:first]], max_tokens)[0][0]:
            out.append(ids)
        if len(out) >= n:
            return out
    print(f"[eval] NOTICE: only {len(out)} usable prompts (asked for {n})")
    return out

def decode(target, drafters, prompts, n, stops, bs, device, rows=None, compile=False):
    """{name: ([(new tokens, acceptance lengths)] per prompt, seconds)}, the prompts in batches of `rows` (None: as many
    as fit); at batch 1 timed after an untimed prompt (the graphs' capture), as a server at batch 1 runs."""
    length, out = max(map(len, prompts)) + n + 2 * bs, {}
    rows = rows or min(len(prompts), decoding.Engine.fit(target, length, most=len(prompts)))
    methods = [("target greedy", (), lambda: None),    # (name, feature layers, a fresh proposer)
               *((lb, d.config.target_layer_ids, lambda d=d: decoding.DrafterRows(d, rows, length, compile))
                 for lb, d in drafters.items()), ("n-gram lookup", (), lambda: decoding.NGram(bs))]
    for name, layers, make in methods:
        engine, proposer = decoding.Engine(target, rows, length, layers, compile), make()
        if rows == 1:
            decoding.speculate(engine, prompts[:1], n, stops, proposer)
        compiled.sync_device(device)
        t0 = time.time()
        got = []
        for i in range(0, len(prompts), rows):
            got += decoding.speculate(engine, prompts[i:i + rows], n, stops, proposer)
        compiled.sync_device(device)
        out[name], rounds = (got, time.time() - t0), [r for _, acc in got for r in acc]
        print(f"[eval] {name}: {len(prompts)} prompts in batches of {rows}, {out[name][1]:.1f} s"
              + (f", tau {sum(rounds) / max(1, len(rounds)):.3f}" if name != "target greedy" else ""), flush=True)
    return out

@errors.script
def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    (tcfg, tok), t_start, dtype = models.load_target_config(a.target), time.time(), getattr(torch, a.dtype)
    data_dflash.require_chat_template(tok, a.target)
    target = models.load_model(a.target, a.device, dtype)
    drafters = {lb: dm.load_drafter(p, target, device=a.device, dtype=dtype).eval() for lb, p in a.drafters.items()}
    identity = models.target_identity(a.target, tcfg)
    for lb, p in a.drafters.items():     # before any decoding: a wrong pairing wastes the whole eval
        models.check_drafter_target(p, drafters[lb].config.target, identity)
    sizes = {lb: d.config.block_size for lb, d in drafters.items()}
    if len(set(sizes.values())) > 1:      # the report and its JSON name one drafter block size
        raise SystemExit(f"error: the drafters' block sizes differ ({sizes}): compare drafters of one block size")
    stops, dbs = decoding.stop_token_ids(tok, target), next(iter(sizes.values()))
    bs = max(dbs, 16)     # n-gram lookup drafts what it would alone (15 tokens), however short the drafters' blocks
    prompts = prompts_from(a.prompts, tok, a.num_prompts, a.max_prompt_tokens)
    if not prompts:
        raise SystemExit("error: no usable prompts")
    print(f"[eval] {len(prompts)} prompts, target {a.target}, {len(drafters)} drafter(s), {a.dtype} on {a.device}, "
          f"block {dbs}, stop ids {stops}; baseline: n-gram prompt lookup (last 3/2/1 tokens, up to {bs - 1})")
    outs = {name: got for name, (got, _) in decode(target, drafters, prompts, a.max_new_tokens, stops, bs,
                                                     a.device).items()}
    ref = outs.pop("target greedy")
    res = {"prompts": len(prompts), "target": a.target, "drafters": a.drafters,
           "prompt_files": a.prompts, "max_prompt_tokens": a.max_prompt_tokens, "max_new_tokens": a.max_new_tokens,
           "dtype": a.dtype, "device": str(a.device), "block_size": dbs, "ngram_block": bs,
           "tokens_out": sum(len(o) for o, _ in ref), "methods": {}, "per_prompt": []}
    for name, got in outs.items():
        bad = [{"prompt": i, **first_difference(target, p, r, o)}
               for i, (p, (r, _), (o, _)) in enumerate(zip(prompts, ref, got)) if o != r]
        hist = collections.Counter(x for _, acc in got for x in acc)
        rounds = sum(hist.values())
        res["methods"][name] = {"mean_tau": sum(L * c for L, c in hist.items()) / max(1, rounds), "rounds": rounds,
                                "histogram": dict(sorted(hist.items())),
                                "acceptance_by_position": acceptance_by_position(hist, dbs if name in drafters else bs),
                                "lossless": len(prompts) - len(bad), "mismatches": bad}
    for i, (p, (r, _)) in enumerate(zip(prompts, ref)):
        taus = {name: sum(got[i][1]) / len(got[i][1]) if got[i][1] else None for name, got in outs.items()}
        res["per_prompt"].append({"prompt": i, "tokens_in": len(p), "tokens_out": len(r), "tau": taus})
    if a.speed_prompts:
        target.to(getattr(torch, a.speed_dtype))
        drafters = {lb: dm.load_drafter(p, target, device=a.device, dtype=getattr(torch, a.speed_dtype)).eval()
                    for lb, p in a.drafters.items()}
        times = {name: (sum(len(o) for o, _ in got), t) for name, (got, t) in decode(
            target, drafters, prompts[:a.speed_prompts], a.max_new_tokens, stops, bs, a.device, 1, a.gpu).items()}
        greedy_rate = times["target greedy"][0] / times["target greedy"][1]
        res["speed"] = {"prompts": a.speed_prompts, "dtype": a.speed_dtype, "batch": 1,
                        "loop": "CUDA graphs, compiled target and drafters" if a.gpu else "eager",
                        "methods": {name: {"tokens": t, "seconds": s, "tok_s": t / s, "speedup": t / s / greedy_rate}
                                    for name, (t, s) in times.items()}}
    res["seconds"] = time.time() - t_start
    for label, folder in a.drafters.items():     # each drafter's card carries what it measured
        dm.write_measured(folder, measured(res, label))
    return report(res, a.json)

def measured(res, label):
    """A drafter's figures for its card: acceptance, losslessness, the batch-1 speed-up, n-gram lookup's beside."""
    m, ng, sp, n = res["methods"][label], res["methods"]["n-gram lookup"], res.get("speed"), res["prompts"]
    out = {"prompts": f"{n} of {', '.join(res['prompt_files'])}, up to {res['max_new_tokens']} new tokens, "
                      f"{res['dtype']}",
           "tau (acceptance length)": f"{m['mean_tau']:.2f} (n-gram lookup {ng['mean_tau']:.2f})",
           "lossless": f"{m['lossless']}/{n}"}
    if sp:
        s = sp["methods"]
        out["batch-1 speed-up"] = (f"{s[label]['speedup']:.2f}x over the target alone (n-gram lookup "
                                   f"{s['n-gram lookup']['speedup']:.2f}x): {sp['prompts']} prompts, {sp['dtype']}, "
                                   f"{sp['loop']}")
    return out

def first_difference(target, prompt, ref, out):
    """Where an output first differs, and the target's logit margin there (tiny: a rounding near-tie; large: a bug)."""
    at = next((i for i, (x, y) in enumerate(zip(ref, out)) if x != y), min(len(ref), len(out)))
    with torch.no_grad():
        top = target(torch.tensor([prompt + ref[:at]], device=target.device)).logits[0, -1].float().topk(2).values
    return {"at": at, "margin": float(top[0] - top[1])}

def acceptance_by_position(hist, bs):
    """Per draft position k = 1..bs-1: of the rounds accepting >= k tokens, the share accepting > k; None if none."""
    at_least = [sum(c for L, c in hist.items() if L >= k) for k in range(1, bs + 1)]
    return [at_least[k] / at_least[k - 1] if at_least[k - 1] else None for k in range(1, bs)]

def report(res, json_path):
    bs, n, m, names = res["ngram_block"], res["prompts"], res["methods"], list(res["methods"])
    sp, w = res.get("speed"), max(16, *map(len, names))
    print("\nDFlash drafters: " + ", ".join(f"{lb} = {p}" for lb, p in res["drafters"].items()))
    print(f"tau and losslessness: {n} prompts side by side, {res['dtype']}; " + (
        f"tok/s: {sp['prompts']} prompts at batch 1, {sp['dtype']}, {sp['loop']}" if sp else "no speed table"))
    print(f"{'':{w}s} {'tau':>6s} {'lossless':>9s} {'tok/s':>9s} {'speed-up':>9s}")
    for name in ["target greedy", *names]:
        r, s = m.get(name), sp and sp["methods"][name]
        print(f"{name:{w}s} " + (f"{r['mean_tau']:6.3f} {r['lossless']:>5d}/{n:<3d}" if r else f"{'':6s} {'':9s}")
              + (f" {s['tok_s']:9.1f} {s['speedup']:8.2f}x" if s else ""))
    print(f"acceptance by draft position 1..{bs - 1} (of the rounds that reach it, the share that accept it):")
    for name in names:
        print(f"  {name:{w}s} " + " ".join(f"{'-' if x is None else format(x, '.2f'):>4s}"
                                           for x in m[name]["acceptance_by_position"]))
    print(f"[eval] {res['seconds']:.1f} s in all")
    if json_path:
        data_dflash.write_json(json_path, res)
    bad = [(name, x) for name in names for x in m[name]["mismatches"]]
    for name, x in bad:
        print(f"ERROR: prompt {x['prompt']}: {name} output differs from target greedy at new token "
              f"{x['at']} (target logit margin there {x['margin']:.2e})")
    return 1 if bad else 0

if __name__ == "__main__":
    sys.exit(main())
