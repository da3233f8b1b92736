"""CPU tests of the threaded trainer, mostly end to end in processes of their own (train_dflash.py, warmup.py,
bench.py, eval_dflash.py, start_training.sh, torchrun); Python scripts fork from a server that has imported
torch and transformers once.

Every training run is tiny: a random 4-layer Llama/Qwen3 target (hidden 64) with the SmolLM2
tokenizer, a 2-layer drafter, a handful of steps. What each test asserts is in its name. Faults are
injected by the tests: break() wraps the project's own function that is to fail, in the run's process.
"""
import errno
import functools
import json
import math
import multiprocessing
import os
import random
import re
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
import shutil

import pytest
import torch

from errors import UserError
import models


REPO = Path(__file__).resolve().parent
TRAIN = str(REPO / "train_dflash.py")
TIMEOUT = 120

# The tiny run every test starts from (options are --kebab-case TrainConfig fields).
TINY = ["--max-length", "256", "--num-anchors", "32", "--block-size", "8", "--num-draft-layers", "2",
        "--log-interval", "1"]


# -----------------------------------------------------------------------------
# helpers


@dataclass
class Proc:
    rc: int
    lines: list          # (monotonic time the line was read, line)

    @property
    def out(self):
        return "".join(line for _, line in self.lines)

    def tail(self, n=60):
        return "".join(line for _, line in self.lines[-n:])


def child_env(**extra):
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")       # 2 shared cores: no oversubscription
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_cmd(cmd, timeout=TIMEOUT, env=None, cwd=REPO):
    """Run `cmd`, timestamp every output line as it arrives, and kill its process group on timeout. A Python
    script or `-c` code runs in a child of the fork server (`_script`), other commands in a fresh process."""
    env = env or child_env()
    if cmd[0] == sys.executable and (cmd[1] == "-c" or cmd[1].endswith(".py")):
        ctx = _fork_server()
        read, write = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_script, args=(list(map(str, cmd[1:])), env, str(cwd), write))
        p.start()
        write.close()
        out, wait, pid = open(os.dup(read.fileno()), errors="replace"), p.join, p.pid
        read.close()
    else:
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        out, wait, pid = p.stdout, p.wait, p.pid
    lines = []

    def reader():
        for line in out:
            lines.append((time.monotonic(), line))

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    wait(timeout)
    if _alive(p):
        os.killpg(pid, signal.SIGTERM)      # torchrun passes it on to its workers (own sessions)
        wait(15)
        if _alive(p):
            os.killpg(pid, signal.SIGKILL)
            wait()
        th.join(5)
        pytest.fail(f"{cmd[:3]}... did not finish within {timeout}s; output tail:\n"
                    + "".join(x for _, x in lines[-60:]))
    th.join(10)
    return Proc(p.returncode if isinstance(p, subprocess.Popen) else p.exitcode, lines)


def _alive(p):
    return p.poll() is None if isinstance(p, subprocess.Popen) else p.is_alive()


@functools.cache
def _fork_server():
    """multiprocessing's fork server, with torch, transformers and datasets imported once: a script forked from
    it skips those imports, most of a tiny run's time in a fresh interpreter."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")      # read by torch as the server imports it
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "datasets", "transformers.models.llama.modeling_llama",
                                "transformers.models.qwen3.modeling_qwen3"])
    return ctx


def _script(args, env, cwd, write):
    """In the forked child: `python *args` as a fresh interpreter would run it, its output into `write`, in a
    session of its own (a timeout kills what it started too)."""
    os.setsid()
    os.dup2(write.fileno(), 1)
    os.dup2(write.fileno(), 2)
    sys.stdout, sys.stderr = (open(fd, "w", buffering=1, closefd=False) for fd in (1, 2))
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if args[0] == "-c":
        sys.argv = args[1:]
        sys.argv[0] = "-c"
        sys.path.insert(0, cwd)
        exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = args
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        runpy.run_path(args[0], run_name="__main__")


def break_(kind, n):
    """Wrap the function a fault breaks, in this process (a child that then runs a script's main):
      target:N    the target thread's N-th batch raises        drafter:N   a drafter thread's step N raises
      ckpt:N      checkpoint N's write raises, mid-folder      ckpt_lag:N  each checkpoint's write waits
                                                                           until training is N steps past it
      kill:N      SIGKILL once checkpoint N is on disk         gen_kill:N  SIGKILL after generate_data.py's
      term:N      SIGTERM as step N's backward starts                      N-th shard is written
      kill_write:N  SIGKILL in the middle of checkpoint N's write (its drafter folder written, its state not)"""
    import checkpoint as ck
    import data_dflash
    import dflash_model as dm
    import replicas

    def wrap(owner, name, before=None, after=None):
        orig = getattr(owner, name)

        def wrapped(*a, **kw):
            before and before(*a)
            out = orig(*a, **kw)
            after and after(*a)
            return out
        setattr(owner, name, wrapped)

    def fail(where):
        raise RuntimeError(f"injected failure in {where} at {n}")
    calls = iter(range(1, 1 << 30))
    if kind == "target":
        wrap(dm, "target_forward", before=lambda *a: next(calls) == n and fail("target"))
    elif kind == "drafter":    # a drafter thread's N-th call is step N's (one replica; the warm-up's run elsewhere)
        wrap(replicas, "forward_backward", before=lambda *a: threading.current_thread().name.startswith("drafter")
             and next(calls) == n and fail("drafter"))
    elif kind == "ckpt":         # as a full disk fails a write
        def full(d, path, *a):
            if f"step_{n:06d}.tmp" in path:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        wrap(dm, "save_drafter", after=full)
    elif kind == "kill_write":
        def die(d, path, *a):
            if f"step_{n:06d}.tmp" in path:
                print(f"[test] SIGKILL while checkpoint {n} is written", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        wrap(dm, "save_drafter", after=die)
    elif kind == "ckpt_lag":
        def lag(self, step, *a):          # training's progress, as metrics.jsonl records it
            done = lambda: max([0] + [json.loads(x)["step"] for x in open(Path(self.out_dir) / "metrics.jsonl")])
            while done() < step + n and not self.run.stop.wait(0.05):
                pass
        wrap(ck.Checkpointer, "_write", before=lag)
    elif kind == "kill":
        def kill(self, step, *a):
            if step == n:
                self.wait()
                print(f"[test] SIGKILL after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        wrap(ck.Checkpointer, "save", after=kill)
    elif kind == "term":
        wrap(replicas, "forward_backward", before=lambda *a: threading.current_thread().name.startswith("drafter")
             and next(calls) == n and os.kill(os.getpid(), signal.SIGTERM))
    elif kind == "gen_kill":
        wrap(data_dflash, "write_chat_jsonl", after=lambda path, *a: ".shards" in path and next(calls) == n
             and os.kill(os.getpid(), signal.SIGKILL))
    else:
        raise ValueError(kind)


def broken(script, fault, args):
    """The command that runs `script` with the fault `kind:N` injected (break_)."""
    kind, n = fault.split(":")
    code = (f"import sys, test_train, {script}; test_train.break_({kind!r}, {int(n)}); "
            f"sys.exit({script}.main(sys.argv[1:]))")
    return [sys.executable, "-c", code, *map(str, args)]


def train(*args, timeout=TIMEOUT, fault=None):
    cmd = broken("train_dflash", fault, args) if fault else [sys.executable, TRAIN, *map(str, args)]
    return run_cmd(cmd, timeout=timeout)


def here(script, *args):
    """`script`.main(args) in this process, its printout and exit status as a Proc: for the runs that stop before
    any thread starts, and the variants of a run a test made as a subprocess already (no second start-up)."""
    import contextlib
    import importlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            rc = importlib.import_module(script).main([str(a) for a in args])
        except SystemExit as e:        # argparse's --help and usage errors, and the scripts' one-line errors
            rc = e.code if isinstance(e.code, int) else 1
            if isinstance(e.code, str):
                print(e.code)
    return Proc(rc or 0, [(time.monotonic(), line) for line in buf.getvalue().splitlines(keepends=True)])


def metrics(out_dir):
    with open(Path(out_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_state(ckpt):
    return torch.load(Path(ckpt) / "state.pt", map_location="cpu", weights_only=False)


def checkpoints(out_dir):
    return sorted(p.name for p in Path(out_dir).iterdir()
                  if p.name.startswith("step_") and (p / "DONE").exists())


def assert_ok(proc):
    assert proc.rc == 0, f"exit code {proc.rc}; output tail:\n{proc.tail()}"


def tb_scalars(logdir):
    """{tag: [(step, value), ...]} of the TensorBoard events under logdir, as TensorBoard shows them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(logdir))
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -----------------------------------------------------------------------------
# fixtures: tokenizer, tiny targets, data


@pytest.fixture(scope="module")
def embedded(embedded_default):
    """(SmolLM2 folder, ShareGPT JSONL) of the embedded default (conftest.py: prepared once, in a temporary folder)."""
    return tuple(map(Path, embedded_default[1:]))


def _save_tiny(path, cfg_cls, model_cls, tok, **extra):
    torch.manual_seed(0)
    cfg = cfg_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                  max_position_embeddings=1024, **extra)
    model_cls(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tok(embedded):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(embedded[0])


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tok):
    from transformers import LlamaConfig, LlamaForCausalLM
    return _save_tiny(tmp_path_factory.mktemp("llama"), LlamaConfig, LlamaForCausalLM, tok)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, tok):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return _save_tiny(tmp_path_factory.mktemp("qwen3"), Qwen3Config, Qwen3ForCausalLM, tok, head_dim=16)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))        # tokenised-data cache shared by the tests


@pytest.fixture(scope="module")
def sharegpt(tmp_path_factory, embedded):
    """The first 120 ShareGPT records (real chats: long, short, truncated, skipped ones)."""
    path = tmp_path_factory.mktemp("data") / "sharegpt120.jsonl"
    with open(embedded[1]) as src, open(path, "w") as dst:
        for _, line in zip(range(120), src):
            dst.write(line)
    return str(path)


WORDS = ("alpha beta gamma delta river stone cloud green quick slow bright dark table window "
         "garden music number letter simple answer question model token train draft block "
         "target layer anchor mask loss step batch queue thread device paper light water").split()


def short_chats(path, n, seed=0):
    """n chats that all tokenise to well under 256 tokens with >= 32 supervised tokens."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            q = f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(10)) + "?"
            a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 80))) + "."
            f.write(json.dumps({"conversations": [{"from": "human", "value": q},
                                                  {"from": "gpt", "value": a}]}) + "\n")
    return str(path)


# -----------------------------------------------------------------------------
# 1. resume




# -----------------------------------------------------------------------------
# 1. options


def test_help_lists_every_option_and_unknown_or_mistyped_options_are_errors(tmp_path, capsys):
    import config
    import warmup
    p = here("train_dflash", "--help")
    assert_ok(p)
    with pytest.raises(SystemExit) as e:
        warmup.main(["--help"])
    assert e.value.code == 0
    for text in (p.out, capsys.readouterr().out):
        for f in config.TrainConfig.__dataclass_fields__:
            assert "--" + f.replace("_", "-") in text, f
        assert "(default: 3072)" in text and "passes over the data" in text
    p = here("train_dflash", "--max-step", 3, "--out-dir", tmp_path / "a")
    assert p.rc != 0 and "unknown option --max-step (did you mean --max-steps" in p.out, p.out
    assert not (tmp_path / "a").exists()          # nothing started
    for argv, needle in [(["--max-steps", "three"], "--max-steps: invalid int value: 'three'"),
                         (["--lr"], "--lr: expected one argument"),
                         (["--epochs", "1", "2"], "unexpected argument '2'"),
                         (["--resume", "maybe"], "unexpected argument 'maybe'"),
                         (["--attn", "flexx"], "--attn must be auto|flex|sdpa"),
                         (["--block-size", "1"], "--block-size >= 2"),
                         (["--data", "/no/such/file.jsonl"], "data file not found: /no/such/file.jsonl"),
                         # a bare file name is a file too, and is checked before any target is looked at
                         (["--data", "mydata.jsonl", "--target", "random:x.json"], "data file not found: mydata.jsonl"),
                         (["max-steps", "3"], "unexpected argument 'max-steps'"),
                         (["--num_anchors_x", "3"], "unknown option --num_anchors_x"),
                         (["--compile-scope", "trunk"], "unknown option --compile-scope"),
                         (["--clip", "0"], "--clip must be > 0"),
                         (["--queue-depth", "0"], "--queue-depth must be >= 1"),
                         (["--lr", "0"], "need --lr > 0"),
                         (["--buckets", "1024,4096"], "max_length] = [32, 3072], got 1024,4096"),
                         (["--buckets", "1k"], "--buckets must be comma-separated integers"),
                         (["--lr", "-1e-3"], "need --lr > 0"),           # a negative value, not an unknown option
                         (["--seed", "-1"], "need --seed, --max-samples"),
                         (["--max-samples", "-5"], "need --seed, --max-samples"),
                         (["--gamma", "-1"], "--gamma must be > 0 (0: the block size's default), got -1.0"),
                         (["--data", "synthetic:abc"], "--data synthetic:abc: synthetic:N needs a number N >= 1"),
                         (["--data", "synthetic:0"], "--data synthetic:0: synthetic:N needs a number N >= 1"),
                         (["--data", str(tmp_path)], f"data folder {tmp_path} holds no .json, .jsonl")]:
        with pytest.raises(UserError) as e:
            config.parse_args(argv)
        assert needle in str(e.value), (argv, str(e.value))
    cfg = config.parse_args(["--max-steps", "3", "--resume", "--data", str(REPO / "README.md"), "--lr", "1e-3"])
    assert (cfg.max_steps, cfg.resume, cfg.data, cfg.lr) == (3, True, [str(REPO / "README.md")], 1e-3)
    assert config.parse_args(["--data", "org/chats"]).data == ["org/chats"]     # a hub data set, not a file


def _drafter_config(H, I, heads, kv, hd, V, layers=5):
    import dflash_model as dm
    return dm.DFlashConfig(hidden_size=H, intermediate_size=I, num_attention_heads=heads, num_key_value_heads=kv,
                           head_dim=hd, vocab_size=V, num_target_layers=layers * 6, num_draft_layers=layers)


QWEN3_8B_DRAFTER = dict(H=4096, I=12288, heads=32, kv=8, hd=128, V=151936)
SMOLLM2_DRAFTER = dict(H=576, I=1536, heads=9, kv=3, hd=64, V=49152)


def test_shape_plan_anchors_per_sequence_capped_by_length_and_rows_by_the_block_budget():
    """512 anchors per sequence, fewer only where a sequence has fewer start positions (rounded to
    128-row tiles), and no batch holds more blocks than a batch of max_length sequences."""
    import config
    dcfg = _drafter_config(**SMOLLM2_DRAFTER)
    assert config.shape_plan(config.parse_args([]), dcfg) == [(2, 256, 248), (1, 512, 504), (1, 1024, 512),
                                                             (1, 2048, 512), (1, 3072, 512)]
    assert config.shape_plan(config.parse_args(["--tokens-per-batch", "6144"]), dcfg) == [
        (4, 256, 248), (2, 512, 504), (2, 1024, 512), (2, 2048, 512), (2, 3072, 512)]


def test_auto_batch_on_a_gpu_sized_by_the_drafters_work_and_the_memory():
    """On a GPU an automatic batch holds STEP_FLOPS of drafter work within the memory it is given: a
    Qwen3-8B-sized drafter keeps one full-length sequence a step (its work is already above that), a
    135M target's drafter takes tens of sequences, every bucket about the same work, and less memory
    means fewer rows. An explicit --tokens-per-batch is kept as it is."""
    import config
    import dflash_model as dm
    cfg, h200 = config.parse_args([]), 70e9
    qwen, small = _drafter_config(**QWEN3_8B_DRAFTER), _drafter_config(**SMOLLM2_DRAFTER)
    assert config.shape_plan(cfg, qwen, h200) == config.shape_plan(cfg, qwen) == [
        (2, 256, 248), (1, 512, 504), (1, 1024, 512), (1, 2048, 512), (1, 3072, 512)]
    plan = config.shape_plan(cfg, small, h200)
    work = [B * A * dm.matmul_flops(small, 0, 1) for B, S, A in plan]
    assert [B for B, _, _ in plan] == [29, 14, 14, 14, 14], plan
    assert all(config.STEP_FLOPS * 0.95 < w <= config.STEP_FLOPS for w in work), work
    assert all(B * config.activation_bytes(small, S, A) <= h200 for B, S, A in plan)
    fewer = config.shape_plan(cfg, small, h200 / 4)
    assert all(B * config.activation_bytes(small, S, A) <= h200 / 4 for B, S, A in fewer)
    assert all(f[0] < p[0] for f, p in zip(fewer, plan)), (fewer, plan)
    assert config.shape_plan(config.parse_args(["--tokens-per-batch", "6144"]), small, h200)[-1] == (2, 3072, 512)


def test_compiled_drafters_need_a_gpu_each():
    """Two replicas on one GPU would run the same entries of the compiled trunk's dynamo cache from two
    threads at once (a spurious recompile): an error before anything loads. Dense SDPA and CPU allow it."""
    import config
    twice = [torch.device("cuda:0"), torch.device("cuda:0")]
    with pytest.raises(UserError, match="--drafter-devices cuda:0,cuda:0 lists a GPU twice"):
        config.resolve_attn(config.parse_args([]), twice)
    assert config.resolve_attn(config.parse_args(["--attn", "sdpa"]), twice) == "sdpa"
    assert config.resolve_attn(config.parse_args([]), [torch.device("cuda:0"), torch.device("cuda:1")]) == "flex"
    assert config.resolve_attn(config.parse_args([]), [torch.device("cpu")] * 2) == "sdpa"


def test_device_lists_auto_split_and_local_rank(monkeypatch):
    """auto = the original 5 target + 3 drafter split on 8 GPUs; cuda:local = this torchrun process's GPU."""
    import config
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    t, d = config.resolve_devices(config.parse_args([]))
    assert [str(x) for x in t] == [f"cuda:{i}" for i in range(5)] and [str(x) for x in d] == ["cuda:5", "cuda:6", "cuda:7"]
    monkeypatch.setenv("LOCAL_RANK", "3")
    t, d = config.resolve_devices(config.parse_args(["--target-devices", "cuda:local", "--drafter-devices", "cuda:local"]))
    assert [str(x) for x in t] == ["cuda:3"] and [str(x) for x in d] == ["cuda:3"]
    with pytest.raises(UserError, match="only 8 CUDA device"):
        config.resolve_devices(config.parse_args(["--target-devices", "cuda:9"]))


def test_tensorboard_without_its_package_is_an_error_before_anything_starts(monkeypatch, tmp_path):
    import config
    assert config.parse_args(["--tensorboard", str(tmp_path / "tb")]).tensorboard == str(tmp_path / "tb")
    assert config.parse_args(["--tensorboard", "auto", "--out-dir", "o"]).tensorboard == os.path.join("o", "tensorboard")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)      # the import fails, as when not installed
    with pytest.raises(UserError, match="--tensorboard needs the tensorboard package: pip install tensorboard"):
        config.parse_args(["--tensorboard", str(tmp_path / "tb")])
    assert config.parse_args([]).tensorboard == ""                           # off: never imported
    assert not (tmp_path / "tb").exists()


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


# -----------------------------------------------------------------------------
# 2. checkpoints and resume


def test_sigkill_after_or_in_a_checkpoint_write_then_resume_is_bit_equal_and_a_damaged_one_falls_back(
        llama, sharegpt, cache_dir, tmp_path):
    # 12 conversations -> a few samples -> a few batches per epoch: 6 steps x grad_accum 2 cross
    # epoch boundaries, so the cursor, the per-epoch batch order and per-(sample, epoch) anchors
    # all have to come back right after the kill.
    import checkpoint as ck
    common = [*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 12,
              "--heldout", 0, "--grad-accum", 2, "--max-steps", 6, "--ckpt-interval", 3]
    straight, cut = tmp_path / "straight", tmp_path / "cut"

    # ckpt_lag:3: checkpoint 3 is written in the background only once step 6 has run - it must hold step
    # 3's state all the same (the snapshot is a copy; compared with the cut run's below), and the save
    # at step 6 waits for it, which the log says
    p = train(*common, "--out-dir", straight, fault="ckpt_lag:3")
    assert_ok(p)
    assert p.out.index("step_000003 (written in") > p.out.index("step 6/6"), p.tail()
    assert re.search(r"\[ckpt\] step 6: waited [\d.]+s for the write of checkpoint 3 \(one write at a time", p.out)
    assert "grads: one flat fp32 buffer per replica" in p.out     # micro-batches are added in fp32
    m = re.search(r"\[data\] \d+ samples on this node, (\d+) batches/epoch", p.out)
    assert m and int(m.group(1)) < 12, "the run should cross an epoch boundary"

    killed = train(*common, "--out-dir", cut, fault="kill:3")
    assert killed.rc == -signal.SIGKILL, f"expected SIGKILL, got {killed.rc}\n{killed.tail()}"
    assert "[test] SIGKILL after step 3" in killed.out
    assert checkpoints(cut) == ["step_000003"] and [r["step"] for r in metrics(cut)] == [1, 2, 3]

    resumed = train(*common, "--out-dir", cut, "--resume")
    assert_ok(resumed)
    assert re.search(r"\[resume\] .*step_000003: step 3, batch cursor 6", resumed.out), resumed.tail()

    # killed in the middle of checkpoint 6's write: its folder stays a .tmp, never taken; the resume goes on from 3
    mid = tmp_path / "mid_write"
    killed = train(*common, "--out-dir", mid, fault="kill_write:6")
    assert killed.rc == -signal.SIGKILL and "[test] SIGKILL while checkpoint 6 is written" in killed.out, killed.tail()
    assert checkpoints(mid) == ["step_000003"] and (mid / "step_000006.tmp" / "drafter").is_dir()
    resumed = train(*common, "--out-dir", mid, "--resume")
    assert_ok(resumed)
    assert re.search(r"\[resume\] .*step_000003: step 3, batch cursor 6", resumed.out), resumed.tail()
    assert checkpoints(mid) == ["step_000003", "step_000006"] and not (mid / "step_000006.tmp").exists()

    # both continue bit for bit as the straight run: every record, every checkpoint (the last too)
    for out in (cut, mid):
        a, b = metrics(straight), metrics(out)
        assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
        for ra, rb in zip(a, b):
            assert [ra[k] for k in ("loss", "grad_norm", "lr", "acc")] == [rb[k] for k in ("loss", "grad_norm",
                                                                                            "lr", "acc")], ra["step"]
        for step in ("step_000003", "step_000006"):
            sa, sb = load_state(straight / step), load_state(out / step)
            assert sa["resume_fingerprint"] == sb["resume_fingerprint"], (out, step)    # masters and moments
            assert sa["fingerprint"] == sb["fingerprint"], (out, step)                  # the weights
    # the files are world-readable like the rest (safetensors creates its file 0600)
    mode = lambda f: os.stat(f).st_mode & 0o777
    assert mode(straight / "step_000006" / "drafter" / "model.safetensors") == mode(straight / "step_000006" / "state.pt")

    # damaged newest checkpoints: each is named, and the newest intact one is taken
    def damaged(name, edit):
        out = tmp_path / name
        shutil.copytree(straight, out)
        edit(out / "step_000006")
        logged = []
        path, state = ck.load_newest(str(out), logged.append)
        assert path == str(out / "step_000003") and state["step"] == 3, logged
        assert len(logged) == 1 and f"{out / 'step_000006'} is damaged: " in logged[0], logged
        return logged[0]

    def cut_file(rel):
        def edit(d):
            with open(d / rel, "r+b") as f:
                f.truncate(os.path.getsize(d / rel) // 2)
        return edit

    assert "state.pt has" in damaged("cut_state", cut_file("state.pt"))
    assert "drafter/model.safetensors has" in damaged("cut_weights", cut_file("drafter/model.safetensors"))

    def nudge(d):                  # one value of a moment, one ulp up: loads fine, is not what was saved
        st = load_state(d)
        t = st["optimizer"]["exp_avg_sq"][-1].view(-1)
        t[-1] = torch.nextafter(t[-1], torch.tensor(math.inf))
        torch.save(st, d / "state.pt")
        files = json.loads((d / "DONE").read_text())
        files["files"]["state.pt"] = os.path.getsize(d / "state.pt")
        (d / "DONE").write_text(json.dumps(files))
    assert "does not match the digest saved with it" in damaged("nudged", nudge)
    out = tmp_path / "all_bad"
    shutil.copytree(straight, out)
    for d in ("step_000003", "step_000006"):
        cut_file("state.pt")(out / d)
    with pytest.raises(UserError, match="every checkpoint in .* is damaged"):
        ck.load_newest(str(out), lambda m: None)


def test_sigterm_checkpoints_the_step_under_way_and_stops_then_resume_goes_on(llama, sharegpt, cache_dir, tmp_path):
    """SIGTERM (a scheduler, `timeout`, Ctrl-C's SIGINT alike) mid-run: the run ends its step (or the next: the
    signal is read as a step starts), checkpoints it, says how to go on, and exits 128 + 15; --resume trains the
    rest."""
    common = [*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 12,
              "--heldout", 0, "--max-steps", 6, "--ckpt-interval", 100, "--out-dir", tmp_path / "out"]
    p = train(*common, fault="term:2")
    assert p.rc == 128 + signal.SIGTERM, p.tail()
    m = re.search(r"\[run\] SIGTERM: step (\d) is the last, checkpointed; run again with --resume", p.out)
    assert m and int(m.group(1)) in (2, 3), p.tail()
    stop = int(m.group(1))
    assert checkpoints(tmp_path / "out") == [f"step_{stop:06d}"] and "summary" in p.out
    assert [r["step"] for r in metrics(tmp_path / "out")] == list(range(1, stop + 1))
    resumed = train(*common, "--resume")
    assert_ok(resumed)
    assert f"steps          6 (this run: from {stop})" in resumed.out, resumed.tail()
    assert [r["step"] for r in metrics(tmp_path / "out")] == [1, 2, 3, 4, 5, 6]


def test_checkpoints_are_written_in_the_background_and_a_failed_write_stops_the_run(llama, sharegpt, cache_dir,
                                                                                     tmp_path):
    """A checkpoint's files are written by a thread while training goes on: a write that fails (a full disk) stops
    the run like any thread (non-zero exit, one line saying why, the previous checkpoint intact and named,
    the half-written folder removed); the log line reports the step loop's pause for the snapshot
    apart from the rates."""
    out = tmp_path / "out"
    p = train(*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 60,
              "--max-steps", 40, "--ckpt-interval", 2, "--out-dir", out, fault="ckpt:4")
    assert p.rc not in (0, None) and p.rc > 0, f"exit code {p.rc}\n{p.tail()}"
    # one line: which checkpoint, where, and the system's reason (a full disk), not a traceback
    assert re.search(r"\[FATAL\] thread checkpoint-writer failed: checkpoint 4 could not be written to \S+"
                     r"step_000004\.tmp: OSError: \[Errno 28\] No space left on device", p.out), p.tail()
    assert "Traceback" not in p.out, p.tail()
    assert re.search(r"\[FATAL\] run stopped\. Last intact checkpoint: \S+step_000002", p.out), p.tail()
    assert sorted(x.name for x in out.glob("step_*")) == ["step_000002"], "the failed write's folder is left"
    assert "[ckpt] the write of checkpoint 4 failed" in p.out and "its partial folder was removed" in p.out, p.tail()
    assert "step 40/40" not in p.out
    state = load_state(out / "step_000002")    # the masters by name are the optimiser's, stored once
    shared = {t.untyped_storage().data_ptr() for t in state["master_weights"].values()}
    assert all(m.untyped_storage().data_ptr() in shared for m in state["optimizer"]["master"])
    # checkpoint 2 is snapshotted after step 2's line: its pause is in step 3's
    assert re.search(r"step 3/40 .*\| checkpoint pause \d+\.\d\ds \(not in the rates\)", p.out), p.tail()


def test_a_time_budget_stops_at_the_last_step_within_it_and_resume_rules(llama, sharegpt, cache_dir, tmp_path):
    """--max-minutes: the progress line gives the share of the budget used, the run stops at the last
    step that ends within the budget and checkpoints it once; a resume counts the time already used (a spent
    budget: nothing to do). Without --resume an out dir with checkpoints is refused before any work; a
    different --lr, --distill, --gamma or drafter shape is an error (the drafter's, the optimiser's and the loss's
    settings come from the checkpoint); a resume drops the
    metrics of steps after the checkpoint and continues, with a notice, on a larger data set."""
    out = tmp_path / "out"
    common = [*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 30,
              "--heldout", 0, "--log-interval", 5, "--ckpt-interval", 1000, "--out-dir", out]
    p = train(*common, "--max-minutes", 0.1)
    assert_ok(p)
    m = re.search(r"\[run\] time budget of 0.1 min: step (\d+) is the last that ends within it", p.out)
    assert m, p.tail()
    last = int(m.group(1))
    assert re.search(rf"step {last} \(\d+% of 0.1 min\) \|", p.out), p.tail()   # progress: the budget's share
    assert checkpoints(out) == [f"step_{last:06d}"] and [r["step"] for r in metrics(out)][-1] == last
    state = load_state(out / f"step_{last:06d}")
    assert state["next_step_ends_s"] >= 6, state      # why it stopped; the resume below applies the same rule to it
    assert state["batches_per_epoch_by_rank"] == [m_ := state["batches_per_epoch_by_rank"][0]] and m_ > 0

    p = here("train_dflash", *common, "--max-minutes", 0.1, "--resume")
    assert_ok(p)
    assert f"budget (--max-minutes, resumes included) was used up by step {last}: nothing to do" in p.out, p.tail()
    # and says again how to measure the result: no held-out file here (--heldout 0)
    assert f"[run] measure its acceptance: python eval_dflash.py --target {llama} --drafter {out}/step_{last:06d}/drafter" \
        " --prompts YOUR_PROMPTS.jsonl" in p.out, p.tail()
    p = here("train_dflash", *common, "--max-steps", last + 2)
    assert p.rc != 0 and "holds checkpoints of an earlier run" in p.out and "--resume" in p.out, p.tail()
    assert "[data]" not in p.out                          # refused before the data or the models
    p = here("train_dflash", *common, "--max-steps", last + 2, "--resume", "--lr", 1e-5)
    assert p.rc != 0 and "--lr 1e-05 (checkpoint: 0.0006)" in p.out, p.tail()
    p = here("train_dflash", *common, "--max-steps", last + 2, "--resume", "--distill", 0.5, "--gamma", 2)
    assert p.rc != 0 and "--distill 0.5 (checkpoint: 0.0), --gamma 2.0 (checkpoint: 4.0)" in p.out, p.tail()  # a new run
    p = here("train_dflash", *common, "--max-steps", last + 2, "--resume", "--num-draft-layers", 1)
    assert p.rc != 0 and "--num-draft-layers 1 (checkpoint: 2)" in p.out, p.tail()
    p = here("train_dflash", *common, "--max-steps", last + 2, "--resume", "--seed", 1)
    assert p.rc != 0 and "--seed 1 (checkpoint: 0)" in p.out, p.tail()
    # the run's identity: its held-out conversations and its target's weights; both are refused before anything
    # is written (heldout.jsonl stays the run's)
    held = list(common)
    held[held.index("--heldout") + 1] = 3
    p = here("train_dflash", *held, "--max-steps", last + 2, "--resume")
    assert p.rc != 0 and "holds out other conversations" in p.out and not (out / "heldout.jsonl").exists(), p.tail()
    from transformers import AutoModelForCausalLM
    other = AutoModelForCausalLM.from_pretrained(llama)
    with torch.no_grad():
        other.model.layers[0].mlp.up_proj.weight.mul_(2)       # the same shape, other weights
    shutil.copytree(llama, tmp_path / "other")
    other.save_pretrained(tmp_path / "other")
    p = here("train_dflash", *[tmp_path / "other" if a == llama else a for a in common], "--max-steps", last + 2,
             "--resume")
    assert p.rc != 0 and "was trained against another target than --target" in p.out, p.tail()

    with open(out / "metrics.jsonl", "a") as f:     # a killed run's steps after the checkpoint, one cut mid-line
        f.write(json.dumps({"step": last + 1, "loss": 1.0}) + "\n" + '{"step": 4, "lo')
    common[common.index("--max-samples") + 1] = 60
    p = train(*common, "--max-steps", last + 2, "--resume")
    assert_ok(p)
    assert re.search(r"\[resume\] NOTICE: the training samples changed \(\d+ -> \d+ samples", p.out), p.tail()
    # a new schedule (the budget's end was near its step count's): its learning rate from the first resumed step on
    assert f"[resume] NOTICE: the schedule changed ({state['total_steps']} -> {last + 2} steps planned)" in p.out
    lr = [r["lr"] for r in metrics(out)][last]
    progress = (last + 0.5) / (last + 2)
    assert lr > 0 and lr == pytest.approx(6e-4 * 0.5 * (1 + math.cos(math.pi * (progress - 0.04) / 0.96)), rel=1e-9)
    assert [r["step"] for r in metrics(out)] == list(range(1, last + 3))


def test_distillation_runs_the_whole_target_and_trains(llama, sharegpt, cache_dir, tmp_path):
    """--distill: the target keeps its last layers and final norm (the teacher's distribution), and the run trains
    on the mixed loss; --distill outside [0, 1] is an error."""
    common = [*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 30,
              "--heldout", 0, "--out-dir", tmp_path / "out"]
    p = here("train_dflash", *common, "--distill", 1.5)
    assert p.rc != 0 and "--distill must lie in [0, 1], got 1.5" in p.out, p.tail()
    p = train(*common, "--distill", 0.5, "--max-steps", 3)
    assert_ok(p)
    assert "kept 4/4 layers and the final norm, no LM head" in p.out, p.tail()
    losses = [r["loss"] for r in metrics(tmp_path / "out")]
    assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses), losses


# -----------------------------------------------------------------------------
# 3. replicas


def test_two_replicas_equal_one_replica_on_the_concatenated_batch(qwen3, cache_dir, tmp_path):
    # Why this construction: replica r of step s takes stream batch base + g*R + r, and the stream's
    # batch order is a permutation over the NUMBER of batches in the epoch, so "R batches of B" and
    # "1 batch of R*B" are the same samples only when one epoch is exactly one optimiser step.
    # So: 4 samples, all in the single bucket 256; R=2 x B=2 (2 batches/epoch) vs R=1 x B=4
    # (1 batch/epoch). Every step then sees all 4 samples in both runs; anchors are drawn per
    # (sample, epoch), and the weight normaliser is global, so each step's update must agree.
    # The 2-replica run also uses 2 target threads (features arrive out of order, reorder buffer).
    data = short_chats(tmp_path / "chats4.jsonl", 4)
    common = [*TINY, "--target", qwen3, "--data", data, "--cache-dir", cache_dir, "--buckets", "256",
              "--heldout", 0, "--max-steps", 3, "--ckpt-interval", 1, "--keep-last", 3]
    two, one = tmp_path / "two", tmp_path / "one"
    p2 = train(*common, "--out-dir", two, "--drafter-devices", "cpu,cpu", "--target-devices", "cpu,cpu",
               "--tokens-per-batch", 512)
    assert_ok(p2)
    p1 = train(*common, "--out-dir", one, "--drafter-devices", "cpu", "--tokens-per-batch", 1024)
    assert_ok(p1)
    assert "[data] 4 samples on this node, 2 batches/epoch, buckets [256], shapes (B,S,A) [(2, 256, 32)]" in p2.out
    assert "[data] 4 samples on this node, 1 batches/epoch, buckets [256], shapes (B,S,A) [(4, 256, 32)]" in p1.out
    assert "2 drafter replica(s)" in p2.out and "2 target + 2 drafter threads started" in p2.out
    assert "grads: one flat fp32 buffer per replica" in p2.out and "grads: handed over by each backward" in p1.out
    assert "[replicas] 2 replica(s) x 1 rank(s) bit-identical after step 3" in p2.out, p2.tail()

    m2, m1 = metrics(two), metrics(one)
    assert [r["step"] for r in m2] == [r["step"] for r in m1] == [1, 2, 3]
    for r2, r1 in zip(m2, m1):
        assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-5), r2["step"]
        assert r2["grad_norm"] == pytest.approx(r1["grad_norm"], rel=1e-4), r2["step"]
        assert r2["acc"] == pytest.approx(r1["acc"], abs=1e-3), r2["step"]

    from safetensors.torch import load_file
    for step in (1, 2, 3):
        name = f"step_{step:06d}"
        s2, s1 = load_state(two / name), load_state(one / name)
        assert s2["step"] == s1["step"] == step
        for k in s1["master_weights"]:
            torch.testing.assert_close(s2["master_weights"][k], s1["master_weights"][k], rtol=0, atol=1e-5,
                                       msg=lambda s: f"step {step} {k}: {s}")
        # Adam's moments are the (clipped) summed gradients themselves: sensitive to any scale error,
        # which the first sign-like Adam update would hide
        o2, o1 = s2["optimizer"], s1["optimizer"]
        assert len(o2["exp_avg"]) == len(o1["exp_avg"]) > 0 and o2["step"] == o1["step"] == [step] * len(o1["step"])
        for i in range(len(o1["exp_avg"])):
            for key in ("exp_avg", "exp_avg_sq"):
                a, b = o2[key][i], o1[key][i]        # relative to the tensor's norm: summation order
                err = float((a - b).norm() / b.norm().clamp(min=1e-30))     # moves tiny entries
                assert err < 1e-5, (step, i, key, err)
        b2, b1 = load_file(two / name / "drafter" / "model.safetensors"), load_file(one / name / "drafter" / "model.safetensors")
        for k in b1:
            assert b1[k].dtype == torch.bfloat16
            torch.testing.assert_close(b2[k].float(), b1[k].float(), rtol=2 ** -7, atol=1e-5)


def _replicas(n, world=1):
    """A Replicas stand-in over n copies of one Linear with MasterAdamW (fp32 weights)."""
    import replicas
    from master_adamw import MasterAdamW
    r = replicas.Replicas.__new__(replicas.Replicas)
    torch.manual_seed(0)
    first = torch.nn.Linear(4, 4)
    r.drafters = []
    for _ in range(n):
        m = torch.nn.Linear(4, 4)
        m.load_state_dict(first.state_dict())
        r.drafters.append(m)
    r.opts = [MasterAdamW(m.parameters(), lr=0.1, param_dtype=torch.float32) for m in r.drafters]
    r.world = world
    return r


def test_replica_fingerprints_catch_a_divergence_naming_the_tensor_and_the_step():
    """The check at a log interval: equal replicas pass; one that differs by offsetting +-e (a float sum
    would not see it), or -0.0 against 0.0 (torch.equal would not), stops the run naming the tensor and
    the step; the end-of-run check says the same."""
    import checkpoint as ck
    r = _replicas(2)
    a, b = r.drafters
    r.check(10)
    logged = []
    r.check(7, logged.append)
    assert logged == ["[replicas] 2 replica(s) x 1 rank(s) bit-identical after step 7 (20 parameters each; "
                      f"fingerprint {ck.digest(ck.fingerprint(r.tensors(0)[1]))})"]
    with torch.no_grad():
        b.weight[0, 0] += 0.5
        b.weight[0, 1] -= 0.5
    with pytest.raises(RuntimeError, match=r"diverged by step 20: 1 tensor fingerprint\(s\) differ, first \['replica 1: weight'\]"):
        r.check(20)
    with torch.no_grad():
        b.weight.copy_(a.weight)
        a.bias[0], b.bias[0] = 0.0, -0.0
    assert torch.equal(a.bias, b.bias)       # what a value comparison would accept
    with pytest.raises(RuntimeError, match=r"by step 30: .*replica 1: bias"):
        r.check(30)


@pytest.mark.parametrize("clip", [1e-3, 1e3])        # clipped / not clipped
def test_a_lone_replica_steps_on_handed_over_grads_and_clips_exactly_like_clip_grad_norm(clip):
    """One replica without a flat buffer (MasterAdamW, the clip factor applied inside its pass): the same
    parameters, byte for byte, and the same norm as clip_grad_norm_ + torch's AdamW.step; grads None
    afterwards (the next backward's grads are handed over, not added to zeros); the step's stats on
    the host."""
    r = _replicas(1)
    a = r.drafters[0]
    b = torch.nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    r.flats, r.grads = [None], [None]
    r.scheds = [torch.optim.lr_scheduler.LambdaLR(r.opts[0], lambda s: 1.0)]
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.1, foreach=False)
    x = torch.randn(4, 4)
    for m in (a, b):
        m(x).square().sum().backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(b.parameters(), clip))
    opt_b.step()
    stats = r.reduce([torch.tensor([1.0, 2.0])])
    gnorm = r.step(clip)
    assert gnorm == ref_norm and (ref_norm > clip) == (clip < 1)
    assert stats.device.type == "cpu" and stats.tolist() == [1.0, 2.0]
    import checkpoint as ck
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert pa.grad is None and torch.equal(ck.as_bytes(pa), ck.as_bytes(pb))


def test_a_nan_or_inf_gradient_norm_raises_with_nothing_stepped_and_the_next_step_is_the_first():
    """clip_and_step queues the update before it reads the norm (on a GPU the host must not wait for the
    norm first), so a bad norm must make the update a no-op: FloatingPointError, and weights, masters,
    moments and step counts as they were; a good step afterwards is step 1 and equals a fresh
    optimiser's."""
    from replicas import clip_and_step
    r = _replicas(2)
    opt_a, opt_b = r.opts
    a = r.drafters[0]
    state = lambda opt: [t.clone() for p in opt.params() for t in (p.detach(), *(opt.state[p][k] for k in
                                                                                ("master", "exp_avg", "exp_avg_sq")))]
    before = state(opt_a)
    for bad in (float("nan"), float("inf")):
        grads = [torch.randn_like(p) for p in a.parameters()]
        grads[1][0] = bad
        with pytest.raises(FloatingPointError, match="the gradient norm is"):
            clip_and_step(opt_a, grads, 1.0)
        assert all(torch.equal(x, y) for x, y in zip(before, state(opt_a)))
        assert [opt_a.state[p]["step"] for p in opt_a.params()] == [0, 0]
    grads = [torch.randn_like(p) for p in a.parameters()]
    assert clip_and_step(opt_a, grads, 1.0) == clip_and_step(opt_b, [g.clone() for g in grads], 1.0)
    assert all(torch.equal(x, y) for x, y in zip(state(opt_a), state(opt_b)))


def test_gradients_summed_in_the_flat_buffer_by_the_hooks():
    """Where grads are summed (replicas, ranks, micro-batches), each backward's gradient is added into
    the replica's fp32 buffer by a hook and freed; two backward passes sum there."""
    from replicas import add_into
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    params = list(lin.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    views = [g.view_as(p) for g, p in zip(torch.split(flat, [p.numel() for p in params]), params)]
    for p, v in zip(params, views):
        p.register_post_accumulate_grad_hook(add_into(v))
    x1, x2 = torch.randn(2, 4), torch.randn(5, 4)
    lin(x1).sum().backward()
    lin(x2).sum().backward()
    assert all(p.grad is None for p in params)
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(lin.state_dict())
    ref(torch.cat([x1, x2])).sum().backward()
    for v, p in zip(views, ref.parameters()):
        torch.testing.assert_close(v, p.grad)


def test_the_warm_up_runs_the_trainers_own_step_on_each_shape():
    """warm_shape hands the step it is given (replicas.forward_backward, the drafter threads' own) a Batch of the
    shape, with distillation features that carry the teacher's states, and that step's backward fills the grads."""
    import compiled
    import dflash_model as dm
    from replicas import forward_backward
    c = dm.DFlashConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=16, vocab_size=64, num_target_layers=4, max_position_embeddings=128,
                        num_draft_layers=1)
    d = dm.DFlashDrafter(c, embed_weight=torch.randn(64, 32), lm_head_weight=torch.randn(64, 32))
    seen = []

    def step(drafter, work, weight_sum):
        seen.append((work[0][0].shape[-1], work[0][1].shape, work[0][1].distill))
        return forward_backward(drafter, work, weight_sum)
    for shape, distill in (((1, 64, 4), 0.0), ((2, 32, 2), 0.5)):
        compiled.warm_shape(d, shape, step, 7.0, distill)
    assert seen == [(len(c.target_layer_ids) * 32, (1, 64, 4), 0.0), ((len(c.target_layer_ids) + 1) * 32, (2, 32, 2), 0.5)]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in d.parameters())


def test_checkpoint_snapshots_reuse_their_host_buffers_and_never_alias_the_live_tensors():
    """The snapshot's host buffers are the same from one checkpoint to the next (no ~15 GB allocated per
    checkpoint), hold copies (training on does not change them), keep a tensor shared in the state
    shared (written once), and are replaced where a tensor's shape or dtype changed."""
    import checkpoint as ck
    w, m = torch.arange(6.0), torch.ones(2, 3)
    pool = ck.HostPool()
    first = ck.to_host({"w": w, "opt": [w, m], "n": 3}, {}, pool.start())
    pool.finish()
    assert first["w"] is first["opt"][0] and first["n"] == 3
    assert first["w"].data_ptr() != w.data_ptr() and torch.equal(first["w"], w)
    kept = [t.data_ptr() for t in pool.bufs]
    w += 1                                                  # training goes on
    assert torch.equal(first["w"], torch.arange(6.0))
    second = ck.to_host({"w": w, "opt": [w, m], "n": 3}, {}, pool.start())
    pool.finish()
    assert [t.data_ptr() for t in pool.bufs] == kept        # the same buffers, refilled
    assert torch.equal(second["w"], torch.arange(6.0) + 1) and torch.equal(second["opt"][1], m)
    third = ck.to_host({"w": w.double(), "opt": [m]}, {}, pool.start())
    assert third["w"].dtype == torch.float64 and pool.bufs[0].data_ptr() != kept[0]
    assert torch.equal(third["opt"][0], m)


def test_checkpoints_record_the_start_environment_and_the_cache_as_it_is(tmp_path, monkeypatch):
    """A checkpoint's env.json is the environment the run started in (what --against compares with; the run
    keeps the code and packages it loaded), with the compile cache as it is at the save."""
    import config
    import environment
    import train_dflash as tr
    cfg = config.parse_args(["--out-dir", str(tmp_path)])
    trainer = tr.Trainer(cfg, print, environment.collect_env(str(tmp_path / "compile_cache")))
    packages = environment.installed_packages
    monkeypatch.setattr(environment, "installed_packages", lambda: packages() + [("newpkg", "1.0", 0.0)])
    (tmp_path / "compile_cache").mkdir()
    (tmp_path / "compile_cache" / "entry").write_text("x")
    env = environment.with_cache(trainer.env_at_start, cfg.compile_cache)     # what Trainer.checkpoint writes
    assert "newpkg" not in env["packages"]                             # the start's environment
    assert env["compile_cache"]["file_count"] == 1                     # the cache as it is now


def test_use_compile_cache_sets_the_cache_folders_and_leaves_a_users_cache_switches(tmp_path, monkeypatch):
    import compiled
    for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"):
        monkeypatch.delenv(k, raising=False)      # use_compile_cache sets them; restored after the test
    monkeypatch.setenv("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
    cache = compiled.use_compile_cache(str(tmp_path / "compile_cache"))
    assert os.path.isdir(cache) and os.environ["TORCHINDUCTOR_CACHE_DIR"] == cache
    assert os.environ["TRITON_CACHE_DIR"] == os.path.join(cache, "triton")
    assert (os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"], os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"]) == ("1", "0")


def test_matmul_flops_of_the_mfu_equal_torchs_flop_counter_on_a_real_step():
    """The MFU's analytic matmul FLOPs are what a drafter forward+backward really runs: torch's FLOP
    counter over one step of a tiny drafter (SDPA path: the counter sees the matmuls, not attention)
    counts exactly dm.matmul_flops. (The fc over the frozen target features has no input grad.)"""
    import dflash_model as dm
    from torch.utils.flop_counter import FlopCounterMode
    S, A, bs, H = 256, 16, 16, 64
    torch.manual_seed(7)
    cfg = dm.DFlashConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, vocab_size=256, num_target_layers=6, num_draft_layers=3, block_size=bs,
                          mask_token_id=255)
    drafter = dm.DFlashDrafter(cfg, embed_weight=torch.randn(256, H), lm_head_weight=torch.randn(256, H))
    feats = torch.randn(1, S, len(cfg.target_layer_ids) * H)
    ids, lm = torch.randint(0, 255, (1, S)), torch.ones(1, S)
    anchors, valid = dm.sample_anchors(lm, torch.tensor([S]), A, bs, torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        loss, _, _ = drafter(feats, dm.make_batch(ids, lm, anchors, valid, cfg, 7.0))
        loss.backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    matmuls = sum(n for op, n in counts.items() if op in ("aten.mm", "aten.addmm", "aten.bmm"))
    assert matmuls == dm.matmul_flops(cfg, S, A), counts
    ctx = 100.0
    assert dm.step_flops(cfg, S, A, ctx) == matmuls + 3 * 3 * 4 * A * bs * 64 * (ctx + bs)
    # per row, attention from that row's VALID anchors only; all A anchors and the bucket's S in the matmuls
    anchors2 = torch.tensor([[10, 30, 0], [50, 0, 0]])
    valid2 = torch.tensor([[True, True, False], [True, False, False]])
    assert dm.batch_flops(cfg, S, anchors2, valid2) == (dm.step_flops(cfg, S, 3, ctx=20.0)
                                                        + dm.step_flops(cfg, S, 3, ctx=50.0))
    # distillation adds one LM head matmul per distinct taught position: 10-24 and 30-44, then 50-64
    taught2 = dm.teacher_positions(anchors2, valid2, S, bs)
    assert len(taught2[0]) == 30 + 15
    assert dm.batch_flops(cfg, S, anchors2, valid2, taught2) == \
        dm.batch_flops(cfg, S, anchors2, valid2) + 2 * (30 + 15) * H * 256
    taught = len(dm.teacher_positions(anchors, valid, S, bs)[0])
    feats_final = torch.cat([feats, torch.randn(1, S, H)], -1)     # the target's final states: the teacher
    batch = dm.make_batch(ids, lm, anchors, valid, cfg, 7.0, distill=0.5)
    with FlopCounterMode(display=False) as counter:
        drafter(feats_final, batch)[0].backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert sum(n for op, n in counts.items() if op in ("aten.mm", "aten.addmm", "aten.bmm")) == \
        dm.matmul_flops(cfg, S, A) + 2 * taught * H * 256, counts


# -----------------------------------------------------------------------------
# 4. failures and bad data


@pytest.mark.parametrize("where", ["target", "drafter"])
def test_exception_in_a_thread_stops_the_run_at_once_with_traceback_and_intact_checkpoint(
        where, llama, sharegpt, cache_dir, tmp_path):
    import dflash_model as dm
    out = tmp_path / "out"
    # drafter:4 raises at the start of step 4, so steps 1-3 (checkpoint 2) are done.
    # target:7 raises at the target thread's 7th batch. With --queue-depth 1 the reorder buffer holds
    # indices < taken + 2, so the target can only have fetched its 7th batch after putting batch 5,
    # i.e. after the drafter took batch 3 (= began step 4), so checkpoint 2 exists then as well.
    fail = {"target": "target:7", "drafter": "drafter:4"}[where]
    p = train(*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 60,
              "--max-steps", 40, "--ckpt-interval", 2, "--queue-depth", 1, "--out-dir", out,
              "--tensorboard", tmp_path / "tb", fault=fail)
    assert p.rc not in (0, None) and p.rc > 0, f"exit code {p.rc}\n{p.tail()}"
    assert "injected failure" in p.out and "Traceback" in p.out, p.tail()
    assert re.search(rf"\[FATAL\] thread {where}-0:cpu failed", p.out), p.tail()
    assert "[FATAL] run stopped" in p.out
    # it stops at the failure (by itself: rc > 0, not the test's timeout), not after training on: the target's
    # 7th batch is at most step 7's, the drafter's step 4 never ends
    trained = [r["step"] for r in metrics(out)]
    assert trained == list(range(1, len(trained) + 1)) and len(trained) < 7, trained
    if where == "drafter":
        assert trained == [1, 2, 3] and "step 4/40" not in p.out
        assert [s for s, _ in tb_scalars(tmp_path / "tb")["loss"]] == [1, 2, 3]     # the events up to the failure
    log = (out / "train.log").read_text()
    assert "injected failure" in log and "[FATAL]" in log
    last = re.search(r"\[FATAL\] run stopped\. Last intact checkpoint: (\S+)", p.out).group(1)
    step = int(Path(last).name.split("_")[1])
    assert step >= 2 and step % 2 == 0 and (step == 2 if where == "drafter" else True)
    drafter = dm.load_drafter(str(Path(last) / "drafter"))
    master = load_state(last)["master_weights"]
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, master[k].to(torch.bfloat16).float()), k


def test_a_nan_gradient_stops_the_run_before_stepping_and_keeps_the_checkpoints(llama, sharegpt, cache_dir, tmp_path):
    """--lr 1e30: step 1 is finite, the weights then overflow and step 2's gradient norm is not: the run
    stops with an error naming the step, steps nothing, and the step-1 checkpoint stays."""
    out = tmp_path / "out"
    p = train(*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 12,
              "--max-steps", 5, "--ckpt-interval", 1, "--keep-last", 1, "--warmup-frac", 0, "--lr", 1e30,
              "--out-dir", out)
    assert p.rc != 0
    assert re.search(r"FloatingPointError: step 2: the gradient norm is (nan|inf)", p.out), p.tail()
    assert "stopped without stepping" in p.out
    assert checkpoints(out) == ["step_000001"] and [r["step"] for r in metrics(out)] == [1]
    assert all(torch.isfinite(w).all() for w in load_state(out / "step_000001")["master_weights"].values())


def _skips(text):
    m = re.search(r"\| skipped: (.*)", text)
    assert m, text
    return {} if m.group(1).strip() == "none" else {
        k: int(v) for k, v in (kv.split("=") for kv in m.group(1).strip().split(", "))}


def test_malformed_lines_are_counted_not_fatal_and_every_batch_has_its_buckets_warmed_shape(llama, embedded, tok,
                                                                                            tmp_path):
    """Malformed JSONL lines and short samples are counted in the log and skipped; with 4 rows per
    batch the short last batch of each bucket is filled up to the warmed shape (a ragged batch would
    be a shape the warm-up never compiled)."""
    import data_dflash
    clean, dirty = tmp_path / "clean.jsonl", tmp_path / "dirty.jsonl"
    with open(embedded[1]) as src:
        good = [line for _, line in zip(range(30), src)]
    clean.write_text("".join(good))
    garbage = ["this is not json\n",
               "[1, 2, 3]\n",                                              # JSON, not a record
               '{"conversations": "oops"}\n',
               '{"conversations": [{"from": "human", "value": 5}]}\n',
               '{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]}\n',
               '{"conversations": [{"from": "human", "value": "hello?"}]}\n',      # no reply
               '{"conversations": [{"from": "wizard", "value": "x"}, {"from": "gpt", "value": "y"}]}\n']
    dirty.write_text("".join(good[:10] + garbage[:4] + good[10:] + garbage[4:])
                     + '{"conversations": [{"from": "human", "val')                 # cut-off last line
    base = data_dflash.build_dataset(tok, [str(clean)], 256, 8, str(tmp_path / "c0"), min_supervised=32,
                                     log=lambda *_: None)["stats"]["skipped"]       # real ShareGPT's own skips
    expect = dict(base)
    for k, n in {"malformed record": 5, "too few supervised tokens": 1, "no assistant turn": 1,
                 "unknown role": 1}.items():
        expect[k] = expect.get(k, 0) + n
    out = tmp_path / "out"
    p = train(*TINY, "--target", llama, "--data", dirty, "--cache-dir", tmp_path / "c1", "--heldout", 0,
              "--tokens-per-batch", 1024, "--epochs", 2, "--out-dir", out)
    assert_ok(p)
    assert _skips(p.out) == expect, p.out
    assert "shapes (B,S,A) [(4, 64, 32), (4, 128, 32), (4, 256, 32)]" in p.out, p.tail()
    assert all(math.isfinite(r["loss"]) for r in metrics(out)) and len(metrics(out)) >= 2


# -----------------------------------------------------------------------------
# 5. torchrun


def test_nccl_rank_sets_its_gpu_before_the_process_group_starts(monkeypatch):
    """On GPUs (NCCL) each torchrun rank must select cuda:LOCAL_RANK before init_process_group, and name
    it as the group's device: else every rank's collectives run on cuda:0 and NCCL fails ("invalid
    usage"). CPU CI has no NCCL, so the calls are recorded instead of made."""
    import torch.distributed as dist
    import config
    import train_dflash as tr
    calls = []

    class Started(Exception):
        pass

    def init_process_group(backend, **kw):
        calls.append(("init_process_group", backend, kw))
        raise Started
    for k, v in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with pytest.raises(Started):
        tr.Trainer(config.parse_args([]), log=lambda m: None).setup()
    assert calls == [("set_device", 1), ("init_process_group", "nccl", {"device_id": torch.device("cuda", 1)})]


def test_torchrun_two_processes_keep_identical_replicas_and_resume_on_their_own_shards(llama, cache_dir, tmp_path):
    # 5 samples, one bucket, B=1: rank 0's shard has 3 batches/epoch, rank 1's has 2, so with --epochs 3
    # they would plan 9 and 6 steps: the ranks must agree (min: 6), or their lr schedules differ and
    # rank 0 waits forever in the all-reduce of step 7.
    data = short_chats(tmp_path / "chats5.jsonl", 5)
    out = tmp_path / "out"
    cmd = [str(c) for c in [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                            free_port(), TRAIN, *TINY, "--target", llama, "--data", data, "--cache-dir", cache_dir,
                            "--heldout", 0, "--buckets", 256, "--tokens-per-batch", 256, "--epochs", 3,
                            "--ckpt-interval", 3, "--tensorboard", tmp_path / "tb", "--out-dir", out]]
    p = run_cmd(cmd, timeout=180)
    assert_ok(p)
    rank1 = (out / "train.rank1.log").read_text()        # rank > 0 logs to its own file, not stdout
    assert "[dist] rank 0/2 backend gloo" in p.out and "[dist] rank 1/2 backend gloo" in rank1
    assert "[dist] rank 1/2" not in p.out
    assert re.search(r"\[data\] 3 samples on this node, 3 batches/epoch.*, 6 steps planned", p.out), p.out
    assert re.search(r"\[data\] 2 samples on this node, 2 batches/epoch.*, 6 steps planned", rank1), rank1
    m = re.search(r"\[replicas\] 1 replica\(s\) x 2 rank\(s\) bit-identical after step 6 .*fingerprint (\w+)\)", p.out)
    assert m, p.tail()
    assert m.group(1) == load_state(out / "step_000006")["fingerprint"]   # the saved final weights
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5, 6]       # rank 0 only writes metrics
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1   # and TensorBoard events
    loss = tb_scalars(tmp_path / "tb")["loss"]
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5, 6]
    assert checkpoints(out) == ["step_000003", "step_000006"]

    # both ranks resume from step 3: each reads its data position against its own shard (rank 1 has 2
    # batches/epoch, rank 0 3), so the resumed run ends on the straight run's weights
    again = tmp_path / "again"
    shutil.copytree(out, again, ignore=shutil.ignore_patterns("step_000006"))
    p2 = run_cmd(cmd[:-1] + [str(again), "--resume"], timeout=180)
    assert_ok(p2)
    rank1 = (again / "train.rank1.log").read_text()
    assert "step_000003: step 3, batch cursor 3" in p2.out and "step_000003: step 3, batch cursor 3" in rank1, rank1
    assert "NOTICE" not in p2.out + rank1
    m2 = re.search(r"bit-identical after step 6 .*fingerprint (\w+)\)", p2.out)
    assert m2 and m2.group(1) == m.group(1), p2.tail()
    assert [r["step"] for r in metrics(again)] == [1, 2, 3, 4, 5, 6]
    # the events of steps 4-6 from before the resume are hidden by those trained again: each step once
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2
    assert [s for s, _ in tb_scalars(tmp_path / "tb")["loss"]] == [1, 2, 3, 4, 5, 6]


# -----------------------------------------------------------------------------
# 6. the one command and the tools


def test_tensorboard_events_hold_every_figure_of_the_log_line_at_its_step_equal_to_metrics_jsonl(
        llama, sharegpt, cache_dir, tmp_path):
    out, tb = tmp_path / "out", tmp_path / "tb"
    p = train(*TINY, "--target", llama, "--data", sharegpt, "--cache-dir", cache_dir, "--max-samples", 20,
              "--heldout", 0, "--max-steps", 4, "--ckpt-interval", 100, "--out-dir", out, "--tensorboard", tb)
    assert_ok(p)
    assert f"  tensorboard    tensorboard --logdir {tb}" in p.out, p.tail()      # the summary says how to view it
    assert re.search(r"step 4/4 .*\| busy target \d+% drafter \d+% \|", p.out), p.tail()
    events, recs = tb_scalars(tb), metrics(out)
    logged = {"loss", "acc@1", "acc@7", "sim_tau", "lr", "grad_norm", "tok_s", "mfu_drafter", "busy_target",
              "busy_drafter", "queue_load", "queue_feat", "sync_ms", "eta_min", "ckpt_pause_s"}     # no GPU: no mem_gib
    assert set(events) == logged, sorted(events)
    assert all([s for s, _ in events[tag]] == [1, 2, 3, 4] for tag in logged), events
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))             # TensorBoard keeps float32
    for tag, key in {"loss": "loss", "sim_tau": "sim_tau", "lr": "lr", "grad_norm": "grad_norm"}.items():
        assert [v for _, v in events[tag]] == [f32(r[key]) for r in recs], tag
    for tag, i in {"acc@1": 0, "acc@7": -1}.items():
        assert [v for _, v in events[tag]] == [f32(r["acc"][i]) for r in recs], tag
    assert all(v > 0 for _, v in events["tok_s"]) and all(0 < v <= 1.5 for _, v in events["busy_drafter"])


def test_install_names_what_is_missing_or_too_old_and_keeps_an_installed_torch(tmp_path, monkeypatch):
    """install.py (the two commands' set-up) installs the lines of a requirements file that no installed package
    satisfies; an installed torch counts whatever its version. Here, after it ran, every file is satisfied."""
    import install
    assert not [f for f in ("requirements.txt", "requirements-data.txt", "requirements-test.txt") if install.missing(f)]
    monkeypatch.setattr(install, "HERE", str(tmp_path))
    (tmp_path / "r.txt").write_text("# a comment\ntorch==0.0.1\nnumpy>=1.0  # new enough\nnumpy>=999\n\n"
                                    "pytest==0.1\nno-such-package-dflash==1.0\n")
    assert install.missing("r.txt") == ["numpy>=999", "pytest==0.1", "no-such-package-dflash==1.0"]


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


def test_every_script_answers_a_bad_input_with_one_line_naming_it(llama, tmp_path):
    """A user's mistake ends every script with one line that names the file or option (a SystemExit with its
    message: no traceback). Each case runs the script's main in one child process. (diagnose.py: test_diagnose.)"""
    import dflash_model as dm
    from transformers import AutoConfig
    t = tmp_path
    good = t / "drafter"
    dm.save_drafter(dm.DFlashDrafter(dm.DFlashConfig.from_target_config(AutoConfig.from_pretrained(llama),
                                                                        num_draft_layers=1, block_size=4)), str(good))
    dm.save_drafter(dm.DFlashDrafter(dm.DFlashConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                                     num_key_value_heads=1, head_dim=16, vocab_size=100,
                                                     num_target_layers=4, num_draft_layers=1)), str(t / "alien"))
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


def test_warmup_cli_prints_a_line_per_device_and_shape(llama, tmp_path):
    p = run_cmd([sys.executable, str(REPO / "warmup.py"), *TINY, "--target", llama, "--drafter-devices", "cpu,cpu",
                 "--out-dir", str(tmp_path / "out")])
    assert_ok(p)
    rows = re.findall(r"^\[warmup\] \d/6 cpu\s+\((\d+), (\d+), (\d+)\)\s+[\d.]+s  eager \(sdpa\)", p.out, re.M)
    assert [tuple(map(int, r)) for r in rows] == [(1, 64, 32), (1, 128, 32), (1, 256, 32)] * 2, p.out
    assert re.search(r"^\[warmup\] done: [\d.]+s over 6 \(device, shape\) pairs$", p.out, re.M), p.out


def test_bench_embedded_reads_the_main_jobs_figures_from_its_files_and_eval_runs(tmp_path):
    """bench.py --embedded's figures (its GPU run is not a CPU test): regeneration from generate_data.py's manifest,
    start-up, warm-up and the summary's busy and sync shares from the log, steps/s from metrics.jsonl after its
    first fifth; per method tau and the mean, range and ratio to tau of the batch-1 speed-ups of the eval runs."""
    import bench
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time": 100 + s / 40}) + "\n"
                                                    for s in range(1, 101)))
    (tmp_path / "m.json").write_text(json.dumps({"this_run": {"tok_s": 1e5, "generation_seconds": 100.0},
                                                 "counts": {"generated_tokens": 10 ** 7}}))
    log = ("[run] start-up 201.5s: imports ...\n[warmup] done in 95.0s\n  busy           target 30%; drafter 96% "
           "(share of the training time on device work); optimiser step + gradient sync 4%\n")
    got = bench.main_job_figures(log, tmp_path, tmp_path / "m.json")
    assert got == {"regen_tok_s": 1e5, "regen_s": 100.0, "regen_tokens": 10 ** 7, "startup_s": 201.5, "warmup_s": 95.0,
                   "train_steps": 100, "train_steps_s": pytest.approx(40.0), "train_busy": "target 30%; drafter 96%",
                   "optimiser_sync_share": "4%"}
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
    out = tmp_path / "bench.json"
    p = run_cmd([sys.executable, bench, "--tiny", "--device", "cpu", "--steps", "1", "--rounds", "1",
                 "--pipeline-steps", "10", "--json", str(out)], timeout=300)
    assert_ok(p)
    assert "target forward (6 layers" in p.out, p.out                  # cut after the deepest feature layer
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
    assert "[replicas] 2 replica(s) x 1 rank(s) bit-identical after step 10" in p.out, p.out
    assert re.fullmatch(r"target \d+%; drafter cpu \d+%, cpu \d+%", res["pipeline_busy"]), res["pipeline_busy"]
    p = run_cmd([sys.executable, bench, "--tiny", "--device", "cpu", "--steps", "1", "--rounds", "1", "--no-pipeline",
                 "--distill", "0.5", "--json", str(out)], timeout=300)
    assert_ok(p)
    assert "target forward (8 layers" in p.out and math.isfinite(json.loads(out.read_text())["drafter_ms"]), p.out


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


# -----------------------------------------------------------------------------
# 7. the optimiser


def _adamw_pair(param_dtype):
    from master_adamw import MasterAdamW
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    b.load_state_dict(a.state_dict())
    opt_a = MasterAdamW(a.parameters(), lr=0.1, betas=(0.9, 0.95), weight_decay=0.1, param_dtype=param_dtype)
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.1, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    return a, b, opt_a, opt_b


def raw(t):
    import checkpoint as ck
    return ck.as_bytes(t)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_master_adamw_is_torch_adamw_on_fp32_masters_and_writes_the_weights_from_them(param_dtype):
    """Given the same fp32 gradients, MasterAdamW's masters are torch AdamW's parameters byte for byte
    (with a grad_scale of 0.5 against gradients halved by hand), and the model's weights are the
    masters cast to the weight dtype (bf16: what a GPU run uses; fp32: CPU)."""
    a, b, opt_a, opt_b = _adamw_pair(param_dtype)
    assert all(p.dtype == param_dtype for p in a.parameters())
    assert all(m.dtype == torch.float32 for m in opt_a.masters())
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in b.parameters()]
        for p, g in zip(b.parameters(), grads):
            p.grad = g * 0.5
        opt_b.step()
        opt_a.step(grads=grads, grad_scale=torch.tensor(0.5))
    for p, m, ref in zip(a.parameters(), opt_a.masters(), b.parameters()):
        assert torch.equal(raw(m), raw(ref.detach()))
        assert torch.equal(raw(p), raw(m.to(param_dtype)))


def test_master_adamw_state_round_trip_keeps_the_masters_in_fp32_and_checks_what_it_loads():
    """A checkpoint's optimiser state restores masters, moments and steps exactly into an optimiser of
    bf16 weights (torch.optim's own load would round them to the parameters' dtype), writes the
    weights from the masters, and the next step is the uninterrupted optimiser's. Another optimiser's
    state or another model's is a clear error."""
    from master_adamw import MasterAdamW
    a, _, opt_a, _ = _adamw_pair(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=gen) for p in a.parameters()] for _ in range(2)]
    opt_a.step(grads=grads[0])
    sd = opt_a.state_dict()
    torch.manual_seed(5)
    c = torch.nn.Linear(8, 8)
    opt_c = MasterAdamW(c.parameters(), lr=0.5, param_dtype=torch.bfloat16)
    opt_c.load_state_dict(sd)
    assert opt_c.param_groups[0]["lr"] == 0.1
    for m_c, m_a, p_c in zip(opt_c.masters(), opt_a.masters(), c.parameters()):
        assert m_c.dtype == torch.float32 and torch.equal(raw(m_c), raw(m_a))
        assert torch.equal(raw(p_c), raw(m_a.to(torch.bfloat16)))
    opt_a.step(grads=grads[1])
    opt_c.step(grads=grads[1])
    for m_c, m_a in zip(opt_c.masters(), opt_a.masters()):
        assert torch.equal(raw(m_c), raw(m_a))
    with pytest.raises(ValueError, match="not a master_adamw/1 optimiser state"):
        opt_c.load_state_dict(torch.optim.AdamW(c.parameters()).state_dict())
    with pytest.raises(ValueError, match="another model"):
        MasterAdamW(torch.nn.Linear(8, 4).parameters()).load_state_dict(sd)
    with pytest.raises(ValueError, match="takes fp32 parameters"):
        MasterAdamW(c.parameters())            # already bf16: the masters would be rounded


def test_resuming_a_drafter_of_another_targets_shape_is_a_one_line_error_naming_a_tensor():
    import config
    import dflash_model as dm
    from replicas import Replicas

    def replicas(hidden):
        dcfg = dm.DFlashConfig(hidden_size=hidden, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=16, vocab_size=64, num_target_layers=4, num_draft_layers=1,
                               max_position_embeddings=64)
        emb = torch.zeros(64, hidden)
        return Replicas(dcfg, emb, emb, [torch.device("cpu")], config.TrainConfig(), 1, lambda s: 1.0, lambda m: None)
    state = replicas(32).checkpoint_state()
    with pytest.raises(UserError, match=r"^out/step_000001/state.pt holds a drafter this run cannot take "
                                         r"\(size mismatch for .*\): resume with the checkpoint's --target"):
        replicas(48).load(state, "out/step_000001", 1, print)


def test_a_batch_of_many_sequences_gives_the_losses_and_gradients_of_its_rows_run_one_by_one():
    """The sized batches change the speed, not the result: a step over 6 rows of different lengths has the
    loss, the hits and counts, and the gradients of the same rows run one at a time with the same weight sum."""
    import dflash_model as dm
    import train_dflash as tr
    S, A, bs, H, B = 128, 16, 8, 64, 6
    torch.manual_seed(3)
    cfg = dm.DFlashConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, vocab_size=256, num_target_layers=6, num_draft_layers=2, block_size=bs,
                          mask_token_id=255)
    drafter = dm.DFlashDrafter(cfg, embed_weight=torch.randn(256, H), lm_head_weight=torch.randn(256, H))
    lengths = torch.tensor([128, 100, 77, 64, 50, 33])
    ids, feats = torch.randint(0, 255, (B, S)), torch.randn(B, S, len(cfg.target_layer_ids) * H)
    lm = (torch.arange(S)[None] < lengths[:, None]).long()
    lm[:, :10] = 0                                                      # a prompt: no loss there
    anchors, valid = tr.sample_anchors_for(0, [(i, 0) for i in range(B)], lm, lengths, A, bs)
    wsum = float(dm.make_batch(ids, lm, anchors, valid, cfg, 4.0).weights[:, :, 1:].sum())

    def run(rows):
        drafter.zero_grad(set_to_none=True)
        batch = dm.make_batch(ids[rows], lm[rows], anchors[rows], valid[rows], cfg, 4.0)
        loss, acc, cnt = drafter(feats[rows], batch, wsum)
        loss.backward()
        return loss.detach(), acc * cnt, cnt, [p.grad.clone() for p in drafter.parameters()]

    together = run(slice(0, B))
    alone = [run(slice(r, r + 1)) for r in range(B)]
    assert torch.allclose(together[0], sum(a[0] for a in alone), rtol=1e-5, atol=1e-6)
    assert torch.equal(together[1], sum(a[1] for a in alone)) and torch.equal(together[2], sum(a[2] for a in alone))
    for g, parts in zip(together[3], zip(*(a[3] for a in alone))):
        assert torch.allclose(g, sum(parts), rtol=1e-4, atol=1e-6)


def test_host_threads_is_one_intra_op_thread_only_where_every_device_is_a_gpu():
    import compiled
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        compiled.host_threads([torch.device("cpu")])
        compiled.host_threads([torch.device("cuda:0"), torch.device("cpu")])
        assert torch.get_num_threads() == 2        # a CPU device trains with the intra-op threads
        compiled.host_threads([torch.device("cuda:0"), torch.device("cuda:1")])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_loaders_prepared_batch_is_what_the_step_would_compute_itself():
    """prepare_batch (the loader thread's host work) gives each batch its anchors (drawn per sample and epoch), its
    Batch with distillation's taught positions, and the step's sums (weights, tokens, FLOPs)."""
    import config
    import dflash_model as dm
    import train_dflash as tr
    S, bs, H, B = 128, 8, 64, 3
    torch.manual_seed(5)
    cfg = config.parse_args(["--num-anchors", "16", "--block-size", str(bs), "--distill", "0.5", "--max-length", "128"])
    dcfg = dm.DFlashConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, vocab_size=256, num_target_layers=6, num_draft_layers=2, block_size=bs,
                           mask_token_id=255)
    lengths, ids = torch.tensor([128, 90, 41]), torch.randint(0, 255, (B, S))
    lm = (torch.arange(S)[None] < lengths[:, None]).long()
    keys = [(7, 0), (3, 1), (5, 0)]
    b = tr.prepare_batch(cfg, dcfg, keys, ids, lm, lengths)
    anchors, valid = tr.sample_anchors_for(cfg.seed, keys, lm, lengths, config.anchors_for(cfg, S), bs)
    want = dm.make_batch(ids, lm, anchors, valid, dcfg, cfg.gamma, 0.5)
    got = b["batch"]
    for k in ("block_ids", "block_pos", "labels", "weights", "anchors"):
        assert torch.equal(getattr(got, k), getattr(want, k)), k
    assert got.distill == 0.5 and got.shape == (B, S, config.anchors_for(cfg, S))
    for g, w in zip(got.taught, dm.teacher_positions(anchors, valid, S, bs)):
        assert torch.equal(g, w)
    assert b["wsum"] == float(want.weights[:, :, 1:].sum())
    assert b["tokens"] == 259 and b["flops"] == dm.batch_flops(dcfg, S, anchors, valid, got.taught)
