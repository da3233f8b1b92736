"""Checkpoints, laid out as README's "What a run writes" says: a host snapshot taken in the step loop, written by a
background thread into step_N.tmp and renamed into place (a crash leaves the previous ones intact). A resume takes
the newest intact one: its files match DONE, its state.pt loads and its optimiser state gives the saved digest."""
import hashlib
import json
import os
import shutil
import time

import torch

import data_dflash
import dflash_model as dm
from errors import UserError, first_line

def list_checkpoints(out_dir):
    """Complete checkpoints (DONE written), oldest first."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    return sorted(os.path.join(out_dir, d) for d in names if d.startswith("step_") and not d.endswith(".tmp")
                  and os.path.exists(os.path.join(out_dir, d, "DONE")))

def damage(path):
    """Why the checkpoint at `path` cannot be trusted (a missing or cut file), or None."""
    try:
        with open(os.path.join(path, "DONE")) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"unreadable DONE ({e})"
    for name, size in files.items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"{name} is missing"
        if os.path.getsize(full) != size:
            return f"{name} has {os.path.getsize(full)} bytes, {size} were written"

def load_newest(out_dir, log):
    ckpts = list_checkpoints(out_dir)
    for path in reversed(ckpts):
        why = damage(path)
        if why is None:
            try:
                state = torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=False)
                if optimizer_digest(state["optimizer"]) == state["resume_fingerprint"]:
                    return path, state
                why = "its optimiser state does not match the digest saved with it (edited or corrupted)"
            except Exception as e:           # noqa: BLE001 - any unreadable state.pt is a damaged checkpoint
                why = f"state.pt does not load: {type(e).__name__}: {e}"
        log(f"[resume] WARNING: {path} is damaged: {why}; trying the checkpoint before it")
    if ckpts:
        raise UserError(f"every checkpoint in {out_dir} is damaged (see above): nothing to resume from")
    return None, None

def check_same_run(path, state, cfg, identity, heldout, target):
    """A resume continues the run of `path`: the same drafter, optimiser, loss, seed, target and held-out
    conversations (else a one-line error before anything is written). Returns a notice if the training samples
    changed, else ''."""
    saved = {"distill": 0.0, "dpace": 0.0, **state["config"]}    # a config without the keys: labels, a fixed decay
    changed = [f"--{k.replace('_', '-')} {getattr(cfg, k)} (checkpoint: {saved[k]})"
               for k in ("num_draft_layers", "block_size", "target_layer_ids", "mask_token_id", "lr",
                         "weight_decay", "distill", "gamma", "dpace", "seed") if saved[k] != getattr(cfg, k)]
    if changed:
        raise UserError(f"{path} continues with its own drafter, optimiser, loss and seed settings, but "
                        f"{', '.join(changed)}: pass the checkpoint's values or start a new run")
    old, new = state.get("identity", {}), identity
    if not old and heldout and os.path.isfile(heldout):   # a checkpoint that predates the record
        old = {"heldout": data_dflash.digest(data_dflash.load_conversations([heldout])[0])}
    if old.get("target", new["target"]) != new["target"]:
        raise UserError(f"{path} was trained against another target than --target {target} (other "
                        f"weights or config: fingerprint {old['target']}, now {new['target']}): resume with the "
                        "run's target, or start a new run")
    if old.get("heldout", new["heldout"]) != new["heldout"]:
        raise UserError(f"{path}'s run holds out other conversations ({cfg.out_dir}/heldout.jsonl) "
                        "than this --data, --heldout give: the new ones may be conversations it trained on. "
                        "Resume with the run's --data and --heldout, or start a new --out-dir")
    if old.get("data", new["data"]) != new["data"]:
        return (f"[resume] NOTICE: the training samples changed ({old['samples']} -> {new['samples']} samples, "
                f"digest {old['data']} -> {new['data']}); the held-out conversations did not")
    return ""

class WriteError(OSError):
    """A checkpoint that could not be written (a full or read-only disk, no permission): the run reports its one line
    (pipeline.Threads), not a traceback."""
    one_line = True

class Checkpointer:
    """One write at a time, in the background: a save waits for the last and says so (a slow disk is not a slow GPU)."""

    def __init__(self, threads, out_dir, keep_last, log):
        self.threads, self.out_dir, self.keep_last, self.log = threads, out_dir, keep_last, log
        self.pool, self.writer, self.writing = HostPool(), None, None   # writing: the step the writer writes

    def save(self, step, state, drafter, env_fn, card=None):
        busy, t0 = self.writer is not None and self.writer.is_alive(), time.time()
        self.wait()
        self.threads.check()               # no new snapshot once the run is stopping
        if busy:
            self.log(f"[ckpt] step {step}: waited {time.time() - t0:.1f}s for the write of checkpoint {self.writing} "
                     "(one write at a time, and writing takes longer than --ckpt-interval steps of training: the "
                     "wait is in this interval's rates; raise --ckpt-interval or write to a faster disk)")
        t0 = time.time()
        self.pool.start()              # the last write is done: its buffers are free
        state, serving = to_host(state, {}, self.pool), to_host(drafter.state_dict(), {}, self.pool)
        self.pool.finish()             # the asynchronous device -> host copies have landed
        self.writer = self.threads.start_thread("checkpoint-writer", self._write, step, state, serving, drafter, env_fn,
                                            card)
        self.writing = step
        return time.time() - t0

    def _write(self, step, state, serving, drafter, env_fn, card):
        t0, final = time.time(), os.path.join(self.out_dir, f"step_{step:06d}")
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            os.makedirs(tmp)
            dm.save_drafter(drafter, os.path.join(tmp, "drafter"), state=serving, card=card)
            torch.save(state, os.path.join(tmp, "state.pt"))
            with open(os.path.join(tmp, "env.json"), "w") as f:
                json.dump(env_fn(), f, indent=1, default=str)
            files = {os.path.relpath(os.path.join(d, n), tmp): os.path.getsize(os.path.join(d, n))
                     for d, _, names in os.walk(tmp) for n in names}
            with open(os.path.join(tmp, "DONE"), "w") as f:
                json.dump({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files}, f, indent=1)
        except Exception as e:     # noqa: BLE001 - torch.save words a full disk as "file write failed"
            shutil.rmtree(tmp, ignore_errors=True)      # a partial checkpoint only takes disk space
            try:
                free = f"{shutil.disk_usage(self.out_dir).free / 2**30:.2f} GiB free"
            except OSError as gone:    # the folder itself went away: say that, not a second traceback
                free = f"its folder unreadable: {gone.strerror}"
            self.log(f"[ckpt] the write of checkpoint {step} failed ({free} on {self.out_dir}'s file system); its "
                     "partial folder was removed")
            raise WriteError(f"checkpoint {step} could not be written to {tmp}: {first_line(e)} ({free} there"
                             + ("; the disk is full" if free.startswith("0.00 GiB") else "") + ")") from e
        shutil.rmtree(final, ignore_errors=True)      # a damaged one of an earlier run
        os.replace(tmp, final)
        for old in list_checkpoints(self.out_dir)[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        self.log(f"[ckpt] {final} (written in {time.time() - t0:.1f}s, in the background)")

    def wait(self):
        if self.writer is not None:
            self.writer.join()

# --- Host snapshots -------------------------------------------------------------------------------
def to_host(obj, memo, pool):
    """obj (dicts, lists, tuples) with every tensor, a CPU one too, COPIED into `pool` (read after its finish()):
    training goes on changing them. Once per tensor (memo: id -> copy): shared ones stay shared, saved once."""
    if isinstance(obj, dict):
        return {k: to_host(v, memo, pool) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v, memo, pool) for v in obj)
    if not isinstance(obj, torch.Tensor):
        return obj
    if id(obj) not in memo:        # the original is kept with its copy, so its id is not reused meanwhile
        memo[id(obj)] = (obj, pool.copy(obj.detach()))
    return memo[id(obj)][1]

class HostPool:
    """Host buffers reused, in order, from one checkpoint to the next: torch rounds each pinned one up to a power of 2.
    Pinned for a GPU tensor, so its copy runs asynchronously (fresh pageable memory would pause the step loop)."""

    def __init__(self):
        self.bufs, self.i, self.devices = [], 0, set()

    def start(self):
        self.i, self.devices = 0, set()
        return self

    def copy(self, t):
        pin, b = t.is_cuda, self.bufs[self.i] if self.i < len(self.bufs) else None
        if b is None or b.shape != t.shape or b.dtype != t.dtype or b.is_pinned() != pin:
            b = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            self.bufs[self.i:self.i + 1] = [b]          # replaces buffer i, or appends it
        self.i += 1
        if pin:
            self.devices.add(t.device)
        return b.copy_(t, non_blocking=pin)

    def finish(self):
        for d in self.devices:
            torch.cuda.synchronize(d)

# --- Fingerprints: bit-exact comparison of tensors, cheap enough for every log interval -----------
def fingerprint(tensors):
    """Per tensor, the wrapping int64 sum of its bytes as 8-byte words (near memory bandwidth), on its device: equal
    for bit-identical tensors, almost surely not otherwise (unlike a float sum, +e and -e or -0.0 and 0.0 differ)."""
    sums = []
    for t in tensors:
        b = as_bytes(t)
        if b.data_ptr() % 8 or b.numel() % 8:      # an aligned copy, its last word padded with zeros
            b = torch.cat([b, b.new_zeros(-b.numel() % 8)])
        sums.append(b.view(torch.int64).sum())
    return torch.stack(sums)

def digest(fp):
    """A fingerprint() as 16 hex digits, the same on any device (integer sums do not depend on the order)."""
    return hashlib.sha256(fp.cpu().numpy().tobytes()).hexdigest()[:16]

def as_bytes(t):
    """A tensor's raw bytes (bit-exact comparison: torch.equal on floats treats -0.0 == 0.0)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)

def optimizer_digest(opt_state):
    """digest() of what a resume restores bit for bit: MasterAdamW's fp32 masters and moments (the weights follow)."""
    return digest(fingerprint([t for k in ("master", "exp_avg", "exp_avg_sq") for t in opt_state[k]]))
