"""The layout advisor's arithmetic against hand-computed predictions (layout.py), on Qwen3-8B's H200 figures:
a 3072-token batch's target forward takes 96.8 ms, its drafter step 126.4 ms."""
import pytest
import torch

import config
import layout

QWEN3_8B = [layout.Bucket(share=1.0, tokens=3072, t_target=0.0968, t_drafter=0.1264)]
CUDA = lambda *ids: [f"cuda:{i}" for i in ids]


def test_one_and_two_gpus_predictions_by_hand_and_both_roles_within_ten_percent_is_no_warning():
    assert layout.predict(1, 1, QWEN3_8B, shared=True) == (pytest.approx(13_763.4, abs=0.1), "both")  # 3072 / 0.2232
    rows = layout.layouts(2, QWEN3_8B)
    print("\n" + layout.format_table(rows))
    assert rows == [("cuda:0,cuda:1", "cuda:0,cuda:1", pytest.approx(26_150.5, abs=0.1), "both"),  # 2 x 13,763 x 0.95
                    ("cuda:0", "cuda:1", pytest.approx(24_303.8, abs=0.1), "drafter")]           # 3072 / 0.1264
    assert layout.warning(rows, QWEN3_8B, CUDA(0), CUDA(1)) == ""                                  # best 7.6% faster
    assert layout.layouts(1, QWEN3_8B) == [("cuda:0", "cuda:0", pytest.approx(13_763.4, abs=0.1), "both")]


def test_eight_gpus_table_and_the_warning_on_a_layout_over_ten_percent_slower():
    rows = layout.layouts(8, QWEN3_8B)
    table = layout.format_table(rows)
    print("\n" + table)
    by = {(r.target_devices.count(",") + 1, r.binds == "both"): r for r in rows}
    assert by[8, True].tok_s == pytest.approx(104_602.2, abs=0.1)            # 8 x 3072 / 0.2232 x 0.95
    assert by[5, False].tok_s == pytest.approx(69_265.8, abs=0.1)            # 3 x 3072 / 0.1264 x 0.95
    assert (by[5, False].binds, by[3, False].binds) == ("drafter", "target")  # 3 x 3072 / 0.0968 = 95,207
    assert by[3, False].tok_s == pytest.approx(95_206.6, abs=0.1)
    assert [r.tok_s for r in rows] == sorted((r.tok_s for r in rows), reverse=True) and len(rows) == 8
    assert "8 GPUs both roles        104,602  both     cuda:0-7 / cuda:0-7" in table
    assert "5 target + 3 drafter      69,266  drafter  cuda:0-4 / cuda:5-7" in table
    assert layout.warning(rows, QWEN3_8B, CUDA(0, 1, 2, 3, 4, 5, 6, 7), CUDA(0, 1, 2, 3, 4, 5, 6, 7)) == ""
    warning = layout.warning(rows, QWEN3_8B, CUDA(0, 1, 2, 3, 4), CUDA(5, 6, 7))
    assert warning.startswith("WARNING: --target-devices cuda:0,cuda:1,cuda:2,cuda:3,cuda:4 --drafter-devices "
                              "cuda:5,cuda:6,cuda:7 is predicted at 69,266 tok/s (drafter binds)"), warning
    assert (f"--target-devices {layout.devices(range(8))} --drafter-devices {layout.devices(range(8))} at "
            "104,602 tok/s (51% faster)") in warning
    assert layout.warning(rows, QWEN3_8B, CUDA(0, 1, 2), CUDA(3, 4, 5, 6, 7)) == ""       # best 9.9% faster
    # GPUs shared by only some of the threads: not a layout the model covers, so no prediction and no warning
    assert layout.predict_devices(CUDA(0, 1), CUDA(1, 2), QWEN3_8B) is None
    assert layout.warning(rows, QWEN3_8B, CUDA(0, 1), CUDA(1, 2)) == ""


def test_buckets_mix_by_their_share_of_the_batches_time_weighted():
    # half the batches 3072 tokens (96.8 / 126.4 ms), half 2048 (60 / 120 ms): a batch holds 2560 tokens
    # and takes 78.4 ms of target and 123.2 ms of drafter time on average; the shares need not sum to 1
    mix = [layout.Bucket(3, 3072, 0.0968, 0.1264), layout.Bucket(3, 2048, 0.060, 0.120)]
    assert layout.predict(1, 1, mix, shared=True) == (pytest.approx(12_698.4, abs=0.1), "both")   # 2560 / 0.2016
    assert layout.predict(1, 1, mix) == (pytest.approx(20_779.2, abs=0.1), "drafter")               # 2560 / 0.1232
    assert layout.predict(4, 1, mix) == (pytest.approx(20_779.2, abs=0.1), "drafter")
    assert layout.predict(1, 4, mix, sync=1.0) == (pytest.approx(32_653.1, abs=0.1), "target")     # 2560 / 0.0784


def test_every_advised_layout_is_one_the_trainer_resolves_and_auto_is_the_five_three_row(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    rows = layout.layouts(8, QWEN3_8B)
    for r in rows:
        tdevs, ddevs = config.resolve_devices(config.parse_args(["--target-devices", r.target_devices,
                                                                 "--drafter-devices", r.drafter_devices]))
        assert layout.predict_devices(tdevs, ddevs, QWEN3_8B) == (r.tok_s, r.binds)
    auto = config.resolve_devices(config.parse_args([]))
    assert layout.predict_devices(*auto, QWEN3_8B) == (pytest.approx(69_265.8, abs=0.1), "drafter")
