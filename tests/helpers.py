"""Plain helpers of the test files (their fixtures are in conftest.py): a script run in a process of its own,
forked from a server that has imported torch and transformers once; faults injected into such a run; what a
training run leaves in its out dir; the tiny targets, drafters and configs that several files build."""
import errno
import functools
import json
import multiprocessing
import os
import random
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import data_dflash as D
import dflash_model as dm
from compiled import GATE

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
TRAIN = str(REPO / "train_dflash.py")
TIMEOUT = 120

# The tiny run every training test starts from (options are --kebab-case TrainConfig fields).
TINY = ["--max-length", "256", "--num-anchors", "32", "--block-size", "8", "--num-draft-layers", "2",
        "--log-interval", "1"]


# -----------------------------------------------------------------------------
# scripts in processes of their own


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
            while done() < step + n and not self.threads.stop.wait(0.05):
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
    """The command that runs `script` with the fault `kind:N` injected (break_). The child's cwd is the project's
    folder, so it finds this file by its folder."""
    kind, n = fault.split(":")
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); import helpers, {script}; "
            f"helpers.break_({kind!r}, {int(n)}); sys.exit({script}.main(sys.argv[1:]))")
    return [sys.executable, "-c", code, *map(str, args)]


@dataclass
class Run(Proc):
    """A training run: its Proc, and what it left in its --out-dir as it ended: metrics.jsonl's records (its complete
    lines: a killed run's last one may be cut) and the names of its complete checkpoints."""
    records: list = field(default_factory=list)
    checkpoints: list = field(default_factory=list)


def train(*args, timeout=TIMEOUT, fault=None):
    """train_dflash.py with `args`, a fault injected where given (break_), as a Run."""
    cmd = broken("train_dflash", fault, args) if fault else [sys.executable, TRAIN, *map(str, args)]
    p = run_cmd(cmd, timeout=timeout)
    out = _out_dir(args)
    records, names = [], []
    if out and (out / "metrics.jsonl").exists():
        with open(out / "metrics.jsonl") as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    if out and out.is_dir():
        names = checkpoints(out)
    return Run(p.rc, p.lines, records, names)


def _out_dir(args):
    """The --out-dir among train_dflash.py's `args` (the last one given), or None."""
    args = [str(a) for a in args]
    out = None
    for i, a in enumerate(args):
        if a == "--out-dir" and i + 1 < len(args):
            out = args[i + 1]
        elif a.startswith("--out-dir="):
            out = a.split("=", 1)[1]
    return Path(out) if out else None


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


def _checkpoint(tmp_path, env, name="step_000010"):
    """A checkpoint folder holding only `env` as its env.json (what diagnose.py --against reads)."""
    ckpt = tmp_path / name
    ckpt.mkdir()
    (ckpt / "env.json").write_text(json.dumps(env))
    return str(ckpt)


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
# chats


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


def tokenize_conversation(tokenizer, messages, max_length):
    """(input ids by the chat template, loss mask 1 on assistant replies) of one conversation, as the trainer
    tokenises it, truncated to max_length."""
    item = D._encode(tokenizer, [messages], max_length)[0]
    if isinstance(item, Exception):
        raise item
    return item[0], item[1]


def masked_id_runs(ids, mask):
    """The ids of each contiguous run of loss-masked tokens."""
    edges = [i for i in range(len(mask) + 1) if (mask[i - 1] if i else 0) != (mask[i] if i < len(mask) else 0)]
    return [ids[a:b] for a, b in zip(edges[::2], edges[1::2])]


def _masked_runs(tok, ids, mask):
    """Decoded text of each contiguous run of loss-masked tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


# -----------------------------------------------------------------------------
# tiny targets and drafters


def _save_tiny(path, cfg_cls, model_cls, tok, **extra):
    """A random 4-layer target of hidden 64 over `tok`'s vocabulary, saved with `tok` at `path`."""
    torch.manual_seed(0)
    cfg = cfg_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                  max_position_embeddings=1024, **extra)
    model_cls(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def tiny_target(arch, seed=0):
    """A tiny random causal LM. initializer_range 0.3 makes greedy continuations diverse
    (at 0.02 a random model falls into repeating one token after a few steps)."""
    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_hidden_layers=6, vocab_size=512, max_position_embeddings=512,
                  initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(arch)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def tiny_llama(layers):
    """A random Llama of hidden 64 (4 query, 2 kv heads) over a 256-token vocabulary, `layers` deep."""
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2))


def drafter_for(target, block_size, num_draft_layers=2, seed=1):
    torch.manual_seed(seed)
    cfg = dm.DFlashConfig.from_target_config(target.config, num_draft_layers=num_draft_layers,
                                             block_size=block_size,
                                             mask_token_id=target.config.vocab_size - 1)
    return dm.DFlashDrafter(cfg).attach_target(target)


def drafter_with_heads(cfg, lm_head_scale=1.0):
    """A drafter of `cfg` with a random embedding and LM head (a run reads the target's), drawn in that order."""
    V, H = cfg.vocab_size, cfg.hidden_size
    return dm.DFlashDrafter(cfg, embed_weight=torch.randn(V, H), lm_head_weight=lm_head_scale * torch.randn(V, H))


# -----------------------------------------------------------------------------
# the mask's formula and the compile gate


def naive_mask(anchors, S, bs):
    """The DFlash mask's formula, one element at a time: (B, Q, KV) bool."""
    B, A = anchors.shape
    Q, KV = A * bs, S + A * bs
    al = anchors.tolist()
    rows = []
    for b in range(B):
        for q in range(Q):
            i = q // bs
            a = al[b][i]
            rows.append([(kv < S and kv < a) or (kv >= S and (kv - S) // bs == i) for kv in range(KV)])
    return torch.tensor(rows, dtype=torch.bool).view(B, Q, KV)


def reset_gate():
    """The gate as a fresh process has it: cold, default limits, applied in this thread."""
    torch.compiler.set_stance("default")
    GATE.__init__()
    GATE.configure_thread()


# -----------------------------------------------------------------------------
# tiny configs


def tiny_config_json(path, **extra):
    """A tiny Llama config written to `path`: a random:<path> target for the trainer's own loading."""
    path.write_text(json.dumps(dict(model_type="llama", hidden_size=64, intermediate_size=128,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    num_hidden_layers=4, vocab_size=512, max_position_embeddings=512, **extra)))
    return path


def small_config(**kw):
    """The drafter config of several CPU tests: hidden 64 (4 query and 2 kv heads of 16), intermediate 96, a 256-token
    vocabulary whose last id is the mask, a 6-layer target, 2 draft layers; `kw` sets any field."""
    return dm.DFlashConfig(**{**dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=16, vocab_size=256, num_target_layers=6, num_draft_layers=2,
                                     mask_token_id=255), **kw})


def toy_config(**kw):
    """The smallest drafter config: hidden 32 (2 query heads, 1 kv head of 16), intermediate 64, a 64-token
    vocabulary, a 4-layer target, 1 draft layer; `kw` sets any field."""
    return dm.DFlashConfig(**{**dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                                     head_dim=16, vocab_size=64, num_target_layers=4, num_draft_layers=1), **kw})


# -----------------------------------------------------------------------------
# what a run's functions were called with and returned


def traced(script, args, trace, calls, fault=None):
    """The command that runs `script` with `args` (the fault `kind:N` injected where given: break_) as `broken` does,
    each function of `calls` traced into `trace` (trace_calls)."""
    return [sys.executable, "-c", tracing_code(script, trace, calls, fault), *map(str, args)]


def tracing_code(script, trace, calls, fault=None):
    """Python code that runs `script`.main on its argv, each function of `calls` traced (trace_calls): for `-c`, or
    written to a file for a launcher that takes a script (torchrun)."""
    kind, n = fault.split(":") if fault else (None, 0)
    return (f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(TESTS)!r}]; import helpers, {script}; "
            + (f"helpers.break_({kind!r}, {int(n)}); " if fault else "")
            + f"helpers.trace_calls({str(trace)!r}, {list(calls)!r}); sys.exit({script}.main(sys.argv[1:]))")


def trace_calls(trace, calls):
    """Wrap each function of `calls` ("module:name" or "module:Class.name") to append a JSON line to the file `trace`
    ("{rank}" in it: the process's RANK) as it is called and as it returns, in the order that happens across threads:
    {"fn", "at": "call" | "return", "thread", "args", "kwargs", "out"} with each value as `described`."""
    import importlib
    path, lock = trace.replace("{rank}", os.environ.get("RANK", "0")), threading.Lock()

    def emit(**event):
        with lock, open(path, "a") as f:
            f.write(json.dumps(event) + "\n")

    def wrap(name, owner, attr):
        orig = getattr(owner, attr)

        @functools.wraps(orig)
        def wrapped(*a, **kw):
            where = dict(fn=name, thread=threading.current_thread().name, args=[described(x) for x in a],
                         kwargs={k: described(v) for k, v in kw.items()})
            emit(at="call", **where)
            out = orig(*a, **kw)
            emit(at="return", out=described(out), **where)
            return out
        setattr(owner, attr, wrapped)

    for name in calls:
        module, attrs = name.split(":")
        owner = importlib.import_module(module)
        *outer, attr = attrs.split(".")
        for a in outer:
            owner = getattr(owner, a)
        wrap(name, owner, attr)


def described(x, depth=0):
    """A value as JSON: numbers, strings and short lists and dicts as they are; a tensor as its dtype, shape and the
    numel of the tensor it views (None: not a view); a module as its class and parameter count; an object with a shape
    as its type and shape; anything else as its type's name."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, torch.Tensor):
        return {"tensor": str(x.dtype), "shape": list(x.shape), "base": None if x._base is None else x._base.numel()}
    if isinstance(x, torch.nn.Module):
        return {"module": type(x).__name__, "params": sum(p.numel() for p in x.parameters())}
    if isinstance(getattr(x, "shape", None), tuple):
        return {"type": type(x).__name__, "shape": list(x.shape)}
    if isinstance(x, (list, tuple)) and len(x) <= 64 and depth < 3:
        return [described(v, depth + 1) for v in x]
    if isinstance(x, dict) and len(x) <= 64 and depth < 3:
        return {str(k): described(v, depth + 1) for k, v in x.items()}
    return f"<{type(x).__name__}>"


def read_trace(trace):
    """trace_calls' events, in order."""
    with open(trace) as f:
        return [json.loads(line) for line in f]
