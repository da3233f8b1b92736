"""Every script answers a user's mistake with one line (errors.py: UserError, script)."""
import json
import shutil
import sys

from helpers import assert_ok, run_cmd, short_chats, toy_config


def test_every_script_answers_a_bad_input_with_one_line_naming_it(llama, tmp_path):
    """A user's mistake ends every script with one line that names the file or option (a SystemExit with its
    message: no traceback). Each case runs the script's main in one child process. (diagnose.py: test_diagnose.)"""
    import dflash_model as dm
    from transformers import AutoConfig
    t = tmp_path
    good = t / "drafter"
    dm.save_drafter(dm.DFlashDrafter(dm.DFlashConfig.from_target_config(AutoConfig.from_pretrained(llama),
                                                                        num_draft_layers=1, block_size=4)), str(good))
    dm.save_drafter(dm.DFlashDrafter(toy_config(vocab_size=100)), str(t / "alien"))
    shutil.copytree(good, t / "cut")
    (t / "cut" / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:100])
    shutil.copytree(llama, t / "tcut")
    for f in (t / "tcut").glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:100])
    (t / "other").mkdir()
    (t / "other" / "config.json").write_text('{"model_type": "qwen3"}')
    (t / "bad.json").write_text("{not json")
    prompts = short_chats(t / "p.jsonl", 2)
    shutil.copy(prompts, t / "m.jsonl")
    (t / "m.jsonl.manifest.json").write_text('{"settings": {"tar')        # cut mid-write
    ev = ["eval_dflash", "--target", llama, "--prompts", prompts, "--drafter"]
    cases = [(ev + [str(t / "nowhere" / "drafter")], f"no drafter at {t / 'nowhere' / 'drafter'}"),
             (ev + [str(t / "cut")], f"cannot load the drafter weights {t / 'cut' / 'model.safetensors'}"),
             (ev + [str(t / "other")], f"{t / 'other' / 'config.json'} is not a DFlash drafter's config"),
             (ev + [str(t / "alien")], f"the drafter at {t / 'alien'} was trained for a target of hidden size 32"),
             (["eval_dflash", "--target", str(t / "tcut"), "--prompts", prompts, "--drafter", str(good)],
              f"cannot load the target '{t / 'tcut'}'"),
             (ev[:4] + [str(t / "nope.jsonl"), "--drafter", str(good)], f"--prompts: data file not found: {t / 'nope.jsonl'}"),
             (ev + [str(good), "--device", "cuda:7"], "device cuda:7 requested but only"),
             (ev + [str(good), "--device", "gpu0"], "--device 'gpu0' is not a device: cpu, cuda or cuda:N"),
             (ev + [str(good), "--json", str(t)], f"--json {t} is a folder: name a file"),
             (ev + [str(good), "--json", str(t / "bad.json" / "r.json")], f"its folder {t / 'bad.json'} is a file"),
             (["eval_dflash", "--target", str(good), "--prompts", prompts, "--drafter", str(good)],
              "is a DFlash drafter (a checkpoint's drafter/ folder): pass the target model it drafts for"),
             (["eval_dflash", "--target", "./no/such/target", "--prompts", prompts, "--drafter", str(good)],
              "cannot load the target './no/such/target': no such folder"),
             (ev + [str(good), "--num-prompts", "0"], "--num-prompts, --max-new-tokens and --max-prompt-tokens must"),
             (["generate_data", "--target", str(t / "tcut"), "--data", prompts, "--out", str(t / "g.jsonl")],
              f"cannot load the target '{t / 'tcut'}'"),
             (["generate_data", "--target", llama, "--data", prompts, "--out", str(t / "g.jsonl"), "--shard-size", "0"],
              "--shard-size >= 1"),
             (["generate_data", "--target", llama, "--data", prompts, "--out", "/proc/no/g.jsonl"],
              "--out /proc/no/g.jsonl: its folder /proc/no cannot write there"),
             (["generate_data", "--target", llama, "--data", prompts, "--out", str(t)], f"--out {t} is a folder"),
             (["generate_data", "--target", llama, "--data", prompts, "--out", prompts],
              f"--out {prompts} is one of the --data files: the answers would replace the conversations they are "
              "written from; give another --out"),
             (["generate_data", "--target", llama, "--data", prompts, "--out", str(t / "g3.jsonl"), "--max-length",
               "8"], f"no conversation was regenerated, so nothing is written to {t / 'g3.jsonl'} (skipped: skipped: "
                     "prompt longer than max length=2)"),
             (["generate_data", "--target", llama, "--data", prompts, "--out", str(t / "g.jsonl"), "--devices",
               "cuda0"], "--devices 'cuda0' is not a device"),
             (["generate_data", "--target", llama, "--data", prompts, "--out", str(t / "g.jsonl"), "--max-samples",
               "-5"], "--max-samples, --seed >= 0"),
             (["train_dflash", "--target", llama, "--data", str(t / "m.jsonl"), "--max-length", "256",
               "--cache-dir", str(t / "c"), "--out-dir", str(t / "o2")],
              f"{t / 'm.jsonl'}.manifest.json, the record generate_data.py writes beside {t / 'm.jsonl'}, is cut"),
             (["train_dflash", "--target", llama, "--data", prompts, "--out-dir", str(t / "bad.json")],
              f"--out-dir {t / 'bad.json'} is a file, not a folder"),
             (["train_dflash", "--target", llama, "--data", prompts, "--out-dir", str(t / "o"), "--cache-dir",
               str(t / "bad.json")], f"--cache-dir {t / 'bad.json'} is a file, not a folder"),
             (["train_dflash", "--target", llama, "--data", prompts, "--out-dir", str(t / "o"), "--target-devices",
               "cuda0"], "--target-devices 'cuda0' is not a device"),
             (["warmup", "--target", str(t / "nowhere"), "--data", prompts], f"cannot load the target '{t / 'nowhere'}'"),
             (["bench", "--target-config", str(t / "bad.json")], f"--target-config {t / 'bad.json'}"),
             (["warmup", "--target", llama, "--target-layer-ids", "1,99"], "for this target: target_layer_ids [99] outside"),
             (["warmup", "--target", llama, "--target-layer-ids", "1,x"], "for this target: invalid literal for int()"),
             (["warmup", "--target", llama, "--mask-token-id", "100000"], "for this target: mask_token_id 100000 outside"),
             (["train_dflash", "--target", str(t / "tcut"), "--data", prompts, "--max-length", "256",
               "--cache-dir", str(t / "c"), "--out-dir", str(t / "o")], f"cannot load the target '{t / 'tcut'}'")]
    code = ("import importlib, json, sys\n"
            "for argv in json.loads(sys.argv[1]):\n"
            "    try:\n"
            "        importlib.import_module(argv[0]).main(argv[1:])\n"
            "        print('RAN', argv)\n"
            "    except SystemExit as e:\n"
            "        print('EXIT', json.dumps(str(e.code)))\n")
    p = run_cmd([sys.executable, "-c", code, json.dumps([c for c, _ in cases])], timeout=300)
    assert_ok(p)
    exits = [json.loads(line[5:]) for _, line in p.lines if line.startswith("EXIT ")]
    assert len(exits) == len(cases), p.tail()
    for (argv, needle), msg in zip(cases, exits):
        assert msg.startswith("error: ") and needle in msg and "\n" not in msg, (argv, msg)
