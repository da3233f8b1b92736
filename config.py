"""A training run's options (one dataclass that generates the command line), its devices and shape plan, and the
target and drafter as the trainer and the warm-up build them."""
import argparse
import dataclasses
import difflib
import json
import math
import os

import torch

import data_dflash
import dflash_model as dm

def opt(default, help):
    """A config field with its --help line (a list default is copied for each instance)."""
    kw = {"default_factory": lambda: list(default)} if isinstance(default, list) else {"default": default}
    return dataclasses.field(**kw, metadata={"help": help})

@dataclasses.dataclass
class TrainConfig:
    # model and data
    target: str = opt("", "HF folder or hub name of the target; '' = the embedded default (SmolLM2-135M-Instruct); "
                          "random:<config.json> = random weights from a config (benchmarks)")
    data: list = opt([], "ShareGPT JSON/JSONL, chat JSONL (messages) or hub data set names; '' = the embedded "
                         "default (ShareGPT V3); synthetic:N = random tokens (benchmarks)")
    cache_dir: str = opt(".cache", "the embedded default's converted files and the tokenised data")
    max_samples: int = opt(0, "tokenise and train on only the first N conversations (0 = all)")
    heldout: int = opt(200, "held-out eval prompts: last N conversations (at most a tenth; side-by-side answers to "
                            "one prompt count as one), trained on in no file, <out_dir>/heldout.jsonl")
    num_draft_layers: int = opt(5, "drafter layers")
    block_size: int = opt(16, "tokens drafted per block (the anchor + block_size - 1 masked)")
    num_anchors: int = opt(512, "blocks per sequence, fewer where a sequence has fewer start positions")
    gamma: float = opt(0.0, "loss decay over block positions; 0 = 7 for block 16, 5 for 10, 4 for 8")
    mask_token_id: int = opt(-1, "the mask token; -1 = <|MASK|>, a spare embedding row or an unused special token")
    target_layer_ids: str = opt("", "target layers feeding the drafter, e.g. 1,9,17,25,33; '' = spread over the depth")
    max_length: int = opt(3072, "longer samples are truncated")
    buckets: str = opt("", "sequence-length buckets, e.g. 512,1024,3072; '' = doubling from 256 to max_length")
    tokens_per_batch: int = opt(0, "target tokens per micro-batch; 0 = auto: one max_length sequence's blocks, on "
                                   "a GPU at least 25 TFLOP of drafter work within half the memory the weights leave")
    min_supervised: int = opt(32, "samples with fewer assistant tokens are skipped")
    distill: float = opt(0.0, "weight of the KL to the target's next-token distribution in the loss, the rest on "
                              "the labels (0 = labels only); the target then runs its whole depth")
    # optimisation
    lr: float = opt(6e-4, "peak learning rate (AdamW, cosine decay)")
    warmup_frac: float = opt(0.04, "linear warm-up share of the run")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    clip: float = opt(1.0, "gradient norm clip")
    epochs: float = opt(6.0, "passes over the data")
    grad_accum: int = opt(1, "micro-batches per optimiser step and drafter replica")
    max_steps: int = opt(0, "stop after N optimiser steps (0 = the epochs decide); the schedule follows")
    max_minutes: float = opt(0.0, "time budget of the whole run, resumes included (0 = none); the schedule follows")
    seed: int = opt(0, "seed of the initial weights, batch order and anchors")
    # devices and compilation
    target_devices: str = opt("auto", "e.g. cuda:0,cuda:1; auto = 5/8 of the GPUs (one GPU: both roles; no GPU: "
                                      "cpu); cuda:local = this torchrun process's GPU")
    drafter_devices: str = opt("auto", "e.g. cuda:2,cuda:3; auto = the GPUs the target does not take")
    attn: str = opt("auto", "flex: compiled, on GPUs | sdpa: dense mask, eager (CPU) | auto: flex on GPUs, sdpa on CPU")
    compile_cache: str = opt("", "persistent inductor/triton cache; '' = <out_dir>/compile_cache")
    queue_depth: int = opt(4, "batches buffered per target and drafter thread")
    # output
    out_dir: str = opt("out", "checkpoints, metrics.jsonl, train.log, heldout.jsonl")
    ckpt_interval: int = opt(500, "optimiser steps between checkpoints")
    keep_last: int = opt(3, "checkpoints kept")
    log_interval: int = opt(10, "optimiser steps between log lines")
    tensorboard: str = opt("", "also write the log line's figures as TensorBoard events to this folder "
                               "('' = off, auto = <out_dir>/tensorboard)")
    resume: bool = opt(False, "continue from the newest intact checkpoint in out_dir")

    @property
    def teacher(self):
        """Does the loss read the target's final hidden states (its whole depth runs)?"""
        return self.distill > 0

class ArgumentParser(argparse.ArgumentParser):
    """argparse that answers a bad command line with one line naming the problem, not the usage text."""
    def error(self, message):
        raise SystemExit(f"error: {message} (see --help)")

def parse_args(argv):
    """TrainConfig from the command line; a bad option is a one-line error (an unknown one with the closest names)."""
    p = ArgumentParser(description="Train a DFlash drafter (python train_dflash.py --help).", allow_abbrev=False,
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        kw = (dict(action="store_true") if f.type is bool else
              dict(nargs="+", default=f.default_factory(), metavar="FILE") if f.type is list else
              dict(type=f.type, default=f.default))
        p.add_argument("--" + f.name.replace("_", "-"), help=f.metadata["help"], **kw)
    args, extra = p.parse_known_args(argv)
    if extra:
        arg = extra[0]
        if not arg.startswith("-"):
            raise SystemExit(f"error: unexpected argument {arg!r} (options are --name value)")
        close = difflib.get_close_matches(arg.split("=")[0], p._option_string_actions, n=3, cutoff=0.6)
        raise SystemExit(f"error: unknown option {arg}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
    cfg = TrainConfig(**vars(args))
    bs = cfg.block_size     # every bad option next, in one line, before any slow set-up
    errs = [msg for bad, msg in [
        (cfg.attn not in ("auto", "flex", "sdpa"), f"--attn must be auto|flex|sdpa, got {cfg.attn}"),
        (bs < 2 or cfg.num_anchors < 1 or cfg.max_length < 2 * bs,
         "need --block-size >= 2, --num-anchors >= 1, --max-length >= 2 x block size"),
        (min(cfg.grad_accum, cfg.keep_last, cfg.log_interval, cfg.ckpt_interval, cfg.queue_depth) < 1,
         "--grad-accum, --keep-last, --log-interval, --ckpt-interval, --queue-depth must be >= 1"),
        # the step is scaled by clip/norm: 0 freezes the weights, < 0 steps uphill
        (not cfg.clip > 0, f"--clip must be > 0, got {cfg.clip}"),
        (not cfg.lr > 0 or cfg.weight_decay < 0 or cfg.epochs <= 0 or cfg.max_steps < 0 or cfg.max_minutes < 0,
         "need --lr > 0, --weight-decay >= 0, --epochs > 0, --max-steps >= 0, --max-minutes >= 0"),
        (not 0 <= cfg.warmup_frac < 1 or cfg.heldout < 0, "need 0 <= --warmup-frac < 1 and --heldout >= 0"),
        (not 0 <= cfg.distill <= 1, f"--distill must lie in [0, 1], got {cfg.distill}")] if bad]
    if cfg.buckets:
        try:
            if not all(2 * bs <= int(x) <= cfg.max_length for x in cfg.buckets.split(",")):
                errs.append(f"--buckets must lie in [2 x block size, max_length] = [{2 * bs}, {cfg.max_length}], "
                            f"got {cfg.buckets}")
        except ValueError:
            errs.append(f"--buckets must be comma-separated integers, got {cfg.buckets!r}")
    if cfg.tensorboard:
        try:
            __import__("torch.utils.tensorboard")
        except ImportError as e:
            errs.append(f"--tensorboard needs the tensorboard package: pip install tensorboard ({e})")
    errs += [f"data file not found: {name}" for name in cfg.data if data_dflash.names_a_file(name)
             and not name.startswith("synthetic:") and not os.path.isfile(os.path.expanduser(name))]
    if errs:
        raise SystemExit("error: " + "; ".join(errs))
    # the defaults that follow from other options, resolved once (logged and checkpointed as resolved)
    cfg.gamma = cfg.gamma or {16: 7.0, 10: 5.0, 8: 4.0}.get(bs, max(1.0, bs * 7 / 16))
    cfg.compile_cache = cfg.compile_cache or os.path.join(cfg.out_dir, "compile_cache")
    cfg.tensorboard = os.path.join(cfg.out_dir, "tensorboard") if cfg.tensorboard == "auto" else cfg.tensorboard
    return cfg

# --- Devices and shapes ---------------------------------------------------------------------------
def resolve_devices(cfg):
    """(target devices, drafter devices), as --target-devices and --drafter-devices say (auto: 5/8 and 3/8)."""
    def parse(s, auto):
        s = auto if s == "auto" else s.replace("local", os.environ.get("LOCAL_RANK", "0"))
        return [torch.device(d.strip()) for d in s.split(",") if d.strip()]
    n = torch.cuda.device_count()
    gpus, nd = [f"cuda:{i}" for i in range(n)], max(1, round(n * 3 / 8))
    auto = (",".join(gpus[:n - nd]), ",".join(gpus[n - nd:])) if n > 1 else ("cuda:0",) * 2 if n else ("cpu",) * 2
    tdev, ddev = parse(cfg.target_devices, auto[0]), parse(cfg.drafter_devices, auto[1])
    check_devices(tdev + ddev)
    if not tdev or not ddev:
        raise SystemExit("error: need at least one target and one drafter device")
    return tdev, ddev

def check_devices(devices):
    """Every device exists here; else every script's one-line error."""
    n = torch.cuda.device_count()
    for d in map(torch.device, devices):
        if d.type == "cuda" and (d.index or 0) >= n:
            raise SystemExit(f"error: device {d} requested but only {n} CUDA device(s) visible")

def resolve_attn(cfg, drafter_devs):
    if cfg.attn == "flex" and drafter_devs[0].type == "cpu":
        raise SystemExit("error: --attn flex cannot train on CPU (FlexAttention has no CPU backward); use --attn sdpa")
    attn = cfg.attn if cfg.attn != "auto" else "flex" if drafter_devs[0].type == "cuda" else "sdpa"
    if attn == "flex" and len(set(map(str, drafter_devs))) < len(drafter_devs):
        # two replicas' threads would run one dynamo cache's entries at once: a spurious recompile (the gate stops)
        raise SystemExit(f"error: --drafter-devices {','.join(map(str, drafter_devs))} lists a GPU twice: give "
                         "each drafter replica a GPU of its own")
    return attn

def param_dtype(dev):
    """The weights' dtype on `dev`: the drafter's (its masters stay fp32), the target's, its embedding and LM head."""
    return torch.bfloat16 if torch.device(dev).type == "cuda" else torch.float32

def bucket_list(cfg):
    return sorted({int(x) for x in cfg.buckets.split(",")} | {cfg.max_length}) if cfg.buckets else \
        data_dflash.default_buckets(cfg.max_length)

def anchors_for(cfg, S):
    """num_anchors, capped by the S - block + 1 start positions, rounded up to fill flex's 128-row tiles."""
    m = 128 // math.gcd(cfg.block_size, 128)
    return max(m, math.ceil(min(cfg.num_anchors, S - cfg.block_size + 1) / m) * m)

# An automatic micro-batch on a GPU holds at least this much drafter work: the per-step costs (launches, optimiser,
# gradient sum) stay small next to it while a small data set still gets many steps.
STEP_FLOPS = 25e12

def batch_size_for(cfg, dcfg, S, memory=0):
    """Rows per micro-batch of bucket S, at most tokens_per_batch // S: the blocks of tokens_per_batch // max_length
    full-length sequences (auto: one, on a GPU at least STEP_FLOPS of work within `memory`): steps cost the same."""
    A, tokens = anchors_for(cfg, S), cfg.tokens_per_batch or cfg.max_length
    blocks = max(1, tokens // cfg.max_length) * anchors_for(cfg, cfg.max_length)
    rows = min(tokens // S, blocks // A)
    if not cfg.tokens_per_batch and memory:
        blocks = max(blocks, STEP_FLOPS / dm.matmul_flops(dcfg, 0, 1))
        rows = min(blocks // A, memory // activation_bytes(dcfg, S, A))
    return max(1, int(rows))

def activation_bytes(c, S, A):
    """Bytes one sequence's drafter forward keeps for its backward, over-estimated twofold: per block token and
    layer 4H + 3q + 2kv + 3I bf16 values, per context token its features, ctx and keys/values, the LM-head grad."""
    qd, kvd, H = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.hidden_size
    per_block_token = c.num_draft_layers * (4 * H + 3 * qd + 2 * kvd + 3 * c.intermediate_size) + H
    per_context_token = (len(c.target_layer_ids) + 1) * H + c.num_draft_layers * 2 * kvd
    return 2 * 2 * (A * c.block_size * per_block_token + S * per_context_token)

def batch_memory(dcfg, tcfg, tdevs, ddevs):
    """Bytes a drafter GPU gives one micro-batch (0 on a CPU): half of what its total memory leaves after the drafter
    (18 B a parameter), embedding, LM head and a target on it; not the free memory, so a restart plans the same."""
    from transformers import AutoModelForCausalLM
    if ddevs[0].type != "cuda":
        return 0
    with torch.device("meta"):
        drafter = sum(p.numel() for p in dm.DFlashDrafter(dcfg, embed_weight=torch.empty(0)).parameters())
        target = sum(p.numel() for p in AutoModelForCausalLM.from_config(tcfg).parameters()) \
            if ddevs[0] in tdevs else 0
    used = 18 * drafter + 2 * 2 * dcfg.vocab_size * dcfg.hidden_size + 2 * target
    return max(0, torch.cuda.get_device_properties(ddevs[0]).total_memory - used) // 2

def shape_plan(cfg, dcfg, memory=0):
    """Every (B, S, A) the drafter can see: one per bucket. This is what the warm-up compiles."""
    return [(batch_size_for(cfg, dcfg, S, memory), S, anchors_for(cfg, S)) for S in bucket_list(cfg)]

# --- Target and drafter ---------------------------------------------------------------------------
def target_and_data(cfg):
    """(target path, data files): --target and --data, or the embedded default's, prepared once in the cache."""
    if cfg.target:
        return cfg.target, cfg.data
    target, data = data_dflash.prepare_embedded_default(cfg.cache_dir)
    return target, cfg.data or [data]

def first_line(e):
    """An exception's first message line, or its type where the message is empty."""
    return (str(e).splitlines() or [type(e).__name__])[0]

def load_target_config(path):
    """(config, tokenizer). random:<config.json>: a config for random weights, and no tokenizer."""
    from transformers import AutoConfig, AutoTokenizer
    try:
        if path.startswith("random:"):
            with open(path[len("random:"):]) as f:
                d = json.load(f)
            return AutoConfig.for_model(d.pop("model_type"), **d), None
        return AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:    # no such folder or hub name, a file that is no config
        raise SystemExit(f"error: cannot load the target {path!r}: {first_line(e)}") from None

def choose_mask_token_id(tokenizer, vocab_size):
    """The mask token: an existing <|MASK|>, else a spare embedding row (Qwen3's), else an unused special token."""
    vocab = tokenizer.get_vocab()
    if "<|MASK|>" in vocab:
        return vocab["<|MASK|>"]
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    used = {None, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    for tok in getattr(tokenizer, "all_special_tokens", []) + sorted(getattr(tokenizer, "added_tokens_encoder", {})):
        if vocab.get(tok) not in used and tok not in (tokenizer.chat_template or ""):
            return vocab[tok]
    raise ValueError("no spare or unused special token to use as the mask token; pass --mask-token-id")

def make_drafter_config(cfg, tcfg, tok):
    """The drafter's DFlashConfig for this target (tok None: a random target; its last row is the mask token)."""
    vocab = getattr(tcfg, "text_config", tcfg).vocab_size
    try:    # layer ids or a mask token this target does not have
        mask_id = cfg.mask_token_id if cfg.mask_token_id >= 0 else (
            vocab - 1 if tok is None else choose_mask_token_id(tok, vocab))
        ids = [int(x) for x in cfg.target_layer_ids.split(",")] if cfg.target_layer_ids else None
        dcfg = dm.DFlashConfig.from_target_config(tcfg, cfg.num_draft_layers, cfg.block_size, mask_id, ids)
    except ValueError as e:
        raise SystemExit(f"error: --target-layer-ids {cfg.target_layer_ids!r}, --mask-token-id {cfg.mask_token_id} "
                         f"for this target: {e}") from None
    if cfg.max_length > dcfg.max_position_embeddings:
        raise SystemExit(f"error: --max-length {cfg.max_length} exceeds the target's max_position_embeddings "
                         f"({dcfg.max_position_embeddings})")
    return dcfg

def new_drafter(dcfg, emb, head, dev, seed):
    """A drafter replica on `dev` reading the target's embedding and LM head (a tied pair stays one storage); the
    warm-up builds its drafters here too, as compiled graphs key on dtype, layout and aliasing."""
    torch.manual_seed(seed)
    with torch.device(dev):        # initialised where it runs: 1B parameters take seconds on a CPU
        dr = dm.DFlashDrafter(dcfg, embed_weight=torch.empty(0))
    dr.embed_weight, dr.lm_head_weight = emb.to(dev), head.to(dev)
    return dr

def load_model(path, device, dtype):
    """The target as transformers loads it (LM head included), frozen: every script's one way to load it."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging
    logging.disable_progress_bar()    # a bar per load would fill the logs
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except Exception as e:    # no such folder or hub name, missing or cut weights: name it, in one line
        raise SystemExit(f"error: cannot load the target {path!r}: {type(e).__name__}: {first_line(e)}") from None
    return model.to(device).eval().requires_grad_(False)

def load_target(path, device, dtype, layer_ids, log=print, random_weights=False, whole=False):
    """The target cut after the deepest captured layer (whole: all of it, for its final hidden states), hooked to keep
    the captured outputs (dm.capture). random_weights or random:<config.json>: seeded random weights of its shape."""
    from transformers import AutoConfig, AutoModelForCausalLM
    if random_weights or path.startswith("random:"):
        tcfg = load_target_config(path)[0] if path.startswith("random:") else AutoConfig.from_pretrained(path)
        torch.manual_seed(0)       # the same weights on every device and run: features must not depend on the thread
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(tcfg, dtype=dtype).eval().requires_grad_(False)
        source = f"random weights of {path.removeprefix('random:')}'s shape"
    else:
        model, source = load_model(path, device, dtype), path
    base, n_keep = model.model, len(model.model.layers) if whole else max(layer_ids) + 1
    if n_keep < len(base.layers):
        base.layers, base.norm = base.layers[:n_keep], torch.nn.Identity()
    dm.capture(model, layer_ids)
    log(f"[target] {source} on {device}: kept {len(base.layers)}/{model.config.num_hidden_layers} layers"
        + (" and the final norm" if whole else "") + ", no LM head")
    return model
