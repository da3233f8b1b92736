"""Target decoding: generate (many answers at once, for generate_data.py), speculate (greedy; n-gram, DFlash or no
drafts; for eval_dflash.py). Engine: a static KV cache of rows, each at its own position, under the target's HF layers
(attention replaced); on a GPU a step shape is one CUDA-graph replay: a small target's step is hundreds of launches."""
import heapq
import itertools
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

import kernels
from compiled import replay
from errors import UserError

def stop_token_ids(tok, target):
    """Sorted ids that end generation; <|im_end|> is looked up in the vocabulary (convert_tokens_to_ids gives unk)."""
    gen = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    ids = {*(gen if isinstance(gen, (list, tuple)) else [gen]), tok.eos_token_id, tok.get_vocab().get("<|im_end|>")}
    return sorted(t for t in ids if isinstance(t, int) and t >= 0)

def kv_shape(c, rows, length):
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return rows, length, c.num_key_value_heads, head_dim

class Engine:
    """The target over a static cache of `rows` rows of `length` tokens, also returning `feature_layers`' outputs (a
    drafter's input). compile: the decoder layers run compiled, the attention outside their graphs."""
    PREFILL_TOKENS = 65536     # padded tokens per prefill batch at most (but a lone prompt)
    CALL_TOKENS = 2048         # a prefill batch's fixed cost, in padded tokens
    GRAPH_TOKENS = 16384       # a batch of at most these, padded to powers of two, is a graph replay (see shape)

    def __init__(self, model, rows, length, feature_layers=(), compile=False):
        c, base = model.config, getattr(model, "model", None)   # refused: not Llama-like, or windows a context reaches
        missing = [n for n in ("embed_tokens", "rotary_emb", "layers", "norm") if not hasattr(base, n)]
        window = getattr(c, "sliding_window", None) if getattr(c, "use_sliding_window", True) else None
        sliding = set(getattr(c, "layer_types", None) or []) - {"full_attention"} or (window and window < length)
        if missing or sliding:
            raise UserError(f"the decoding engine runs Llama-like targets with full attention; "
                            f"{type(model).__name__} " + (f"has no model.{', model.'.join(missing)}" if missing else
                            f"has sliding-window attention within {length} tokens"))
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
        AttentionInterface.register("row_cache", engine_attention)
        AttentionMaskInterface.register("row_cache", sdpa_mask)   # a plain HF forward keeps sdpa's mask
        model.set_attn_implementation("row_cache")
        dev = model.device
        self.k = [torch.zeros(kv_shape(c, rows, length), dtype=model.dtype, device=dev)
                  for _ in range(c.num_hidden_layers)]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.model, self.rows, self.length, self.layers = model, rows, length, list(feature_layers)
        self.layer_step = torch.compile(_layer_step, dynamic=False) if compile else None
        self.pos = torch.zeros(rows, dtype=torch.long, device=dev)   # each row's first position in a step
        self.all_rows = torch.arange(rows, device=dev)[:, None]
        self.inputs, self.graphs, self.prefill_graphs, self.at = {}, {}, {}, None

    @staticmethod
    def fit(model, length, most=512):
        """Rows that fit: on a GPU half the free memory goes to the cache, at most `most`."""
        if model.device.type != "cuda":
            return 8
        c = model.config
        per_row = 2 * c.num_hidden_layers * math.prod(kv_shape(c, 1, length)) * model.dtype.itemsize
        return max(1, min(most, torch.cuda.mem_get_info(model.device)[0] // 2 // per_row))

    def forward(self, ids, rows, positions, lens, layer_step=None):
        """Final-normed hidden states of ids (n, T) at positions (n, T) of cache rows (n, 1), and features or None.
        Query t of row i sees the row's keys before lens[i] + t: lens[i] is its first position + 1."""
        m = self.model.model
        self.at = rows, positions.clamp(max=self.length - 1), lens    # past the end: garbage, at the last position
        h, outs = m.embed_tokens(ids), {}
        pe = m.rotary_emb(h, positions)
        for i, layer in enumerate(m.layers):
            h = outs[i] = (layer_step or _layer_step)(layer, h, pe, positions, self)
        return m.norm(h), (torch.cat([outs[i] for i in self.layers], -1) if self.layers else None)

    def attend(self, layer, q, k, v, scale):
        rows, positions, lens = self.at   # a token's keys join its row's cache, then it reads the row up to itself
        self.k[layer][rows, positions] = k.transpose(1, 2)
        self.v[layer][rows, positions] = v.transpose(1, 2)
        return kernels.row_attention(q, self.k[layer], self.v[layer], lens, True, scale, rows[:, 0])

    @torch.no_grad()
    def prefill(self, rows, prompts, features=None, starts=None):
        """Write the prompts into cache rows `rows`: their next-token logits (n, V). rows[i] has prompts[i][:starts[i]]
        already (an earlier turn's). features(rows, feats, lens) takes each batch's features (a drafter's context). A
        padding token writes to its row's last position, which no prompt reaches; a padding row to the first row's."""
        dev, logits, starts = self.model.device, None, starts or [0] * len(prompts)
        for take in self.batches([len(p) - s for p, s in zip(prompts, starts)]):
            n, T = len(take), max(len(prompts[i]) - starts[i] for i in take)
            R, T_pad, graph = self.shape(n, T)
            at = torch.full((R, T_pad + 3), self.length - 1, dtype=torch.long)   # positions | row, lens, last
            ids, at[:, -3], at[:, -2], at[:, -1] = torch.zeros(R, T_pad, dtype=torch.long), rows[take[0]], 1, 0
            for j, i in enumerate(take):
                new = prompts[i][starts[i]:]
                ids[j, :len(new)], at[j, :len(new)] = torch.tensor(new), torch.arange(starts[i], len(prompts[i]))
                at[j, -3:] = torch.tensor([rows[i], starts[i] + 1, len(new) - 1])
            if graph and (R, T_pad) in self.inputs:   # a graph reads the tensors it was captured with: these stay
                ids, at = (b.copy_(x) for b, x in zip(self.inputs[R, T_pad], (ids, at)))
            else:
                ids, at = ids.to(dev), at.to(dev)
                if graph:
                    self.inputs[R, T_pad] = ids, at

            def run(ids=ids, at=at):
                h, f = self.forward(ids, at[:, -3:-2], at[:, :-3], at[:, -2])
                return h[torch.arange(len(h), device=dev), at[:, -1]], f
            h, f = replay(self.prefill_graphs, (R, T_pad), run, dev) if graph else run()
            out = self.model.lm_head(h[:n]).float()
            logits = out.new_empty(len(prompts), out.shape[1]) if logits is None else logits
            logits[torch.tensor(take, device=dev)] = out
            if features is not None:
                features([rows[i] for i in take], f if f is None else f[:n, :T],
                         [len(prompts[i]) - starts[i] for i in take])
        return logits

    @classmethod
    def shape(cls, n, T):
        """(rows, tokens, graph) for n prompts of up to T new tokens: a small batch is a graph replay, padded to powers
        of two (few shapes captured); a large one runs eager, unpadded (its work dwarfs launches; padding adds work)."""
        R, T_pad = kernels.pow2(n), kernels.pow2(T)
        return (R, T_pad, True) if R * T_pad <= cls.GRAPH_TOKENS else (n, T, False)

    @classmethod
    def batches(cls, lens):
        """Prompt indices in batches, longest first: the split of the length order with the fewest padded tokens (in
        their shape(), + CALL_TOKENS a batch), none over PREFILL_TOKENS unless it is one prompt."""
        order = sorted(range(len(lens)), key=lambda i: -lens[i])
        L = [lens[i] for i in order]
        cost, start = [0] + [math.inf] * len(L), [0] * (len(L) + 1)
        for j in range(1, len(L) + 1):     # the best split of the first j: its last batch is L[i:j], padded to L[i]
            for i in range(j - 1, -1, -1):
                padded = math.prod(cls.shape(j - i, L[i])[:2])
                if i < j - 1 and padded > cls.PREFILL_TOKENS:
                    break
                if cost[i] + padded + cls.CALL_TOKENS < cost[j]:
                    cost[j], start[j] = cost[i] + padded + cls.CALL_TOKENS, i
        out, j = [], len(L)
        while j:
            out.append(order[start[j]:j])
            j = start[j]
        return out[::-1]

    @torch.no_grad()
    def step(self, ids, pos):
        """Logits (rows, T, V) and features of ids (n, T) fed to rows [0, n) from positions pos (n,) on. A row at a
        position < 0, or past n, idles: it writes to its last position only (see prefill), keeping its cache."""
        (n, T), dev = ids.shape, self.pos.device
        if T not in self.inputs:    # a graph reads the tensors it was captured with: these stay
            self.inputs[T] = torch.zeros(self.rows, T, dtype=torch.long, device=dev), torch.arange(T, device=dev)
        buf, offsets = self.inputs[T]
        buf[:n].copy_(ids)
        buf[n:] = 0
        self.pos.fill_(-1)
        self.pos[:n].copy_(torch.as_tensor(pos))

        def run():   # a compile that cannot happen (dynamo's recompile limit) raises: never eager layers unnoticed
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                at = torch.where(self.pos[:, None] < 0, self.length - 1, self.pos[:, None] + offsets)
                h, feats = self.forward(buf, self.all_rows, at, self.pos.clamp(min=0) + 1, self.layer_step)
            return self.model.lm_head(h), feats     # the pickers read the logits in the model's dtype
        return replay(self.graphs, T, run, dev)

def _layer_step(layer, h, pe, positions, engine):
    return layer(h, position_embeddings=pe, position_ids=positions, engine=engine)

@torch.compiler.disable   # a compiled layer breaks its graph here: the cache rows and the row kernel run as they are
def engine_attention(module, q, k, v, mask, scaling=None, engine=None, **kw):
    """The engine's attention for the target's layers; without `engine` (a plain HF forward) HF's sdpa."""
    if engine is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, q, k, v, mask, scaling=scaling, **kw)
    return engine.attend(module.layer_idx, q, k, v, scaling), None

def picker(temperature, top_p):
    """Greedy, or sampling at `temperature` within the `top_p` nucleus: (logits (rows, V), seeds (rows,)) -> ids. The
    Gumbel noise is hashed from the row's seed and the token id: the same answer whichever row or device decodes it."""
    if temperature <= 0:
        return lambda logits, seeds: logits.argmax(-1)
    if top_p >= 1:     # every token stays: one pass over the logits (a kernel on a GPU), no sort of the vocabulary
        return lambda logits, seeds: kernels.gumbel_argmax(logits, seeds, 1 / temperature)

    def sample(logits, seeds):
        z = logits.float() * (1 / temperature)
        p, idx = z.softmax(-1).sort(-1, descending=True)
        cut = p.cumsum(-1) - p > top_p      # outside the smallest head whose mass reaches top_p
        z.scatter_(-1, idx, torch.where(cut, -torch.inf, z.gather(-1, idx)))
        return kernels.gumbel_scores_torch(z, seeds, 1.0).argmax(-1)
    return sample

@dataclass
class Request:
    """An answer to decode: up to `budget` new tokens after `prompt`, its token i drawn with the seed `seed` + i."""
    key: tuple      # (group, ...): the answer comes back under it; requests start by group (a shard)
    prompt: list    # token ids
    budget: int     # new tokens at most
    chain: int      # answers its conversation asks for from this one on: the longest chains start first
    seed: int

    @property
    def group(self):
        """The first part of the key: requests start group by group."""
        return self.key[0]

class _Parked(NamedTuple):
    """An ended answer's row, held for its key's next turn, and the ids its cache holds."""
    row: int
    ids: list

@dataclass
class _Step:
    """A step queued on the device: its picks land in a pinned buffer (`landed`: a CUDA event, None on a CPU)."""
    picks: torch.Tensor
    landed: object
    live: torch.Tensor     # the rows that keep their pick

@dataclass
class _GenRows:
    """generate's state: each row's answer on the host, its next step's inputs on the device, the requests between."""
    stop_ids: torch.Tensor
    req: list               # each row's Request; None while it is free or held
    gen: torch.Tensor       # (rows, engine.length): each row's answer so far
    count: torch.Tensor     # its tokens so far
    budget: torch.Tensor    # its tokens at most
    live: torch.Tensor      # decoding
    held: torch.Tensor      # ended, its cache kept for a next turn
    cur: torch.Tensor       # on the device: the next step's token of each row,
    at: torch.Tensor        # its position (-1: the row idles)
    drawn: torch.Tensor     # and its seed
    back: list              # two pinned buffers the picks come back through, a step each in turn
    ahead: _Step = None     # the step queued, its picks not read yet
    heap: list = field(default_factory=list)     # waiting: (group, -chain, prompt length, arrival, Request)
    arrival: itertools.count = field(default_factory=itertools.count)
    more_done: bool = False                      # more() gave []: no more requests come
    ended: list = field(default_factory=list)    # (key, tokens) of the answers ended since the last follow
    parked: dict = field(default_factory=dict)   # key -> _Parked
    resume: list = field(default_factory=list)   # (row, Request, ids shared): next turns in their keys' held rows
    pending: Future = None                       # the last follow, run in the thread during this step
    pending_keys: list = field(default_factory=list)   # the ended answers' keys it was asked for

    @classmethod
    def new(cls, engine, stops):
        """Every row free: no request, idle on the device."""
        n, dev = engine.rows, engine.pos.device
        zeros = lambda dtype=torch.long, device=None: torch.zeros(n, dtype=dtype, device=device)
        return cls(stop_ids=torch.tensor(sorted(stops), dtype=torch.long), req=[None] * n,
                   gen=torch.zeros(n, engine.length, dtype=torch.long), count=zeros(), budget=zeros(),
                   live=zeros(torch.bool), held=zeros(torch.bool),
                   cur=zeros(device=dev), at=zeros(device=dev) - 1, drawn=zeros(device=dev),
                   back=[torch.zeros(n, dtype=torch.long, pin_memory=dev.type == "cuda") for _ in range(2)])

@torch.no_grad()
def generate(engine, more, stops, pick, follow=lambda ended: []):
    """Decode Requests until none is left; more() gives more ([] at the end) while fewer wait than rows.
    pick(logits, seeds) -> ids; seeds: the request's seed + the token's index. An answer ends at a stop id (kept) or
    after its budget. follow([(key, tokens)]), run in a thread during the next step, gives the ended answers' next
    turns: each takes its answer's row and prefills past the prefix its cache shares. Other requests go by group (a
    shard), then longest chain first: a group's last turns do not decode alone at the end. Each step is queued before
    the host reads the last one's picks (a row they end decodes one token more, never kept): the GPU never waits for
    the host's bookkeeping."""
    s = _GenRows.new(engine, stops)
    with ThreadPoolExecutor(1) as pool:
        while True:
            free = (~s.live & ~s.held).nonzero()[:, 0].tolist()
            if _prefill_due(s, free):
                _prefill(s, engine, pick, free)
            last, s.ahead = s.ahead, None
            if s.live.any():   # queued before the host reads the last step's picks
                s.ahead = _queue_step(s, engine, pick)
            _join_follow(s)
            _fill(s, more)
            if last:
                _read(s, last)
            elif _finished(s):
                return
            if s.ended:   # their next turns are made in the thread while the step queued decodes
                s.pending, s.pending_keys = pool.submit(_follow_shared, s, follow, s.ended), [k for k, _ in s.ended]
                s.ended = []

def _wait(s, r):
    """Queue a request: by group (a shard), then longest chain, then shortest prompt, then arrival."""
    heapq.heappush(s.heap, (r.group, -r.chain, len(r.prompt), next(s.arrival), r))

def _prefill_due(s, free):
    """Whether to prefill: requests wait for rows, and an eighth of the rows idles (fewer, larger prefills)."""
    idle = len(s.live) - int(s.live.sum())
    return bool(s.resume or s.heap and free) and idle >= len(s.live) // 8

def _prefill(s, engine, pick, free):
    """Start waiting requests in free rows and next turns in their held rows: one batched prefill, the first picks."""
    take = [heapq.heappop(s.heap)[-1] for _ in range(min(len(free), len(s.heap)))]
    rows = torch.tensor(free[:len(take)] + [row for row, _, _ in s.resume])
    shared = [0] * len(take) + [m for _, _, m in s.resume]
    take, s.resume = take + [r for _, r, _ in s.resume], []
    for row, r in zip(rows.tolist(), take):
        s.req[row] = r
    s.count[rows], s.live[rows], s.held[rows] = 0, True, False
    s.budget[rows] = torch.tensor([r.budget for r in take])
    logits = engine.prefill(rows.tolist(), [r.prompt for r in take], starts=shared)
    dev = s.cur.device
    on, seeds = rows.to(dev), torch.tensor([r.seed for r in take], device=dev)
    first = pick(logits, seeds)   # a row decodes on from its prompt's end, with the seed's next draws
    s.cur[on], s.at[on], s.drawn[on] = first, torch.tensor([len(r.prompt) for r in take], device=dev), seeds + 1
    _emit(s, rows, first.cpu())

def _queue_step(s, engine, pick):
    """Queue a step of every row on the device, its picks copied into the pinned buffer the last step's are not in."""
    s.cur = pick(engine.step(s.cur[:, None], s.at)[0][:, 0], s.drawn)
    s.at += (s.at >= 0).long()
    s.drawn += 1
    s.back.reverse()                   # the other buffer: the last step's is read after this one is queued
    s.back[0].copy_(s.cur, non_blocking=True)
    landed = torch.cuda.Event() if s.cur.device.type == "cuda" else None
    if landed:
        landed.record()
    return _Step(s.back[0], landed, s.live.clone())

def _read(s, step):
    """Keep a step's picks once they land (the step queued after it runs on meanwhile)."""
    if step.landed:
        step.landed.synchronize()
    rows = step.live.nonzero()[:, 0]
    _emit(s, rows, step.picks[rows])

def _emit(s, rows, tokens):
    """Keep a token for each of rows (host tensors); a row whose answer ends is held for its next turn."""
    s.gen[rows, s.count[rows]] = tokens
    s.count[rows] += 1
    done = rows[torch.isin(tokens, s.stop_ids) | (s.count[rows] >= s.budget[rows])]
    for row in done.tolist():
        r, answer = s.req[row], s.gen[row, :s.count[row]].tolist()
        s.ended.append((r.key, answer))
        s.parked[r.key] = _Parked(row, r.prompt + answer[:-1])   # the last token: cached only by a step queued ahead
        s.req[row] = None
    s.live[done], s.held[done] = False, True
    s.at[done.to(s.at.device)] = -1
    if s.ahead:   # the step queued ahead decodes them once more: not kept, and its writes land just past the
        s.ahead.live[done] = False   # ids a held row keeps

def _follow_shared(s, follow, ended):
    """follow's requests for the ended answers, each with the ids its prompt shares with its key's held row."""
    out = []
    for r in follow(ended):
        cached = s.parked[r.key].ids if r.key in s.parked else []
        m = min(len(cached), len(r.prompt) - 1)            # one prompt token at least is prefilled: its logits
        differ = (torch.tensor(cached[:m]) != torch.tensor(r.prompt[:m])).nonzero()
        out.append((r, int(differ[0, 0]) if len(differ) else m))
    return out

def _join_follow(s):
    """Take the last follow's requests: a next turn resumes its key's held row; a row without one is freed."""
    if s.pending:
        for r, shared in s.pending.result():
            if r.key in s.parked:
                s.resume.append((s.parked.pop(r.key).row, r, shared))
            else:
                _wait(s, r)
        for key in s.pending_keys:   # conversations without a next turn: their rows are free
            if key in s.parked:
                s.held[s.parked.pop(key).row] = False
    s.pending = None

def _fill(s, more):
    """Ask more() for requests while fewer wait than there are rows, until it gives []."""
    while not s.more_done and len(s.heap) < len(s.req):
        got = more()
        s.more_done = not got
        for r in got:
            _wait(s, r)

def _finished(s):
    """Whether nothing is left: no step queued, follow pending, request waiting or to come, answer unhanded."""
    return not (s.ahead or s.pending or s.heap or s.resume or s.ended or not s.more_done)

class NGram:
    """Prompt lookup on the device: the up to block_size-1 tokens after the latest earlier occurrence of the row's
    last 3 tokens, else 2, else 1 (each a comparison of the row with its tail: no host round trip per round)."""
    N = 3

    def __init__(self, block_size):
        self.k = block_size - 1

    def prefill(self, rows, feats, lens):
        pass

    def propose(self, tokens, length, last):
        """Drafts (R, k) from tokens (R, L) of which each row holds length[r], and their lengths (R,)."""
        (R, L), dev = tokens.shape, tokens.device
        at, start = torch.arange(L, device=dev), torch.full((R,), -1, device=dev)
        for n in range(1, min(self.N, L - 1) + 1):          # a longer match overrides a shorter one
            tail = tokens.gather(1, (length[:, None] - n + torch.arange(n, device=dev)).clamp(min=0))
            hit = at[None, :L - n + 1] < (length - n)[:, None]   # a window before the tail's own
            for t in range(n):
                hit &= tokens[:, t:L - n + 1 + t] == tail[:, t:t + 1]
            latest = torch.where(hit, at[:L - n + 1], -1).amax(1)
            start = torch.where(latest >= 0, latest + n, start)
        k = torch.where(start >= 0, (length - start).clamp(max=self.k), 0)
        offsets = torch.arange(self.k, device=dev)
        ids = tokens.gather(1, (start.clamp(min=0)[:, None] + offsets).clamp(max=L - 1))
        return torch.where(offsets < k[:, None], ids, 0), k

    def accept(self, n, feats, live):
        pass

class DrafterRows:
    """A DFlash drafter proposing for each engine row over its own cache: each round one block step (a graph replay on
    a GPU) adds the committed tokens' features and drafts block_size-1 tokens. compile: as the Engine's."""

    def __init__(self, drafter, rows, length, compile=False):
        c, dev, dt = drafter.config, drafter.fc.weight.device, drafter.fc.weight.dtype
        if length > c.max_position_embeddings:
            raise UserError(f"prompts and answers of {length} positions (a block included) exceed the "
                            f"{c.max_position_embeddings} positions of the drafter's rotary table")
        self.k = [torch.zeros(kv_shape(c, rows, length), dtype=dt, device=dev) for _ in drafter.layers]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.drafter, self.block_size, self.graphs = drafter, c.block_size, {}
        self.feats = torch.zeros(rows, c.block_size, len(c.target_layer_ids) * c.hidden_size, dtype=dt, device=dev)
        self.ctx_len, self.n_new, self.anchor = (torch.zeros(rows, dtype=torch.long, device=dev) for _ in range(3))
        self.rows, self.offsets = torch.arange(rows, device=dev)[:, None], torch.arange(c.block_size, device=dev)
        self.masks = torch.full((rows, c.block_size - 1), c.mask_token_id, dtype=torch.long, device=dev)
        self.layer_step = torch.compile(_block_layer, dynamic=False) if compile else _block_layer
        self.layer, self.pos_c, self.pos_q, self.start = 0, None, None, None    # the block step's, for attend

    @torch.no_grad()
    def prefill(self, rows, feats, lens):
        d, dt = self.drafter, self.feats.dtype
        pos = torch.arange(feats.shape[1], device=feats.device)[None].expand(len(rows), -1)
        ctx, (cos, sin) = d.context(feats.to(dt)), d.rope(pos, dt)
        r = torch.tensor(rows, device=feats.device)[:, None]
        for i, layer in enumerate(d.layers):
            k, v = layer.self_attn.kv(ctx, cos, sin)
            self.k[i][r, pos], self.v[i][r, pos] = k.transpose(1, 2), v.transpose(1, 2)
        self.ctx_len[r[:, 0]] = torch.as_tensor(lens, device=feats.device)
        self.n_new[r[:, 0]] = 0

    @torch.no_grad()
    def propose(self, tokens, length, last):
        self.anchor[:len(last)].copy_(last)
        k = torch.full((len(last),), self.block_size - 1, device=last.device)
        return replay(self.graphs, "block", self.block, self.anchor.device)[:len(last)], k

    def block(self):
        d, dt = self.drafter, self.feats.dtype
        self.pos_c = self.ctx_len[:, None] + self.offsets     # the new context (n_new of them valid)
        self.start = self.ctx_len + self.n_new                # the anchor's position
        self.pos_q = self.start[:, None] + self.offsets
        ctx, (cos_c, sin_c), (cos_q, sin_q) = d.context(self.feats), d.rope(self.pos_c, dt), d.rope(self.pos_q, dt)
        h = F.embedding(torch.cat([self.anchor[:, None], self.masks], 1), d.embed_weight).to(dt)
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):   # never eager layers unnoticed
            for i, layer in enumerate(d.layers):
                self.layer = i
                h = self.layer_step(layer, h, ctx, cos_c, sin_c, cos_q, sin_q, self)
        return (d.norm(h)[:, 1:] @ d.lm_head_weight.t().to(h.dtype)).argmax(-1)

    @torch.compiler.disable   # a compiled layer's graph breaks here: cache rows and row kernel run as they are
    def attend(self, q, k, v):
        """The new context's keys join the cache, then the block's over its invalid tail; the block reads to its end."""
        i, bs = self.layer, self.block_size
        for pos, part in ((self.pos_c, slice(0, bs)), (self.pos_q, slice(bs, 2 * bs))):
            self.k[i][self.rows, pos] = k[:, :, part].transpose(1, 2)
            self.v[i][self.rows, pos] = v[:, :, part].transpose(1, 2)
        out = kernels.row_attention(q, self.k[i], self.v[i], self.start + bs, False, q.shape[-1] ** -0.5)
        return out.transpose(1, 2)

    @torch.no_grad()
    def accept(self, n, feats, live):
        """The verify step committed its first n+1 tokens per live row: their features are the next context."""
        R = len(n)
        self.ctx_len[:R] += self.n_new[:R]
        self.n_new[:R] = torch.where(live, n + 1, 0)
        self.feats[:R].copy_(feats[:R])

def _block_layer(layer, h, ctx, cos_c, sin_c, cos_q, sin_q, rows):
    """A drafter layer of the block step: the new context's keys/values and the block's go to rows.attend."""
    return layer(h, *layer.self_attn.kv(ctx, cos_c, sin_c), cos_q, sin_q, rows.attend)

@torch.no_grad()
def speculate(engine, prompts, max_new_tokens, stops, proposer=None):
    """Greedy decoding of each prompt in a row of its own, as it would decode alone: [(new tokens, acceptance lengths)]
    per prompt; an answer ends at a stop id (kept) or after max_new_tokens. The rounds run on the device: the host
    queues a round before it reads whether the one before left a row live (a round past the end commits nothing)."""
    rows, accepted = _start(engine, prompts, max_new_tokens, stops, proposer), []
    flags = [torch.zeros((), dtype=torch.bool, pin_memory=rows.live.is_cuda) for _ in range(2)]
    pending = _flag(rows.live, flags[0])       # any row live for the round queued next?
    while True:
        accepted.append(_round(engine, rows, proposer))
        flags.reverse()
        before, pending = pending, _flag(rows.live, flags[0])
        if not before():                       # no row was live for this round: it committed nothing
            break
    tokens, length, acc = rows.tokens.cpu(), rows.length.tolist(), torch.stack(accepted, 1).tolist()
    return [(tokens[r, len(p):length[r]].tolist(), [a for a in acc[r] if a] if proposer else [])
            for r, p in enumerate(prompts)]

def _start(engine, prompts, max_new_tokens, stops, proposer):
    """The rows after the prefill and its first tokens: tokens (R, engine.length), each row's length and new tokens
    so far, whether it is live; budget and stop ids."""
    dev, R = engine.pos.device, len(prompts)
    logits = engine.prefill(list(range(R)), prompts, proposer.prefill if proposer else None)   # batched by length
    tokens = torch.zeros(R, engine.length, dtype=torch.long)
    for r, p in enumerate(prompts):
        tokens[r, :len(p)] = torch.tensor(p)
    tokens, length = tokens.to(dev), torch.tensor([len(p) for p in prompts], device=dev)
    first, stops = logits.argmax(-1), torch.tensor(sorted(stops), dtype=torch.long, device=dev)
    tokens[torch.arange(R, device=dev), length] = first
    live = ~torch.isin(first, stops) & (max_new_tokens > 1)
    return _Rows(tokens, length + 1, torch.ones_like(length), live, max_new_tokens, stops)

@dataclass
class _Rows:
    tokens: torch.Tensor      # (R, engine.length): the prompt, then the answer so far
    length: torch.Tensor      # (R,) tokens held
    new: torch.Tensor         # (R,) answer tokens
    live: torch.Tensor        # (R,) bool: neither stopped nor at the budget
    budget: int
    stops: torch.Tensor

def _round(engine, rows, proposer):
    """Draft, verify and commit a round for every live row: its acceptance length (0 for a row not live)."""
    last = rows.tokens.gather(1, (rows.length - 1)[:, None])[:, 0]
    if proposer:
        draft, k = proposer.propose(rows.tokens, rows.length, last)
    else:
        draft, k = last.new_zeros(len(last), 0), last.new_zeros(len(last))
    logits, feats = engine.step(torch.cat([last[:, None], draft], 1), torch.where(rows.live, rows.length - 1, -1))
    verified = logits[:len(last)].argmax(-1)                                      # (R, 1 + proposals)
    n = torch.minimum((draft == verified[:, :-1]).long().cumprod(1).sum(1), k)   # the agreeing prefix
    if proposer:
        proposer.accept(n, feats, rows.live)
    acc = torch.where(rows.live, n + 1, 0)
    _commit(rows, F.pad(draft, (0, 1)), n, verified.gather(1, n[:, None]))
    return acc

def _commit(rows, block, n, bonus):
    """Append the accepted n tokens of block and the target's bonus token to each live row, up to a stop id (kept)
    or the budget; a row that reaches either is no longer live."""
    j = torch.arange(block.shape[1], device=block.device)
    out = torch.where(j < n[:, None], block, bonus)
    stopped = torch.isin(out, rows.stops) & (j <= n[:, None])
    count = torch.where(stopped.any(1), stopped.long().argmax(1) + 1, n + 1)
    count = torch.where(rows.live, torch.minimum(count, rows.budget - rows.new), 0)
    at = (rows.length[:, None] + j).clamp(max=rows.tokens.shape[1] - 1)   # beyond count: the token already there
    rows.tokens.scatter_(1, at, torch.where(j < count[:, None], out, rows.tokens.gather(1, at)))
    rows.length += count
    rows.new += count
    rows.live &= ~(stopped & (j < count[:, None])).any(1) & (rows.new < rows.budget)

def _flag(live, buf):
    """A function returning whether any row is live at this point of the stream, once the device gets there."""
    buf.copy_(live.any(), non_blocking=buf.is_pinned())
    done = torch.cuda.Event() if buf.is_pinned() else None
    if done:
        done.record()

    def read():
        if done:
            done.synchronize()
        return bool(buf)
    return read
