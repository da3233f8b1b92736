"""Regenerate the assistant turns of chat data with the target itself, turn by turn on the regenerated context.

    python generate_data.py --out data/regen.jsonl                       # the embedded default
    python generate_data.py --target Qwen/Qwen3-8B --data sharegpt.json --out data/qwen3_regen.jsonl

A worker process per device decodes shards of --shard-size conversations together, each written to <out>.shards/
(a stopped run goes on from there, to the same file); then <out> and <out>.manifest.json (settings, sources, counts)."""
import hashlib
import os
import queue
import shutil
import sys
import time
from argparse import RawDescriptionHelpFormatter
from collections import Counter

import torch

import config
import data_dflash
import decoding
import errors
import models

SETTINGS = ("temperature", "top_p", "max_new_tokens", "max_length", "seed", "shard_size", "max_samples", "dtype",
            "answers", "unfinished")  # with the target and the sources, what decides the result (not the batch size)

def parse_args(argv):
    p = config.ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--target", default="", help="HF folder or hub name; '' = the embedded default")
    p.add_argument("--data", nargs="+", default=[], help="chat / ShareGPT JSON(L) files; none = the embedded default")
    p.add_argument("--out", required=True, help="the regenerated chat JSONL")
    p.add_argument("--cache-dir", default=".cache", help="where the embedded default is prepared")
    p.add_argument("--max-samples", type=int, default=0, help="the first N conversations (0 = all)")
    p.add_argument("--max-length", type=int, default=3072, help="prompt + answer tokens, as in training")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed: with it, each answer's draws depend on its conversation, copy and turn only")
    p.add_argument("--answers", type=int, default=1,
                   help="K copies of each conversation side by side, each with its own draws (--temperature > 0)")
    p.add_argument("--unfinished", default="keep", choices=("keep", "mark", "cut", "drop"),
                   help="an answer reaching --max-new-tokens without a stop token: keep (default: the template adds an "
                        "end of turn the target never wrote; later turns follow), mark (kept, marked \"unfinished\": "
                        "its end of turn untrained; later turns follow), cut (marked, and the conversation ends with "
                        "it) or drop (the conversation ends before it)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="weights, cache: auto = bfloat16 on GPUs, float32 on CPU (eval_dflash.py verifies in float32)")
    p.add_argument("--shard-size", type=int, default=1024, help="conversations per shard (the restart unit)")
    p.add_argument("--devices", default="", help="comma-separated (default: every visible GPU, else cpu)")
    a = p.parse_args(argv)
    if a.target and not a.data:
        p.error("--target needs --data (the embedded default's data goes with its own target)")
    if min(a.max_new_tokens, a.shard_size, a.max_length - 1) < 1 or min(a.temperature, a.max_samples, a.seed) < 0 \
            or not 0 < a.top_p <= 1:
        p.error("need --max-new-tokens, --shard-size >= 1, --max-length >= 2, --temperature, --max-samples, "
                "--seed >= 0, 0 < --top-p <= 1")
    if a.answers < 1 or a.answers > 1 and a.temperature == 0:
        p.error(f"--answers {a.answers}: need 1, or more with a --temperature > 0 (greedy copies would be identical)")
    n_gpu = torch.cuda.device_count()
    a.devices = a.devices.split(",") if a.devices else [f"cuda:{i}" for i in range(n_gpu)] or ["cpu"]
    config.check_devices(a.devices, "--devices")
    config.writable_file(a.out, "--out")
    if a.dtype == "auto":   # resolved, as the precision decides the answers: config.param_dtype's, for all devices
        a.dtype = "bfloat16" if all(torch.device(d).type == "cuda" for d in a.devices) else "float32"
    return a

def weights_hash(target):
    if not os.path.isdir(target):
        return f"hub:{target}"
    h = hashlib.sha256()
    for name in sorted(f for f in os.listdir(target) if f.endswith(".safetensors")):
        h.update(name.encode())
        with open(os.path.join(target, name), "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()

# ---- shards: regenerate turn by turn; a worker decodes the turns of the shards it holds together

class Shard:
    """One shard's conversations, each --answers times, regenerated turn by turn: each answer on the regenerated
    context before it, the next asked for once it is written. The result depends on the shard's conversations only."""

    def __init__(self, i, convs, tok, a, stops):
        convs = [c for c in convs for _ in range(a.answers)]   # copy j of conversation c is k = c * K + j
        self.i, self.convs, self.tok, self.a, self.stops, self.t0 = i, convs, tok, a, set(stops), time.time()
        self.st, self.regen, self.done = Counter(generated_tokens=0, answers=0), {k: [] for k in range(len(convs))}, {}

    def finish(self, k, why=None):   # kept up to its last regenerated answer (cut there, for `why`), or dropped
        r = self.regen.pop(k)
        while r and r[-1]["role"] != "assistant":
            r.pop()
        if r:
            self.done[k] = r
        if why:
            self.st[f"{'cut' if r else 'skipped'}: {why}"] += 1

    def next_turns(self, ks):
        """The decoding.Requests of the next answers of conversations ks that have one."""
        asked, out, a = [], [], self.a
        for k in ks:
            msgs, r = self.convs[k], self.regen[k]
            if not any(m["role"] == "assistant" for m in msgs[len(r):]):
                self.finish(k)
                continue
            while msgs[len(r)]["role"] != "assistant":   # system and user turns are kept as they are
                r.append(dict(msgs[len(r)]))
            asked.append(k)
        prompts = data_dflash.prompt_ids(self.tok, [self.regen[k] for k in asked], a.max_length - 1)
        for k, (ids, why) in zip(asked, prompts):
            if ids is None:
                self.finish(k, why)
                continue
            r = self.regen[k]
            chain = sum(m["role"] == "assistant" for m in self.convs[k][len(r):])
            # the answer's sampling noise, its own whoever decodes it; sha256: hash() is not documented to be stable
            c, j = divmod(k, a.answers)    # one answer a conversation: the key of files written without copies
            key = repr((a.seed, self.i, c, len(r)) + ((j,) if a.answers > 1 else ())).encode()
            seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 2
            out.append(decoding.Request((self.i, k), ids, min(a.max_new_tokens, a.max_length - len(ids)), chain, seed))
        return out

    def answered(self, k, row):
        """Keep conversation k's answer `row` as --unfinished says, with the ids the target wrote before its stop token
        (the trainer learns them, not the text tokenised again): True if its next turn may be asked for."""
        finished = row[-1] in self.stops
        new = row[:-1] if finished else row
        beyond = not finished and len(new) < self.a.max_new_tokens   # the answer would pass max-length
        mode = "keep" if finished else self.a.unfinished
        self.st["generated_tokens"] += len(row)
        self.st["hit_max_new_tokens"] += not finished and not beyond
        if beyond or mode == "drop":
            self.finish(k, "answer beyond max length" if beyond else "unfinished answer dropped")
            return False
        self.st["answers"] += 1
        self.regen[k].append({"role": "assistant", "content": self.tok.decode(new, skip_special_tokens=True).strip(),
                              "ids": new})
        if mode in ("mark", "cut"):   # the trainer learns no end of turn the target did not write
            self.regen[k][-1]["unfinished"] = True
        if mode == "cut":
            later = any(m["role"] == "assistant" for m in self.convs[k][len(self.regen[k]):])
            self.finish(k, "turns after an unfinished answer" if later else None)
            return False
        return True

# ---- workers: one process per device, shards from a queue

def load_engine(device, a):
    """(tokenizer, stop ids, decoding engine) of the target on `device`: as many rows of --max-length as fit."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    tok = models.load_target_config(a.target)[1]
    data_dflash.require_chat_template(tok, a.target)
    model = models.load_model(a.target, device, getattr(torch, a.dtype))
    engine = decoding.Engine(model, decoding.Engine.fit(model, a.max_length, most=1024), a.max_length,
                             compile=device.startswith("cuda"))
    print(f"[gen] {device}: {engine.rows} rows of {a.max_length} tokens", flush=True)
    return tok, decoding.stop_token_ids(tok, model), engine

def worker(device, jobs, a, shards_dir, n_shards, total, t_run):
    """Regenerate the shards of the queue `jobs` ((index, conversations); None ends) on `device`. The next shard's
    turns join the rows while the last ones still decode, so no shard waits for the longest chain of the one before."""
    tok, stops, engine = load_engine(device, a)
    shards, queued, decoded = {}, iter(jobs.get, None), 0   # up to this worker's None: the next one is another's
    t_start = last_line = time.time()

    def write(sh):
        del shards[sh.i]
        sh.st.update(conversations=len(sh.convs) // a.answers, written=len(sh.done), seconds=time.time() - sh.t0,
                     finished=time.time())
        path = os.path.join(shards_dir, f"shard_{sh.i:05d}")
        data_dflash.write_json(path + ".json", sh.st)  # counts first: the .jsonl marks the shard done
        data_dflash.write_chat_jsonl(path + ".jsonl", [sh.done[k] for k in sorted(sh.done)])
        partial = sum(len(s.convs) - len(s.regen) for s in shards.values()) // a.answers   # kept or not
        print(f"[gen] shard {sh.i + 1}/{n_shards} on {device}: {sh.st['conversations']} conversations, "
              f"{sh.st['answers']} answers, {sh.st['generated_tokens']:,} tokens | "
              f"{progress(shards_dir, n_shards, total, t_run, partial)}", flush=True)

    def more():   # the first turns of the next shard from the queue, [] once it is empty
        for job in queued:
            sh = shards[job[0]] = Shard(*job, tok, a, stops)
            if first := sh.next_turns(range(len(sh.convs))):
                return first
            write(sh)
        return []

    def follow(ended):   # the next turns of the conversations whose answers ended, shard by shard
        nonlocal last_line, decoded
        by_shard, asked = {}, []
        for (i, k), tokens in ended:
            by_shard.setdefault(i, []).extend([k] if shards[i].answered(k, tokens) else [])
            decoded += len(tokens)
        for i, ks in by_shard.items():
            asked += shards[i].next_turns(ks)
            if not shards[i].regen:
                write(shards[i])
        if time.time() - last_line > 60:   # between shard lines: this worker's rate
            last_line = time.time()
            print(f"[gen] {device}: {decoded:,} tokens in {last_line - t_start:.0f} s "
                  f"({decoded / (last_line - t_start):,.0f} tok/s), shards {sorted(i + 1 for i in shards)} open",
                  flush=True)
        return asked

    decoding.generate(engine, more, stops, decoding.picker(a.temperature, a.top_p), follow)

def progress(shards_dir, n_shards, total, t_run, partial):
    """All workers' progress: the shards on disk, and `partial` conversations finished in this worker's open shards
    (the others are well under way when one ends); those finished since t_run give the ETA of the `total`."""
    done = [data_dflash.read_json(os.path.join(shards_dir, f[:-1])) for f in sorted(os.listdir(shards_dir))
            if f.startswith("shard_") and f.endswith(".jsonl")]
    now = [st for st in done if st.get("finished", 0) >= t_run]
    elapsed = time.time() - t_run
    ran = sum(st["conversations"] for st in now) + partial
    left = total - sum(st["conversations"] for st in done) - partial
    return (f"{len(done)}/{n_shards} shards, {sum(st['generated_tokens'] for st in now) / elapsed:,.0f} tok/s this "
            f"run, ETA {left / max(ran, 1) * elapsed / 60:.1f} min")

def run_workers(a, pending, shards_dir, n_shards, total):
    """A process per device (threads would serialise host work between CUDA-graph replays on the GIL); one runs here."""
    ctx = torch.multiprocessing.get_context("spawn")
    q = queue.Queue() if len(a.devices) == 1 else ctx.Queue()
    for job in pending + [None] * len(a.devices):
        q.put(job)
    if len(a.devices) == 1:
        return worker(a.devices[0], q, a, shards_dir, n_shards, total, time.time())
    procs = [ctx.Process(target=worker, args=(d, q, a, shards_dir, n_shards, total, time.time())) for d in a.devices]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if bad := [f"{d} (exit code {p.exitcode})" for d, p in zip(a.devices, procs) if p.exitcode]:
        raise SystemExit(f"error: the worker on {', '.join(bad)} failed; run again to go on from the shards done")

# ---- main: settings, shards, then the output and its manifest

def same_settings(path, settings):
    """Does `path` record these settings (no file: False; other ones: an error)?"""
    if not os.path.exists(path):
        return False
    old = data_dflash.read_json(path)
    old = old.get("settings", old)
    if diff := [k for k in settings if old.get(k) != settings[k]]:
        raise SystemExit(f"error: {path} was made with other settings ({', '.join(diff)}): use another --out "
                         f"or delete {os.path.dirname(path) if path.endswith('settings.json') else path}")
    return True

@errors.script
def main(argv=None):
    a, t_start = parse_args(sys.argv[1:] if argv is None else argv), time.time()
    a.target, a.data = models.target_and_data(a)
    if errs := config.data_errors(a.data):
        raise SystemExit(f"error: --data: {'; '.join(errs)}")
    if os.path.exists(a.out) and any(os.path.isfile(f) and os.path.samefile(f, a.out) for f in a.data):
        raise SystemExit(f"error: --out {a.out} is one of the --data files: the answers would replace the "
                         "conversations they are written from; give another --out")
    settings = {"target": a.target, "target_sha256": weights_hash(a.target),   # what decides the result
                "sources": [dict(zip(("path", "size", "mtime_ns"), data_dflash.identity(f))) for f in a.data],
                **{k: getattr(a, k) for k in SETTINGS}}
    manifest, shards_dir = a.out + ".manifest.json", a.out + ".shards"
    if os.path.isfile(a.out) and same_settings(manifest, settings):
        print(f"[gen] {a.out} is done ({manifest}): nothing to do")
        return 0
    convs, skipped = data_dflash.load_conversations(a.data)
    n_usable, convs = len(convs), convs[:a.max_samples or None]
    reasons = ", ".join(f"{k}={v}" for k, v in sorted(skipped.items())) or "none"
    print(f"[gen] {n_usable + sum(skipped.values())} records: {n_usable} conversations, {len(convs)} taken | "
          f"skipped: {reasons}")
    if not convs:
        raise SystemExit(f"error: no usable conversation in {', '.join(a.data)} (skipped: {reasons})")
    os.makedirs(shards_dir, exist_ok=True)
    if not same_settings(os.path.join(shards_dir, "settings.json"), settings):
        data_dflash.write_json(os.path.join(shards_dir, "settings.json"), settings)
    shards = [convs[i:i + a.shard_size] for i in range(0, len(convs), a.shard_size)]
    path = os.path.join(shards_dir, "shard_{:05d}").format
    pending = [(i, s) for i, s in enumerate(shards) if not os.path.isfile(path(i) + ".jsonl")]
    print(f"[gen] {len(shards)} shards of up to {a.shard_size} conversations, {len(shards) - len(pending)} done "
          f"before; target {a.target} on {', '.join(a.devices)}", flush=True)
    t0 = time.time()
    run_workers(a, pending, shards_dir, len(shards), len(convs))
    t_gen, total, ran, this_run = time.time() - t0, Counter(skipped), {i for i, _ in pending}, 0
    for i in range(len(shards)):
        total.update(st := data_dflash.read_json(path(i) + ".json"))
        this_run += st.get("generated_tokens", 0) if i in ran else 0
    skips = {k: v for k, v in sorted(total.items()) if k in skipped or k.startswith(("skipped: ", "cut: "))}
    if not total["written"]:     # e.g. every prompt longer than --max-length: an empty file would read as done
        raise SystemExit(f"error: no conversation was regenerated, so nothing is written to {a.out} (skipped: "
                         + ", ".join(f"{k}={v}" for k, v in skips.items()) + ")")
    with open(tmp := f"{a.out}.tmp{os.getpid()}", "wb") as out:  # renamed when whole: <out> means done
        for i in range(len(shards)):
            with open(path(i) + ".jsonl", "rb") as f:
                shutil.copyfileobj(f, out)
    os.replace(tmp, a.out)
    counts = {"records_skipped_on_load": sum(skipped.values()), "usable": n_usable, "conversations_in": len(convs),
              "written": total["written"], "skipped": skips, "turns_regenerated": total["answers"],
              **{k: total[k] for k in ("generated_tokens", "hit_max_new_tokens")}}
    import transformers
    run = {"shards": len(ran), "generated_tokens": this_run, "tok_s": this_run / t_gen, "generation_seconds": t_gen,
           "wall_seconds": time.time() - t_start, "devices": a.devices}
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    data_dflash.write_json(manifest, {"out": os.path.abspath(a.out), "settings": settings, "counts": counts,
                                      "this_run": run, "shard_seconds": total["seconds"], "versions": versions})
    shutil.rmtree(shards_dir)  # <out> and its manifest hold everything: the shards would double the disk use
    skips = ", ".join(f"{k}={v}" for k, v in skips.items()) or "none"
    print(f"[gen] done: {counts['written']} of {len(convs)} x {a.answers} conversations, {counts['turns_regenerated']} "
          f"answers, {counts['generated_tokens']:,} tokens ({run['tok_s']:,.0f} tok/s this run, load and graph "
          f"capture included), {run['wall_seconds']:.1f} s | skipped: {skips} -> {a.out}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
