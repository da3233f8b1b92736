"""CPU tests of eval_dflash.py: acceptance by position from a histogram, and the script end to end."""
import json
import re
import sys

import torch

from helpers import REPO, assert_ok, here, run_cmd


def test_eval_acceptance_by_position_from_a_histogram_equals_the_hand_count():
    """Block 6, rounds by acceptance length {1: 4, 2: 3, 4: 2, 5: 1}: 10 rounds reach position 1 and 6
    accept it; 6 reach 2, 3 accept; 3 reach 3, all accept; 3 reach 4, 1 accepts; 1 reaches 5, none.
    No round reaching a position: None, not a division by zero."""
    import collections
    import eval_dflash
    got = eval_dflash.acceptance_by_position(collections.Counter({1: 4, 2: 3, 4: 2, 5: 1}), bs=6)
    assert got == [6 / 10, 3 / 6, 3 / 3, 1 / 3, 0 / 1]
    assert eval_dflash.acceptance_by_position(collections.Counter({1: 5}), bs=4) == [0.0, None, None]
    assert eval_dflash.acceptance_by_position(collections.Counter(), bs=3) == [None, None]


def test_eval_cli_reports_tau_histogram_speedup_and_losslessness(llama, tmp_path):
    """eval_dflash.py end to end (tiny target, two drafters, chat prompts), with the CPU defaults (5 prompts
    side by side, 32 new tokens, 1 prompt timed at batch 1): every prompt lossless, the JSON consistent with
    the printout, a table row per method with its tau and speed-up, saying which loop and precision each comes
    from; each drafter measures in the shared run exactly what it measures alone; drafters of two block sizes
    are an error."""
    import collections
    import decoding
    import dflash_model as dm
    import eval_dflash
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = AutoModelForCausalLM.from_pretrained(llama)
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(6):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
                                             {"role": "assistant", "content": "An answer."}]}) + "\n")
    # step_000001 is untrained; step_000002 drafts the token the target repeats most after the first prompt
    # (its layer adds nothing: each block position's logits are those of its input, the mask token), so
    # the two drafters measure differently
    x = eval_dflash.prompts_from([str(prompts)], AutoTokenizer.from_pretrained(llama), 1, 1024)[0]
    common = collections.Counter(decoding.speculate(decoding.Engine(target, 1, 256), [x], 32, [])[0][0]).most_common(1)[0][0]
    drafters = {}
    for seed, label, bs in ((0, "step_000001", 4), (1, "step_000002", 4), (2, "step_000003", 8)):
        cfg = dm.DFlashConfig.from_target_config(target.config, num_draft_layers=1, block_size=bs,
                                                 mask_token_id=common if seed == 1 else target.config.vocab_size - 1)
        torch.manual_seed(seed)
        drafter = dm.DFlashDrafter(cfg).attach_target(target)
        if seed == 1:
            torch.nn.init.zeros_(drafter.layers[0].self_attn.o_proj.weight)
            torch.nn.init.zeros_(drafter.layers[0].mlp.down_proj.weight)
        drafters[label] = str(tmp_path / label / "drafter")
        dm.save_drafter(drafter, drafters[label])
    labels = ["step_000001", "step_000002"]
    eval_py = [sys.executable, str(REPO / "eval_dflash.py")]
    one = eval_py + ["--target", llama, "--prompts", str(prompts), "--device", "cpu", "--drafter"]
    base = one + [drafters[lb] for lb in labels]
    names = [*labels, "n-gram lookup"]

    p = run_cmd(base + ["--json", str(tmp_path / "all.json")])
    assert_ok(p)
    res = json.loads((tmp_path / "all.json").read_text())
    assert res["max_new_tokens"] == 32 and res["prompts"] == 5 and list(res["drafters"]) == labels, res
    assert "tau and losslessness: 5 prompts side by side, float32; tok/s: 1 prompts at batch 1, bfloat16, eager" \
        in p.out, p.out
    sp = res["speed"]
    assert sp["prompts"] == 1 and sp["loop"] == "eager" and sp["methods"]["target greedy"]["speedup"] == 1.0, sp
    for label in names:                                     # every method, one table
        r, s = res["methods"][label], sp["methods"][label]
        assert r["lossless"] == 5 and r["mismatches"] == [] and sum(r["histogram"].values()) == r["rounds"] > 0
        tau = sum(int(k) * v for k, v in r["histogram"].items()) / r["rounds"]
        assert abs(tau - r["mean_tau"]) < 1e-9 and 1 <= tau <= (16 if label == "n-gram lookup" else 4)
        assert s["tokens"] > 0 and s["tok_s"] > 0
        assert re.search(rf"^{label} +{tau:.3f} +5/5 +{s['tok_s']:.1f} +{s['speedup']:.2f}x$", p.out, re.M), p.out
        # n-gram lookup drafts up to 15 tokens whatever the drafters' block (4 here: 3 tokens)
        assert len(r["acceptance_by_position"]) == (15 if label == "n-gram lookup" else 3), r
        assert re.search(rf"^  {label} +[-\d. ]+$", p.out, re.M), p.out
    assert re.search(r"^target greedy +[\d.]+ +1.00x$", p.out, re.M), p.out
    assert "block 4, stop ids" in p.out and "(last 3/2/1 tokens, up to 15)" in p.out and res["ngram_block"] == 16
    assert [(q["prompt"], q["tokens_in"] > 0, set(q["tau"])) for q in res["per_prompt"]] == \
        [(i, True, set(names)) for i in range(5)], res["per_prompt"]
    assert res["methods"]["step_000002"]["mean_tau"] > res["methods"]["step_000001"]["mean_tau"] + 0.5, res
    assert sum(q["tokens_out"] for q in res["per_prompt"]) == res["tokens_out"] > 0

    # each drafter alone: the shared run's figures for it, prompt by prompt (greedy decoding is deterministic)
    for label in labels:
        p = here("eval_dflash", *one[2:], drafters[label], "--speed-prompts", "0", "--json", tmp_path / f"{label}.json")
        assert_ok(p)
        alone = json.loads((tmp_path / f"{label}.json").read_text())
        assert list(alone["drafters"]) == [label] and "speed" not in alone, alone
        for k in ("histogram", "rounds", "mean_tau", "acceptance_by_position", "lossless"):
            for name in (label, "n-gram lookup"):
                assert alone["methods"][name][k] == res["methods"][name][k], (name, k)
        assert [q["tau"][label] for q in alone["per_prompt"]] == [q["tau"][label] for q in res["per_prompt"]]
    p = here("eval_dflash", *base[2:], drafters["step_000003"])
    assert p.rc != 0 and "block sizes differ" in p.out and "'step_000003': 8" in p.out, p.tail()


def test_eval_refuses_a_drafter_of_another_target_before_decoding(llama, tmp_path):
    """A drafter whose folder records another target: one line naming both, exit status 1, nothing measured."""
    import dflash_model as dm
    from transformers import AutoConfig
    cfg = dm.DFlashConfig.from_target_config(AutoConfig.from_pretrained(llama), num_draft_layers=1, block_size=4,
                                             mask_token_id=0)
    cfg.target = {"name": "org/other", "config": "0" * 16, "weights": None}
    dm.save_drafter(dm.DFlashDrafter(cfg), str(tmp_path / "drafter"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    p = here("eval_dflash", "--target", llama, "--drafter", tmp_path / "drafter", "--prompts", prompts,
             "--device", "cpu", "--json", tmp_path / "res.json")
    assert p.rc == 1 and not (tmp_path / "res.json").exists()
    assert p.out.strip().splitlines()[-1] == (f"error: the drafter at {tmp_path / 'drafter'} was trained for the "
                                              f"target 'org/other', and --target '{llama}' has other config: pass "
                                              "the target it drafts for")


def test_eval_writes_what_it_measured_into_the_drafters_card(llama, tmp_path):
    """The card's Measured section, replaced by eval_dflash.py: tau and n-gram lookup's, lossless n/n, the batch-1
    speed-up, as its JSON has them; the rest of the card stays."""
    import dflash_model as dm
    import models
    from transformers import AutoConfig
    tcfg = AutoConfig.from_pretrained(llama)
    cfg = dm.DFlashConfig.from_target_config(tcfg, num_draft_layers=1, block_size=4, mask_token_id=0)
    cfg.target = models.target_identity(llama, tcfg)
    folder = str(tmp_path / "drafter")
    dm.save_drafter(dm.DFlashDrafter(cfg), folder, card=dm.model_card(cfg, folder, {"steps": 5}))
    before = (tmp_path / "drafter" / "README.md").read_text()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Count to {i}."},
                                                        {"role": "assistant", "content": "One."}]}) + "\n"
                               for i in range(2)))
    p = here("eval_dflash", "--target", llama, "--drafter", folder, "--prompts", prompts, "--device", "cpu",
             "--max-new-tokens", 8, "--json", tmp_path / "res.json")
    assert_ok(p)
    res = json.loads((tmp_path / "res.json").read_text())
    label = next(iter(res["drafters"]))
    m, s = res["methods"][label], res["speed"]["methods"]
    card = (tmp_path / "drafter" / "README.md").read_text()
    assert card.split("## Measured")[0] == before.split("## Measured")[0]
    assert f"| tau (acceptance length) | {m['mean_tau']:.2f} (n-gram lookup " in card
    assert f"| lossless | {m['lossless']}/2 |" in card and m["lossless"] == 2
    assert f"| batch-1 speed-up | {s[label]['speedup']:.2f}x over the target alone" in card
