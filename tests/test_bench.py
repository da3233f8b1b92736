"""CPU tests of bench.py: the main job's figures from its files, and the tiny benchmark end to end."""
import json
import math
import re
import sys

import pytest

from helpers import REPO, assert_ok, run_cmd

# bench.py's main in a process of its own, with the number of layers of each target models.load_target gave it to time
# written to the file sys.argv[1] (its options follow)
TIMED_DEPTH = ("import json, sys, bench, models\n"
               "load, depths = models.load_target, []\n"
               "models.load_target = lambda *a, **k: depths.append(len((m := load(*a, **k)).model.layers)) or m\n"
               "bench.main(sys.argv[2:])\n"
               "with open(sys.argv[1], 'w') as f:\n"
               "    json.dump(depths, f)\n")


def test_bench_embedded_reads_the_main_jobs_figures_from_its_files_and_eval_runs(tmp_path):
    """bench.py --embedded's figures (its GPU run is not a CPU test): regeneration from generate_data.py's manifest,
    start-up, warm-up and the summary's busy and sync shares from the log, the last log line's MFU, steps/s from
    metrics.jsonl after its first fifth; per method tau and the mean, range and ratio to tau of the batch-1 speed-ups of the eval runs."""
    import bench
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time": 100 + s / 40}) + "\n"
                                                    for s in range(1, 101)))
    (tmp_path / "m.json").write_text(json.dumps({"this_run": {"tok_s": 1e5, "generation_seconds": 100.0},
                                                 "counts": {"generated_tokens": 10 ** 7}}))
    log = ("[run] start-up 201.5s: imports ...\n[warmup] done in 95.0s\nstep 50 | MFU drafter 20.0% (real tokens 15.0%) "
           "| busy\nstep 100 | MFU drafter 30.1% (real tokens 25.2%) | busy\n  busy           target 30%; drafter 96% "
           "(share of the training time on device work); optimiser step + gradient sync 4%\n")
    got = bench.main_job_figures(log, tmp_path, tmp_path / "m.json")
    assert got == {"regen_tok_s": 1e5, "regen_s": 100.0, "regen_tokens": 10 ** 7, "startup_s": 201.5, "warmup_s": 95.0,
                   "train_steps": 100, "train_steps_s": pytest.approx(40.0), "train_busy": "target 30%; drafter 96%",
                   "optimiser_sync_share": "4%", "train_mfu_last_line": "30.1% (real tokens 25.2%)"}
    run = lambda up: {"prompts": 100, "methods": {"d": {"mean_tau": 3.0, "lossless": 100}},
                      "speed": {"methods": {"target greedy": {"speedup": 1.0, "tok_s": 600.0},
                                            "d": {"speedup": up, "tok_s": 600.0 * up}}}}
    got = bench.eval_figures([run(2.4), run(2.5), run(2.6)])
    assert got["lossless"] == {"d": 100} and got["target greedy"]["tau"] is None
    assert got["d"]["speedup"] == pytest.approx(2.5) and got["d"]["speedup_range"] == [2.4, 2.6]
    assert got["d"]["speedup_per_tau"] == pytest.approx(2.5 / 3.0)


def test_bench_tiny_reports_every_figure_and_a_two_replica_layout(tmp_path):
    """bench.py at toy size on CPU: every figure of the table lands in --json (values are timings, not
    asserted), --pipeline-only runs the real loop on a 2-replica layout, and the step with distillation runs the
    target's whole depth."""
    bench = str(REPO / "bench.py")
    out, depths = tmp_path / "bench.json", tmp_path / "depths.json"
    p = run_cmd([sys.executable, "-c", TIMED_DEPTH, depths, "--tiny", "--device", "cpu", "--steps", "1", "--rounds",
                 "1", "--pipeline-steps", "10", "--json", str(out)], timeout=300)
    assert_ok(p)
    assert json.loads(depths.read_text()) == [6], p.tail()             # cut after the deepest feature layer (of 8)
    res = json.loads(out.read_text())
    for key in ("target_ms", "target_tok_s", "target_mfu", "drafter_ms", "drafter_mfu", "warmup_cold_s",
                "sum_of_parts_tok_s", "pipeline_tok_s", "pipeline_vs_sum_of_parts", "warmup_warm_cache_s"):
        assert isinstance(res[key], float) and math.isfinite(res[key]), (key, res.get(key))
    assert set(res["spread_ms"]) == {"target_ms", "target_eager_ms", "drafter_ms"}
    out2 = tmp_path / "layout.json"
    p = run_cmd([sys.executable, bench, "--tiny", "--device", "cpu", "--pipeline-only", "--target-devices", "cpu",
                 "--drafter-devices", "cpu,cpu", "--pipeline-steps", "10", "--json", str(out2)], timeout=300)
    assert_ok(p)
    res = json.loads(out2.read_text())
    assert res["pipeline_devices"] == {"target": "cpu", "drafter": "cpu,cpu"} and res["pipeline_tok_s"] > 0
    # the replicas' bit-identity check at the run's end: only its log line (which bench.py passes on) says it ran
    assert "[replicas] 2 replica(s) x 1 rank(s) bit-identical after step 10" in p.out, p.out
    assert re.fullmatch(r"target \d+%; drafter cpu \d+%, cpu \d+%", res["pipeline_busy"]), res["pipeline_busy"]
    p = run_cmd([sys.executable, "-c", TIMED_DEPTH, depths, "--tiny", "--device", "cpu", "--steps", "1", "--rounds",
                 "1", "--no-pipeline", "--distill", "0.5", "--json", str(out)], timeout=300)
    assert_ok(p)
    res = json.loads(out.read_text())
    assert json.loads(depths.read_text()) == [8] and math.isfinite(res["drafter_ms"]), p.tail()   # the whole target
    assert "pipeline_tok_s" not in res
