"""Train a DFlash drafter: threaded target -> drafter pipeline on one node (torchrun for several).

    python train_dflash.py --target Qwen/Qwen3-8B --data sharegpt.json \
        --target-devices cuda:0,cuda:1,cuda:2,cuda:3,cuda:4 --drafter-devices cuda:5,cuda:6,cuda:7
    python train_dflash.py                      # embedded default: SmolLM2-135M-Instruct + ShareGPT

Threads (../shared/design.md):
  loader  --batches-->  [bounded queue]  -->  one target thread per target device
      (no grad, bf16, stops after the deepest captured layer, no LM head)
  --features-->  [reorder buffer, bounded]  -->  one drafter thread per drafter device (own replica)
      anchors -> block mask -> compiled forward -> loss -> backward; replicas meet at every optimiser
      step: gradients summed (NCCL between distinct GPUs, plain sum on one device / CPU; all-reduce
      across nodes under torchrun), clipped, the same AdamW step on every replica.
  main: config, data, warm-up (serial compile of every shape), start, watch, stop.
Any exception in any thread stops the run within seconds, prints its traceback, exits non-zero;
checkpoints are written atomically, so the last one stays intact.
"""
import dataclasses
import hashlib
import json
import math
import os
import queue
import shutil
import signal
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

T_PROCESS = time.time()       # before torch's import: the start-up line counts from here

import numpy as np
import torch

import dflash_model as dm
import warmup
from master_adamw import MasterAdamW, from_torch_adamw_state


# -----------------------------------------------------------------------------
# Config: one dataclass; every field is a command-line option; unknown options are errors.

@dataclass
class TrainConfig:
    # model / data
    target: str = ""                    # HF folder or hub name; "" = embedded default (SmolLM2-135M-Instruct)
    data: list = field(default_factory=list)   # ShareGPT JSON/JSONL or chat JSONL files (or a hub data set)
    cache_dir: str = ".cache"           # embedded default conversion + tokenised data cache
    max_samples: int = 0                # 0 = all; else only the first N conversations are tokenised
    num_draft_layers: int = 5
    block_size: int = 16
    num_anchors: int = 512              # per sequence (see anchor_density)
    anchor_density: str = "sequence"    # sequence: num_anchors per sequence, capped by its length (the spec) | length: per max_length tokens
    gamma: float = 0.0                  # 0 = by block size: 7 (16), 5 (10), 4 (8)
    mask_token_id: int = -1             # -1 = <|MASK|>, a spare embedding row, or an unused special token
    target_layer_ids: str = ""          # "" = spec formula; else "1,9,17,25,33"
    max_length: int = 3072
    buckets: str = ""                   # "" = multiples of 256 up to max_length, e.g. "512,1024,3072"
    tokens_per_batch: int = 0           # target tokens per micro-batch; 0 = max_length (B = this // bucket)
    min_supervised: int = 32
    # optimisation (the spec's recipe)
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    clip: float = 1.0
    epochs: float = 6.0
    grad_accum: int = 1
    max_steps: int = 0                  # 0 = epochs decide
    max_minutes: float = 0.0            # 0 = no time budget; else stop (with a checkpoint) after this
    seed: int = 0
    # devices / compile
    target_devices: str = "auto"        # e.g. cuda:0,cuda:1 ; "auto": 5/8 of the GPUs, or cpu; cuda:local = LOCAL_RANK
    drafter_devices: str = "auto"
    attn: str = "auto"                  # flex (compiled) | sdpa (dense mask, explicit) | auto: flex on cuda, sdpa on cpu
    on_unwarmed: str = "error"          # error | compile (exclusive, logged)
    compile_cache: str = ""             # "" = <out_dir>/compile_cache
    compile_scope: str = "trunk"        # trunk: whole drafter one graph | layer: one graph reused per layer | flex: only attention
    warmup_workers: int = -1            # cold-compile the flex shapes in up to N parallel processes first; -1 = auto (by free GPU memory, 0 on CPU)
    chunk_rows: int = dm.CHUNK_ROWS     # LM head + CE rows per chunk (3072)
    flex_options: str = ""              # JSON flex options over dflash_model.DEFAULT_FLEX_OPTIONS (GQA_EXPAND; torch's tiles), e.g. '{"USE_TMA": true}'
    queue_depth: int = 4
    no_gate: bool = False               # DEBUG ONLY: bypass the compile gate (reproduces the race)
    # output
    out_dir: str = "out"
    ckpt_interval: int = 500
    keep_last: int = 3
    log_interval: int = 10
    resume: bool = False
    # fault injection for tests: "target:3" / "drafter:5" raise at that batch/step, "kill:4" SIGKILLs
    # the process after step 4 (after its checkpoint, if any), "ckpt:4" fails the write of checkpoint
    # 4, "ckpt_lag:2" starts each checkpoint's write 2 steps late, "disk:4" pretends the output's file
    # system is full (1 MiB free) from checkpoint 4 on (disk:0: from the start)
    debug_fail: str = ""


def parse_config(argv):
    """--name value / --flag / --name v1 v2 (lists). Unknown or mistyped options are errors."""
    cfg, fields = TrainConfig(), {f.name: f for f in dataclasses.fields(TrainConfig)}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise SystemExit(f"error: unexpected argument {arg!r} (options are --name value)")
        name = arg[2:].replace("-", "_")
        if name not in fields:
            close = [f"--{n.replace('_', '-')}" for n in fields if n.split("_")[0] == name.split("_")[0]]
            raise SystemExit(f"error: unknown option {arg}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        default = getattr(cfg, name)
        vals = []
        while i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            vals.append(argv[i + 1])
            i += 1
        i += 1
        try:
            if isinstance(default, bool):
                value = True if not vals else {"true": True, "1": True, "false": False, "0": False}[vals[0].lower()]
            elif isinstance(default, list):
                value = vals
            elif len(vals) != 1:
                raise ValueError(f"expects one value, got {len(vals)}")
            else:
                value = type(default)(vals[0])
        except (ValueError, KeyError) as e:
            raise SystemExit(f"error: bad value for {arg}: {vals} ({e})")
        setattr(cfg, name, value)
    validate(cfg)
    return cfg


def validate(cfg):
    errs = []
    if cfg.attn not in ("auto", "flex", "sdpa"):
        errs.append(f"--attn must be auto|flex|sdpa, got {cfg.attn}")
    if cfg.compile_scope not in dm.COMPILE_SCOPES:
        errs.append(f"--compile-scope must be one of {'|'.join(dm.COMPILE_SCOPES)}, got {cfg.compile_scope}")
    if cfg.anchor_density not in ("sequence", "length"):
        errs.append(f"--anchor-density must be sequence|length, got {cfg.anchor_density}")
    if cfg.on_unwarmed not in ("error", "compile"):
        errs.append(f"--on-unwarmed must be error|compile, got {cfg.on_unwarmed}")
    if cfg.block_size < 2 or cfg.num_anchors < 1 or cfg.max_length < 2 * cfg.block_size:
        errs.append("need block_size >= 2, num_anchors >= 1, max_length >= 2*block_size")
    if cfg.grad_accum < 1 or cfg.keep_last < 1 or cfg.log_interval < 1 or cfg.ckpt_interval < 1:
        errs.append("grad_accum, keep_last, log_interval, ckpt_interval must be >= 1")
    if cfg.queue_depth < 1:     # 0 would be an unbounded load queue, < 0 a reorder buffer that never takes
        errs.append(f"--queue-depth must be >= 1, got {cfg.queue_depth}")
    if not cfg.clip > 0:        # the clip factor clip/norm: 0 freezes the weights, < 0 steps uphill
        errs.append(f"--clip must be > 0, got {cfg.clip}")
    if not cfg.lr > 0 or cfg.weight_decay < 0 or cfg.epochs <= 0 or cfg.max_steps < 0 or cfg.max_minutes < 0:
        errs.append("need lr > 0, weight_decay >= 0, epochs > 0, max_steps >= 0, max_minutes >= 0")
    if cfg.buckets:
        try:
            b = [int(x) for x in cfg.buckets.split(",")]
        except ValueError:
            b = None
            errs.append(f"--buckets must be comma-separated integers, got {cfg.buckets!r}")
        if b and not all(2 * cfg.block_size <= x <= cfg.max_length for x in b):
            errs.append(f"--buckets must lie in [2*block_size, max_length] = [{2 * cfg.block_size}, "
                        f"{cfg.max_length}], got {cfg.buckets}")
    try:
        dm.parse_flex_options(cfg.flex_options)
    except ValueError as e:
        errs.append(f"--flex-options: {e}")
    if cfg.warmup_workers < -1:
        errs.append(f"--warmup-workers must be >= 0, or -1 (auto), got {cfg.warmup_workers}")
    if not 0 <= cfg.warmup_frac < 1:
        errs.append("warmup_frac must be in [0, 1)")
    for f in cfg.data:
        if not os.path.exists(f) and os.sep in f:
            errs.append(f"data file not found: {f}")
    if cfg.debug_fail and cfg.debug_fail.split(":")[0] not in ("target", "drafter", "kill", "ckpt", "ckpt_lag", "disk"):
        errs.append(f"--debug-fail must be target:N, drafter:N, kill:N, ckpt:N, ckpt_lag:N or disk:N, got {cfg.debug_fail}")
    elif debug_at(cfg, "ckpt_lag") is not None and not 0 < debug_at(cfg, "ckpt_lag") <= cfg.ckpt_interval:
        errs.append("--debug-fail ckpt_lag:N needs 0 < N <= --ckpt-interval (the next save waits for the write)")
    if errs:
        raise SystemExit("error: " + "; ".join(errs))


def default_gamma(block_size):
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size * 7 / 16))


# -----------------------------------------------------------------------------
# Devices, shapes, target


PINNED = []    # the CUDA_VISIBLE_DEVICES pin_local_gpu() set in this process, if it did


def local_gpu():
    """This process's GPU index under torchrun: LOCAL_RANK, or 0 once pin_local_gpu() put it first."""
    return 0 if PINNED else int(os.environ.get("LOCAL_RANK", "0"))


def pin_local_gpu(cfg, environ=os.environ):
    """Under torchrun with cuda:local devices, list this rank's GPU first in CUDA_VISIBLE_DEVICES, so
    that it is cuda:0 in every rank. Why: torch 2.11's compiled-graph cache keys hold the device index,
    so ranks on cuda:0, cuda:1, ... each compile every shape from scratch; on cuda:0 they all share one
    set of graphs in the compile cache - the ranks split the cold compiles and load each other's
    (warmup.Claims). The other GPUs stay visible, in their order: NCCL's peer-to-peer paths
    between the ranks' processes need them. Must run before anything starts CUDA (CUDA reads the
    variable once). Returns the new value, or None where nothing was changed."""
    if "LOCAL_RANK" not in environ or PINNED or (cfg.target_devices, cfg.drafter_devices) != ("cuda:local",) * 2:
        return None          # (explicit indices in a list keep meaning the node's GPUs as numbered)
    if torch.cuda.is_initialized():
        raise RuntimeError("pin_local_gpu() must run before CUDA starts (CUDA_VISIBLE_DEVICES is read once)")
    local = int(environ["LOCAL_RANK"])
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    ids = ([s.strip() for s in visible.split(",") if s.strip()] if visible is not None
           else [str(i) for i in range(int(environ.get("LOCAL_WORLD_SIZE", local + 1)))])
    if local >= len(ids):
        raise SystemExit(f"error: LOCAL_RANK {local} but CUDA_VISIBLE_DEVICES={visible!r} lists {len(ids)} GPU(s): "
                         "cuda:local needs one GPU per process of the node")
    import diagnose
    environ[diagnose.UNPINNED_VAR] = "(unset)" if visible is None else visible   # what env reports compare
    environ["CUDA_VISIBLE_DEVICES"] = ",".join([ids[local]] + ids[:local] + ids[local + 1:])
    PINNED.append(environ["CUDA_VISIBLE_DEVICES"])
    return PINNED[0]


def resolve_devices(cfg):
    def parse(s):
        # "cuda:local" = this process's GPU under torchrun (one process per GPU: --nproc-per-node 8)
        s = s.replace("local", str(local_gpu()))
        return [torch.device(d.strip()) for d in s.split(",") if d.strip()]
    n = torch.cuda.device_count()
    if cfg.target_devices == "auto" or cfg.drafter_devices == "auto":
        if n == 0:
            auto_t, auto_d = [torch.device("cpu")], [torch.device("cpu")]
        elif n == 1:
            auto_t, auto_d = [torch.device("cuda:0")], [torch.device("cuda:0")]
        else:   # the original 5 target + 3 drafter split, scaled to the node
            nd = max(1, round(n * 3 / 8))
            auto_t = [torch.device(f"cuda:{i}") for i in range(n - nd)]
            auto_d = [torch.device(f"cuda:{i}") for i in range(n - nd, n)]
    tdev = auto_t if cfg.target_devices == "auto" else parse(cfg.target_devices)
    ddev = auto_d if cfg.drafter_devices == "auto" else parse(cfg.drafter_devices)
    for d in tdev + ddev:
        if d.type == "cuda" and (d.index or 0) >= n:
            raise SystemExit(f"error: device {d} requested but only {n} CUDA device(s) visible")
    if not tdev or not ddev:
        raise SystemExit("error: need at least one target and one drafter device")
    return tdev, ddev


def resolve_attn(cfg, drafter_dev):
    if cfg.attn != "auto":
        if cfg.attn == "flex" and drafter_dev.type == "cpu":
            raise SystemExit("error: --attn flex cannot train on CPU (FlexAttention has no CPU backward); "
                             "use --attn sdpa")
        return cfg.attn
    return "flex" if drafter_dev.type == "cuda" else "sdpa"


def bucket_list(cfg):
    import data_dflash
    if cfg.buckets:
        b = sorted(int(x) for x in cfg.buckets.split(","))
        if b[-1] != cfg.max_length:
            b.append(cfg.max_length)
        return b
    return data_dflash.default_buckets(cfg.max_length)


def anchors_for(cfg, S, block_size):
    """Anchors per sequence of bucket S, rounded up so that anchors*block is a multiple of 128 (flex
    tiles). --anchor-density sequence (the spec's recipe): num_anchors per sequence, capped by the
    S - block + 1 positions a block can start at (a short sample still gets a block at nearly every
    supervised position); length: num_anchors per max_length tokens, a shorter bucket proportionally
    fewer (more samples per step, less signal from each)."""
    m = 128 // math.gcd(block_size, 128)
    if cfg.anchor_density == "length":
        a = math.ceil(cfg.num_anchors * S / cfg.max_length)
    else:
        a = min(cfg.num_anchors, S - block_size + 1)
    return max(m, math.ceil(a / m) * m)


def batch_size_for(cfg, S, block_size):
    """Rows per batch of bucket S: tokens_per_batch // S; with the sequence density also no more blocks
    than a batch of max_length sequences holds, so every step costs the drafter about the same."""
    tokens = cfg.tokens_per_batch or cfg.max_length
    rows = max(1, tokens // S)
    if cfg.anchor_density == "sequence":
        blocks = max(1, tokens // cfg.max_length) * anchors_for(cfg, cfg.max_length, block_size)
        rows = max(1, min(rows, blocks // anchors_for(cfg, S, block_size)))
    return rows


def shape_plan(cfg, block_size):
    """Every (B, S, A) the drafter can see: one per bucket. This is what warm-up compiles."""
    return [(batch_size_for(cfg, S, block_size), S, anchors_for(cfg, S, block_size)) for S in bucket_list(cfg)]


def load_target_config(path):
    """(config, tokenizer). "random:<config.json>" = random weights from a config (benchmarks), no tokenizer."""
    from transformers import AutoConfig, AutoTokenizer
    if path.startswith("random:"):
        with open(path[len("random:"):]) as f:
            d = json.load(f)
        return AutoConfig.for_model(d.pop("model_type"), **d), None
    return AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)


HELDOUT = 200   # embedded default: the last 200 ShareGPT records are never trained on (eval prompts)


def embedded_default(cache_dir):
    """(target folder, train JSONL, held-out JSONL) of the embedded default, prepared once."""
    import data_dflash
    target, data = data_dflash.prepare_embedded_default(cache_dir)
    train, held = data.replace(".jsonl", ".train.jsonl"), data.replace(".jsonl", ".heldout.jsonl")
    if not (os.path.exists(train) and os.path.exists(held)):
        with open(data) as f:
            lines = f.readlines()
        for path, part in ((held, lines[-HELDOUT:]), (train, lines[:-HELDOUT])):
            tmp = f"{path}.tmp{os.getpid()}"       # its own: torchrun ranks may split at the same time
            with open(tmp, "w") as f:
                f.writelines(part)
            os.replace(tmp, path)
    return target, train, held


def target_path(cfg):
    return cfg.target or embedded_default(cfg.cache_dir)[0]


def mask_token_for(cfg, tok, vocab):
    """--mask-token-id, else the tokenizer's best spare token; a random:<config> target (no tokenizer):
    the last row."""
    if cfg.mask_token_id >= 0:
        return cfg.mask_token_id
    return vocab - 1 if tok is None else dm.choose_mask_token_id(tok, vocab)


def new_drafter(dcfg, emb, head, dev, tdtype, seed):
    """One drafter replica on `dev` reading the target's embedding and LM head (copied there in the
    target's dtype; a tensor already there is kept, so a tied pair stays one storage). warmup.py builds
    its drafters with this too: compiled graphs key on these tensors' dtype, layout and aliasing."""
    torch.manual_seed(seed)
    dr = dm.DFlashDrafter(dcfg)
    dr.embed_weight, dr.lm_head_weight = emb, head
    dr = dr.to(dev)
    dr.embed_weight = emb.to(dev, tdtype)
    dr.lm_head_weight = head.to(dev, tdtype)
    return dr


def make_drafter_config(cfg, tcfg, mask_token_id):
    ids = [int(x) for x in cfg.target_layer_ids.split(",")] if cfg.target_layer_ids else None
    dcfg = dm.DFlashConfig.from_target_config(tcfg, cfg.num_draft_layers, cfg.block_size,
                                              mask_token_id, target_layer_ids=ids)
    if cfg.max_length > dcfg.max_position_embeddings:
        raise SystemExit(f"error: --max-length {cfg.max_length} exceeds the target's max_position_embeddings "
                         f"({dcfg.max_position_embeddings})")
    return dcfg


def synthetic_data(spec, length, vocab, seed):
    """Random samples for benchmarks: "synthetic:N" = N full-length samples, "synthetic:N:varied" =
    lengths uniform in [length/8, length] (so every bucket occurs). Loss on all but the first 10%."""
    parts = spec.split(":")
    n, varied = int(parts[1]), parts[2:] == ["varied"]
    rng = np.random.default_rng(seed)
    ids, masks = [], []
    for _ in range(n):
        L = int(rng.integers(max(2, length // 8), length + 1)) if varied else length
        m = np.ones(L, dtype=np.uint8)
        m[: L // 10] = 0
        ids.append(rng.integers(0, vocab, L, dtype=np.int32))
        masks.append(m)
    return {"input_ids": ids, "loss_mask": masks, "stats": {"synthetic": n}}


def load_target(path, device, dtype, layer_ids, log=print):
    """The target, frozen, cut after the deepest captured layer (+1, whose input we need)."""
    from transformers import AutoModelForCausalLM
    if path.startswith("random:"):    # random weights built directly on the device (benchmarks)
        tcfg, _ = load_target_config(path)
        tcfg.num_hidden_layers = min(tcfg.num_hidden_layers, max(layer_ids) + 2)
        # the same weights on every target device and in every run: a batch's features must not depend
        # on which target thread took it (a real target is the same checkpoint everywhere)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(tcfg, dtype=dtype)
        log(f"[target] random weights from {path[7:]} on {device}: {tcfg.num_hidden_layers} layers")
        return model.eval().requires_grad_(False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval().requires_grad_(False)
    base = model.model
    n_keep = min(len(base.layers), max(layer_ids) + 2)
    probe = torch.randint(0, model.config.vocab_size, (1, 16), device=device)
    with torch.no_grad():
        full = dm.target_features(base(probe, output_hidden_states=True).hidden_states, layer_ids)
        base.layers = base.layers[:n_keep]
        cut = dm.target_features(base(probe, output_hidden_states=True).hidden_states, layer_ids)
    # Guard against a transformers change in how hidden_states are indexed/normed.
    if not torch.allclose(full.float(), cut.float(), atol=1e-3, rtol=1e-3):
        raise RuntimeError("target features of the truncated model differ from the full model's: "
                           "transformers' hidden_states indexing changed; cannot train safely")
    log(f"[target] {path} on {device}: kept {n_keep}/{model.config.num_hidden_layers} layers, no LM head")
    return model


# -----------------------------------------------------------------------------
# Thread plumbing


class Stop(Exception):
    """Raised inside a thread when another thread failed: unwind quietly."""


class Run:
    """Shared state of one run: stop flag, failures, queues."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.stop = threading.Event()
        self.failures = []
        self.lock = threading.Lock()
        self.on_stop = []          # callables that wake threads blocked elsewhere (barriers)

    def fail(self, name, exc):
        with self.lock:
            self.failures.append((name, "".join(traceback.format_exception(exc))))
        self.stop.set()
        for wake in self.on_stop:
            wake()

    def check(self):
        if self.stop.is_set():
            raise Stop()

    def put(self, q, item):
        while True:
            self.check()
            try:
                return q.put(item, timeout=0.2)
            except queue.Full:
                pass

    def get(self, q):
        while True:
            self.check()
            try:
                return q.get(timeout=0.2)
            except queue.Empty:
                pass


class ReorderBuffer:
    """Features arrive from several target threads out of order; drafters consume batch j exactly.

    Bounded: only indices in [lo, lo + capacity) are accepted, lo = lowest index not yet taken, so a
    fast target thread cannot run away, and nothing deadlocks (earlier indices always fit).
    """

    def __init__(self, run, start, capacity):
        self.run, self.lo, self.cap = run, start, capacity
        self.items, self.taken = {}, set()
        self.cond = threading.Condition()

    def put(self, j, item):
        with self.cond:
            while j >= self.lo + self.cap:
                self.run.check()
                self.cond.wait(0.2)
            self.items[j] = item
            self.cond.notify_all()

    def take(self, j):
        with self.cond:
            while j not in self.items:
                self.run.check()
                self.cond.wait(0.2)
            item = self.items.pop(j)
            self.taken.add(j)
            while self.lo in self.taken:
                self.taken.discard(self.lo)
                self.lo += 1
            self.cond.notify_all()
            return item

    def __len__(self):
        return len(self.items)


def start_thread(run, name, fn, *args):
    def body():
        try:
            dm.GATE.configure_thread()     # dynamo config is per thread on torch >= 2.12
            fn(*args)
        except Stop:
            pass
        except BaseException as e:       # noqa: B902 - every failure must stop the run loudly
            run.fail(name, e)
    t = threading.Thread(target=body, name=name, daemon=True)
    t.start()
    return t


def debug_at(cfg, kind):
    """N of --debug-fail kind:N, or None for another kind or none."""
    if cfg.debug_fail.startswith(kind + ":"):
        return int(cfg.debug_fail.split(":")[1])
    return None


def debug_point(cfg, role, n):
    if debug_at(cfg, role) == n:
        raise RuntimeError(f"injected failure in {role} at {n} (--debug-fail {cfg.debug_fail})")


# -----------------------------------------------------------------------------
# Data stream: a flat, deterministic sequence of batches across epochs (so resume is exact)


class BatchStream:
    def __init__(self, cfg, data, rank, world):
        import data_dflash
        self.cfg, self.data = cfg, data
        n = len(data["input_ids"])
        self.indices = list(range(rank, n, world))          # this node's shard
        self.lengths = [len(data["input_ids"][i]) for i in self.indices]
        self.buckets = bucket_list(cfg)
        self.per_epoch = {}
        self._epoch_batches(0)
        self.nb = len(self.per_epoch[0])
        self.padding_waste = data_dflash.padding_waste(self.lengths, self.per_epoch[0])

    def _epoch_batches(self, epoch):
        import data_dflash
        if epoch not in self.per_epoch:
            rows = {S: batch_size_for(self.cfg, S, self.cfg.block_size) for S in self.buckets}   # = shape_plan's
            self.per_epoch = {epoch: data_dflash.make_batches(self.lengths, self.buckets, rows, self.cfg.seed, epoch)}
        return self.per_epoch[epoch]

    def batch(self, j):
        """Batch j of the flat stream: (bucket length, global sample ids)."""
        S, local = self._epoch_batches(j // self.nb)[j % self.nb]
        return S, [self.indices[i] for i in local]


def sample_anchors_for(cfg, sample_ids, lm, lengths, A, block_size):
    """Anchors drawn per SAMPLE (seed, sample id, epoch-free step index), so the same sample gets the
    same anchors however batches are split across replicas."""
    anchors, valid = [], []
    for r, sid in enumerate(sample_ids):
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + int(sid[0]) * 7919 + int(sid[1]))
        a, v = dm.sample_anchors(lm[r: r + 1], lengths[r: r + 1], A, block_size, generator=g)
        anchors.append(a)
        valid.append(v)
    return torch.cat(anchors), torch.cat(valid)


# -----------------------------------------------------------------------------
# The trainer


class Trainer:
    def __init__(self, cfg, log):
        self.cfg, self.log = cfg, log
        self.run = Run(cfg)
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))

    # --- setup ------------------------------------------------------------------------------
    def setup(self):
        cfg, log = self.cfg, self.log
        import data_dflash
        if self.world > 1:
            import torch.distributed as dist
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            bind = {}
            if backend == "nccl":   # before any collective: else every rank's NCCL runs on cuda:0 ("invalid usage")
                local = local_gpu()
                torch.cuda.set_device(local)
                bind["device_id"] = torch.device("cuda", local)   # the group's GPU, stated (barrier() warns otherwise)
            dist.init_process_group(backend, **bind)
            pinned = (f": this rank's GPU listed first (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}), "
                      "cuda:0 in every rank, so the ranks share compiled graphs" if PINNED else "")
            log(f"[dist] rank {self.rank}/{self.world} backend {backend}{pinned}")
        self.tdevs, self.ddevs = resolve_devices(cfg)
        self.attn = resolve_attn(cfg, self.ddevs[0])
        data_files = cfg.data
        if cfg.target:
            self.tpath = cfg.target
            if not data_files:
                raise SystemExit("error: --data is required with --target")
        else:                                   # prepared (or found in the cache) once
            self.tpath, train_file, self.heldout = embedded_default(cfg.cache_dir)
            data_files = data_files or [train_file]
        tcfg, self.tok = load_target_config(self.tpath)
        vocab = getattr(tcfg, "text_config", tcfg).vocab_size
        mask_id = mask_token_for(cfg, self.tok, vocab)
        if self.tok is None:     # random target from a config: synthetic data, ids picked by hand
            self.pad_id, mask_name = 0, "-"
        else:
            self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
            mask_name = self.tok.convert_ids_to_tokens(mask_id)
        self.dcfg = make_drafter_config(cfg, tcfg, mask_id)
        self.gamma = cfg.gamma or default_gamma(cfg.block_size)
        log(f"[model] drafter {self.dcfg}")
        log(f"[model] mask token {mask_id} ({mask_name!r}), gamma {self.gamma}, "
            f"attention {self.attn}" + (" (CPU: FlexAttention has no backward, dense-mask SDPA chosen explicitly)"
                                        if self.attn == "sdpa" and self.ddevs[0].type == "cpu" else ""))
        if data_files[0].startswith("synthetic:"):
            self.data = synthetic_data(data_files[0], cfg.max_length, vocab, cfg.seed)
        else:
            if self.tok is None:
                raise SystemExit("error: a random:<config> target has no tokenizer; use --data synthetic:N")
            self.data = data_dflash.build_dataset(self.tok, data_files, cfg.max_length, cfg.block_size,
                                                  cfg.cache_dir, min_supervised=cfg.min_supervised, log=log,
                                                  max_conversations=cfg.max_samples)
        if not self.data["input_ids"]:
            raise SystemExit("error: no usable training samples (see the skip counts above)")
        self.stream = BatchStream(cfg, self.data, self.rank, self.world)
        self.per_step = len(self.ddevs) * cfg.grad_accum             # batches per optimiser step (this node)
        steps_per_epoch = max(1, self.stream.nb // self.per_step)
        self.total_steps = cfg.max_steps or max(1, int(cfg.epochs * steps_per_epoch))
        # shards differ in size: all ranks must agree (same lr schedule, no hang at the end)
        self.total_steps = min(self.gather_ints(self.total_steps))
        # every rank's batches per epoch go into the checkpoint: a rank's data position on resume is
        # read against its own shard's count, not rank 0's
        self.nb_by_rank = self.gather_ints(self.stream.nb)
        self.shapes = shape_plan(cfg, cfg.block_size)
        self.shape_set = set(self.shapes)
        if self.attn == "flex" and any(S % 128 for _, S, _ in self.shapes):
            raise SystemExit(f"error: flex attention needs bucket lengths that are multiples of 128, got "
                             f"{[S for _, S, _ in self.shapes]} (set --buckets / --max-length)")
        log(f"[data] {len(self.stream.indices)} samples on this node, {self.stream.nb} batches/epoch, "
            f"buckets {self.stream.buckets}, shapes (B,S,A) {self.shapes}, "
            f"padding waste {100 * self.stream.padding_waste:.1f}%, {steps_per_epoch} steps/epoch, "
            f"{self.total_steps} steps planned")

    def gather_ints(self, value):
        """[value of rank 0, value of rank 1, ...] (a collective: every rank calls it at the same point)."""
        if self.world == 1:
            return [int(value)]
        import torch.distributed as dist
        t = torch.zeros(self.world, dtype=torch.int64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
        t[self.rank] = int(value)
        dist.all_reduce(t)
        return t.tolist()

    def build_models(self):
        cfg, log = self.cfg, self.log
        tdtype = param_dtype(self.tdevs[0])
        self.targets = [load_target(self.tpath, d, tdtype, self.dcfg.target_layer_ids, log) for d in self.tdevs]
        t0 = self.targets[0]
        emb = t0.get_input_embeddings().weight.detach()
        head = t0.get_output_embeddings().weight.detach()
        self.drafters, self.opts, self.scheds, self.flat_grads, self.grads = [], [], [], [], []
        # Where gradients are summed (several replicas or ranks, or micro-batches), an fp32 buffer
        # per replica holds them, so one collective per step sums them and micro-batches add in fp32.
        summed = len(self.ddevs) > 1 or self.world > 1 or cfg.grad_accum > 1
        for d in self.ddevs:
            dr = new_drafter(self.dcfg, emb, head, d, tdtype, cfg.seed)   # identical initial replicas
            params = list(dr.parameters())
            # The optimiser keeps the fp32 masters and moments; the model's weights become bf16 on a GPU
            # (what the matmuls read: no casts in the step) and its update writes both in one pass.
            opt = MasterAdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                              param_dtype=param_dtype(d))
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(self.progress(s), cfg.warmup_frac))
            flat, grads = None, None
            if summed:
                flat = torch.zeros(sum(p.numel() for p in params), device=d, dtype=torch.float32)
                grads = list(torch.split(flat, [p.numel() for p in params]))
                grads = [g.view_as(p) for g, p in zip(grads, params)]
                for p, g in zip(params, grads):
                    p.register_post_accumulate_grad_hook(add_into(g))
            # Otherwise (a lone replica, one micro-batch) each backward hands its fresh gradient
            # tensors over and the step sets them to None: no zeroing or accumulating pass.
            self.drafters.append(dr); self.opts.append(opt); self.scheds.append(sched)
            self.flat_grads.append(flat); self.grads.append(grads)
        log(f"[model] {len(self.drafters)} drafter replica(s) x {dm.DFlashDrafter.num_trainable(self.drafters[0]) / 1e6:.1f}M "
            f"trainable params on {[str(d) for d in self.ddevs]} ({str(param_dtype(self.ddevs[0])).removeprefix('torch.')} "
            f"weights, fp32 masters in the optimiser); target on {[str(d) for d in self.tdevs]}; grads: "
            + ("one flat fp32 buffer per replica (summed across replicas/ranks/micro-batches)" if self.flat_grads[0] is not None
               else "handed over by each backward (lone replica)"))

    def progress(self, s):
        """Fraction of the run reached at (the middle of) step s, 0-based: never 0 or 1, so no step
        runs at lr 0. With a time budget (--max-minutes) the elapsed fraction of the budget counts too
        (agreed by all ranks in reduce_and_step), so a time-limited run still warms up and decays."""
        return min(1.0, max((s + 0.5) / self.total_steps, getattr(self, "time_frac", 0.0)))

    def resume(self):
        """Newest complete checkpoint -> weights, optimiser, schedule, step, data position, the time
        used of a --max-minutes budget."""
        self.step, self.cursor, self.seconds_before = 0, 0, 0.0
        if not self.cfg.resume:
            return
        ckpts = list_checkpoints(self.cfg.out_dir)
        if not ckpts:
            self.log(f"[resume] no checkpoint in {self.cfg.out_dir}: starting fresh")
            return
        path = ckpts[-1]
        state = torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=False)
        # the optimiser's settings come back from the checkpoint: a different --lr / --weight-decay
        # would be silently ignored, so it is an error
        old_cfg = state.get("config", {})
        changed = [f"--{k.replace('_', '-')} {getattr(self.cfg, k)} (checkpoint: {old_cfg[k]})"
                   for k in ("lr", "weight_decay") if k in old_cfg and old_cfg[k] != getattr(self.cfg, k)]
        if changed:
            raise SystemExit(f"error: {path} continues with its own optimiser settings, but {', '.join(changed)}: "
                             "drop the option(s) or start a new run")
        # the fp32 master weights, not the bf16 serving copy: resuming from that would silently
        # round every weight
        master = state.get("master_weights")
        if master is None:
            raise RuntimeError(f"{path}/state.pt has no master_weights: not a checkpoint of this trainer")
        opt_state = state["optimizer"]
        if "format" not in opt_state and "state" in opt_state:
            self.log(f"[resume] NOTICE: {path} holds torch AdamW state (this trainer before MasterAdamW): "
                     "its fp32 weights become the masters, its moments and steps carry over")
            names = [n for n, _ in self.drafters[0].named_parameters()]
            opt_state = from_torch_adamw_state(opt_state, [master[n] for n in names])
        for dr, opt, sched in zip(self.drafters, self.opts, self.scheds):
            dr.load_state_dict(master, strict=True)      # buffers; the weights come from the masters:
            try:
                opt.load_state_dict(opt_state)            # fp32 masters and moments, weights written from them
            except ValueError as e:
                raise RuntimeError(f"{path}/state.pt: cannot resume its optimiser state: {e}") from None
            sched.load_state_dict(state["scheduler"])
        # The masters and moments now in memory must be, bit for bit, those that were saved: this catches
        # a damaged state.pt that still loads and any resume path that rounds or skips a tensor.
        saved = state.get("resume_fingerprint")
        if saved is None:
            self.log(f"[resume] NOTICE: {path} has no resume fingerprint (an older trainer): "
                     "the loaded optimiser state is not checked against it")
        elif (now := self.resume_fingerprint()) != saved:
            raise RuntimeError(f"{path}: the fp32 masters and moments loaded from it do not match the "
                               f"fingerprint saved with them ({now} != {saved}): "
                               "the checkpoint is damaged or was edited; resume from an earlier one")
        self.step = state["step"]
        self.seconds_before = float(state.get("train_seconds", 0.0))
        by_rank = state.get("batches_per_epoch_by_rank")
        nb_old = by_rank[self.rank] if by_rank and len(by_rank) == self.world else state["batches_per_epoch"]
        cur = state["cursor"]
        if nb_old != self.stream.nb:
            self.log(f"[resume] NOTICE: the data set changed ({nb_old} -> {self.stream.nb} batches/epoch); "
                     "continuing at the same epoch and position within it")
            cur = (cur // nb_old) * self.stream.nb + min(cur % nb_old, self.stream.nb - 1)
        self.cursor = cur
        self.log(f"[resume] {path}: step {self.step}, batch cursor {self.cursor}"
                 + (", fp32 masters + moments match the saved fingerprint" if saved else ""))

    # --- threads -----------------------------------------------------------------------------
    def loader(self, load_q):
        import data_dflash
        j = self.cursor
        while True:
            self.run.check()
            S, sids = self.stream.batch(j)
            ids, am, lm = data_dflash.collate(sids, self.data, S, self.pad_id)
            lengths = am.sum(1)
            epoch = j // self.stream.nb
            self.run.put(load_q, (j, S, [(i, epoch) for i in sids], ids, lm, lengths))
            j += 1

    def target_worker(self, ti, load_q, buf):
        dev, model = self.tdevs[ti], self.targets[ti]
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        n = 0
        while True:
            j, S, sids, ids, lm, lengths = self.run.get(load_q)
            n += 1
            debug_point(self.cfg, "target", n)
            t0 = time.time()
            with torch.no_grad():
                x = ids.to(dev, non_blocking=True)
                am = (torch.arange(S)[None] < lengths[:, None]).to(dev)
                hs = model.model(input_ids=x, attention_mask=am, output_hidden_states=True, use_cache=False).hidden_states
                feats = dm.target_features(hs, self.dcfg.target_layer_ids)
            del hs
            sync_device(dev)            # busy = device time, not launch time (shared GPU: includes overlap)
            self.t_busy[ti] += time.time() - t0
            buf.put(j, (S, sids, ids, lm, lengths, feats))

    def drafter_worker(self, r, buf, sync):
        cfg, dev, dr = self.cfg, self.ddevs[r], self.drafters[r]
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        R, G = len(self.ddevs), cfg.grad_accum
        step = self.step
        while step < self.total_steps:
            debug_point(cfg, "drafter", step + 1)
            base = self.cursor + (step - self.step) * self.per_step
            items = [buf.take(base + g * R + r) for g in range(G)]
            t0 = time.time()
            prepared, wsum, flops = [], 0.0, 0.0
            for S, sids, ids, lm, lengths, feats in items:
                A = anchors_for(cfg, S, cfg.block_size)
                anchors, valid = sample_anchors_for(cfg, sids, lm, lengths, A, cfg.block_size)
                _, _, _, w = dm.make_blocks(ids, lm, anchors, valid, cfg.block_size, self.dcfg.mask_token_id, self.gamma)
                wsum += float(w[:, :, 1:].sum())
                flops += batch_flops(self.dcfg, S, anchors, valid)
                prepared.append((S, ids, lm, feats, anchors, valid))
            wsum = sync.all_sum_scalar(r, wsum)                  # global normaliser over replicas x micro-batches
            loss_sum, hits, counts = 0.0, 0, 0
            for S, ids, lm, feats, anchors, valid in prepared:
                x, m = dm.to_device(ids, dev), dm.to_device(lm, dev)
                f = feats.to(dev, non_blocking=True)
                shape = (x.shape[0], S, anchors.shape[1])
                if shape not in self.shape_set:     # on every path, not only the gate's: CPU tests see it too
                    raise RuntimeError(f"batch shape {shape} is not in the warmed shape plan {self.shapes}")
                with warmup.autocast(dev):
                    loss, acc, cnt = dm.drafter_forward_loss(dr, f, x, m, anchors, valid, self.gamma, attn=self.attn,
                                                             chunk_rows=cfg.chunk_rows, weight_sum=wsum,
                                                             compile_scope=cfg.compile_scope)
                dm.backward(loss, dev, shape, self.attn)
                loss_sum += loss.detach()
                hits = hits + acc * cnt
                counts = counts + cnt
            sync_device(dev)            # the step waits for the grads anyway; this makes busy = device time
            self.d_busy[r] += time.time() - t0
            t1 = time.time()
            n_tok = float(sum(int(it[4].sum()) for it in items))          # real (unpadded) target tokens
            stats = torch.cat([loss_sum.float().view(1), hits.float(), counts.float(),
                               torch.tensor([n_tok, flops], device=hits.device)]).to(dev)
            gnorm, stats = sync.step(r, self, stats)
            self.d_sync[r] += time.time() - t1
            step += 1
            if r == 0:
                self.after_step(step, stats, gnorm)
            sync.barrier(r)            # checkpoint / stop decision seen by all replicas
            if self.finish_at is not None and step >= self.finish_at:
                break

    # --- the step, after every replica's backward ---------------------------------------------
    def reduce_and_step(self, stats_list):
        """Runs in the leader thread while the others wait: sum grads, clip, step every replica."""
        flats = self.flat_grads
        t0 = time.time()
        if len(flats) > 1:                    # (several replicas: every one has its flat buffer)
            if all(f.device.type == "cuda" for f in flats) and len({f.device for f in flats}) == len(flats):
                torch.cuda.nccl.all_reduce(flats)                         # in-process NCCL across GPUs
            else:
                total = flats[0].clone()
                for f in flats[1:]:
                    total += f.to(total.device)
                for f in flats:
                    f.copy_(total)
        stats = sum(s.to(stats_list[0].device) for s in stats_list)
        if self.world > 1:
            import torch.distributed as dist
            dist.all_reduce(flats[0])
            dist.all_reduce(stats)
            for f in flats[1:]:
                f.copy_(flats[0])
        self.t_sync_last = time.time() - t0
        if self.cfg.max_minutes:
            # The budget clock must be the same on every rank (same lr, same stopping step).
            frac = torch.tensor([self.train_seconds() / (60 * self.cfg.max_minutes)], dtype=torch.float64)
            if self.world > 1:
                import torch.distributed as dist
                frac = frac.to(flats[0].device) if dist.get_backend() == "nccl" else frac
                dist.all_reduce(frac, op=dist.ReduceOp.MAX)
            self.time_frac = float(frac)
        self.lr_used = self.opts[0].param_groups[0]["lr"]
        # The host reads the stats now (they are ready with the grads), not after the optimiser: so the
        # step's log costs no wait for it, and this thread prepares the next step's inputs while the
        # device runs the AdamW pass (~9 ms at Qwen3-8B size on an H200).
        stats = stats.to("cpu")
        gnorms = []
        for dr, opt, sched, flat, grads in zip(self.drafters, self.opts, self.scheds, flats, self.grads):
            try:
                gnorms.append(clip_and_step(opt, grads if grads is not None else [p.grad for p in dr.parameters()],
                                            self.cfg.clip))
            except FloatingPointError as e:   # before any replica stepped: the weights are the last step's
                raise FloatingPointError(f"step {self.last_step() + 1}: {e} (loss {float(stats[0]):.4g}); stopped "
                                         "without stepping, the checkpoints are intact. Usual causes: too high "
                                         "--lr, or a bad batch / target feature") from None
            sched.step()
            if flat is None:
                opt.zero_grad(set_to_none=True)
            else:
                flat.zero_()
        return gnorms[0], stats

    def after_step(self, step, stats, gnorm):
        cfg = self.cfg
        bs = cfg.block_size
        now = time.time()
        self.tokens_done += float(stats[2 * bs - 1])     # summed over replicas and ranks
        self.flops_done += float(stats[2 * bs])
        loss = float(stats[0])
        hits, counts = stats[1: bs], stats[bs: 2 * bs - 1]
        acc = (hits / counts.clamp(min=1)).tolist()
        tau = dm.simulated_tau(acc)
        rec = {"step": step, "loss": loss, "acc": [round(a, 4) for a in acc], "sim_tau": round(tau, 4),
               "lr": self.lr_used, "grad_norm": gnorm, "time": now}
        if self.first_loss is None:
            self.first_loss = loss
        self.losses.append(loss)
        self.last = rec
        self.busy_at_last = (list(self.t_busy), list(self.d_busy))   # the summary's window ends here
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()
        if len(self.drafters) > 1 or self.world > 1:
            # the previous interval's fingerprints (ready by now: this step's stats came after them on
            # every stream), then this interval's, queued without a wait
            self.check_fingerprints()
            if step % cfg.log_interval == 0:
                self.queue_fingerprints(step)
        if step % cfg.log_interval == 0 or step == self.total_steps:
            # a checkpoint's pause is reported apart: the rates say how fast training runs (and a save
            # does not set off the throughput-drop warning below)
            pause, self.ckpt_pause = self.ckpt_pause, None
            dt = now - self.t_log - (pause or 0.0)
            tok_s = (self.tokens_done - self.tokens_log) / max(dt, 1e-9)
            mfu = (self.flops_done - self.flops_log) / max(dt, 1e-9) / (self.peak_flops * len(set(self.ddevs)) * self.world)
            self.t_log, self.tokens_log, self.flops_log = now, self.tokens_done, self.flops_done
            self.tok_hist.append(tok_s)
            mem = (f"{torch.cuda.max_memory_allocated(self.ddevs[0]) / 2**30:.1f}GiB"
                   if self.ddevs[0].type == "cuda" else "-")
            eta = (self.total_steps - step) * (now - self.t_start) / max(1, step - self.step)
            if cfg.max_minutes:
                eta = min(eta, 60 * cfg.max_minutes - self.train_seconds())
            line = (f"step {step}/{self.total_steps} | loss {loss:.4f} | acc@1 {acc[0]:.3f} acc@{bs - 1} {acc[-1]:.3f} "
                    f"| sim_tau {tau:.2f} | lr {rec['lr']:.2e} | gnorm {gnorm:.2f} | {tok_s:,.0f} tok/s "
                    f"| MFU drafter {mfu:.1%} | queues load {self.load_q.qsize()} feat {len(self.buf)} "
                    f"| sync {1000 * self.t_sync_last:.0f}ms | mem {mem} | ETA {eta / 60:.1f}min"
                    + (f" | checkpoint pause {pause:.2f}s (not in the rates)" if pause is not None else ""))
            self.log(line)
            self.check_mfu(mfu)
            rec.update(tok_s=tok_s, mfu=mfu, load_q=self.load_q.qsize(), feat_q=len(self.buf))
            recent = self.tok_hist[-20:-1]
            if len(recent) >= 5 and tok_s < 0.5 * statistics.median(recent):
                last = list_checkpoints(cfg.out_dir)
                self.log(f"WARNING: throughput {tok_s:,.0f} tok/s is far below this run's recent median "
                         f"{statistics.median(recent):,.0f}. If the environment changed, run: python diagnose.py"
                         + (f" --against {last[-1]}" if last else ""))
        if self.rank == 0 and (step % cfg.ckpt_interval == 0 or step == self.total_steps or
                               (self.finish_at is not None and step >= self.finish_at)):
            self.save_checkpoint(step)
        # rank 0 only: it writes the checkpoints, and its death ends the others (torchrun stops them);
        # every rank killing itself at once could stop rank 0 inside its save
        if debug_at(cfg, "kill") == step and self.rank == 0:
            self.wait_for_checkpoint()          # killed once its checkpoint is on disk
            self.log(f"[debug] SIGKILL after step {step}")
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if cfg.max_minutes and self.finish_at is None and self.time_frac >= 1.0:
            self.finish_at = step
            self.log(f"[run] time budget of {cfg.max_minutes} min reached at step {step}")
            if self.rank == 0 and step % cfg.ckpt_interval:
                self.save_checkpoint(step)

    def checkpoint_env(self):
        """env.json: the environment this run STARTED in (its code and packages were loaded then: a
        commit or a pip install during the run is not what it ran), with the compile cache as it is
        now, and under changed_during_run what differs now (announced once, as a WARNING)."""
        import diagnose
        now = diagnose.collect_env(self.compile_cache)
        start = getattr(self, "env_at_start", None)
        if start is None:
            return now
        changed = [r for r in diagnose.diff_env(start, now) if not r[0].startswith("compile_cache.")]
        if changed and not getattr(self, "env_change_logged", False):
            self.env_change_logged = True
            self.log(f"WARNING: the environment changed while this run was going ({len(changed)} field(s): "
                     + "; ".join(f"{k} {a} -> {b}" for k, a, b in changed[:3])[:300] + "). Checkpoints keep "
                     "the environment the run started with, and these changes under changed_during_run")
        return {**start, "compile_cache": now["compile_cache"], "changed_during_run": [list(r) for r in changed]}

    def train_seconds(self):
        """Training time of the whole run, the runs it resumed included: what --max-minutes budgets."""
        return self.seconds_before + time.time() - self.t_start

    def check_mfu(self, mfu):
        """An MFU above 100% means the peak measured at the start was too low (the GPU was busy then, as
        on a GPU shared with another job): say so once, instead of printing impossible figures silently."""
        if mfu > 1.0 and not getattr(self, "mfu_warned", False):
            self.mfu_warned = True
            self.log(f"WARNING: MFU above 100%: the matmul peak measured at the start ({self.peak_flops / 1e12:.0f} "
                     f"TFLOP/s on {self.ddevs[0]}) was too low; was the GPU busy with another process then? "
                     "This run's MFU figures are not comparable")

    # --- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, step):
        """Snapshot this step's state into host memory, here in the step loop, and write it in a
        background thread while training goes on: the step loop pauses for the copy (seconds), not for
        the disk (a Qwen3-8B-sized drafter's checkpoint is ~15 GB: ~25 s when it was written in the loop). One
        write at a time: a save waits for the previous one (a slow disk slows training instead of
        piling snapshots up in RAM). A failed write stops the run like any thread's failure."""
        cfg = self.cfg
        if getattr(self, "saved_step", None) == step:    # (the budget's stop at a step that was just saved)
            return
        self.saved_step = step
        with self.writer_lock:
            busy = self.writer is not None and self.writer.is_alive()
        t_wait = time.time()
        waited_for = self.wait_for_checkpoint()   # (in the rates: this wait is not the pause below)
        t_wait = time.time() - t_wait
        if busy and not self.run.stop.is_set():     # a slow disk must not pass for a slow GPU
            self.log(f"[ckpt] step {step}: waited {t_wait:.1f}s for the write of checkpoint {waited_for} (one "
                     "write at a time, and writing takes longer than --ckpt-interval steps of training: the "
                     "wait is in this interval's rates; raise --ckpt-interval or write to a faster disk)")
        self.run.check()               # no new snapshot once the run is stopping (a failed write, say)
        t0 = time.time()
        dr, pool = self.drafters[0], self.host_pool.start()    # (the last write is done: its buffers are free)
        memo = {}       # one host copy per tensor: the masters under master_weights are the optimiser's
        state = {"step": step, "cursor": self.cursor + (step - self.step) * self.per_step,
                 "batches_per_epoch": self.stream.nb, "batches_per_epoch_by_rank": self.nb_by_rank,
                 "train_seconds": self.train_seconds(), "optimizer": to_host(self.opts[0].state_dict(), memo, pool),
                 "scheduler": self.scheds[0].state_dict(), "config": dataclasses.asdict(cfg),
                 "master_weights": to_host(master_state_dict(dr, self.opts[0]), memo, pool),
                 "replica_fingerprints": self.replica_fingerprints(),
                 "resume_fingerprint": self.resume_fingerprint()}
        serving = to_host(dr.state_dict(), {}, pool)
        pool.finish()                  # the asynchronous device -> host copies have landed
        with self.writer_lock:
            if self.writers_closed:    # the run stopped (a failure elsewhere) while this snapshot was taken:
                self.log(f"[ckpt] step {step}: not written, the run is stopping")    # nobody would wait for it
                return
            self.writer = start_thread(self.run, "checkpoint-writer", self.write_checkpoint, step, state, serving)
            self.writer.step = step
        self.ckpt_pause = (self.ckpt_pause or 0.0) + time.time() - t0

    def write_checkpoint(self, step, state, serving):
        cfg = self.cfg
        lag = debug_at(cfg, "ckpt_lag")
        if lag is not None:
            # DEBUG: start writing only once training is N steps further (or at its end), to show the
            # snapshot does not change under the writer
            def until():     # (a time budget may end the run before step + N: then at its last step)
                return min(step + lag, self.total_steps if self.finish_at is None else self.finish_at)
            while self.last_step() < until() and not self.run.stop.wait(0.05):
                pass
        t0 = time.time()
        final = os.path.join(cfg.out_dir, f"step_{step:06d}")
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        need = snapshot_bytes(state, serving)
        free = free_bytes(cfg, step)
        if free < need + DISK_SLACK:     # (torch.save's own error for a full disk is "unexpected pos ...")
            raise RuntimeError(f"checkpoint {step} needs ~{size_str(need)} and {cfg.out_dir}'s file system "
                               f"has {size_str(free)} free: not written. Free space, or resume with another "
                               "--out-dir (copy the last checkpoint there)")
        os.makedirs(tmp)
        try:
            dm.save_drafter(self.drafters[0], os.path.join(tmp, "drafter"), state=serving)
            debug_point(cfg, "ckpt", step)          # (a half-written checkpoint: its folder must go)
            torch.save(state, os.path.join(tmp, "state.pt"))
            with open(os.path.join(tmp, "env.json"), "w") as f:
                json.dump(self.checkpoint_env(), f, indent=1, default=str)
            with open(tmp + "/DONE", "w") as f:
                f.write(time.strftime("%Y-%m-%dT%H:%M:%S"))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)      # a partial checkpoint only takes the disk space
            try:
                free = size_str(free_bytes(cfg, step))
            except OSError as e:
                free = f"? ({e})"
            self.log(f"[ckpt] the write of checkpoint {step} failed (now {free} free on {cfg.out_dir}'s file "
                     f"system, ~{size_str(need)} needed); its partial folder was removed")
            raise
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)                          # atomic: a crash leaves the previous intact
        for old in list_checkpoints(cfg.out_dir)[: -cfg.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        self.log(f"[ckpt] {final} (written in {time.time() - t0:.1f}s, in the background)")

    def wait_for_checkpoint(self):
        """Block until the checkpoint being written (if any) is on disk; its step, or None if none was."""
        with self.writer_lock:     # (the step loop and, at the end, the main thread both wait)
            writer = self.writer
        if writer is None:
            return None
        writer.join()
        with self.writer_lock:
            if self.writer is writer:
                self.writer = None
        return writer.step

    def check_checkpoint_space(self, n_old):
        """At start-up: is there disk space for the checkpoints this run will hold at once? A write goes
        to a new folder before the oldest beyond --keep-last is deleted, so up to keep_last + 1 are on
        disk. n_old: the checkpoints already there (a resume), which occupy their space already.
        Returns the error for too little space, else None."""
        cfg, dr, opt = self.cfg, self.drafters[0], self.opts[0]
        each = snapshot_bytes({"optimizer": opt.state_dict(), "master_weights": master_state_dict(dr, opt)},
                              dr.state_dict())
        n_new = planned_checkpoints(self.step, self.total_steps, cfg.ckpt_interval)
        at_once = checkpoints_at_once(n_old, n_new, cfg.keep_last)
        need, free = (at_once - n_old) * each, free_bytes(cfg, self.step)
        self.log(f"[ckpt] ~{size_str(each)} per checkpoint; this run writes up to {n_new} and keeps "
                 f"{cfg.keep_last} (--keep-last), each written before the oldest is deleted: up to {at_once} on disk "
                 f"at once, {size_str(need)} more; {size_str(free)} free on {cfg.out_dir}'s file system")
        if free < need + DISK_SLACK:
            return (f"error: not enough disk space for this run's checkpoints: ~{size_str(need)} "
                    f"needed ({at_once} of ~{size_str(each)} at once, {n_old} there already), "
                    f"{size_str(free)} free on {cfg.out_dir}'s file system. Free space (old "
                    "checkpoints there count as used until a new one is written), lower --keep-last, "
                    "or choose another --out-dir")
        return None

    def resume_fingerprint(self):
        """digest() of what a resume restores byte for byte: replica 0's fp32 masters and both moments.
        (Its bf16 weights are derived from the masters: rounded by torch on load, by the optimiser's
        kernel after a step; both round to nearest even, but only the masters are the saved truth.)"""
        opt = self.opts[0]
        return digest(fingerprint([opt.state[p][k] for k in ("master", "exp_avg", "exp_avg_sq") for p in opt.params()]))

    def replica_fingerprints(self):
        """Each replica's digest() (weights + fp32 masters, exact), saved with a checkpoint: replicas that
        differ are an error naming the tensors."""
        fps = [fingerprint(self.replica_tensors(r)[1]).cpu() for r in range(len(self.drafters))]
        bad = self.differing(fps)
        if bad:
            raise RuntimeError(f"drafter replicas diverged by step {self.last_step()}: {len(bad)} tensor "
                               f"fingerprint(s) differ, first {bad[:5]}")
        return [digest(fp) for fp in fps]

    # --- main --------------------------------------------------------------------------------
    def train(self):
        cfg, log = self.cfg, self.log
        old = list_checkpoints(cfg.out_dir)
        if old and not cfg.resume:   # training on would interleave two runs' checkpoints (and prune the new ones)
            raise SystemExit(f"error: {cfg.out_dir} holds checkpoints of an earlier run (newest {old[-1]}): "
                             "pass --resume to continue it, or use another --out-dir")
        self.compile_cache = warmup.use_compile_cache(cfg.compile_cache or os.path.join(cfg.out_dir, "compile_cache"), log)
        dm.set_flex_options(cfg.flex_options)         # before anything compiles (checked by validate)
        # the effective options: "" in the config means the defaults of this version, which can change
        log(f"[flex] options {json.dumps(dm.FLEX_OPTIONS)}; LM head + CE in chunks of up to {cfg.chunk_rows} rows")
        t_setup = time.time()
        self.setup()
        t_models = time.time()
        self.build_models()
        self.resume()
        steps = self.gather_ints(self.step)
        if len(set(steps)) > 1:
            raise SystemExit(f"error: the ranks resumed at different steps {steps} (rank order): every rank "
                             "must see the same --out-dir (a file system all nodes share)")
        if self.step >= self.total_steps:
            log(f"[run] already at step {self.step} of {self.total_steps}: nothing to do")
            return 0
        if cfg.max_minutes and self.seconds_before >= 60 * cfg.max_minutes:
            log(f"[run] the {cfg.max_minutes} min budget (--max-minutes, resumes included) was used up by step "
                f"{self.step}: nothing to do (a larger --max-minutes continues)")
            return 0
        # before the warm-up: a full disk found hours later costs the hours. Rank 0 writes the
        # checkpoints and checks; every rank stops on its verdict (not only rank 0, the others hung)
        short = self.check_checkpoint_space(len(old)) if self.rank == 0 else None
        if self.gather_ints(short is not None)[0]:
            raise SystemExit(short or "error: not enough disk space for this run's checkpoints (rank 0's log says more)")
        dm.GATE.log = log
        t0 = time.time()
        if cfg.no_gate:
            # What the original run did: no gate, no serial warm-up, every thread compiles on its own.
            log("WARNING: --no-gate: compile gate BYPASSED and warm-up skipped (debug only: the FX race can strike)")
            dm.GATE.enabled = False
        else:
            rows = warmup.warm_up(self.drafters, self.shapes, self.gamma, self.attn, cfg.chunk_rows,
                                  cfg.on_unwarmed, log, compile_scope=cfg.compile_scope,
                                  workers=cfg.warmup_workers)
            log(warmup.format_table(rows).replace("\n", "\n[warmup] "))
            log(f"[warmup] done in {time.time() - t0:.1f}s")
            for flat in self.flat_grads:     # the warm-up's backward passes added into them (the hooks)
                if flat is not None:
                    flat.zero_()
        t_peak = time.time()
        self.peak_flops = measure_peak_flops(self.ddevs[0])
        log(f"[mfu] measured matmul peak on {self.ddevs[0]}: {self.peak_flops / 1e12:.1f} TFLOP/s")
        now = time.time()
        # where a start's time goes (a slow start is one of the things that "changed")
        log(f"[run] start-up {now - T_PROCESS:.1f}s: imports + environment report {t_setup - T_PROCESS:.1f}s, "
            f"setup + data {t_models - t_setup:.1f}s, models + resume {t0 - t_models:.1f}s, warm-up {t_peak - t0:.1f}s, "
            f"matmul peak {now - t_peak:.1f}s")
        os.makedirs(cfg.out_dir, exist_ok=True)
        metrics = os.path.join(cfg.out_dir, "metrics.jsonl")
        if self.rank == 0 and os.path.exists(metrics):    # a resume: the killed run's steps after the checkpoint go
            keep_metrics_upto(metrics, self.step)
        self.metrics = open(metrics if self.rank == 0 else os.devnull, "a")
        self.t_busy = [0.0] * len(self.tdevs)
        self.d_busy = [0.0] * len(self.ddevs)
        self.d_sync = [0.0] * len(self.ddevs)
        self.first_loss, self.last, self.finish_at, self.t_sync_last, self.time_frac = None, None, None, 0.0, 0.0
        self.tokens_done = self.tokens_log = 0
        self.flops_done = self.flops_log = 0.0      # the drafter steps' analytic FLOPs (the MFU's numerator)
        self.tok_hist, self.losses = [], []
        self.t_start = self.t_log = time.time()
        self.ckpt_pause = None       # step-loop time spent snapshotting checkpoints since the last log line
        self.writer, self.writer_lock = None, threading.Lock()     # the checkpoint being written
        self.writers_closed = False                                  # set once the main thread waits for the last
        self.host_pool = HostPool()                                  # its host buffers, reused
        self.load_q = queue.Queue(maxsize=cfg.queue_depth * len(self.tdevs))
        self.buf = ReorderBuffer(self.run, self.cursor, cfg.queue_depth * len(self.ddevs) * cfg.grad_accum + len(self.tdevs))
        sync = StepSync(self.run, len(self.ddevs), self.world)
        self.run.on_stop.append(sync.bar.abort)
        threads = [start_thread(self.run, "loader", self.loader, self.load_q)]
        threads += [start_thread(self.run, f"target-{i}:{d}", self.target_worker, i, self.load_q, self.buf)
                    for i, d in enumerate(self.tdevs)]
        drafters = [start_thread(self.run, f"drafter-{r}:{d}", self.drafter_worker, r, self.buf, sync)
                    for r, d in enumerate(self.ddevs)]
        log(f"[run] {len(threads) - 1} target + {len(drafters)} drafter threads started")
        while any(t.is_alive() for t in drafters) and not self.run.stop.is_set():
            for t in drafters:
                t.join(timeout=0.5)
        self.run.stop.set()                                   # stop loader and target threads
        with self.writer_lock:         # no writer starts after this (a step loop still inside a snapshot)
            self.writers_closed = True
        self.wait_for_checkpoint()     # a snapshot taken before a failure elsewhere is still a good checkpoint
        if self.run.failures:
            for name, tb in self.run.failures:
                log(f"\n[FATAL] thread {name} failed:\n{tb}")
            last = list_checkpoints(cfg.out_dir)
            log(f"[FATAL] run stopped. Last intact checkpoint: {last[-1] if last else 'none'}")
            return 1
        for t in threads:    # loader/target threads leave within one batch; one still inside torch at
            t.join(60)       # interpreter exit aborts the process ("terminate called...", rc 134)
        if len(self.drafters) > 1 or self.world > 1:
            self.check_replicas_identical()
        self.summary()
        if self.world > 1:
            # Tear the process group down explicitly, all ranks together: one left to the interpreter's
            # exit can abort the process ("terminate called without an active exception", seen in CI).
            import torch.distributed as dist
            dist.barrier()
            dist.destroy_process_group()
        return 0

    # --- replicas stay bit-identical: a fingerprint every log interval, bytes at the end ---------
    def replica_tensors(self, r):
        """(names, tensors) of replica r: its weights and, where its optimiser holds them, the fp32
        masters (bf16 weights can hide a master that differs below their rounding)."""
        names, tensors = map(list, zip(*self.drafters[r].named_parameters()))
        opts = getattr(self, "opts", None)
        if opts is not None:
            names += [n + " (master)" for n in names]
            tensors += opts[r].masters()
        return names, tensors

    def queue_fingerprints(self, step):
        """Queue every replica's fingerprint() after this step's update and copy it to the host without
        waiting; check_fingerprints() compares them at the next step. Across ranks, replica 0's is
        all-reduced to its min and max (equal on every rank iff all ranks agree)."""
        pending = []
        for r in range(len(self.drafters)):
            fp = fingerprint(self.replica_tensors(r)[1])
            rows = [fp]
            if r == 0 and self.world > 1:
                import torch.distributed as dist
                lo, hi = fp.clone(), fp.clone()
                dist.all_reduce(lo, op=dist.ReduceOp.MIN)
                dist.all_reduce(hi, op=dist.ReduceOp.MAX)
                rows += [lo, hi]
            fp = torch.stack(rows)
            host = torch.empty(fp.shape, dtype=fp.dtype, pin_memory=fp.is_cuda)
            host.copy_(fp, non_blocking=True)
            ev = None
            if fp.is_cuda:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(fp.device))
            pending.append((host, ev))
        self.pending_fp = (step, pending)

    def check_fingerprints(self):
        """Raise (stopping the run) if the replicas' last queued fingerprints differ, naming the tensors."""
        if getattr(self, "pending_fp", None) is None:
            return
        step, pending = self.pending_fp
        self.pending_fp = None
        for _, ev in pending:
            if ev is not None:
                ev.synchronize()
        fps = [host for host, _ in pending]
        bad = self.differing([fp[0] for fp in fps])
        if self.world > 1:      # replica 0's min and max over the ranks
            bad += self.differing([fps[0][1], fps[0][2]], who="another rank")
        if bad:
            raise RuntimeError(f"drafter replicas diverged by step {step}: {len(bad)} tensor fingerprint(s) differ, "
                               f"first {bad[:5]} (checked every log interval; a bug, not noise: replicas must "
                               "stay bit-identical)")

    def differing(self, fps, who=None):
        """'replica r: tensor name' (or '<who>: ...') for each tensor whose fingerprint in fps[r]
        differs from fps[0]'s."""
        names = self.replica_tensors(0)[0]
        return [f"{who or f'replica {r}'}: {names[i]}" for r in range(1, len(fps))
                for i in (fps[r] != fps[0]).nonzero()[:, 0]]

    def check_replicas_identical(self):
        """Every replica, in this process and on every rank, must end bit-identical to replica 0 of
        rank 0: each parameter's bytes are compared (a checksum could hide offsetting differences)."""
        tensors = [list(zip(*self.replica_tensors(r))) for r in range(len(self.drafters))]
        ref = tensors[0]
        ref_tensors = [p for _, p in ref]
        n_params = sum(p.numel() for _, p in self.drafters[0].named_parameters())
        bad = []
        for r, mine in enumerate(tensors[1:], 1):
            for (name, p0), (_, p) in zip(ref, mine):
                if not torch.equal(as_bytes(p0), as_bytes(p.to(p0.device))):
                    bad.append(f"replica {r}: {name}")
        if self.world > 1:
            import torch.distributed as dist
            for name, p0 in ref:
                theirs = p0.detach().clone()
                dist.broadcast(theirs, 0)                     # rank 0's bytes, to every rank
                if not torch.equal(as_bytes(theirs), as_bytes(p0)):
                    bad.append(f"rank {self.rank}: {name}")
            n_bad = torch.tensor([len(bad)], device=ref[0][1].device)
            dist.all_reduce(n_bad)
            if int(n_bad) and not bad:
                bad.append(f"(another rank: {int(n_bad)} tensors)")
        if bad:
            raise RuntimeError(f"drafter replicas diverged after step {self.last_step()}: {len(bad)} parameter "
                               f"tensor(s) differ, first {bad[:5]}")
        self.log(f"[replicas] {len(self.drafters)} replica(s) x {self.world} rank(s) bit-identical after step "
                 f"{self.last_step()} ({n_params:,} parameters each, compared byte for byte; fingerprint "
                 f"{digest(fingerprint(ref_tensors))})")      # the others are byte-equal to it

    def last_step(self):
        return self.last["step"] if self.last else self.step

    def summary(self):
        cfg = self.cfg
        # the training window: from the threads' start to the last step (not the final checkpoint,
        # which for a 1B drafter writes ~13 GB and would dilute every rate below)
        elapsed = (self.last["time"] if self.last else time.time()) - self.t_start
        last = list_checkpoints(cfg.out_dir)
        eval_cmd = (f"python eval_dflash.py --target {self.tpath} --drafter {last[-1]}/drafter "
                    f"--prompts {cfg.data[0] if cfg.data else self.heldout} "
                    f"--num-prompts 100") if last else "(no checkpoint)"
        t_busy, d_busy = self.busy_at_last if self.last else (self.t_busy, self.d_busy)
        busy_t = [f"{b / elapsed:.0%}" for b in t_busy]
        n_avg = max(1, min(20, len(self.losses) // 5))
        busy_d = [f"{b / elapsed:.0%}" for b in d_busy]
        self.log("\n".join([
            "=" * 72, "summary",
            f"  steps          {self.last['step'] if self.last else self.step} (this run: from {self.step})",
            f"  tokens/s       {self.tokens_done / max(elapsed, 1e-9):,.0f} (target tokens, {elapsed / 60:.1f} min)",
            (f"  loss           {self.first_loss:.4f} -> {self.last['loss']:.4f} (mean of the first / last "
             f"{n_avg} steps: {statistics.mean(self.losses[:n_avg]):.4f} -> {statistics.mean(self.losses[-n_avg:]):.4f})")
            if self.last else "  loss -",
            f"  simulated tau  {self.last['sim_tau']:.2f}" if self.last else "",
            f"  busy           target {busy_t} drafter {busy_d} (share of the training time on device work); "
            f"drafter wait at the step barrier + sync {[f'{x / elapsed:.0%}' for x in self.d_sync]}",
            f"  checkpoint     {last[-1] if last else 'none'}",
            f"  measure real acceptance:\n    {eval_cmd}", "=" * 72]))


class StepSync:
    """Where drafter replicas meet: a scalar sum (weight normaliser) and the optimiser step."""

    def __init__(self, run, n, world):
        self.run, self.n, self.world = run, n, world
        self.bar = threading.Barrier(n)
        self.slots = [None] * n
        self.result = None

    def barrier(self, r):
        self._wait()

    def _wait(self):
        # A failure anywhere aborts the barrier (Run.fail), which wakes every waiter.
        self.run.check()
        try:
            self.bar.wait()
        except threading.BrokenBarrierError:
            raise Stop()
        self.run.check()

    def all_sum_scalar(self, r, x):
        self.slots[r] = x
        self._wait()
        if r == 0:
            total = float(sum(self.slots))
            if self.world > 1:
                import torch.distributed as dist
                t = torch.tensor([total], dtype=torch.float64)
                if dist.get_backend() == "nccl":
                    t = t.cuda()
                dist.all_reduce(t)
                total = float(t)
            self.result = total
        self._wait()
        return self.result

    def step(self, r, trainer, stats):
        self.slots[r] = stats
        self._wait()
        if r == 0:
            self.result = trainer.reduce_and_step(list(self.slots))
        self._wait()
        return self.result


def lr_factor(progress, warmup_frac):
    """Linear warm-up over the first warmup_frac of the run, then cosine decay to 0."""
    if progress < warmup_frac:
        return progress / warmup_frac
    return 0.5 * (1 + math.cos(math.pi * (progress - warmup_frac) / (1 - warmup_frac)))


def drafter_step_flops(c, S, A, ctx=None):
    """Analytic FLOPs of one drafter forward+backward for one sequence of S tokens with A anchors:
    its matmuls plus its attention. `ctx`: the mean number of context keys a block sees (= its anchor
    position); default S/2, anchors spread evenly over a full sequence."""
    return drafter_matmul_flops(c, S, A) + drafter_attention_flops(c, A, S / 2 if ctx is None else ctx)


def batch_flops(c, S, anchors, valid):
    """Analytic FLOPs of one drafter step on a (B, S) batch with these (B, A) anchors: the step's
    shape as it runs (padding included: the MFU is of the device), attention from each row's own
    anchor positions. A row without any valid anchor still runs at its shape (ctx 0)."""
    A = anchors.shape[1]
    total = 0.0
    for a, v in zip(anchors, valid):
        ctx = float(a[v].float().mean()) if bool(v.any()) else 0.0
        total += drafter_step_flops(c, S, A, ctx=ctx)
    return total


def drafter_matmul_flops(c, S, A):
    """FLOPs of the drafter's matmuls in one forward+backward (tested equal to torch's FLOP counter).

    A trainable matmul costs 3x its forward (forward, input grads, weight grads), except the fc over
    the target's features, which need no gradient (2x); the frozen LM head costs 2 matmuls (logits,
    grad wrt hidden) on the A*(bs-1) scored rows."""
    Q = A * c.block_size
    H, I, V = c.hidden_size, c.intermediate_size, c.vocab_size
    qd, kvd = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = 2 * Q * H * qd * 2 + 2 * (S + Q) * H * kvd * 2 + 2 * Q * H * I * 3
    fc = 2 * S * len(c.target_layer_ids) * H * H
    head = 2 * 2 * Q * (c.block_size - 1) / c.block_size * H * V
    return 2 * fc + 3 * c.num_draft_layers * layer + head


def drafter_attention_flops(c, A, ctx):
    """FLOPs of the drafter's attention over the visible keys only (ctx context keys + the block's
    own bs), forward (QK^T and PV) and backward (2x the forward; flash-style recomputation not counted)."""
    Q, qd = A * c.block_size, c.num_attention_heads * c.head_dim
    return 3 * c.num_draft_layers * 4 * Q * qd * (ctx + c.block_size)


def clip_and_step(opt, grads, clip):
    """Clip the gradients' global norm to `clip` and take the optimiser step; returns the norm (float).

    clip_grad_norm_'s factor, min(1, clip / (norm + 1e-6)), stays on the device and the optimiser's
    pass multiplies the gradients by it (MasterAdamW's grad_scale): no scaling pass over 1B gradients.
    On a GPU the host queues the step BEFORE it waits for the norm, and waits for the norm only (an
    event after its copy), not for the step: the device runs the update while the host goes on to the
    next step. Waiting first left the GPU idle ~3.8 ms of a 133 ms Qwen3-8B-size step on an H200
    (session 11's trace: 0.7 ms until the update was launched, launch gaps within it, and 1.1 ms at the
    next step's start while the host entered the compiled trunk). A nan/inf norm makes the factor nan,
    which makes the update store nothing; then FloatingPointError, with nothing stepped (the step
    counts are put back)."""
    norm = total_norm(grads)
    scale = torch.where(torch.isfinite(norm), (clip / (norm + 1e-6)).clamp(max=1.0), math.nan)
    if norm.is_cuda:
        host = torch.empty((), dtype=torch.float32, pin_memory=True)
        host.copy_(norm, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(norm.device))
    else:
        host, ready = norm, None
    counts = [opt.state[p]["step"] for p in opt.params()]
    opt.step(grads=grads, grad_scale=scale)
    if ready is not None:
        ready.synchronize()
    value = float(host)
    if not math.isfinite(value):      # a nan/inf step would poison every weight and every later checkpoint
        for p, n in zip(opt.params(), counts):
            opt.state[p]["step"] = n
        raise FloatingPointError(f"the gradient norm is {value}")
    return value


def total_norm(grads):
    """Global L2 norm of the gradients, accumulated in fp32 whatever their dtype (bf16 on a GPU)."""
    grads = [g for g in grads if g is not None]
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms))


def param_dtype(dev):
    """The weights' dtype on `dev`: bf16 on a GPU, fp32 on a CPU - the drafter's (fp32 masters in the
    optimiser), the target's, and the embedding and LM head the drafter reads from it."""
    return torch.bfloat16 if torch.device(dev).type == "cuda" else torch.float32


def add_into(buf):
    """A post-accumulate-grad hook: add the fresh gradient into `buf` (an fp32 view) and free it."""
    def hook(p):
        buf.add_(p.grad)
        p.grad = None
    return hook


def measure_peak_flops(dev):
    """Matmul rate measured now, on this device (the MFU denominator)."""
    n, dtype = (8192, torch.bfloat16) if dev.type == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    reps, t0 = 10, time.time()
    for _ in range(reps):
        a @ b
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return 2 * n ** 3 * reps / (time.time() - t0)


def keep_metrics_upto(path, step):
    """Drop the records of steps after `step` (run again after a resume), atomically."""
    def upto(line):
        try:
            return json.loads(line)["step"] <= step
        except (ValueError, KeyError, TypeError):    # a line cut by a kill mid-write
            return False
    with open(path) as f:
        keep = [line for line in f if upto(line)]
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


def master_state_dict(model, opt):
    """The model's state_dict with every weight replaced by its fp32 master (the optimiser's own
    tensor): what a checkpoint resumes from (the bf16 weights would round every master)."""
    masters = dict(zip([n for n, _ in model.named_parameters()], opt.masters()))
    return {k: masters.get(k, v) for k, v in model.state_dict().items()}     # (state_dict()'s are detached)


def map_tensors(obj, fn):
    """obj (dicts, lists, tuples) with fn(t) in place of every tensor t."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def to_host(obj, memo, pool):
    """obj with every tensor COPIED into host buffers of `pool` (a HostPool; call its finish() before
    reading the copies) - also a CPU tensor: the copy must not change when training goes on - once
    per tensor object (memo: id -> copy), so tensors shared in obj stay shared and torch.save writes
    them once."""
    def copy(t):
        if id(t) not in memo:        # the original is kept with its copy: its id stays its own meanwhile
            memo[id(t)] = (t, pool.copy(t.detach()))
        return memo[id(t)][1]
    return map_tensors(obj, copy)


class HostPool:
    """Host buffers for checkpoint snapshots, reused from one checkpoint to the next (handed out in the
    order asked for; one of another shape or dtype is replaced). Pinned when CUDA is there: a copy from
    the GPU then runs asynchronously at bus speed. Freshly allocated pageable memory cost 8.9 s of step-loop
    pause per checkpoint at Qwen3-8B size (~14 GB; H200, session 10): staging, and faulting in new
    pages every time. The buffers of one snapshot may be reused only once it has been written (the
    trainer writes one checkpoint at a time), and they hold a checkpoint's size of host RAM for the run
    (pinned: more, torch's pinned allocator rounds each buffer up to a power of two)."""

    def __init__(self):
        self.bufs, self.i, self.devices = [], 0, set()

    def start(self):
        self.i = 0
        self.devices.clear()
        return self

    def copy(self, t):
        pin = t.is_cuda
        if self.i == len(self.bufs):
            self.bufs.append(None)
        b = self.bufs[self.i]
        if b is None or b.shape != t.shape or b.dtype != t.dtype or b.is_pinned() != pin:
            b = self.bufs[self.i] = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        self.i += 1
        if pin:
            self.devices.add(t.device)
        return b.copy_(t, non_blocking=pin)

    def finish(self):
        for d in self.devices:
            torch.cuda.synchronize(d)


def fingerprint(tensors):
    """Per tensor, the int64 sum (wrapping) of its bytes read as 8-byte words, on the tensors' device:
    bit-identical tensors give equal entries, differing ones almost surely not (unlike a float sum,
    +e and -e or -0.0 and 0.0 do not cancel). Whole words, not elements: torch's int64 sum of int64
    words runs near bandwidth (1.9 ms for a 1B-parameter drafter's bf16 weights + fp32 masters on an
    H200), a sum of int16 elements into int64 at a sixth of it (11.7 ms)."""
    sums = []
    for t in tensors:
        b = as_bytes(t)
        if b.data_ptr() % 8:             # a view at an unaligned offset: its own aligned copy
            b = b.clone()
        n = b.numel() // 8 * 8
        s = b[:n].view(torch.int64).sum()
        if n < b.numel():                # the last few bytes, weighted by position
            s = s + (b[n:].to(torch.int64) << (8 * torch.arange(b.numel() - n, device=b.device))).sum()
        sums.append(s)
    return torch.stack(sums)


def digest(fp):
    """A fingerprint() as 16 hex digits, for logs and checkpoints. Integer sums do not depend on the
    order of addition, so the same bytes give the same digest on any device."""
    return hashlib.sha256(fp.cpu().numpy().tobytes()).hexdigest()[:16]


def as_bytes(t):
    """A tensor's raw bytes (bit-exact comparison: torch.equal on floats treats -0.0 == 0.0)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def sync_device(dev):
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()


def list_checkpoints(out_dir):
    if not os.path.isdir(out_dir):
        return []
    return sorted(os.path.join(out_dir, d) for d in os.listdir(out_dir)
                  if d.startswith("step_") and not d.endswith(".tmp")
                  and os.path.exists(os.path.join(out_dir, d, "DONE")))


DISK_SLACK = 64 << 20      # bytes kept free beyond a checkpoint's estimate (configs, logs, env.json)


def size_str(n):
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def free_bytes(cfg, step):
    """Free bytes on the file system of cfg.out_dir. (--debug-fail disk:N pretends 1 MiB from
    checkpoint N on, at start-up too for N = 0.)"""
    full_from = debug_at(cfg, "disk")
    if full_from is not None and step >= full_from:
        return 1 << 20
    return shutil.disk_usage(cfg.out_dir).free


def snapshot_bytes(state, serving):
    """Bytes a checkpoint writes, about: every tensor of `state` once (shared ones are stored once) and
    the serving weights in bf16 (save_drafter's dtype). The live state gives the same count as its
    snapshot: the start-up check estimates with it."""
    nbytes = {}                      # id -> bytes: a shared tensor counts once
    map_tensors(state, lambda t: nbytes.setdefault(id(t), t.numel() * t.element_size()))
    return sum(nbytes.values()) + sum(v.numel() * 2 for v in serving.values())


def checkpoints_at_once(n_old, n_new, keep_last):
    """The most checkpoints on disk at once when n_new are written after n_old: each is written before
    the oldest beyond keep_last is deleted. (n_old may exceed keep_last, on a resume with a lower
    --keep-last: none of them goes before the first write.)"""
    return max(n_old, min(n_old + n_new - 1, keep_last)) + 1 if n_new else n_old


def planned_checkpoints(start, total, interval):
    """How many checkpoints a run from step `start` to `total` writes: every `interval` steps and the
    last step. (A time budget's stop at step s saves there instead of at the last step: no more.)"""
    return total // interval - start // interval + (1 if total % interval else 0)


class Logger:
    """print + append to <out_dir>/train.log; every run log starts with the environment fingerprint.
    Under torchrun, rank r > 0 writes train.rank<r>.log and prints only failures and warnings."""

    def __init__(self, out_dir, rank=0):
        os.makedirs(out_dir, exist_ok=True)
        self.f = open(os.path.join(out_dir, "train.log" if rank == 0 else f"train.rank{rank}.log"), "a")
        self.rank = rank
        self.lock = threading.Lock()

    def __call__(self, msg):
        with self.lock:
            if self.rank == 0 or msg.lstrip().startswith(("[FATAL]", "WARNING", "error")):
                print(msg if self.rank == 0 else f"[rank {self.rank}] {msg}", flush=True)
            self.f.write(msg + "\n")
            self.f.flush()


def main(argv=None):
    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    pin_local_gpu(cfg)          # first: before anything starts CUDA
    log = Logger(cfg.out_dir, int(os.environ.get("RANK", 0)))
    import diagnose
    log("=" * 72)
    env = diagnose.collect_env(cfg.compile_cache or os.path.join(cfg.out_dir, "compile_cache"))
    log(diagnose.format_report(env))
    log("[config] " + json.dumps(dataclasses.asdict(cfg)))
    trainer = Trainer(cfg, log)
    trainer.env_at_start = env        # what every checkpoint's env.json records (checkpoint_env)
    rc = trainer.train()
    sys.stdout.flush()
    if rc:
        os._exit(rc)          # do not wait for threads stuck in device work: stop within seconds
    return rc


if __name__ == "__main__":
    sys.exit(main())
