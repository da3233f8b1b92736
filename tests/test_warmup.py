"""CPU tests of warmup.py: it builds the trainer's drafters, fills the target's compile cache from random weights
of its shape, and prints a line per device and shape."""
import re
import sys

import pytest

from helpers import REPO, TINY, assert_ok, run_cmd, tiny_config_json, tiny_llama


# the compile gate and dynamo's limits are process-wide: each test starts and ends with them as a fresh process
# has them; one intra-op thread for the module (conftest.py: clean_gate, one_thread)
pytestmark = pytest.mark.usefixtures("one_thread", "clean_gate")


def layout(t):
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.storage_offset(), t.untyped_storage().nbytes())


@pytest.mark.parametrize("tied", [False, True])
def test_warmup_builds_the_drafter_the_trainer_builds(tmp_path, tied):
    """Compiled graphs depend on the drafter's config (mask token included), its weights' dtype, and the
    embedding / LM head tensors it reads (dtype, layout, aliasing): `python warmup.py` must fill the
    cache entries the trainer then hits, so it builds the trainer's drafters (without the target's
    weights)."""
    import config
    import train_dflash as tr
    import warmup
    path = tiny_config_json(tmp_path / "tiny.json", tie_word_embeddings=tied)
    cfg = config.parse_args(["--target", f"random:{path}", "--data", "synthetic:4", "--max-length", "256",
                             "--num-anchors", "32", "--block-size", "8", "--num-draft-layers", "2",
                             "--target-devices", "cpu", "--drafter-devices", "cpu", "--out-dir", str(tmp_path)])
    trainer = tr.Trainer(cfg, log=lambda m: None)
    trainer.setup()
    trainer.build_models()
    dcfg, drafters, shapes = warmup.build_drafters(cfg)
    mine, theirs = drafters[0], trainer.replicas.drafters[0]
    assert dcfg == trainer.dcfg and shapes == trainer.plan.shapes and len(drafters) == len(trainer.replicas.drafters) == 1
    assert dcfg.mask_token_id == 511                                # the trainer's pick for a tokenizer-less target
    assert [(n, p.dtype, p.shape, p.requires_grad) for n, p in mine.named_parameters()] == \
        [(n, p.dtype, p.shape, p.requires_grad) for n, p in theirs.named_parameters()]
    for name in ("embed_weight", "lm_head_weight"):
        assert layout(getattr(mine, name)) == layout(getattr(theirs, name)), name
    for d in (mine, theirs):      # tied: two tensor objects over one storage, in both
        assert (d.embed_weight.data_ptr() == d.lm_head_weight.data_ptr()) is tied and d.embed_weight is not d.lm_head_weight


def test_warmup_py_fills_the_targets_cache_from_random_weights_of_its_shape(tmp_path):
    """warmup.py compiles the target's layers on random weights of the target's shape: the compile cache
    it fills serves the real weights (a cache hit in a later process), because a compile reads shapes,
    never values. (Processes of their own: in this one, dynamo would reuse its in-process graphs.)"""
    import json
    import sys
    tiny_llama(3).save_pretrained(tmp_path / "m")
    # each process writes warm_up's rows and whether the target's weights are the saved ones
    code = ("import json, sys, torch, compiled, safetensors.torch\n"
            f"compiled.use_compile_cache({str(tmp_path / 'cache')!r})\n"
            "import config, models, dflash_model as dm\n"
            f"t = models.load_target({str(tmp_path / 'm')!r}, 'cpu', torch.float32, [0, 2], log=print, "
            "random_weights=sys.argv[1] == 'random')\n"
            f"saved = safetensors.torch.load_file({str(tmp_path / 'm' / 'model.safetensors')!r})\n"
            "same = {n: torch.equal(p, saved[n]) for n, p in t.named_parameters()}\n"
            "compiled.compile_target_layers(t)\n"
            "rows = compiled.warm_up([], [(2, 64, 8)], None, dm.Loss(7.0), "
            "targets=[compiled.GraphedTarget(t, [0, 2], False)], log=lambda m: None)\n"
            "with open(sys.argv[2], 'w') as f:\n"
            "    json.dump({'rows': rows, 'saved_weights': same, 'layers': len(t.model.layers)}, f)\n")
    got = {}
    for weights in ("random", "real"):
        p = run_cmd([sys.executable, "-c", code, weights, tmp_path / f"{weights}.json"], timeout=300)
        assert p.rc == 0, p.tail()
        got[weights] = json.loads((tmp_path / f"{weights}.json").read_text())
    # random: seeded weights of the saved shape (none the saved ones but the norms' ones); real: the saved weights
    seeded, saved = got["random"]["saved_weights"], got["real"]["saved_weights"]
    assert seeded.keys() == saved.keys() and len(saved) > 10 and all(saved.values()), got
    assert all("norm" in n for n, same in seeded.items() if same) and not all(seeded.values()), seeded
    assert got["random"]["layers"] == got["real"]["layers"] == 3, got          # the same shape: the same compile
    # one row each: the target at (rows, length), compiled cold from the random weights, a cache hit for the real ones,
    # its features compared with the eager target's
    (dev, shape, _, how), = got["random"]["rows"]
    assert (dev, shape) == ("cpu target", [2, 64]) and how.startswith("cold compile, features "), got["random"]
    (dev, shape, _, how), = got["real"]["rows"]
    assert (dev, shape) == ("cpu target", [2, 64]) and how.startswith("cache hit, features "), got["real"]


def test_warmup_cli_prints_a_line_per_device_and_shape(llama, tmp_path):
    p = run_cmd([sys.executable, str(REPO / "warmup.py"), *TINY, "--target", llama, "--drafter-devices", "cpu,cpu",
                 "--out-dir", str(tmp_path / "out")])
    assert_ok(p)
    # README: warmup.py prints a line per (device, shape) with its seconds and how it warmed, then the total; its main
    # returns nothing, so these lines are what it gives
    rows = re.findall(r"^\[warmup\] \d/6 cpu\s+\((\d+), (\d+), (\d+)\)\s+[\d.]+s  eager \(sdpa\)", p.out, re.M)
    assert [tuple(map(int, r)) for r in rows] == [(1, 64, 32), (1, 128, 32), (1, 256, 32)] * 2, p.out
    assert re.search(r"^\[warmup\] done: [\d.]+s over 6 \(device, shape\) pairs$", p.out, re.M), p.out
