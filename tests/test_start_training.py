"""start_training.sh, the one command, end to end on the embedded default."""
import json
import shutil
import sys

from helpers import REPO, assert_ok, checkpoints, child_env, load_state, metrics, run_cmd, tb_scalars


def test_start_training_sh_embedded_default_end_to_end(embedded, tmp_path):
    """No --target / --data: the embedded default (SmolLM2-135M-Instruct + ShareGPT) through
    start_training.sh, with a tmp cache holding a link to the prepared model and the first 260 ShareGPT
    records (a tenth held out), so the test does not re-tokenise ShareGPT; the eval command it prints uses the
    held-out prompts and the defaults of this machine. The scripts run from a copy, whose logs/ takes the log."""
    import data_dflash as D
    import dflash_model as dm
    from transformers import AutoModelForCausalLM
    code = tmp_path / "code"
    code.mkdir()
    for f in [*REPO.glob("*.py"), *REPO.glob("*.sh"), *REPO.glob("requirements*.txt")]:
        shutil.copy(f, code)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "SmolLM2-135M-Instruct").symlink_to(embedded[0])
    with open(embedded[1]) as src, open(cache / "sharegpt_v3.jsonl", "w") as dst:
        for _, line in zip(range(260), src):
            dst.write(line)
    out = tmp_path / "out"
    env = child_env(DFLASH_SKIP_INSTALL="1", PYTHON=sys.executable)
    p = run_cmd(["bash", str(code / "start_training.sh"), "--max-steps", "2", "--max-length", "128",
                 "--num-anchors", "8", "--max-samples", "20", "--log-interval", "1", "--cache-dir", str(cache),
                 "--out-dir", str(out)], timeout=300, env=env, cwd=tmp_path)
    assert_ok(p)
    model = cache / "SmolLM2-135M-Instruct"
    assert checkpoints(out) == ["step_000002"] and [r["step"] for r in metrics(out)] == [1, 2]
    # start_training.sh's CPU defaults, the options given overriding them: its --lr 1e-3 and 8-minute budget kept
    cfg = load_state(out / "step_000002")["config"]
    assert (cfg["lr"], cfg["max_minutes"], cfg["resume"]) == (1e-3, 8, True), cfg
    assert (cfg["max_length"], cfg["num_anchors"], cfg["max_samples"], cfg["max_steps"]) == (128, 8, 20, 2), cfg
    assert (cfg["target"], cfg["data"], cfg["tensorboard"]) == ("", [], str(out / "tensorboard")), cfg
    # the embedded default's target from the cache given: the drafter records it, and drafts with its vocabulary
    target = AutoModelForCausalLM.from_pretrained(embedded[0])
    drafter = dm.load_drafter(str(out / "step_000002" / "drafter"), target=target)
    assert drafter.config.target["name"] == str(model), drafter.config.target
    assert drafter.config.vocab_size == target.config.vocab_size and drafter.config.num_draft_layers == 5
    # the held-out prompts: the last tenth of the 260 records' conversations (at most --heldout 200 of them)
    held = out / "heldout.jsonl"
    convs = D.load_conversations([str(cache / "sharegpt_v3.jsonl")])[0]
    assert D.load_conversations([str(held)]) == (D._split_heldout(convs, 200)[1], {})
    assert len(D.load_conversations([str(held)])[0]) >= 20
    # --tensorboard auto: the log line's figures as events at steps 1 and 2
    assert {steps for tag, rows in tb_scalars(out / "tensorboard").items() for steps in [tuple(s for s, _ in rows)]} \
        == {(1, 2)}
    # README: the run ends with a summary naming its checkpoint, the tensorboard command and the eval_dflash.py
    # command (on the held-out prompts) that users copy
    assert f"  checkpoint     {out}/step_000002\n" in p.out, p.tail()
    assert f"  tensorboard    tensorboard --logdir {out / 'tensorboard'}\n" in p.out, p.tail()
    assert (f"    python eval_dflash.py --target {model} --drafter {out}/step_000002/drafter --prompts {held}\n"
            in p.out), p.tail()
    # the output also goes to logs/: one log file of this start, the trainer's output as it was printed
    logs = list((code / "logs").iterdir())
    assert [f.name.startswith("train_") and f.suffix == ".log" for f in logs] == [True], logs
    text = logs[0].read_text()
    assert p.out.endswith(text) and len(text.splitlines()) > 10, text[-3000:]
    # the main job measures what it made: eval_dflash.py on the held-out prompts (a CPU's short defaults), its
    # figures into <out-dir>/eval.json and the drafter's card
    res = json.loads((out / "eval.json").read_text())
    assert res["drafters"] == {"step_000002": str(out / "step_000002" / "drafter")} and res["prompt_files"] == [str(held)]
    assert res["prompts"] == 5 and res["methods"]["step_000002"]["lossless"] == 5, res
    card = (out / "step_000002" / "drafter" / "README.md").read_text()
    assert f"| lossless | 5/5 |" in card and f"| tau (acceptance length) | " \
        f"{res['methods']['step_000002']['mean_tau']:.2f} (n-gram lookup" in card, card
    assert f"--speculative-config '{{\"method\": \"dflash\", \"model\": \"{out}/step_000002/drafter\"" in card, card
