"""bench.py's layout table against hand-computed predictions, on Qwen3-8B's H200 figures: a 3072-token batch's
target forward takes 96.8 ms, its drafter step 126.4 ms."""
import pytest
import torch

import bench
import config

QWEN3_8B = dict(tokens=3072, t_target=0.0968, t_drafter=0.1264)


def test_one_and_two_gpus_predictions_by_hand():
    assert [(r["tok_s"], r["binds"]) for r in bench.layouts(1, **QWEN3_8B)] == \
        [(pytest.approx(13_763.4, abs=0.1), "both")]                                  # 3072 / 0.2232
    rows = bench.layouts(2, **QWEN3_8B)
    print("\n" + bench.format_layouts(rows))
    assert [(r["target_devices"], r["drafter_devices"], r["tok_s"], r["binds"]) for r in rows] == [
        ("cuda:0,cuda:1", "cuda:0,cuda:1", pytest.approx(26_150.5, abs=0.1), "both"),   # 2 x 13,763 x 0.95
        ("cuda:0", "cuda:1", pytest.approx(24_303.8, abs=0.1), "drafter")]              # 3072 / 0.1264


def test_eight_gpus_table_best_first():
    rows = bench.layouts(8, **QWEN3_8B)
    table = bench.format_layouts(rows)
    print("\n" + table)
    by = {(r["target_devices"].count(",") + 1, r["binds"] == "both"): r for r in rows}
    assert by[8, True]["tok_s"] == pytest.approx(104_602.2, abs=0.1)            # 8 x 3072 / 0.2232 x 0.95
    assert by[5, False]["tok_s"] == pytest.approx(69_265.8, abs=0.1)            # 3 x 3072 / 0.1264 x 0.95
    assert (by[5, False]["binds"], by[3, False]["binds"]) == ("drafter", "target")  # 3 x 3072 / 0.0968 = 95,207
    assert by[3, False]["tok_s"] == pytest.approx(95_206.6, abs=0.1)
    assert [r["tok_s"] for r in rows] == sorted((r["tok_s"] for r in rows), reverse=True) and len(rows) == 8
    assert "8 GPUs both roles        104,602  both     cuda:0-7 / cuda:0-7" in table
    assert "5 target + 3 drafter      69,266  drafter  cuda:0-4 / cuda:5-7" in table


def test_every_layout_is_one_the_trainer_resolves_and_auto_is_the_five_three_row(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    for r in bench.layouts(8, **QWEN3_8B):
        tdevs, ddevs = config.resolve_devices(config.parse_args(["--target-devices", r["target_devices"],
                                                                 "--drafter-devices", r["drafter_devices"]]))
        both = r["binds"] == "both"
        assert len(tdevs) + len(ddevs) == 8 * (1 + both) and (tdevs == ddevs) is both
    tdevs, ddevs = config.resolve_devices(config.parse_args([]))
    assert [str(d) for d in tdevs + ddevs] == [f"cuda:{i}" for i in range(8)] and len(ddevs) == 3
