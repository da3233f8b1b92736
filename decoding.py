"""Decoding with the target: every way the project decodes, in one file.
  1. speculative decoding - greedy, token-identical to the target's own: a DFlash drafter's blocks or n-gram
                            prompt lookup proposed, the target verifying each proposal in one pass
  2. many answers at once - Slots: a static KV cache of many rows, each step one CUDA-graph replay (the
                            answers generate_data.py writes)
"""
import heapq
import itertools
import math

import torch
import torch.nn.functional as F

import dflash_model as dm


def stop_token_ids(tok, target):
    """Sorted ids that end generation: the target's generation_config eos (an int or a list: Llama-3.1
    lists <|eot_id|> there, which ends each assistant turn), the tokenizer's eos and <|im_end|> where
    the vocabulary has it (looked up in it: convert_tokens_to_ids would give the unk id for a miss)."""
    gen = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    ids = set(gen if isinstance(gen, (list, tuple)) else [gen])
    ids |= {tok.eos_token_id, tok.get_vocab().get("<|im_end|>")}
    return sorted(t for t in ids if isinstance(t, int) and t >= 0)


# -----------------------------------------------------------------------------
# 1. Speculative decoding


@torch.no_grad()
def draft_block(drafter, cache, new_feats, new_pos, anchor_token, anchor_pos):
    """Extend the drafter's context cache (per layer: keys, values; block entries are never kept) with
    new context features, then draft bs-1 tokens' logits."""
    c = drafter.config
    dev = new_feats.device
    ctx = drafter.context(new_feats)
    cos_c, sin_c = drafter.rope(new_pos, ctx.dtype)
    block_ids = torch.full((1, c.block_size), c.mask_token_id, dtype=torch.long, device=dev)
    block_ids[0, 0] = anchor_token
    block_pos = anchor_pos + torch.arange(c.block_size, device=dev)[None]
    h = F.embedding(block_ids, drafter.embed_weight).to(ctx.dtype)
    cos_q, sin_q = drafter.rope(block_pos, ctx.dtype)
    attend = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # all visible
    for i, layer in enumerate(drafter.layers):
        kv = layer.self_attn.kv(ctx, cos_c, sin_c)
        cache[i] = kv if cache[i] is None else [torch.cat([old, new], dim=2) for old, new in zip(cache[i], kv)]
        h = layer(h, *cache[i], cos_q, sin_q, attend)
    return (drafter.norm(h)[0, 1:] @ drafter.lm_head_weight.t().to(h.dtype)).float()     # (bs-1, V)


@torch.no_grad()
def speculative_generate(target, input_ids, max_new_tokens, stop_token_ids, block_size, propose):
    """Greedy speculative decoding: (ids (1, P+n), acceptance length of each round), token-identical to
    the target's own greedy decoding (target_greedy). Each round `propose(tokens, start)` drafts up to
    block_size-1 tokens after tokens[-1]; the target's last pass covered the positions start.., which
    hold tokens[start:-1] (its captured features). The target verifies the draft in one pass and keeps
    the agreeing prefix plus its own next token."""
    from transformers import DynamicCache
    stops, dev, P = set(stop_token_ids or []), input_ids.device, input_ids.shape[1]
    cache = DynamicCache(config=target.config)
    out = target(input_ids=input_ids, past_key_values=cache, use_cache=True)
    tokens, start, accept_lengths = input_ids[0].tolist() + [int(out.logits[0, -1].argmax())], 0, []
    while len(tokens) - P < max_new_tokens and tokens[-1] not in stops:
        draft = torch.as_tensor(propose(tokens, start), dtype=torch.long, device=dev)
        draft, k, start = draft[: block_size - 1], min(len(draft), block_size - 1), len(tokens) - 1
        verify = torch.cat([torch.tensor([tokens[-1]], device=dev), draft])[None]
        out = target(input_ids=verify, past_key_values=cache, use_cache=True)
        t_tok = out.logits[0].argmax(-1)                                      # (k+1,)
        n = int((draft == t_tok[:k]).int().cumprod(0).sum())                  # the agreeing prefix
        if n < k:                                     # keep target KV only for accepted tokens
            cache.crop(-(k - n))
        accept_lengths.append(n + 1)
        for t in draft[:n].tolist() + [int(t_tok[n])]:
            tokens.append(t)
            if t in stops or len(tokens) - P >= max_new_tokens:
                break
    return torch.tensor([tokens[: P + max_new_tokens]], device=dev, dtype=input_ids.dtype), accept_lengths


def dflash_generate(drafter, target, input_ids, max_new_tokens, stop_token_ids=None):
    """speculative_generate with a DFlash drafter: its own cache of context keys/values, extended each
    round with the target features of the newly committed tokens, drafts a block from the last one."""
    c = drafter.config
    P, dcache = input_ids.shape[1], [None] * len(drafter.layers)
    if P + max_new_tokens + c.block_size > c.max_position_embeddings:
        raise ValueError(f"prompt ({P}) + max_new_tokens ({max_new_tokens}) + a block ({c.block_size}) exceed the "
                         f"{c.max_position_embeddings} positions of the drafter's rotary table")

    dm.capture(target, c.target_layer_ids)

    def propose(tokens, start):
        n = len(tokens) - 1 - start
        feats = dm.target_features(target, c.target_layer_ids)[:, :n].to(drafter.fc.weight.dtype)
        pos = torch.arange(start, start + n, device=input_ids.device)[None]
        return draft_block(drafter, dcache, feats, pos, tokens[-1], len(tokens) - 1).argmax(-1)
    return speculative_generate(target, input_ids, max_new_tokens, stop_token_ids, c.block_size, propose)


def ngram_propose(tokens, k, max_n=3):
    """Prompt lookup, the speculator that needs no training: the up to k tokens that followed the latest
    earlier occurrence of the context's last 3 tokens, else of its last 2, else of its last token."""
    for n in range(max_n, 0, -1):
        tail = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == tail:
                return tokens[i + n: i + n + k]
    return []


def ngram_generate(target, input_ids, max_new_tokens, stop_token_ids=None, block_size=16):
    return speculative_generate(target, input_ids, max_new_tokens, stop_token_ids, block_size,
                                lambda tokens, _start: ngram_propose(tokens, block_size - 1))


@torch.no_grad()
def target_greedy(target, input_ids, max_new_tokens, stop_token_ids=None):
    """Plain greedy decoding with a KV cache: the reference for losslessness."""
    from transformers import DynamicCache
    stops = set(stop_token_ids or [])
    cache = DynamicCache(config=target.config)
    nxt, out_tokens = input_ids, []
    for _ in range(max_new_tokens):
        t = int(target(input_ids=nxt, past_key_values=cache, use_cache=True).logits[0, -1].argmax())
        out_tokens.append(t)
        if t in stops:
            break
        nxt = torch.tensor([[t]], device=input_ids.device)
    return torch.cat([input_ids, torch.tensor([out_tokens], device=input_ids.device, dtype=input_ids.dtype)], dim=1)


# -----------------------------------------------------------------------------
# 2. Many answers at once


class Slots:
    """Greedy (or sampled) decoding of many answers at once on a static KV cache of `n` slots of `length`
    tokens: a finished answer's slot takes the next prompt at once (no batch waits for its longest answer),
    prompts are prefilled in batches, and each decoding step is one replay of a CUDA graph
    per (rows, span) shape: a small target's step is otherwise hundreds of kernel launches for little work.
    `span` covers the longest context in the slots (rounded up to SPAN), so attention reads what is
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
    read in place by SDPA (faster than the same attention as two batched matmuls); without `slots` (a
    prefill) it is HF's sdpa."""
    if slots is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, q, k, v, mask, scaling=scaling, **kw)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=slots.mask[:, None, None, :],
                                                           scale=scaling, enable_gqa=True)
    return out.transpose(1, 2), None


def picker(temperature, top_p):
    """Greedy, or sampling at `temperature` within the `top_p` nucleus: logits (rows, V) -> token ids (rows,)."""
    if temperature <= 0:
        return lambda logits: logits.argmax(-1)

    def sample(logits):
        p, idx = (logits / temperature).softmax(-1).sort(-1, descending=True)
        p[p.cumsum(-1) - p > top_p] = 0   # keep the smallest head whose mass reaches top_p
        return idx.gather(-1, torch.multinomial(p, 1)).squeeze(-1)
    return sample


