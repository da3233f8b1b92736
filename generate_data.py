"""Regenerate the assistant turns of chat data with the target itself (the DFlash recipe trains the drafter on
the target's own answers), turn by turn on the regenerated context, in the target's chat template.

    python generate_data.py --out data/regen.jsonl                       # the embedded default
    python generate_data.py --target Qwen/Qwen3-8B --data sharegpt.json --out data/qwen3_regen.jsonl
    python train_dflash.py --target Qwen/Qwen3-8B --data data/qwen3_regen.jsonl

Greedy unless --temperature > 0. A conversation stops before the turn whose prompt + answer would pass
--max-length. One worker process per device takes shards of --shard-size conversations and writes each
atomically to <out>.shards/: a stopped run goes on where it was and gives the same file. Then the shards
become <out> and <out>.manifest.json (settings, sources, counts); a run on a finished <out> only says so.
Speed: a shard's answers are decoded together on a static KV cache of up to 512 slots (Slots): a
finished answer's slot takes the next prompt, a conversation's next turn is queued as soon as its answer
is written, and on a GPU each step is one CUDA-graph replay.
"""
import argparse
import hashlib
import heapq
import itertools
import json
import math
import os
import queue
import shutil
import signal
import sys
import time
from collections import Counter

import torch

import data_dflash
import pipeline

SETTINGS = ("temperature", "top_p", "max_new_tokens", "max_length", "seed", "shard_size", "max_samples")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--target", default="", help="HF folder or hub name; '' = the embedded default")
    p.add_argument("--data", nargs="+", default=[], help="chat / ShareGPT JSON(L) files; none = the embedded default")
    p.add_argument("--out", required=True, help="the regenerated chat JSONL")
    p.add_argument("--cache-dir", default=".cache", help="where the embedded default is prepared")
    p.add_argument("--max-samples", type=int, default=0, help="the first N conversations (0 = all)")
    p.add_argument("--max-length", type=int, default=3072, help="prompt + answer tokens, as in training")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed; shard i uses seed + i")
    p.add_argument("--shard-size", type=int, default=1024, help="conversations per shard (the restart unit)")
    p.add_argument("--devices", default="", help="comma-separated (default: every visible GPU, else cpu)")
    a = p.parse_args(argv)
    if a.target and not a.data:
        p.error("--target needs --data (the embedded default's data goes with its own target)")
    n_gpu = torch.cuda.device_count()
    a.devices = a.devices.split(",") if a.devices else [f"cuda:{i}" for i in range(n_gpu)] or ["cpu"]
    return a


def weights_hash(target):
    """sha256 over the folder's *.safetensors files (a hub name stands for itself)."""
    if not os.path.isdir(target):
        return f"hub:{target}"
    h = hashlib.sha256()
    for name in sorted(f for f in os.listdir(target) if f.endswith(".safetensors")):
        h.update(name.encode())
        with open(os.path.join(target, name), "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


# -----------------------------------------------------------------------------
# one shard: regenerate turn by turn, all conversations at once in the slots

def prompt_ids(tok, regen, max_length):
    """(chat-template ids of the context + generation prompt, None) or (None, why the turn is not answered)."""
    roles = [m["role"] for m in regen if m["role"] != "system"]
    if not roles or roles[-1] != "user":
        return None, "assistant turn without a user turn before it"
    try:
        ids = list(tok.apply_chat_template(regen, add_generation_prompt=True)["input_ids"])
    except Exception:  # noqa: BLE001 - a template that refuses a conversation (jinja2 raises): counted
        return None, "chat template error"
    return (ids, None) if len(ids) <= max_length - 1 else (None, "prompt longer than max length")


class Slots:
    """Greedy (or sampled) decoding of many answers at once on a static KV cache of `n` slots of `length`
    tokens: a finished answer's slot takes the next prompt at once (no batch waits for its longest answer),
    prompts are prefilled in batches, and each decoding step is one replay of a CUDA graph
    per (rows, span) shape: a 135M target's step is otherwise a few hundred kernel launches for ~1 ms of
    work. `span` covers the longest context in the slots (rounded up to SPAN), so attention reads what is
    written, not the whole cache. The target's own layers run the step (any Llama-like HF model: embed,
    rotary, decoder layers, norm); only its attention is replaced, by `slot_attention` below."""
    SPAN, PREFILL_TOKENS = 256, 16384

    def __init__(self, model, n, length):
        check_decodable(model, length)
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
        AttentionInterface.register("slot_decode", slot_attention)
        AttentionMaskInterface.register("slot_decode", sdpa_mask)   # prefill keeps sdpa's causal mask
        model.set_attn_implementation("slot_decode")
        c, dev = model.config, model.device
        self.k = [torch.zeros(n, *self.slot_shape(c, length), dtype=model.dtype, device=dev)
                  for _ in range(c.num_hidden_layers)]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.model, self.n, self.length, self.graphs, self.pool = model, n, length, {}, None
        self.ids, self.pos = (torch.zeros(n, dtype=torch.long, device=dev) for _ in range(2))
        self.rows, self.span = torch.arange(n, device=dev), length

    @staticmethod
    def slot_shape(c, length):
        """(kv heads, length, head dim): one slot's keys, or values, in one layer."""
        return c.num_key_value_heads, length, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @staticmethod
    def fit(model, length, most=512):
        """Slots that fit: on a GPU half the free memory goes to the cache, at most `most`."""
        if model.device.type != "cuda":
            return 8
        c = model.config
        per_slot = 2 * c.num_hidden_layers * math.prod(Slots.slot_shape(c, length)) * model.dtype.itemsize
        return max(1, min(most, torch.cuda.mem_get_info(model.device)[0] // 2 // per_slot))

    def update(self, k, v, layer, *args):
        """HF attention hands over the new token's keys and values: written at each slot's position."""
        r = self.rows[:self.step_rows]
        self.k[layer][r, :, self.pos[:self.step_rows]] = k[:, :, 0]
        self.v[layer][r, :, self.pos[:self.step_rows]] = v[:, :, 0]
        return self.k[layer][:self.step_rows, :, :self.span], self.v[layer][:self.step_rows, :, :self.span]

    def step(self, rows, span):
        """Logits of the next token of slots [0, rows), whose last token is `ids` at position `pos`."""
        m, self.step_rows, self.span = self.model.model, rows, span
        pos = self.pos[:rows, None]
        self.mask = torch.arange(span, device=pos.device) <= pos
        h = m.embed_tokens(self.ids[:rows, None])
        pe = m.rotary_emb(h, pos)
        for layer in m.layers:
            h = layer(h, position_embeddings=pe, position_ids=pos, past_key_values=self, slots=self)
        return self.model.lm_head(m.norm(h[:, 0])).float()

    def replay(self, rows, span):
        if self.model.device.type != "cuda":
            return self.step(rows, span)
        if (rows, span) not in self.graphs:   # warm on a side stream, then capture (writes are idempotent)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                self.step(rows, span)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):   # one pool: the graphs never run at the same time
                out = self.step(rows, span)
            self.pool, self.graphs[rows, span] = g.pool(), (g, out)
        g, out = self.graphs[rows, span]
        g.replay()
        return out

    def prefill(self, slots, prompts):
        """Write the prompts' keys and values into `slots`; the logits of each prompt's next token."""
        lens = torch.tensor([len(p) for p in prompts])
        ids = torch.zeros(len(prompts), int(lens.max()), dtype=torch.long)
        for i, p in enumerate(prompts):   # right-padded: positions count from 0 in every row
            ids[i, :len(p)] = torch.tensor(p)
        att = (torch.arange(ids.shape[1]) < lens[:, None]).long()
        dev = self.model.device
        out = self.model.model(input_ids=ids.to(dev), attention_mask=att.to(dev), use_cache=True)
        rows = torch.tensor(slots, device=dev)
        for layer, c in enumerate(out.past_key_values.layers):
            self.k[layer][rows, :, :ids.shape[1]] = c.keys
            self.v[layer][rows, :, :ids.shape[1]] = c.values
        last = out.last_hidden_state[torch.arange(len(prompts), device=dev), lens.to(dev) - 1]
        return self.model.lm_head(last).float()

    @torch.no_grad()
    def generate(self, requests, stops, pick, follow=lambda key, tokens: None):
        """Decode requests (key, prompt ids, budget, chain) until none is left; pick(logits) -> token ids.
        An answer ends at a stop id (kept) or after `budget` tokens; follow(key, tokens) then returns the
        next request of that key (a conversation's next turn), or None. The longest chains start first
        and keep going, so the last turns of a long conversation do not decode alone at the end."""
        heap, seq = [], itertools.count()
        push = lambda r: heapq.heappush(heap, (-r[3], len(r[1]), next(seq), r))
        for r in requests:
            push(r)
        req, pos, gen, stops = [None] * self.n, [0] * self.n, [[] for _ in range(self.n)], set(stops)

        def emit(slots, tokens):   # a token for each slot: kept, and the slot freed when its answer ends
            for s, t in zip(slots, tokens.tolist()):
                gen[s].append(t)
                if t in stops or len(gen[s]) >= req[s][2]:
                    nxt = follow(req[s][0], gen[s])
                    if nxt is not None:
                        push(nxt)
                    req[s], pos[s], gen[s] = None, 0, []
                else:
                    pos[s] += 1

        while True:
            free = [s for s in range(self.n) if req[s] is None]   # refill once an eighth is free: batched prefill
            while heap and free and (len(free) >= self.n // 8 or len(free) == self.n):
                take = [heapq.heappop(heap)[3]]
                longest = len(take[0][1])   # prompts are right-padded to the longest of their prefill
                while heap and len(take) < len(free) and \
                        (len(take) + 1) * max(longest, len(heap[0][3][1])) <= self.PREFILL_TOKENS:
                    take.append(heapq.heappop(heap)[3])
                    longest = max(longest, len(take[-1][1]))
                slots, free = free[:len(take)], free[len(take):]
                for s, r in zip(slots, take):
                    req[s], pos[s] = r, len(r[1]) - 1   # emit() moves pos to the first new token
                emit(slots, pick(self.prefill(slots, [r[1] for r in take])).cpu())
            live = [s for s in range(self.n) if req[s] is not None]
            if not live:
                if heap:
                    continue
                return
            rows = min(self.n, 1 << live[-1].bit_length())   # power-of-two row counts: few graphs
            span = min(self.length, -(-(max(pos[s] for s in live) + 1) // self.SPAN) * self.SPAN)
            self.ids[:rows].copy_(torch.tensor([gen[s][-1] if gen[s] else 0 for s in range(rows)]))
            self.pos[:rows].copy_(torch.tensor(pos[:rows]))
            emit(live, pick(self.replay(rows, span))[live].cpu())


def check_decodable(model, length):
    """Slots run the target's own layers with full causal attention over each context: a model of
    another shape, or with sliding-window layers that a context of `length` would reach, is refused."""
    c, base = model.config, getattr(model, "model", None)
    missing = [n for n in ("embed_tokens", "rotary_emb", "layers", "norm") if not hasattr(base, n)]
    window = getattr(c, "sliding_window", None) if getattr(c, "use_sliding_window", True) else None
    sliding = set(getattr(c, "layer_types", None) or []) - {"full_attention"} or (window and window < length)
    if missing or sliding:
        raise SystemExit(f"error: generate_data.py decodes Llama-like targets with full attention; "
                         f"{type(model).__name__} " + (f"has no model.{', model.'.join(missing)}" if missing else
                         f"has sliding-window attention within --max-length {length}"))


def slot_attention(module, q, k, v, mask, scaling=None, slots=None, **kw):
    """One query per slot against its cache (`slots.mask`: the positions written), grouped-query heads
    read in place (9.4 ms a step at 512 slots x 2048 positions on one H200, against 14.2 ms for the same
    attention as two batched matmuls); without `slots` (a prefill) it is HF's sdpa."""
    if slots is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, q, k, v, mask, scaling=scaling, **kw)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=slots.mask[:, None, None, :],
                                                           scale=scaling, enable_gqa=True)
    return out.transpose(1, 2), None


def picker(a):
    """Greedy, or sampling at --temperature within the --top-p nucleus."""
    if a.temperature <= 0:
        return lambda logits: logits.argmax(-1)

    def sample(logits):
        p, idx = (logits / a.temperature).softmax(-1).sort(-1, descending=True)
        p[p.cumsum(-1) - p > a.top_p] = 0   # keep the smallest head whose mass reaches top_p
        return idx.gather(-1, torch.multinomial(p, 1)).squeeze(-1)
    return sample


def run_shard(slots, tok, convs, a, stops):
    """(regenerated conversations, stats) of one shard; depends on its conversations only. Each answer
    is greedy (or sampled) on the regenerated context before it; a conversation's next turn is asked for
    as soon as its answer is written."""
    st, regen, done, pick = Counter(), {k: [] for k in range(len(convs))}, {}, picker(a)

    def finish(k, why=None):   # kept up to its last regenerated answer (cut there, for `why`), or dropped
        r = regen.pop(k)
        while r and r[-1]["role"] != "assistant":
            r.pop()
        if r:
            done[k] = r
        if why:
            st[f"{'cut' if r else 'skipped'}: {why}"] += 1

    def next_turn(k):
        msgs, r = convs[k], regen[k]
        if not any(m["role"] == "assistant" for m in msgs[len(r):]):
            return finish(k)
        while msgs[len(r)]["role"] != "assistant":   # system and user turns are kept as they are
            r.append(dict(msgs[len(r)]))
        ids, why = prompt_ids(tok, r, a.max_length)
        if ids is None:
            return finish(k, why)
        chain = sum(m["role"] == "assistant" for m in msgs[len(r):])
        return k, ids, min(a.max_new_tokens, a.max_length - len(ids)), chain

    def answered(k, row):   # finished: the stop token came within --max-new-tokens and --max-length
        finished = row[-1] in stops
        new = row[:-1] if finished else row
        st["generated_tokens"] += len(row)
        if not finished and len(new) < a.max_new_tokens:   # the answer would pass max-length
            return finish(k, "answer beyond max length")
        st["hit_max_new_tokens"] += not finished
        st["answers"] += 1
        regen[k].append({"role": "assistant", "content": tok.decode(new, skip_special_tokens=True).strip()})
        return next_turn(k)

    first = [r for r in map(next_turn, range(len(convs))) if r is not None]
    slots.generate(first, stops, pick, answered)
    return [done[k] for k in sorted(done)], st


# -----------------------------------------------------------------------------
# workers: one process per device, shards from a queue

def worker(device, jobs, a, shards_dir, n_shards):
    """Regenerate the shards taken from the queue `jobs` ((index, conversations); None ends) on `device`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import eval_dflash
    gpu = device.startswith("cuda")
    if gpu:
        torch.cuda.set_device(device)
    tok = AutoTokenizer.from_pretrained(a.target)
    model = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.bfloat16 if gpu else torch.float32)
    model = model.to(device).eval()
    stops = eval_dflash.stop_token_ids(tok, model)
    slots = Slots(model, Slots.fit(model, a.max_length), a.max_length)
    for n, (i, convs) in enumerate(iter(jobs.get, None), 1):
        if a.temperature > 0:
            torch.manual_seed(a.seed + i)  # a restarted shard samples as it would have uninterrupted
        t0 = time.time()
        out, st = run_shard(slots, tok, convs, a, stops)
        st.update(conversations=len(convs), written=len(out), seconds=time.time() - t0)
        path = os.path.join(shards_dir, f"shard_{i:05d}")
        data_dflash.write_json(path + ".json", st)  # counts first: the .jsonl marks the shard done
        data_dflash.write_chat_jsonl(path + ".jsonl", out)
        print(f"[gen] shard {i + 1}/{n_shards} on {device}: {len(convs)} conversations, {st['answers']} answers, "
              f"{st['generated_tokens']:,} tokens in {st['seconds']:.1f} s "
              f"({st['generated_tokens'] / st['seconds']:,.0f} tok/s)", flush=True)
        if pipeline.fault("gen_kill") == n:  # tests only: a worker killed right after its n-th shard
            os.kill(os.getpid(), signal.SIGKILL)


def run_workers(a, pending, shards_dir, n_shards):
    """One process per device (not threads: each decodes token by token with host work between CUDA-graph
    replays, which threads would serialise on the GIL); one device works in this process."""
    ctx = torch.multiprocessing.get_context("spawn")
    q = queue.Queue() if len(a.devices) == 1 else ctx.Queue()
    for job in pending + [None] * len(a.devices):
        q.put(job)
    if len(a.devices) == 1:
        return worker(a.devices[0], q, a, shards_dir, n_shards)
    procs = [ctx.Process(target=worker, args=(d, q, a, shards_dir, n_shards)) for d in a.devices]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if bad := [f"{d} (exit code {p.exitcode})" for d, p in zip(a.devices, procs) if p.exitcode]:
        raise SystemExit(f"error: the worker on {', '.join(bad)} failed; run again to go on from the shards done")


# -----------------------------------------------------------------------------
# main: settings, shards, then the output and its manifest

def settings_of(a):
    """What decides the result (the batch size does not, for greedy decoding)."""
    return {"target": a.target, "target_sha256": weights_hash(a.target),
            "sources": [dict(zip(("path", "size", "mtime_ns"), data_dflash.identity(f))) for f in a.data],
            **{k: getattr(a, k) for k in SETTINGS}}


def same_settings(path, settings):
    """False if `path` does not exist, True if it holds `settings`, else an error."""
    if not os.path.exists(path):
        return False
    with open(path) as f:
        old = json.load(f)
    if diff := [k for k in settings if old.get("settings", old).get(k) != settings[k]]:
        raise SystemExit(f"error: {path} was made with other settings ({', '.join(diff)}): use another --out "
                         f"or delete {os.path.dirname(path) if path.endswith('settings.json') else path}")
    return True


def main(argv=None):
    a, t_start = parse_args(sys.argv[1:] if argv is None else argv), time.time()
    if not a.target:  # the embedded default: its target, and its data unless --data is given
        a.target, data_jsonl = data_dflash.prepare_embedded_default(a.cache_dir)
        a.data = a.data or [data_jsonl]
    if missing := [f for f in a.data if not os.path.isfile(f)]:
        raise SystemExit(f"error: data file not found: {', '.join(missing)}")
    settings, manifest, shards_dir = settings_of(a), a.out + ".manifest.json", a.out + ".shards"
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
    run_workers(a, pending, shards_dir, len(shards))
    t_gen, total, ran, this_run = time.time() - t0, Counter(skipped), {i for i, _ in pending}, 0
    with open(tmp := f"{a.out}.tmp{os.getpid()}", "wb") as out:  # renamed when whole: <out> means done
        for i in range(len(shards)):
            with open(path(i) + ".jsonl", "rb") as f:
                shutil.copyfileobj(f, out)
            with open(path(i) + ".json") as f:
                total.update(st := json.load(f))
            this_run += st["generated_tokens"] if i in ran else 0
    os.replace(tmp, a.out)
    skips = {k: v for k, v in sorted(total.items()) if k in skipped or k.startswith(("skipped: ", "cut: "))}
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
    print(f"[gen] done: {counts['written']} conversations, {counts['turns_regenerated']} answers, "
          f"{counts['generated_tokens']:,} tokens ({run['tok_s']:,.0f} tok/s this run, load and graph capture "
          f"included), {run['wall_seconds']:.1f} s | skipped: {skips} -> {a.out}\n"
          f"[gen] train on it: python train_dflash.py --target {a.target} --data {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
