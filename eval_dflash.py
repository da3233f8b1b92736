"""Measure trained drafters: acceptance length, speed-up and losslessness on real prompts.

    python eval_dflash.py --target PATH_OR_HUB_NAME --drafter out/step_000690/drafter --prompts out/heldout.jsonl
    python eval_dflash.py --target ... --drafter out/step_000*/drafter --prompts ...   # compare checkpoints
    python eval_dflash.py --merge part0.json part1.json [--json all.json]

Each prompt (a conversation up to its first reply) is decoded greedily by the target alone, by n-gram prompt
lookup and by each drafter: tau, its histogram, acceptance by draft position, rates and speed-ups in one
table. Every output must equal the target's, or the exit status is 1. --processes N splits the prompts over
N processes and merges their --json results (as --merge does).
"""
import argparse
import collections
import functools
import json
import os
import sys
import time

import torch

import config
import data_dflash
import decoding
import dflash_model as dm


def parse_args(argv):
    p = config.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--drafter", nargs="+", default=[], metavar="PATH",
                   help="one or more drafter folders, all of one block size, measured on the same prompts")
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
    a.drafters = dict(zip(drafter_labels(a.drafter), a.drafter))
    if len(a.drafters) < len(a.drafter):
        p.error(f"a drafter is given twice: {' '.join(a.drafter)}")
    if missing := [f for f in a.prompts or [] if data_dflash.names_a_file(f) and not os.path.isfile(f)]:
        p.error(f"prompt file not found: {', '.join(missing)}")
    if min(1 if x is None else x for x in (a.num_prompts, a.max_new_tokens, a.max_prompt_tokens, a.processes)) < 1 \
            or a.skip < 0:
        p.error("--num-prompts, --max-new-tokens, --max-prompt-tokens and --processes must be >= 1, --skip >= 0")
    config.check_devices([a.device])
    gpu = torch.device(a.device).type == "cuda"
    a.num_prompts = a.num_prompts or (100 if gpu else 5)
    a.max_new_tokens = a.max_new_tokens or (256 if gpu else 32)
    return a


def drafter_labels(paths):
    """A short name per drafter: the step folder of a checkpoint's .../step_000690/drafter, else the
    folder's own name; the paths themselves where those names collide."""
    parts = [os.path.normpath(p).split(os.sep) for p in paths]
    short = [q[-2] if q[-1] == "drafter" and len(q) > 1 else q[-1] for q in parts]
    return short if len(set(short)) == len(short) else [os.path.normpath(p) for p in paths]


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


def speculators(x):
    """(name, entry) of each speculator in a result, or in anything laid out like one ({"dflash": {label:
    entry}, "ngram": entry}): every drafter in order, then n-gram lookup."""
    return [*x["dflash"].items(), ("n-gram lookup", x["ngram"])]


def nested(labels, values):
    """The inverse of speculators: values in its order, laid out like a result."""
    return {"dflash": dict(zip(labels, values[:-1])), "ngram": values[-1]}


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.merge:
        return merge(a.merge, a.json)
    if a.processes > 1:
        return split(a)
    dtype = getattr(torch, a.dtype)
    torch.backends.cuda.matmul.allow_tf32 = False
    tok = config.load_target_config(a.target)[1]
    target = config.load_model(a.target, a.device, dtype)
    drafters = {lb: dm.load_drafter(p, target, device=a.device, dtype=dtype).eval() for lb, p in a.drafters.items()}
    sizes = {lb: d.config.block_size for lb, d in drafters.items()}
    if len(set(sizes.values())) > 1:      # n-gram lookup and the histograms' rows follow one block size
        raise SystemExit(f"error: the drafters' block sizes differ ({sizes}): compare drafters of one block size")
    stops, bs = decoding.stop_token_ids(tok, target), next(iter(sizes.values()))
    prompts, _ = prompts_from(a.prompts, tok, a.num_prompts, a.skip, a.max_prompt_tokens)
    if not prompts:
        raise SystemExit("error: no usable prompts")
    print(f"[eval] {len(prompts)} prompts, target {a.target}, {len(drafters)} drafter(s), {a.dtype} on {a.device}, "
          f"block {bs}, stop ids {stops}; baseline: n-gram prompt lookup (last 3/2/1 tokens, up to {bs - 1})")
    greedy = lambda x, n: (decoding.target_greedy(target, x, n, stops), [])
    decoders = nested(list(drafters), [
        *(functools.partial(decoding.dflash_generate, d, target, stop_token_ids=stops) for d in drafters.values()),
        functools.partial(decoding.ngram_generate, target, stop_token_ids=stops, block_size=bs)])
    for fn in [greedy, *(fn for _, fn in speculators(decoders))]:  # one untimed round each: no side pays
        fn(torch.tensor([prompts[0]], device=a.device), 8)          # first-call costs in the timings
    runs = new_runs(list(drafters))
    meta = {"skip": a.skip, "requested": len(prompts), "target": a.target, "drafters": a.drafters,
            "prompt_files": a.prompts, "max_prompt_tokens": a.max_prompt_tokens, "max_new_tokens": a.max_new_tokens,
            "dtype": a.dtype, "device": str(a.device), "block_size": bs}
    t_start, done, per_prompt = time.time(), 0, []
    for k, ids in enumerate(prompts):
        if k and a.max_minutes and time.time() - t_start > 60 * a.max_minutes:
            print(f"[eval] NOTICE: time budget of {a.max_minutes} min reached after {k} of {len(prompts)} "
                  "prompts; reporting those (incomplete)")
            break
        done, x = k + 1, torch.tensor([ids], device=a.device)
        ref, _ = timed(greedy, runs["greedy"], x, a.max_new_tokens, a.device)
        taus, lossy = [], set()
        for (name, fn), (_, run) in zip(speculators(decoders), speculators(runs)):
            out, acc = timed(fn, run, x, a.max_new_tokens, a.device)
            if not torch.equal(ref, out):
                run["mismatches"].append(describe_mismatch(target, x, ref, out, a.skip + k))
                lossy.add(name)
            taus.append(sum(acc) / len(acc) if acc else None)
        per_prompt.append({"prompt": a.skip + k, "tokens_in": x.shape[1], "tokens_out": ref.shape[1] - x.shape[1],
                           "tau": nested(list(drafters), taus)})
        res = summarise(done, runs, meta, per_prompt)
        line = [f"{name} {fmt(t)} ({r['mean_tau']:.2f})" + (" NOT LOSSLESS" if name in lossy else "")
                for t, (name, r) in zip(taus, speculators(res))]
        print(f"[eval] prompt {k + 1}/{len(prompts)}: {x.shape[1]} tokens in, {ref.shape[1] - x.shape[1]} out; "
              f"tau (so far): {', '.join(line)}", flush=True)
        if a.json and (k + 1) % 10 == 0:   # partial results survive a run that is stopped early
            data_dflash.write_json(a.json, res)
    return report(summarise(done, runs, meta, per_prompt), a.json)


def timed(fn, run, x, n, device):
    """Decode up to n tokens after x with fn, adding its time, tokens and acceptance lengths to run."""
    sync(device); t0 = time.time()
    out, acc = fn(x, n)
    sync(device)
    run["seconds"] += time.time() - t0; run["tokens"] += out.shape[1] - x.shape[1]
    run["hist"].update(acc)
    return out, acc


def fmt(x):
    return "-" if x is None else f"{x:.2f}"


def split(a):
    """Run --processes copies of this script over consecutive prompt ranges, then merge their results."""
    import subprocess
    import tempfile
    tmp, n = tempfile.mkdtemp(prefix="dflash_eval_"), min(a.processes, a.num_prompts)
    bounds = [a.skip + round(i * a.num_prompts / n) for i in range(n + 1)]
    parts, procs = [os.path.join(tmp, f"part{i}.json") for i in range(n)], []
    for i in range(n):
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--target", a.target, "--drafter", *a.drafter, "--prompts",
             *a.prompts, "--skip", str(bounds[i]), "--num-prompts", str(bounds[i + 1] - bounds[i]),
             "--max-new-tokens", str(a.max_new_tokens), "--max-prompt-tokens", str(a.max_prompt_tokens),
             "--device", a.device, "--dtype", a.dtype, "--max-minutes", str(a.max_minutes), "--json", parts[i]]))
    if any(p.wait() not in (0, 1) for p in procs):    # 1: a lossy prompt, reported by the merge
        raise SystemExit(f"error: an eval process failed (see its output above); parts in {tmp}")
    return merge(parts, a.json)


def report(res, json_path):
    """Print a result (one run's or merged) and write it; exit status 1 if any prompt was lossy."""
    bs, n, rows = res["block_size"], res["prompts"], speculators(res)
    w = max(16, *(len(name) for name, _ in rows))
    print("\nDFlash drafters: " + ", ".join(f"{lb} = {p}" for lb, p in res["drafters"].items()))
    print(f"{'':{w}s} {'tau':>6s} {'tok/s':>9s} {'speed-up':>9s}  lossless\n{'target greedy':{w}s} {'':6s} "
          f"{res['greedy']['tok_s']:9.1f} {1:8.2f}x")
    for name, r in rows:
        print(f"{name:{w}s} {r['mean_tau']:6.3f} {r['tok_s']:9.1f} {r['speedup']:8.2f}x  {r['lossless']}/{n}")
    cw = max(8, *(len(name) for name, _ in rows))
    print(f"acceptance lengths (rounds; block {bs}):\n     " + " ".join(f"{name:>{cw}s}" for name, _ in rows))
    print(format_histogram(*({int(k): v for k, v in r["histogram"].items()} for _, r in rows), bs=bs, width=cw))
    print(f"acceptance by draft position 1..{bs - 1} (of the rounds that reach it, the share that accept it):")
    for name, r in rows:
        print(f"  {name:{w}s} " + " ".join(f"{fmt(x):>4s}" for x in r["acceptance_by_position"]))
    if not res["complete"]:
        print(f"(incomplete: {n} of {res['requested']} prompts)")
    if json_path:
        data_dflash.write_json(json_path, res)
    bad = [(name, x) for name, r in rows for x in r["mismatches"]]
    for name, x in bad:
        print(f"ERROR: prompt {x['prompt']}: {name} output differs from target greedy at new token "
              f"{x['at']} (target logit margin there {x['margin']:.2e})")
    return 1 if bad else 0


MEASUREMENT = ("target", "drafters", "prompt_files", "max_prompt_tokens", "max_new_tokens", "dtype", "block_size")


def merge(paths, json_path):
    """Add up the results of runs over disjoint prompt ranges (their --skip and prompt counts)."""
    parts = []
    for path in paths:
        try:
            with open(path) as f:
                r = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: cannot read {path}: {e}") from None
        if not isinstance(r, dict) or "drafters" not in r:
            raise SystemExit(f"error: {path} has no 'drafters': not a result of this eval_dflash.py")
        parts.append((r["skip"], r["skip"] + r["prompts"], path, r))
    parts.sort(key=lambda p: p[0])
    first = parts[0][3]
    for _, _, path, r in parts:
        for k in MEASUREMENT:
            if r[k] != first[k]:
                raise SystemExit(f"error: {path} has {k} {r[k]}, {parts[0][2]} {first[k]}: not one measurement")
    for (s0, e0, p0, r0), (s1, e1, p1, r1) in zip(parts, parts[1:]):
        if s1 < e0:
            raise SystemExit(f"error: {p0} (prompts {s0 + 1}-{e0}) and {p1} (prompts {s1 + 1}-{e1}) overlap")
    labels = list(first["drafters"])
    runs, per_prompt = new_runs(labels), []
    for r in (p[3] for p in parts):
        for run, got in [(runs["greedy"], r["greedy"]), (runs["ngram"], r["ngram"]),
                         *((runs["dflash"][lb], r["dflash"][lb]) for lb in labels)]:
            run["tokens"] += got["tokens"]
            run["seconds"] += got["seconds"]
            run["hist"].update({int(k): v for k, v in got.get("histogram", {}).items()})
            run["mismatches"] += got.get("mismatches", [])
        per_prompt += r["per_prompt"]
    gaps = [f"{e0 + 1}-{s1}" for (_, e0, _, _), (s1, _, _, _) in zip(parts, parts[1:]) if s1 > e0]
    last = parts[-1][3]
    meta = {k: first[k] for k in MEASUREMENT}
    meta.update(skip=parts[0][0], requested=last["skip"] + last["requested"] - parts[0][0],
                device=", ".join(sorted({p[3]["device"] for p in parts})))
    res = summarise(sum(p[3]["prompts"] for p in parts), runs, meta, per_prompt)
    res["complete"] = not gaps and last["complete"]     # (an earlier part cut short leaves a gap, or none)
    res["merged"] = [p[2] for p in parts]
    print(f"[eval] merged {len(parts)} results: prompts {parts[0][0] + 1}-{parts[-1][1]}"
          + (f" (not measured: {', '.join(gaps)})" if gaps else ""))
    return report(res, json_path)


def format_histogram(*hists, bs, width=8):
    """A row per acceptance length 1..bs: each method's count of rounds, a bar for the first; all zero
    when no prompt ran a drafting round (each ended at its first token: a stop id or --max-new-tokens 1)."""
    top = max(hists[0].values(), default=0)
    return "\n".join(f"  {L:2d} " + " ".join(f"{h.get(L, 0):{width}d}" for h in hists)
                     + f" {'#' * int(40 * hists[0].get(L, 0) / max(1, top))}" for L in range(1, bs + 1))


def acceptance_by_position(hist, bs):
    """For draft position k = 1..bs-1: of the rounds that accepted at least k tokens (reached position k),
    the share that accepted at least k+1 (took its token); None where no round reached it. The product of
    the first k shares is the share of rounds that accept at least k+1 tokens."""
    at_least = [sum(c for L, c in hist.items() if L >= k) for k in range(1, bs + 1)]
    return [at_least[k] / at_least[k - 1] if at_least[k - 1] else None for k in range(1, bs)]


def measures(run, target, bs, n_prompts):
    """Tau, histogram, acceptance by position, rate, speed-up and losslessness of one method from its
    counts and the target's (the counts are kept for --merge)."""
    hist, rounds = run["hist"], sum(run["hist"].values())
    tok_s = run["tokens"] / max(run["seconds"], 1e-9)
    return {"mean_tau": sum(L * c for L, c in hist.items()) / max(1, rounds), "rounds": rounds,
            "histogram": dict(sorted(hist.items())), "acceptance_by_position": acceptance_by_position(hist, bs),
            "tok_s": tok_s, "speedup": tok_s / max(target["tokens"] / max(target["seconds"], 1e-9), 1e-9),
            "tokens": run["tokens"], "seconds": run["seconds"],
            "lossless": n_prompts - len(run["mismatches"]), "mismatches": run["mismatches"]}


def new_runs(labels):
    """Empty counts (rounds per acceptance length, tokens, seconds, mismatches) of the target alone and of
    each speculator, laid out like a result."""
    new = lambda: {"hist": collections.Counter(), "tokens": 0, "seconds": 0.0, "mismatches": []}
    return {"greedy": new(), **nested(labels, [new() for _ in range(len(labels) + 1)])}


def summarise(n_prompts, runs, meta, per_prompt):
    """The result: the run's settings (`meta`), the target alone's rate, each speculator's measures, and
    per prompt its tokens in and out and each speculator's tau there."""
    g, labels = runs["greedy"], list(runs["dflash"])
    return {"prompts": n_prompts, "complete": n_prompts == meta["requested"], **meta,
            "greedy": {"tokens": g["tokens"], "seconds": g["seconds"], "tok_s": g["tokens"] / max(g["seconds"], 1e-9)},
            **nested(labels, [measures(r, g, meta["block_size"], n_prompts) for _, r in speculators(runs)]),
            "per_prompt": per_prompt}


@torch.no_grad()
def describe_mismatch(target, x, ref, out, k):
    n = min(ref.shape[1], out.shape[1])
    at = int((ref[0, :n] != out[0, :n]).nonzero()[0]) if (ref[0, :n] != out[0, :n]).any() else n
    logits = target(ref[:, :at]).logits[0, -1].float()
    top = logits.topk(2).values
    return {"prompt": k, "at": at - x.shape[1], "margin": float(top[0] - top[1])}


if __name__ == "__main__":
    sys.exit(main())
