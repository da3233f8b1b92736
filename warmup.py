"""Fill the compile cache ahead of train_dflash.py: its warm-up (compiled.warm_up) of every (drafter device x shape
bucket) and of the target's layers, on random weights of the target's shape (a compile reads shapes, not values).

    python warmup.py --target Qwen/Qwen3-8B --drafter-devices cuda:5,cuda:6,cuda:7 [train_dflash.py options]
"""
import sys

import torch

import compiled
import config
import errors
from master_adamw import cast_weights
import models
from replicas import forward_backward

def build_drafters(cfg):
    """The drafter replicas and the shape plan train_dflash.py builds for `cfg`, without the target's weights: its
    meta-device model gives the embedding and LM head shapes and whether they are one tensor; empty tensors stand in."""
    from transformers import AutoModelForCausalLM
    tcfg, tok = models.load_target_config(cfg.target)
    tdevs, ddevs = config.resolve_devices(cfg)
    dcfg = models.make_drafter_config(cfg, tcfg, tok, models.target_identity(cfg.target, tcfg))
    tdtype = config.param_dtype(tdevs[0])
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tcfg, dtype=tdtype)
    m_emb, m_head = meta.get_input_embeddings().weight, meta.get_output_embeddings().weight
    emb = torch.empty(m_emb.shape, dtype=tdtype, device=tdevs[0])
    # tied: a second view, not the same object, as the trainer's two .detach() calls (dynamo guards on it)
    head = emb.detach() if m_head is m_emb else torch.empty(m_head.shape, dtype=tdtype, device=tdevs[0])
    drafters = [models.new_drafter(dcfg, emb, head, d, cfg.seed) for d in ddevs]
    for dr, d in zip(drafters, ddevs):
        cast_weights(dr.parameters(), config.param_dtype(d))     # as the trainer's optimiser does
    return dcfg, drafters, config.shape_plan(cfg, dcfg, config.batch_memory(dcfg, tcfg, tdevs, ddevs))

@errors.script
def main(argv=None):
    cfg = config.parse_args(sys.argv[1:] if argv is None else argv)
    config.check_outputs(cfg, ("cache_dir", "compile_cache"))
    cfg.target = models.target_and_data(cfg)[0]      # the embedded default, prepared once
    dcfg, drafters, shapes = build_drafters(cfg)
    attn = config.resolve_attn(cfg, [d.fc.weight.device for d in drafters])
    targets = []
    if attn == "flex":        # the target's compiled layers too, on random weights of its shape
        compiled.use_compile_cache(cfg.compile_cache)
        for dr in drafters:
            compiled.compile_drafter(dr)
        for d in config.resolve_devices(cfg)[0]:
            target = models.load_target(cfg.target, d, config.param_dtype(d), dcfg.target_layer_ids,
                                        random_weights=True, whole=cfg.teacher)
            compiled.compile_target_layers(target)
            targets.append(compiled.GraphedTarget(target, dcfg.target_layer_ids, final=cfg.teacher))
    print(f"[warmup] {len(drafters)} drafter device(s) x {len(shapes)} shapes, {len(targets)} compiled target(s), "
          f"attention {attn}")
    rows = compiled.warm_up(drafters, shapes, forward_backward, cfg.loss, targets=targets)
    print(f"[warmup] done: {sum(r[2] for r in rows):.1f}s over {len(rows)} (device, shape) pairs")

if __name__ == "__main__":
    main()
