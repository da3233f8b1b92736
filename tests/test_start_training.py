"""start_training.sh, the one command, end to end on the embedded default."""
import re
import shutil
import sys

from helpers import REPO, assert_ok, child_env, metrics, run_cmd


def test_start_training_sh_embedded_default_end_to_end(embedded, tmp_path):
    """No --target / --data: the embedded default (SmolLM2-135M-Instruct + ShareGPT) through
    start_training.sh, with a tmp cache holding a link to the prepared model and the first 260 ShareGPT
    records (a tenth held out), so the test does not re-tokenise ShareGPT; the eval command it prints uses the
    held-out prompts and the defaults of this machine. The scripts run from a copy, whose logs/ takes the log."""
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
    assert f"[target] {cache}/SmolLM2-135M-Instruct on cpu" in p.out
    held = out / "heldout.jsonl"
    assert f"--prompts {held}" in p.out and len(held.read_text().splitlines()) >= 20, p.tail()
    assert "summary" in p.out and "[ckpt]" in p.out
    assert f"  tensorboard    tensorboard --logdir {out / 'tensorboard'}" in p.out, p.tail()   # --tensorboard auto
    assert [r["step"] for r in metrics(out)] == [1, 2]
    logfile = re.search(r"\[start\] logging to (logs/\S+)", p.out)
    assert logfile and "summary" in (code / logfile.group(1)).read_text()
    target = AutoModelForCausalLM.from_pretrained(embedded[0])
    drafter = dm.load_drafter(str(out / "step_000002" / "drafter"), target=target)
    assert drafter.config.vocab_size == target.config.vocab_size and drafter.config.num_draft_layers == 5
