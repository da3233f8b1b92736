"""CPU tests of records.py: a tiny run's TensorBoard events, log line and metrics.jsonl agree."""
import re

import torch

from helpers import TINY, assert_ok, metrics, tb_scalars, train


def test_tensorboard_events_hold_every_figure_of_the_log_line_at_its_step_equal_to_metrics_jsonl(
        llama, sharegpt, cache_dir, tmp_path):
    out, tb = tmp_path / "out", tmp_path / "tb"
    p = train(*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 20,
              "--heldout", 0, "--max-steps", 4, "--ckpt-interval", 100, "--out-dir", out, "--tensorboard", tb)
    assert_ok(p)
    assert f"  tensorboard    tensorboard --logdir {tb}" in p.out, p.tail()      # the summary says how to view it
    assert re.search(r"step 4/4 .*\| busy target \d+% drafter \d+% \|", p.out), p.tail()
    events, recs = tb_scalars(tb), metrics(out)
    logged = {"loss", "acc@1", "acc@7", "sim_tau", "lr", "grad_norm", "tok_s", "mfu_drafter", "mfu_drafter_real", "busy_target",
              "busy_drafter", "queue_load", "queue_feat", "sync_ms", "eta_min", "ckpt_pause_s"}     # no GPU: no mem_gib
    assert set(events) == logged, sorted(events)
    assert all([s for s, _ in events[tag]] == [1, 2, 3, 4] for tag in logged), events
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))             # TensorBoard keeps float32
    for tag, key in {"loss": "loss", "sim_tau": "sim_tau", "lr": "lr", "grad_norm": "grad_norm"}.items():
        assert [v for _, v in events[tag]] == [f32(r[key]) for r in recs], tag
    for tag, i in {"acc@1": 0, "acc@7": -1}.items():
        assert [v for _, v in events[tag]] == [f32(r["acc"][i]) for r in recs], tag
    assert all(v > 0 for _, v in events["tok_s"]) and all(0 < v <= 1.5 for _, v in events["busy_drafter"])
