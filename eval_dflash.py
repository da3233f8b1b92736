"""Measure a trained drafter: acceptance length, speed-up and losslessness on real prompts.

    python eval_dflash.py --target PATH_OR_HUB_NAME --drafter out/step_000690/drafter --prompts out/heldout.jsonl
    python eval_dflash.py --merge part0.json part1.json [--json all.json]

Each prompt (a conversation up to its first reply, in the target's chat template) is decoded greedily by
the target alone and by DFlash, both timed: tau (the mean acceptance length), its histogram, both rates
and the speed-up. DFlash's output must equal the target's token for token, or the exit status is 1.
The defaults fit the device: 100 prompts x 256 new tokens on a GPU, 5 x 32 on a CPU (a 135M target
decodes a few tokens per second there). --merge adds up the --json results of runs over disjoint
prompt ranges (--skip / --num-prompts, e.g. one process per GPU).
"""
import argparse
import collections
import json
import os
import sys
import time

import torch

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
    import data_dflash
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


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.merge:
        return merge(a.merge, a.json)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    dtype = getattr(torch, a.dtype)
    torch.backends.cuda.matmul.allow_tf32 = False
    tok = AutoTokenizer.from_pretrained(a.target)
    target = AutoModelForCausalLM.from_pretrained(a.target, dtype=dtype).to(a.device).eval()
    drafter = dm.load_drafter(a.drafter, target, device=a.device, dtype=dtype).eval()
    stops = stop_token_ids(tok, target)
    prompts, _ = prompts_from(a.prompts, tok, a.num_prompts, a.skip, a.max_prompt_tokens)
    if not prompts:
        raise SystemExit("error: no usable prompts")
    a.requested = len(prompts)
    print(f"[eval] {len(prompts)} prompts, target {a.target}, drafter {a.drafter}, {a.dtype} on {a.device}, "
          f"block {drafter.config.block_size}, stop ids {stops}")
    # one untimed round of each, so neither side pays first-call costs in the timings
    warm = torch.tensor([prompts[0]], device=a.device)
    dm.target_greedy(target, warm, 8, stops)
    dm.dflash_generate(drafter, target, warm, 8, stops)

    hist, bs = collections.Counter(), drafter.config.block_size     # acceptance length -> rounds
    t_ref = t_spec = 0.0
    n_ref = n_spec = 0
    mismatches = []
    t_start, done = time.time(), 0
    for k, ids in enumerate(prompts):
        if k and a.max_minutes and time.time() - t_start > 60 * a.max_minutes:
            print(f"[eval] NOTICE: time budget of {a.max_minutes} min reached after {k} of {len(prompts)} "
                  "prompts; reporting those (incomplete)")
            break
        done = k + 1
        x = torch.tensor([ids], device=a.device)
        sync(a.device); t0 = time.time()
        ref = dm.target_greedy(target, x, a.max_new_tokens, stops)
        sync(a.device); t1 = time.time()
        out, acc = dm.dflash_generate(drafter, target, x, a.max_new_tokens, stops)
        sync(a.device); t2 = time.time()
        t_ref += t1 - t0; t_spec += t2 - t1
        n_ref += ref.shape[1] - x.shape[1]; n_spec += out.shape[1] - x.shape[1]
        hist.update(acc)
        if not torch.equal(ref, out):
            mismatches.append(describe_mismatch(target, x, ref, out, a.skip + k))
        res = summarise(k + 1, hist, n_ref, t_ref, n_spec, t_spec, mismatches, a, bs)
        print(f"[eval] prompt {k + 1}/{len(prompts)}: {x.shape[1]} tokens in, {out.shape[1] - x.shape[1]} out, "
              f"tau {sum(acc) / max(1, len(acc)):.2f} ({t2 - t0:.1f}s); so far tau {res['mean_tau']:.2f}, "
              f"speed-up {res['speedup']:.2f}x" + ("" if torch.equal(ref, out) else ", NOT LOSSLESS"), flush=True)
        if a.json and (k + 1) % 10 == 0:   # partial results survive a run that is stopped early
            write_json(a.json, res)
    return report(summarise(done, hist, n_ref, t_ref, n_spec, t_spec, mismatches, a, bs), a.json)


def report(res, json_path):
    """Print a result (one run's or merged) and write it; exit status 1 if any prompt was lossy."""
    bs, hist = res["block_size"], {int(k): v for k, v in res["histogram"].items()}
    print(f"\nmean acceptance length tau = {res['mean_tau']:.3f} over {res['rounds']} rounds (block {bs})")
    print("histogram of acceptance lengths:\n" + format_histogram(hist, bs))
    print(f"target-only greedy: {res['target_tok_s']:8.1f} tok/s\nDFlash speculative: {res['dflash_tok_s']:8.1f} "
          f"tok/s\nspeed-up: {res['speedup']:.2f}x")
    print(f"lossless: {res['lossless']}/{res['prompts']} prompts identical to target greedy"
          + ("" if res["complete"] else f" (incomplete: {res['prompts']} of {res['requested']} prompts)"))
    if json_path:
        write_json(json_path, res)
    for m in res["mismatches"]:
        print(f"ERROR: prompt {m['prompt']}: speculative output differs from target greedy at new token "
              f"{m['at']} (target logit margin there {m['margin']:.2e})")
    return 1 if res["mismatches"] else 0


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
    runs = [p[3] for p in parts]
    hist = collections.Counter()
    for r in runs:
        hist.update({int(k): v for k, v in r["histogram"].items()})
    gaps = [f"{e0 + 1}-{s1}" for (_, e0, _, _), (s1, _, _, _) in zip(parts, parts[1:]) if s1 > e0]
    last = parts[-1][3]
    res = {"prompts": sum(r["prompts"] for r in runs), "requested": last["skip"] + last["requested"] - parts[0][0],
           **measures(hist, *(sum(r[k] for r in runs) for k in RAW_SUMS)),
           "lossless": sum(r["lossless"] for r in runs), "mismatches": [m for r in runs for m in r["mismatches"]],
           "skip": parts[0][0], "max_new_tokens": first["max_new_tokens"], "dtype": first["dtype"],
           "block_size": first["block_size"], "device": ", ".join(sorted({r["device"] for r in runs})),
           "merged": [p[2] for p in parts]}
    res["complete"] = not gaps and last["complete"]     # (an earlier part cut short leaves a gap, or none)
    print(f"[eval] merged {len(runs)} results: prompts {parts[0][0] + 1}-{parts[-1][1]}"
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


def format_histogram(hist, bs):
    """One bar per acceptance length 1..bs; all zero when no prompt ran a drafting round (each ended at
    its first token: a stop id or --max-new-tokens 1)."""
    top = max(hist.values(), default=0)
    return "\n".join(f"  {L:2d} {hist.get(L, 0):7d} {'#' * int(60 * hist.get(L, 0) / max(1, top))}"
                     for L in range(1, bs + 1))


RAW_SUMS = ("target_tokens", "target_seconds", "dflash_tokens", "dflash_seconds")


def measures(hist, n_ref, t_ref, n_spec, t_spec):
    """Tau, histogram and rates from the histogram and the raw sums (kept in the result for --merge)."""
    rounds = sum(hist.values())
    return {"mean_tau": sum(L * c for L, c in hist.items()) / max(1, rounds), "rounds": rounds,
            "histogram": dict(sorted(hist.items())), "target_tok_s": n_ref / t_ref, "dflash_tok_s": n_spec / t_spec,
            "speedup": (n_spec / t_spec) / (n_ref / t_ref), **dict(zip(RAW_SUMS, (n_ref, t_ref, n_spec, t_spec)))}


def summarise(n_prompts, hist, n_ref, t_ref, n_spec, t_spec, mismatches, a, bs):
    return {"prompts": n_prompts, "complete": n_prompts == a.requested, "requested": a.requested,
            **measures(hist, n_ref, t_ref, n_spec, t_spec), "lossless": n_prompts - len(mismatches),
            "skip": a.skip, "target": a.target, "drafter": a.drafter, "prompt_files": a.prompts,
            "max_prompt_tokens": a.max_prompt_tokens, "block_size": bs,
            "mismatches": mismatches, "max_new_tokens": a.max_new_tokens, "dtype": a.dtype, "device": str(a.device)}


def write_json(path, result):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


@torch.no_grad()
def describe_mismatch(target, x, ref, out, k):
    n = min(ref.shape[1], out.shape[1])
    at = int((ref[0, :n] != out[0, :n]).nonzero()[0]) if (ref[0, :n] != out[0, :n]).any() else n
    logits = target(ref[:, :at]).logits[0, -1].float()
    top = logits.topk(2).values
    return {"prompt": k, "at": at - x.shape[1], "margin": float(top[0] - top[1])}


if __name__ == "__main__":
    sys.exit(main())
