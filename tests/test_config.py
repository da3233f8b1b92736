"""CPU tests of config.py: the options and their errors, the shape plan and the automatic batch, devices and the
attention path."""
import os
import sys

import pytest
import torch

from errors import UserError
from helpers import REPO, assert_ok, here


def test_help_lists_every_option_and_unknown_or_mistyped_options_are_errors(tmp_path, capsys):
    import config
    import warmup
    p = here("train_dflash", "--help")
    assert_ok(p)
    with pytest.raises(SystemExit) as e:
        warmup.main(["--help"])
    assert e.value.code == 0
    for text in (p.out, capsys.readouterr().out):
        for f in config.TrainConfig.__dataclass_fields__:
            assert "--" + f.replace("_", "-") in text, f
        assert "(default: 3072)" in text and "passes over the data" in text
    p = here("train_dflash", "--max-step", 3, "--out-dir", tmp_path / "a")
    assert p.rc != 0 and "unknown option --max-step (did you mean --max-steps" in p.out, p.out
    assert not (tmp_path / "a").exists()          # nothing started
    for argv, needle in [(["--max-steps", "three"], "--max-steps: invalid int value: 'three'"),
                         (["--lr"], "--lr: expected one argument"),
                         (["--epochs", "1", "2"], "unexpected argument '2'"),
                         (["--resume", "maybe"], "unexpected argument 'maybe'"),
                         (["--attn", "flexx"], "--attn must be auto|flex|sdpa"),
                         (["--block-size", "1"], "--block-size >= 2"),
                         (["--data", "/no/such/file.jsonl"], "data file not found: /no/such/file.jsonl"),
                         # a bare file name is a file too, and is checked before any target is looked at
                         (["--data", "mydata.jsonl", "--target", "random:x.json"], "data file not found: mydata.jsonl"),
                         (["max-steps", "3"], "unexpected argument 'max-steps'"),
                         (["--num_anchors_x", "3"], "unknown option --num_anchors_x"),
                         (["--compile-scope", "trunk"], "unknown option --compile-scope"),
                         (["--clip", "0"], "--clip must be > 0"),
                         (["--queue-depth", "0"], "--queue-depth must be >= 1"),
                         (["--lr", "0"], "need --lr > 0"),
                         (["--buckets", "1024,4096"], "max_length] = [32, 3072], got 1024,4096"),
                         (["--buckets", "1k"], "--buckets must be comma-separated integers"),
                         (["--lr", "-1e-3"], "need --lr > 0"),           # a negative value, not an unknown option
                         (["--seed", "-1"], "need --seed, --max-samples"),
                         (["--max-samples", "-5"], "need --seed, --max-samples"),
                         (["--gamma", "-1"], "--gamma must be > 0 (0: the block size's default), got -1.0"),
                         (["--dpace", "1.5"], "--dpace must lie in (0, 1] (0: off), got 1.5"),
                         (["--data", "synthetic:abc"], "--data synthetic:abc: synthetic:N needs a number N >= 1"),
                         (["--data", "synthetic:0"], "--data synthetic:0: synthetic:N needs a number N >= 1"),
                         (["--data", str(tmp_path)], f"data folder {tmp_path} holds no .json, .jsonl")]:
        with pytest.raises(UserError) as e:
            config.parse_args(argv)
        assert needle in str(e.value), (argv, str(e.value))
    cfg = config.parse_args(["--max-steps", "3", "--resume", "--data", str(REPO / "README.md"), "--lr", "1e-3"])
    assert (cfg.max_steps, cfg.resume, cfg.data, cfg.lr) == (3, True, [str(REPO / "README.md")], 1e-3)
    assert config.parse_args(["--data", "org/chats"]).data == ["org/chats"]     # a hub data set, not a file


def _drafter_config(H, I, heads, kv, hd, V, layers=5):
    import dflash_model as dm
    return dm.DFlashConfig(hidden_size=H, intermediate_size=I, num_attention_heads=heads, num_key_value_heads=kv,
                           head_dim=hd, vocab_size=V, num_target_layers=layers * 6, num_draft_layers=layers)


QWEN3_8B_DRAFTER = dict(H=4096, I=12288, heads=32, kv=8, hd=128, V=151936)
SMOLLM2_DRAFTER = dict(H=576, I=1536, heads=9, kv=3, hd=64, V=49152)


def test_shape_plan_anchors_per_sequence_capped_by_length_and_rows_by_the_block_budget():
    """512 anchors per sequence, fewer only where a sequence has fewer start positions (rounded to
    128-row tiles), and no batch holds more blocks than a batch of max_length sequences."""
    import config
    dcfg = _drafter_config(**SMOLLM2_DRAFTER)
    assert config.shape_plan(config.parse_args([]), dcfg) == [(2, 256, 248), (1, 512, 504), (1, 1024, 512),
                                                             (1, 2048, 512), (1, 3072, 512)]
    assert config.shape_plan(config.parse_args(["--tokens-per-batch", "6144"]), dcfg) == [
        (4, 256, 248), (2, 512, 504), (2, 1024, 512), (2, 2048, 512), (2, 3072, 512)]


def test_auto_batch_on_a_gpu_sized_by_the_drafters_work_and_the_memory():
    """On a GPU an automatic batch holds STEP_FLOPS of drafter work within the memory it is given: a
    Qwen3-8B-sized drafter keeps one full-length sequence a step (its work is already above that), a
    135M target's drafter takes tens of sequences, every bucket about the same work, and less memory
    means fewer rows. An explicit --tokens-per-batch is kept as it is."""
    import config
    import dflash_model as dm
    cfg, h200 = config.parse_args([]), 70e9
    qwen, small = _drafter_config(**QWEN3_8B_DRAFTER), _drafter_config(**SMOLLM2_DRAFTER)
    assert config.shape_plan(cfg, qwen, h200) == config.shape_plan(cfg, qwen) == [
        (2, 256, 248), (1, 512, 504), (1, 1024, 512), (1, 2048, 512), (1, 3072, 512)]
    plan = config.shape_plan(cfg, small, h200)
    work = [B * A * dm.matmul_flops(small, 0, 1) for B, S, A in plan]
    assert [B for B, _, _ in plan] == [29, 14, 14, 14, 14], plan
    assert all(config.STEP_FLOPS * 0.95 < w <= config.STEP_FLOPS for w in work), work
    assert all(B * config.activation_bytes(small, S, A) <= h200 for B, S, A in plan)
    fewer = config.shape_plan(cfg, small, h200 / 4)
    assert all(B * config.activation_bytes(small, S, A) <= h200 / 4 for B, S, A in fewer)
    assert all(f[0] < p[0] for f, p in zip(fewer, plan)), (fewer, plan)
    assert config.shape_plan(config.parse_args(["--tokens-per-batch", "6144"]), small, h200)[-1] == (2, 3072, 512)


def test_compiled_drafters_need_a_gpu_each():
    """Two replicas on one GPU would run the same entries of the compiled trunk's dynamo cache from two
    threads at once (a spurious recompile): an error before anything loads. Dense SDPA and CPU allow it."""
    import config
    twice = [torch.device("cuda:0"), torch.device("cuda:0")]
    with pytest.raises(UserError, match="--drafter-devices cuda:0,cuda:0 lists a GPU twice"):
        config.resolve_attn(config.parse_args([]), twice)
    assert config.resolve_attn(config.parse_args(["--attn", "sdpa"]), twice) == "sdpa"
    assert config.resolve_attn(config.parse_args([]), [torch.device("cuda:0"), torch.device("cuda:1")]) == "flex"
    assert config.resolve_attn(config.parse_args([]), [torch.device("cpu")] * 2) == "sdpa"


def test_device_lists_auto_split_and_local_rank(monkeypatch):
    """auto = the original 5 target + 3 drafter split on 8 GPUs; cuda:local = this torchrun process's GPU."""
    import config
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    t, d = config.resolve_devices(config.parse_args([]))
    assert [str(x) for x in t] == [f"cuda:{i}" for i in range(5)] and [str(x) for x in d] == ["cuda:5", "cuda:6", "cuda:7"]
    monkeypatch.setenv("LOCAL_RANK", "3")
    t, d = config.resolve_devices(config.parse_args(["--target-devices", "cuda:local", "--drafter-devices", "cuda:local"]))
    assert [str(x) for x in t] == ["cuda:3"] and [str(x) for x in d] == ["cuda:3"]
    with pytest.raises(UserError, match="only 8 CUDA device"):
        config.resolve_devices(config.parse_args(["--target-devices", "cuda:9"]))


def test_tensorboard_without_its_package_is_an_error_before_anything_starts(monkeypatch, tmp_path):
    import config
    assert config.parse_args(["--tensorboard", str(tmp_path / "tb")]).tensorboard == str(tmp_path / "tb")
    assert config.parse_args(["--tensorboard", "auto", "--out-dir", "o"]).tensorboard == os.path.join("o", "tensorboard")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)      # the import fails, as when not installed
    with pytest.raises(UserError, match="--tensorboard needs the tensorboard package: pip install tensorboard"):
        config.parse_args(["--tensorboard", str(tmp_path / "tb")])
    assert config.parse_args([]).tensorboard == ""                           # off: never imported
    assert not (tmp_path / "tb").exists()
