"""Fixtures shared by the test files (plain helpers: helpers.py). Tests write only into temporary folders."""
import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

# The project's modules are in the folder above, whichever folder pytest takes as its rootdir.
REPO = str(Path(__file__).resolve().parent.parent)
if sys.path[0] != REPO:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from helpers import (TIMEOUT, TINY, _save_tiny, drafter_with_heads, reset_gate, small_config,  # noqa: E402
                     tiny_target, train)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (test_gpu.py; skipped without one)")


# -----------------------------------------------------------------------------
# the embedded default, tokenizer, tiny targets saved with it, data


@pytest.fixture(scope="session")
def embedded_default(tmp_path_factory):
    """(cache folder, SmolLM2 folder, ShareGPT JSONL) of the embedded default, prepared once per test run in a
    temporary folder its pytest-xdist workers share: the first builds it, filelock makes the other wait."""
    import data_dflash
    cache = tmp_path_factory.getbasetemp().parent / "embedded_default"
    return (str(cache), *data_dflash.prepare_embedded_default(str(cache)))


@pytest.fixture(scope="session")
def embedded(embedded_default):
    """(SmolLM2 folder, ShareGPT JSONL) of the embedded default, as Paths."""
    return tuple(map(Path, embedded_default[1:]))


@pytest.fixture(scope="session")
def tok(embedded):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(embedded[0])


@pytest.fixture(scope="session")
def llama(tmp_path_factory, tok):
    from transformers import LlamaConfig, LlamaForCausalLM
    return _save_tiny(tmp_path_factory.mktemp("llama"), LlamaConfig, LlamaForCausalLM, tok)


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory, tok):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return _save_tiny(tmp_path_factory.mktemp("qwen3"), Qwen3Config, Qwen3ForCausalLM, tok, head_dim=16)


@pytest.fixture(scope="session")
def target(tmp_path_factory, tok):
    """A tiny Llama whose greedy answers are varied text (initializer_range 0.3), not a run of one special token."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return _save_tiny(tmp_path_factory.mktemp("target"), LlamaConfig, LlamaForCausalLM, tok, initializer_range=0.3)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))        # tokenised-data cache shared by the tests


@pytest.fixture(scope="session")
def sharegpt(tmp_path_factory, embedded):
    """The first 120 ShareGPT records (real chats: long, short, truncated, skipped ones)."""
    path = tmp_path_factory.mktemp("data") / "sharegpt120.jsonl"
    with open(embedded[1]) as src, open(path, "w") as dst:
        for _, line in zip(range(120), src):
            dst.write(line)
    return str(path)


@pytest.fixture
def tiny_train(llama, sharegpt, cache_dir, tmp_path):
    """train_dflash.py on the tiny run in one call: tiny_train(*args, timeout=, fault=) trains the tiny Llama on the
    first ShareGPT records into tmp_path/out, `args` added (a later option overrides an earlier one), and returns a
    helpers.Run: rc, out, tail(), records (metrics.jsonl) and checkpoints (their names)."""
    def run(*args, timeout=TIMEOUT, fault=None):
        return train(*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir,
                     "--out-dir", tmp_path / "out", *args, timeout=timeout, fault=fault)
    return run


# -----------------------------------------------------------------------------
# in-process models and the compile gate


@pytest.fixture(scope="module")
def targets():
    return {"qwen3": tiny_target("qwen3", seed=0), "llama": tiny_target("llama", seed=3)}


@pytest.fixture(scope="module")
def one_thread():
    """Two CPU cores shared with other jobs: one intra-op thread is several times faster than two
    here (measured: ~35 ms per overfit step with 1 thread, ~500 ms with 2 under contention). Set
    before a module's first compile, restored after its last test (other test files)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture
def clean_gate():
    """Every test starts and ends with a cold gate, default limits and the FX flag down."""
    reset_gate()
    yield
    torch.fx._symbolic_trace._is_fx_tracing_flag = False
    reset_gate()


@pytest.fixture(scope="module")
def flex_case():
    """The one flex shape of the tests: B=3, S=256, 16 anchors x block 16 (Q=256, KV=512), block
    mask built once. Batch 0: 16 valid anchors, 8 below and 8 above 128, incl. the last valid
    position S-bs; batch 1:
    length 200, 10 valid incl. its last valid position 184, 6 padding blocks; batch 2: 3 valid
    (one of them at 0), 13 padding blocks."""
    import compiled
    import dflash_model as dm
    B, S, A, bs, H = 3, 256, 16, 16, 64
    g = torch.Generator().manual_seed(1234)
    anchors = torch.zeros(B, A, dtype=torch.long)
    valid = torch.zeros(B, A, dtype=torch.bool)
    # batch 0: 8 anchors below 128 and 8 at or above 128 (so query tile 1 sees all of context
    # tile 0: a FULL tile), the last one at the last valid position S - bs
    anchors[0] = torch.cat([torch.randperm(128, generator=g)[:8].sort().values,
                            128 + torch.randperm(S - bs - 128, generator=g)[:7].sort().values,
                            torch.tensor([S - bs])])
    valid[0] = True
    anchors[1, :10] = torch.cat([torch.randperm(184, generator=g)[:9].sort().values, torch.tensor([184])])
    valid[1, :10] = True
    anchors[2, :3] = torch.tensor([0, 17, 60])
    valid[2, :3] = True
    loss_mask = torch.zeros(B, S, dtype=torch.bool)
    loss_mask[0] = True
    loss_mask[1, :200] = True
    loss_mask[2, :80] = True
    input_ids = torch.randint(0, 255, (B, S), generator=g)

    torch.manual_seed(7)
    cfg = small_config(hidden_size=H, intermediate_size=128, block_size=bs)
    drafter = drafter_with_heads(cfg, 0.3)
    drafter.eval()
    flex = compiled.compile_drafter(copy.deepcopy(drafter))     # the same weights, compiled: flex on a BlockMask
    feats = torch.randn(B, S, len(cfg.target_layer_ids) * H)
    with torch.no_grad():
        bm = dm.create_dflash_block_mask(anchors, S, bs)
    batch = dm.make_batch(input_ids, loss_mask, anchors, valid, cfg, dm.Loss(7.0))
    return SimpleNamespace(B=B, S=S, A=A, bs=bs, anchors=anchors, valid=valid, loss_mask=loss_mask,
                           input_ids=input_ids, drafter=drafter, flex=flex, feats=feats, bm=bm, gamma=7.0, batch=batch)
