"""Measure a trained drafter: acceptance length, speed-up and losslessness on real prompts.

    python eval_dflash.py --target PATH_OR_HUB_NAME --drafter out/step_000690/drafter --prompts out/heldout.jsonl
    python eval_dflash.py --merge part0.json part1.json [--json all.json]

Each prompt (a conversation up to its first reply, in the target's chat template) is decoded greedily by
the target alone, by DFlash and by n-gram prompt lookup (the speculator that needs no training: the
tokens that followed the last earlier match of the context's last 3, 2 or 1 tokens), all timed: tau
(the mean acceptance length), its histogram, the rates and speed-ups, in one table. Both speculators'
output must equal the target's token for token, or the exit status is 1.
The defaults fit the device: 100 prompts x 256 new tokens on a GPU, 5 x 32 on a CPU (a 135M target
decodes a few tokens per second there). --merge adds up the --json results of runs over disjoint
prompt ranges (--skip / --num-prompts, e.g. one process per GPU); --processes N does that on one device.
"""
import argparse
import collections
import json
import os
import sys
import time

import torch

import data_dflash
import dflash_model as dm


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--prompts", nargs="+", help="ShareGPT JSON/JSONL or chat JSONL")
    p.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                   help="only add up these --json results of runs over disjoint prompt ranges")
    p.add_argument("--num-prompts", type=int, default=None, help="default: 100 on a GPU, 5 on a CPU")
    p.add_argument("--skip", type=int, default=0, help="skip this many usable prompts first")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: 256 on a GPU, 32 on a CPU")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="float32 keeps batched verification and one-token decoding numerically aligned")
    p.add_argument("--json", default="", help="also write the results to this JSON file")
    p.add_argument("--processes", type=int, default=1,
                   help="split the prompts over N processes on the device and add their results up: one "
                        "sequence decoding token by token leaves a GPU mostly idle. Tau and losslessness are "
                        "exact; the rates are under contention")
    p.add_argument("--max-minutes", type=float, default=0.0,
                   help="time budget: stop after the prompt that crosses it and report the prompts done "
                        "(marked incomplete); 0 = no budget")
    a = p.parse_args(argv)
    missing = [f"--{n}" for n in ("target", "drafter", "prompts") if not getattr(a, n)]
    if missing and not a.merge:
        p.error(f"{', '.join(missing)} required (or --merge)")
    if a.merge and len(missing) < 3:
        p.error("--merge adds up earlier results: give it without --target/--drafter/--prompts")
    gpu = torch.device(a.device).type == "cuda"
    a.num_prompts = a.num_prompts or (100 if gpu else 5)
    a.max_new_tokens = a.max_new_tokens or (256 if gpu else 32)
    return a


def prompts_from(files, tokenizer, n, skip, max_tokens):
    convs, skipped = data_dflash.load_conversations(files)
    out = []
    for msgs in convs:
        first_asst = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
        if first_asst is None or first_asst == 0:
            continue
        ids = tokenizer.apply_chat_template(msgs[:first_asst], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        if 0 < len(ids) <= max_tokens:
            out.append(ids)
        if len(out) >= skip + n:
            break
    if len(out) < skip + n:
        print(f"[eval] NOTICE: only {len(out) - skip} usable prompts (asked for {n})")
    return out[skip: skip + n], skipped


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


METHODS = {"dflash": "DFlash", "ngram": "n-gram lookup"}


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.merge:
        return merge(a.merge, a.json)
    if a.processes > 1:
        return split(a)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    dtype = getattr(torch, a.dtype)
    torch.backends.cuda.matmul.allow_tf32 = False
    tok = AutoTokenizer.from_pretrained(a.target)
    target = AutoModelForCausalLM.from_pretrained(a.target, dtype=dtype).to(a.device).eval()
    drafter = dm.load_drafter(a.drafter, target, device=a.device, dtype=dtype).eval()
    stops, bs = stop_token_ids(tok, target), drafter.config.block_size
    prompts, _ = prompts_from(a.prompts, tok, a.num_prompts, a.skip, a.max_prompt_tokens)
    if not prompts:
        raise SystemExit("error: no usable prompts")
    print(f"[eval] {len(prompts)} prompts, target {a.target}, drafter {a.drafter}, {a.dtype} on {a.device}, "
          f"block {bs}, stop ids {stops}; baseline: n-gram prompt lookup (last 3/2/1 tokens, up to {bs - 1})")
    decode = {"greedy": lambda x, n: (dm.target_greedy(target, x, n, stops), []),
              "dflash": lambda x, n: dm.dflash_generate(drafter, target, x, n, stops),
              "ngram": lambda x, n: dm.ngram_generate(target, x, n, stops, bs)}
    for fn in decode.values():        # one untimed round each: no side pays first-call costs in the timings
        fn(torch.tensor([prompts[0]], device=a.device), 8)
    runs = {m: new_run() for m in decode}
    meta = {"skip": a.skip, "requested": len(prompts), "target": a.target, "drafter": a.drafter,
            "prompt_files": a.prompts, "max_prompt_tokens": a.max_prompt_tokens, "max_new_tokens": a.max_new_tokens,
            "dtype": a.dtype, "device": str(a.device), "block_size": bs}
    t_start, done = time.time(), 0
    for k, ids in enumerate(prompts):
        if k and a.max_minutes and time.time() - t_start > 60 * a.max_minutes:
            print(f"[eval] NOTICE: time budget of {a.max_minutes} min reached after {k} of {len(prompts)} "
                  "prompts; reporting those (incomplete)")
            break
        done, x, line = k + 1, torch.tensor([ids], device=a.device), []
        for name, fn in decode.items():
            sync(a.device); t0 = time.time()
            out, acc = fn(x, a.max_new_tokens)
            sync(a.device)
            r = runs[name]
            r["seconds"] += time.time() - t0; r["tokens"] += out.shape[1] - x.shape[1]
            r["hist"].update(acc)
            if name == "greedy":
                ref = out
                continue
            lossless = torch.equal(ref, out)
            if not lossless:
                r["mismatches"].append(describe_mismatch(target, x, ref, out, a.skip + k))
            line.append(f"{name} tau {sum(acc) / max(1, len(acc)):.2f}" + ("" if lossless else " NOT LOSSLESS"))
        res = summarise(done, runs, meta)
        print(f"[eval] prompt {k + 1}/{len(prompts)}: {x.shape[1]} tokens in, {ref.shape[1] - x.shape[1]} out, "
              f"{', '.join(line)}; so far tau {res['dflash']['mean_tau']:.2f} (n-gram {res['ngram']['mean_tau']:.2f}), "
              f"speed-up {res['dflash']['speedup']:.2f}x", flush=True)
        if a.json and (k + 1) % 10 == 0:   # partial results survive a run that is stopped early
            data_dflash.write_json(a.json, res)
    return report(summarise(done, runs, meta), a.json)


def split(a):
    """Run --processes copies of this script over consecutive prompt ranges, then merge their results."""
    import subprocess
    import tempfile
    tmp, n = tempfile.mkdtemp(prefix="dflash_eval_"), min(a.processes, a.num_prompts)
    bounds = [a.skip + round(i * a.num_prompts / n) for i in range(n + 1)]
    parts, procs = [os.path.join(tmp, f"part{i}.json") for i in range(n)], []
    for i in range(n):
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--target", a.target, "--drafter", a.drafter, "--prompts",
             *a.prompts, "--skip", str(bounds[i]), "--num-prompts", str(bounds[i + 1] - bounds[i]),
             "--max-new-tokens", str(a.max_new_tokens), "--max-prompt-tokens", str(a.max_prompt_tokens),
             "--device", a.device, "--dtype", a.dtype, "--max-minutes", str(a.max_minutes), "--json", parts[i]]))
    if any(p.wait() not in (0, 1) for p in procs):    # 1: a lossy prompt, reported by the merge
        raise SystemExit(f"error: an eval process failed (see its output above); parts in {tmp}")
    return merge(parts, a.json)


def report(res, json_path):
    """Print a result (one run's or merged) and write it; exit status 1 if any prompt was lossy."""
    bs, n = res["block_size"], res["prompts"]
    print(f"\n{'':16s} {'tau':>6s} {'tok/s':>9s} {'speed-up':>9s}  lossless\n{'target greedy':16s} {'':6s} "
          f"{res['greedy']['tok_s']:9.1f} {1:8.2f}x")
    for m, label in METHODS.items():
        r = res[m]
        print(f"{label:16s} {r['mean_tau']:6.3f} {r['tok_s']:9.1f} {r['speedup']:8.2f}x  {r['lossless']}/{n}")
    print(f"acceptance lengths (rounds; block {bs}):  {'DFlash':>8s} {'n-gram':>8s}")
    hists = [{int(k): v for k, v in res[m]["histogram"].items()} for m in METHODS]
    print(format_histogram(*hists, bs=bs))
    if not res["complete"]:
        print(f"(incomplete: {n} of {res['requested']} prompts)")
    if json_path:
        data_dflash.write_json(json_path, res)
    bad = [(m, x) for m in METHODS for x in res[m]["mismatches"]]
    for m, x in bad:
        print(f"ERROR: prompt {x['prompt']}: {METHODS[m]} output differs from target greedy at new token "
              f"{x['at']} (target logit margin there {x['margin']:.2e})")
    return 1 if bad else 0


def merge(paths, json_path):
    """Add up the results of runs over disjoint prompt ranges (their --skip and prompt counts)."""
    parts = []
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        parts.append((r["skip"], r["skip"] + r["prompts"], path, r))
    parts.sort(key=lambda p: p[0])
    for (s0, e0, p0, r0), (s1, e1, p1, r1) in zip(parts, parts[1:]):
        if s1 < e0:
            raise SystemExit(f"error: {p0} (prompts {s0 + 1}-{e0}) and {p1} (prompts {s1 + 1}-{e1}) overlap")
    first = parts[0][3]
    for _, _, path, r in parts:
        for k in ("target", "drafter", "prompt_files", "max_prompt_tokens", "max_new_tokens", "dtype", "block_size"):
            if r.get(k) != first.get(k):
                raise SystemExit(f"error: {path} has {k} {r.get(k)}, {parts[0][2]} {first.get(k)}: not one measurement")
    runs = {m: new_run() for m in ("greedy", *METHODS)}
    for r in (p[3] for p in parts):
        for m, run in runs.items():
            run["tokens"] += r[m]["tokens"]
            run["seconds"] += r[m]["seconds"]
            run["hist"].update({int(k): v for k, v in r[m].get("histogram", {}).items()})
            run["mismatches"] += r[m].get("mismatches", [])
    gaps = [f"{e0 + 1}-{s1}" for (_, e0, _, _), (s1, _, _, _) in zip(parts, parts[1:]) if s1 > e0]
    last = parts[-1][3]
    meta = {k: first[k] for k in ("target", "drafter", "prompt_files", "max_prompt_tokens", "max_new_tokens",
                                  "dtype", "block_size")}
    meta.update(skip=parts[0][0], requested=last["skip"] + last["requested"] - parts[0][0],
                device=", ".join(sorted({p[3]["device"] for p in parts})))
    res = summarise(sum(p[3]["prompts"] for p in parts), runs, meta)
    res["complete"] = not gaps and last["complete"]     # (an earlier part cut short leaves a gap, or none)
    res["merged"] = [p[2] for p in parts]
    print(f"[eval] merged {len(parts)} results: prompts {parts[0][0] + 1}-{parts[-1][1]}"
          + (f" (not measured: {', '.join(gaps)})" if gaps else ""))
    return report(res, json_path)


def stop_token_ids(tok, target):
    """Sorted ids that end generation: the target's generation_config eos (an int or a list: Llama-3.1
    lists <|eot_id|> there, which ends each assistant turn), the tokenizer's eos and <|im_end|> where
    the vocabulary has it (looked up in it: convert_tokens_to_ids would give the unk id for a miss)."""
    gen = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    ids = set(gen if isinstance(gen, (list, tuple)) else [gen])
    ids |= {tok.eos_token_id, tok.get_vocab().get("<|im_end|>")}
    return sorted(t for t in ids if isinstance(t, int) and t >= 0)


def format_histogram(*hists, bs):
    """A row per acceptance length 1..bs: each method's count of rounds, a bar for the first; all zero
    when no prompt ran a drafting round (each ended at its first token: a stop id or --max-new-tokens 1)."""
    top = max(hists[0].values(), default=0)
    return "\n".join(f"  {L:2d} " + " ".join(f"{h.get(L, 0):8d}" for h in hists)
                     + f" {'#' * int(40 * hists[0].get(L, 0) / max(1, top))}" for L in range(1, bs + 1))


def measures(run, target):
    """Tau, histogram, rate and speed-up of one method from its counts and the target's (kept for --merge)."""
    hist, rounds = run["hist"], sum(run["hist"].values())
    tok_s = run["tokens"] / max(run["seconds"], 1e-9)
    return {"mean_tau": sum(L * c for L, c in hist.items()) / max(1, rounds), "rounds": rounds,
            "histogram": dict(sorted(hist.items())), "tok_s": tok_s,
            "speedup": tok_s / max(target["tokens"] / max(target["seconds"], 1e-9), 1e-9),
            "tokens": run["tokens"], "seconds": run["seconds"], "mismatches": run["mismatches"]}


def new_run():
    return {"hist": collections.Counter(), "tokens": 0, "seconds": 0.0, "mismatches": []}


def summarise(n_prompts, runs, meta):
    """The result: the run's settings (`meta`), the target alone's rate, each speculator's measures."""
    g = runs["greedy"]
    res = {"prompts": n_prompts, "complete": n_prompts == meta["requested"], **meta,
           "greedy": {"tokens": g["tokens"], "seconds": g["seconds"], "tok_s": g["tokens"] / max(g["seconds"], 1e-9)}}
    for m in METHODS:
        res[m] = measures(runs[m], g)
        res[m]["lossless"] = n_prompts - len(runs[m]["mismatches"])
    return res


@torch.no_grad()
def describe_mismatch(target, x, ref, out, k):
    n = min(ref.shape[1], out.shape[1])
    at = int((ref[0, :n] != out[0, :n]).nonzero()[0]) if (ref[0, :n] != out[0, :n]).any() else n
    logits = target(ref[:, :at]).logits[0, -1].float()
    top = logits.topk(2).values
    return {"prompt": k, "at": at - x.shape[1], "margin": float(top[0] - top[1])}


if __name__ == "__main__":
    sys.exit(main())
