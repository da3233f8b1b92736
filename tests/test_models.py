"""CPU tests of models.py: random targets, a target cut after its deepest feature layer, a hub target with the hub
unreachable, the drafter config's position limit."""
import errno
import os
import re

import pytest
import torch

import dflash_model as dm
from errors import UserError
import models
from helpers import REPO, tiny_config_json, tiny_llama


# the compile gate and dynamo's limits are process-wide: each test starts and ends with them as a fresh process
# has them; one intra-op thread for the module (conftest.py: clean_gate, one_thread)
pytestmark = pytest.mark.usefixtures("one_thread", "clean_gate")


def test_a_random_target_has_the_same_weights_on_every_device_and_in_every_run(tmp_path):
    """random:<config> targets (benchmarks) are seeded: with several target devices, a batch's features
    must not depend on which target thread took it, and two runs must see the same target."""
    import config
    path = tiny_config_json(tmp_path / "tiny.json")
    a = models.load_target(f"random:{path}", "cpu", torch.float32, [1, 2], log=lambda m: None)
    torch.randn(1000)        # whatever the global RNG did in between
    b = models.load_target(f"random:{path}", "cpu", torch.float32, [1, 2], log=lambda m: None)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert sa["model.layers.0.mlp.up_proj.weight"].std() > 0      # random, not zeros


def test_the_target_runs_only_up_to_its_deepest_captured_layer_with_the_full_models_features(tmp_path):
    """Layers past the deepest feature layer are dropped and the final norm with them; the features,
    captured by our hooks, are the full model's hidden states of those layers (transformers' indexing:
    layer i's output is hs[i + 1]), as evaluation reads them from an uncut target."""
    from transformers import LlamaForCausalLM
    import config
    torch.manual_seed(0)
    tiny_llama(6).save_pretrained(tmp_path)
    full = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        hs = full.model(ids, output_hidden_states=True).hidden_states      # hs[i + 1]: layer i's output
        lines = []
        cut = models.load_target(str(tmp_path), "cpu", torch.float32, [1, 3], log=lines.append)
        feats = dm.target_forward(cut, ids, [1, 3])
    assert len(cut.model.layers) == 4 and isinstance(cut.model.norm, torch.nn.Identity)
    assert torch.equal(feats, torch.cat([hs[2], hs[4]], -1))
    assert "kept 4/6 layers" in lines[-1]
    last = models.load_target(str(tmp_path), "cpu", torch.float32, [1, 5], log=lines.append)
    assert len(last.model.layers) == 6 and not isinstance(last.model.norm, torch.nn.Identity)  # nothing to cut


def test_a_hub_target_with_the_hub_unreachable_reads_the_cache_only_and_else_is_one_line(monkeypatch, request):
    """Offline, a hub name as --target is read from the HF cache only (from_pretrained would retry for half a
    minute first); not cached, one line says the hub does not answer. A local folder is never probed."""
    import socket
    import config
    import data_dflash
    from huggingface_hub import constants
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    def unreachable(address, timeout):
        raise OSError(errno.ENETUNREACH, os.strerror(errno.ENETUNREACH))
    request.addfinalizer(data_dflash.hub_unreachable.cache_clear)   # the probe's answer is kept for the process
    data_dflash.hub_unreachable.cache_clear()
    probes = []
    monkeypatch.setattr(socket, "create_connection", lambda *a: probes.append(a) or unreachable(*a))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for k in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(k, raising=False)
    asked = []

    def not_cached(path, *a, **kw):
        asked.append(kw.get("local_files_only"))
        raise OSError(f"{path} is not in the cache")
    for cls in (AutoConfig, AutoTokenizer, AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", not_cached)
    line = "huggingface.co does not answer (Network is unreachable), and the HF cache has no copy of it"
    with pytest.raises(UserError, match=re.escape(f"cannot load the target 'org/model': {line}")):
        models.load_target_config("org/model")
    with pytest.raises(UserError, match=re.escape(f"cannot load the target 'org/model': {line}")):
        models.load_model("org/model", "cpu", torch.float32)
    assert asked == [True, True] and len(probes) == 1             # the hub probed once for both loads
    assert models.hub_offline(str(REPO)) is None and data_dflash.hub_unreachable() is not None


def test_max_length_beyond_the_targets_positions_is_an_early_error():
    from transformers import Qwen3Config
    import config
    tcfg = Qwen3Config(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, num_hidden_layers=4, vocab_size=64, max_position_embeddings=512)
    assert models.make_drafter_config(config.parse_args(["--max-length", "512"]), tcfg, None).max_position_embeddings == 512
    with pytest.raises(UserError, match="--max-length 1024 exceeds the target's max_position_embeddings"):
        models.make_drafter_config(config.parse_args(["--max-length", "1024"]), tcfg, None)


def test_the_mask_tokens_text_is_the_tokens_own_or_masks_for_a_spare_row(tok):
    """A special token picked as the mask keeps its text; a spare embedding row (no text in the tokenizer) is
    <|MASK|>, the name SGLang adds as the next id, which is that row; a tokenizer-less (random) target has none."""
    import config
    from transformers import AutoConfig
    tcfg = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=4096)
    special = models.make_drafter_config(config.parse_args([]), tcfg, tok)
    assert special.mask_token == tok.convert_ids_to_tokens(special.mask_token_id) and special.mask_token_id < len(tok)
    tcfg.vocab_size = len(tok) + 64                     # a padded embedding: spare rows after the tokenizer's ids
    spare = models.make_drafter_config(config.parse_args([]), tcfg, tok)
    assert (spare.mask_token_id, spare.mask_token) == (len(tok), "<|MASK|>")
    assert models.make_drafter_config(config.parse_args([]), tcfg, None).mask_token == ""


def test_a_drafter_serves_only_the_target_it_was_trained_for(llama, tmp_path):
    """The identity compares configs and, where both are folders, weights: a copy of the target elsewhere is the
    same target; other weights of the same shape, or another config, are a one-line error naming both."""
    import shutil
    from transformers import AutoConfig
    tcfg = AutoConfig.from_pretrained(llama)
    trained_for = models.target_identity(llama, tcfg)
    copy = shutil.copytree(llama, tmp_path / "copy")
    models.check_drafter_target("d", trained_for, models.target_identity(str(copy), tcfg))
    models.check_drafter_target("d", trained_for, {**trained_for, "name": "org/hub-name", "weights": None})
    models.check_drafter_target("d", {}, models.target_identity(str(copy), tcfg))     # saved before the record
    other = tmp_path / "other"
    shutil.copytree(llama, other)
    weights = next(other.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF                                     # the last MiB: other weights, the same config
    weights.write_bytes(bytes(data))
    with pytest.raises(UserError, match=rf"^the drafter at d was trained for the target '{re.escape(llama)}', and "
                                        rf"--target '{re.escape(str(other))}' has other weights: pass the target"):
        models.check_drafter_target("d", trained_for, models.target_identity(str(other), tcfg))
    tcfg.rope_theta = 1234.0
    with pytest.raises(UserError, match="has other config"):
        models.check_drafter_target("d", trained_for, models.target_identity(str(copy), tcfg))
