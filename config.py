"""A training run's options (one dataclass that generates the command line) and its plan: devices, attention, the
shapes its batches take. Loading the target and building the drafter: models.py."""
import argparse
import dataclasses
import difflib
import math
import os
import re
import tempfile

import torch

import data_dflash
import dflash_model as dm
from errors import UserError

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
    dpace: float = opt(0.0, "D-PACE: the block positions' loss weights from the drafter's confidence exp(-loss) in "
                            "the earlier positions, smoothed by this share in (0, 1] (0.5 is usual), not --gamma's "
                            "fixed decay; 0 = off")
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
    def loss(self):
        """The step's dm.Loss."""
        return dm.Loss(self.gamma, self.distill, self.dpace)

    @property
    def teacher(self):
        """Does the loss read the target's final hidden states (its whole depth runs)?"""
        return self.distill > 0

class ArgumentParser(argparse.ArgumentParser):
    """argparse that answers a bad command line with one line naming the problem, not the usage text."""
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # "-1e-3" is a value (the option's own check names what is wrong with it), not an unknown option
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message):
        raise UserError(f"{message} (see --help)")

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
            raise UserError(f"unexpected argument {arg!r} (options are --name value)")
        close = difflib.get_close_matches(arg.split("=")[0], p._option_string_actions, n=3, cutoff=0.6)
        raise UserError(f"unknown option {arg}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
    cfg = TrainConfig(**vars(args))
    if errs := option_errors(cfg):      # every bad option, in one line, before any slow set-up
        raise UserError("" + "; ".join(errs))
    # the defaults that follow from other options, resolved once (logged and checkpointed as resolved)
    bs = cfg.block_size
    cfg.gamma = cfg.gamma or {16: 7.0, 10: 5.0, 8: 4.0}.get(bs, max(1.0, bs * 7 / 16))
    cfg.compile_cache = cfg.compile_cache or os.path.join(cfg.out_dir, "compile_cache")
    cfg.tensorboard = os.path.join(cfg.out_dir, "tensorboard") if cfg.tensorboard == "auto" else cfg.tensorboard
    return cfg

def option_errors(cfg):
    """What is wrong with the options as given, one phrase each: [] if nothing."""
    bs = cfg.block_size
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
        (min(cfg.seed, cfg.max_samples, cfg.min_supervised, cfg.tokens_per_batch) < 0 or cfg.num_draft_layers < 1,
         "need --seed, --max-samples, --min-supervised, --tokens-per-batch >= 0 and --num-draft-layers >= 1"),
        # gamma < 0 would weight the block's last positions most; 0 picks the block size's default
        (not cfg.gamma >= 0, f"--gamma must be > 0 (0: the block size's default), got {cfg.gamma}"),
        (not 0 <= cfg.distill <= 1, f"--distill must lie in [0, 1], got {cfg.distill}"),
        (not 0 <= cfg.dpace <= 1, f"--dpace must lie in (0, 1] (0: off), got {cfg.dpace}")] if bad]
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
    return errs + data_errors(cfg.data)

def data_errors(names):
    """Why each of these data names reads nothing (a missing file, a folder without parts, synthetic:N without a
    number N >= 1): [] if all do."""
    errs = []
    for name in names:
        try:
            if not name.startswith("synthetic:"):
                data_dflash.local_files(name)
            elif not (name[10:].isdigit() and int(name[10:]) >= 1):
                errs.append(f"--data {name}: synthetic:N needs a number N >= 1 of samples")
        except FileNotFoundError as e:
            errs.append(str(e))
    return errs

# --- Devices and shapes ---------------------------------------------------------------------------
@dataclasses.dataclass
class Plan:
    """Where and how a run trains: its rank of `world`, the target and drafter devices, the attention, the (B, S, A)
    shapes every batch takes (all warmed before the first step), batches a step on this node, the steps planned, and
    each rank's batches an epoch (a resume reads its position against its own)."""
    rank: int
    world: int
    tdevs: list
    ddevs: list
    attn: str
    shapes: list = dataclasses.field(default_factory=list)
    per_step: int = 1
    total_steps: int = 0
    nb_by_rank: list = dataclasses.field(default_factory=list)

def resolve_devices(cfg):
    """(target devices, drafter devices), as --target-devices and --drafter-devices say (auto: 5/8 and 3/8)."""
    n = torch.cuda.device_count()
    gpus, nd = [f"cuda:{i}" for i in range(n)], max(1, round(n * 3 / 8))
    auto = (",".join(gpus[:n - nd]), ",".join(gpus[n - nd:])) if n > 1 else ("cuda:0",) * 2 if n else ("cpu",) * 2
    pick = lambda s, auto: auto if s == "auto" else s.replace("local", os.environ.get("LOCAL_RANK", "0"))
    tdev = devices(pick(cfg.target_devices, auto[0]), "--target-devices")
    ddev = devices(pick(cfg.drafter_devices, auto[1]), "--drafter-devices")
    if not tdev or not ddev:
        raise UserError("need at least one target and one drafter device")
    return tdev, ddev

def devices(text, option="--device"):
    """The devices of a comma-separated list, each one that exists here; else every script's one-line error."""
    return check_devices([d.strip() for d in text.split(",") if d.strip()], option)

def check_devices(names, option="--device"):
    n, out = torch.cuda.device_count(), []
    for name in names:
        try:
            d = torch.device(name)
        except (RuntimeError, TypeError):
            raise UserError(f"{option} {name!r} is not a device: cpu, cuda or cuda:N") from None
        if d.type == "cuda" and (d.index or 0) >= n:
            raise UserError(f"{option}: device {d} requested but only {n} CUDA device(s) visible")
        if d.type not in ("cpu", "cuda"):
            raise UserError(f"{option} {name!r}: only cpu and cuda devices run this code")
        out.append(d)
    return out

def _unwritable(folder):
    """Why no file can be written in `folder` (made with its parents if missing), or None."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        return "is a file, not a folder"
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return f"cannot write there: {e.strerror or e}"

def writable_dir(path, option):
    """The folder `path`, made and written into before any work whose results go there: a file in the way, a
    read-only or full disk, no permission is a one-line error naming the option."""
    if why := _unwritable(path):
        raise UserError(f"{option} {path} {why}")
    return path

def writable_file(path, option):
    """A file that can be written at `path` (its folder made): checked before the work whose result it holds."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UserError(f"{option} {path} is a folder: name a file")
    if why := _unwritable(folder):
        raise UserError(f"{option} {path}: its folder {folder} {why}")
    return path

def check_outputs(cfg, names=("out_dir", "cache_dir", "tensorboard", "compile_cache")):
    """Every folder a run writes (of `names`), before the run starts; the compile cache where a GPU compiles."""
    for name in names:
        if getattr(cfg, name) and (name != "compile_cache" or torch.cuda.is_available()):
            writable_dir(getattr(cfg, name), "--" + name.replace("_", "-"))

def resolve_attn(cfg, drafter_devs):
    if cfg.attn == "flex" and drafter_devs[0].type == "cpu":
        raise UserError("--attn flex cannot train on CPU (FlexAttention has no CPU backward); use --attn sdpa")
    attn = cfg.attn if cfg.attn != "auto" else "flex" if drafter_devs[0].type == "cuda" else "sdpa"
    if attn == "flex" and len(set(map(str, drafter_devs))) < len(drafter_devs):
        # two replicas' threads would run one dynamo cache's entries at once: a spurious recompile (the gate stops)
        raise UserError(f"--drafter-devices {','.join(map(str, drafter_devs))} lists a GPU twice: give "
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
