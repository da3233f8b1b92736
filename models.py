"""The target and the drafter as every script loads them: the target's config and tokenizer, its weights (whole, or
cut after the deepest layer the drafter reads), the embedded default when no --target is given, the drafter's config
for a target, and a new drafter replica. A hub name with the hub unreachable reads the HF cache only."""
import hashlib
import json
import os

import torch

import data_dflash
import dflash_model as dm
from errors import UserError, first_line

def target_and_data(cfg):
    """(target path, data files): --target and --data, or the embedded default's, prepared once in the cache."""
    if cfg.target:
        return cfg.target, cfg.data
    target, data = data_dflash.prepare_embedded_default(cfg.cache_dir)
    return target, cfg.data or [data]

def load_target_config(path):
    """(config, tokenizer). random:<config.json>: a config for random weights, and no tokenizer."""
    from transformers import AutoConfig, AutoTokenizer
    if path.startswith(("/", ".", "~")) and not os.path.isdir(os.path.expanduser(path)):   # a path, not a hub name
        raise UserError(f"cannot load the target {path!r}: no such folder")
    offline = hub_offline(path)
    try:
        if path.startswith("random:"):
            with open(path[len("random:"):]) as f:
                d = json.load(f)
            return AutoConfig.for_model(d.pop("model_type"), **d), None
        tcfg = AutoConfig.from_pretrained(path, local_files_only=bool(offline))
        if hasattr(tcfg, "dflash_config"):
            raise UserError(f"the target {path!r} is a DFlash drafter (a checkpoint's drafter/ folder): pass "
                            "the target model it drafts for")
        return tcfg, AutoTokenizer.from_pretrained(path, local_files_only=bool(offline))
    except (OSError, ValueError, KeyError) as e:    # no such folder or hub name, a file that is no config
        raise UserError(f"cannot load the target {path!r}: {offline or first_line(e)}") from None

def hub_offline(path):
    """None, or for a hub name with the hub unreachable why not: then from_pretrained reads the HF cache only
    (local_files_only; it would retry for half a minute first), and a name not cached has this reason."""
    if path.startswith("random:") or os.path.isdir(os.path.expanduser(path)):
        return None
    why = data_dflash.hub_unreachable()
    return why and f"{why}, and the HF cache has no copy of it"

def config_json(tcfg):
    """The target's config as canonical JSON, its names and versions aside (a copy elsewhere is the same target)."""
    skip = ("_name_or_path", "transformers_version", "_commit_hash")
    return json.dumps({k: v for k, v in tcfg.to_dict().items() if k not in skip}, sort_keys=True, default=str)

def target_fingerprint(path, tcfg):
    """What tells one target from another of its shape: its config, and for a folder each weight file's name, size
    and first and last MiB (hashing all of a large target's weights would take minutes at every start)."""
    h = hashlib.sha256(config_json(tcfg).encode())
    folder = os.path.expanduser(path)
    if not os.path.isdir(folder):
        h.update(path.split(":")[0].encode())     # random:<config> (seeded weights) or a hub name
        return h.hexdigest()[:16]
    for name in sorted(n for n in os.listdir(folder) if n.endswith((".safetensors", ".bin", ".pt", ".pth"))):
        with open(os.path.join(folder, name), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(1 << 20)
            f.seek(max(len(head), size - (1 << 20)))
            h.update(f"{name} {size}".encode() + head + f.read())
    return h.hexdigest()[:16]

def target_identity(path, tcfg):
    """What a drafter folder records of its target: the name it was given, a digest of its config (names aside) and,
    for a folder, target_fingerprint's of its weights (None for a hub name or random weights: not readable here)."""
    return {"name": path, "config": hashlib.sha256(config_json(tcfg).encode()).hexdigest()[:16],
            "weights": target_fingerprint(path, tcfg) if os.path.isdir(os.path.expanduser(path)) else None}

def check_drafter_target(drafter_path, trained_for, target):
    """A drafter drafts for the target it was trained for: the same config and, where both were folders, the same
    weights (a copy elsewhere is the same target; a hub name and a folder compare by config). trained_for, target:
    target_identity's (a drafter saved without it: {})."""
    if not trained_for:
        return
    weights = trained_for["weights"], target["weights"]
    what = ("config" if trained_for["config"] != target["config"] else
            "weights" if None not in weights and weights[0] != weights[1] else None)
    if what:
        raise UserError(f"the drafter at {drafter_path} was trained for the target {trained_for['name']!r}, and "
                        f"--target {target['name']!r} has other {what}: pass the target it drafts for")

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

def make_drafter_config(cfg, tcfg, tok, target=None):
    """The drafter's DFlashConfig for this target (tok None: a random target; its last row is the mask token);
    target: target_identity's, recorded in the drafter's folder."""
    vocab = getattr(tcfg, "text_config", tcfg).vocab_size
    try:    # layer ids or a mask token this target does not have
        mask_id = cfg.mask_token_id if cfg.mask_token_id >= 0 else (
            vocab - 1 if tok is None else choose_mask_token_id(tok, vocab))
        ids = [int(x) for x in cfg.target_layer_ids.split(",")] if cfg.target_layer_ids else None
        dcfg = dm.DFlashConfig.from_target_config(tcfg, cfg.num_draft_layers, cfg.block_size, mask_id, ids)
        # a spare embedding row has no text: engines that look the mask up by name add <|MASK|> as the next id
        dcfg.mask_token = "" if tok is None else "<|MASK|>" if mask_id >= len(tok) else tok.convert_ids_to_tokens(
            mask_id)
        dcfg.target = target or {}
    except ValueError as e:
        raise UserError(f"--target-layer-ids {cfg.target_layer_ids!r}, --mask-token-id {cfg.mask_token_id} "
                        f"for this target: {e}") from None
    if cfg.max_length > dcfg.max_position_embeddings:
        raise UserError(f"--max-length {cfg.max_length} exceeds the target's max_position_embeddings "
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
    offline = hub_offline(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=bool(offline))
    except Exception as e:    # no such folder or hub name, missing or cut weights: name it, in one line
        raise UserError(f"cannot load the target {path!r}: "
                        f"{offline or first_line(e)}") from None
    return model.to(device).eval().requires_grad_(False)

def load_target(path, device, dtype, layer_ids, log=print, random_weights=False, whole=False):
    """The target cut after the deepest captured layer (whole: all of it, for its final hidden states), hooked to keep
    the captured outputs (dm.capture). random_weights or random:<config.json>: seeded random weights of its shape."""
    from transformers import AutoConfig, AutoModelForCausalLM
    if random_weights or path.startswith("random:"):
        tcfg = load_target_config(path)[0] if path.startswith("random:") else AutoConfig.from_pretrained(
            path, local_files_only=bool(hub_offline(path)))
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
