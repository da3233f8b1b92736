"""What runs a run: its threads (any exception in any thread is recorded with its traceback and stops the whole run;
every blocking wait looks at the stop flag every 0.2 s, so no thread hangs on a partner that died), the reorder
buffer between them, the clock (time budget and stop signals) and the collectives over ranks."""
import itertools
import os
import queue
import signal
import threading
import time
import traceback

import torch
import torch.distributed as dist

import compiled
import replicas

class Stop(Exception):
    """Raised inside a thread when another thread failed: unwind quietly."""

class Threads:
    """A run's threads: start_thread starts one; any failure is recorded (failures) and stops them all (stop, which
    every put, get and check looks at)."""
    def __init__(self):
        self.stop, self.failures = threading.Event(), []

    def fail(self, name, exc):
        """Record a thread's failure and stop the run: its traceback, or one line for an error that says it all."""
        report = f" {exc}" if getattr(exc, "one_line", False) else "\n" + "".join(traceback.format_exception(exc))
        self.failures.append((name, report))      # atomic: no lock
        self.stop.set()

    def report(self, log, ckpt):
        """Every failure, with the last intact checkpoint (`ckpt`, None if none)."""
        for name, report in self.failures:
            log(f"\n[FATAL] thread {name} failed:{report}")
        log(f"[FATAL] run stopped. Last intact checkpoint: {ckpt or 'none'}")

    def check(self):
        if self.stop.is_set():
            raise Stop()

    def put(self, q, item):
        return self.retry(lambda: q.put(item, timeout=0.2))

    def get(self, q):
        return self.retry(lambda: q.get(timeout=0.2))

    def retry(self, queue_op):
        while True:
            self.check()
            try:
                return queue_op()
            except (queue.Full, queue.Empty):
                pass

    def start_thread(self, name, fn, *args):
        def body():
            try:
                compiled.GATE.configure_thread()     # dynamo's config is per thread (compiled.py's notes)
                fn(*args)
            except Stop:
                pass
            except BaseException as e:       # noqa: B902 - every failure must stop the run loudly
                self.fail(name, e)
        t = threading.Thread(target=body, name=name, daemon=True)
        t.start()
        return t

class ReorderBuffer:
    """Features from the target threads, out of order, taken in order. Only [lo, lo + capacity) is accepted, lo being
    the next to take: a fast target thread cannot run away, and the next index always fits (no deadlock)."""

    def __init__(self, threads, start, capacity):
        self.threads, self.lo, self.cap, self.items, self.cond = threads, start, capacity, {}, threading.Condition()

    def put(self, j, item):
        with self.cond:
            while not self.cond.wait_for(lambda: j < self.lo + self.cap, 0.2):
                self.threads.check()
            self.items[j] = item
            self.cond.notify_all()

    def take(self, j):
        with self.cond:
            while not self.cond.wait_for(lambda: j in self.items, 0.2):
                self.threads.check()
            self.lo = j + 1
            self.cond.notify_all()
            return self.items.pop(j)

class Workers:
    """The loader (batch j: load(j)), a thread per target device (its features) and one per drafter replica (its
    forward + backward: replicas.forward_backward), and the queues between them and the step loop: `load`, the
    reorder buffer `feats` that hands the step its batches in order, and an inbox and outbox per replica."""
    def __init__(self, threads, plan, depth, cursor, load, graphed, drafters, busy):
        self.threads, self.plan, self.cursor, self.load_batch = threads, plan, cursor, load
        self.graphed, self.drafters, self.busy = graphed, drafters, busy    # busy: seconds of device work, per device
        R, T = len(plan.ddevs), len(plan.tdevs)
        self.load = queue.Queue(maxsize=depth * T)
        self.feats = ReorderBuffer(threads, cursor, depth * plan.per_step + T)
        self.inbox, self.outbox = [queue.Queue(1) for _ in range(R)], [queue.Queue(1) for _ in range(R)]

    def start(self, log):
        plan, run = self.plan, self.threads
        threads = [run.start_thread("loader", self.loader)]
        threads += [run.start_thread(f"target-{i}:{d}", self.target, i) for i, d in enumerate(plan.tdevs)]
        threads += [run.start_thread(f"drafter-{r}:{d}", self.drafter, r) for r, d in enumerate(plan.ddevs)]
        log(f"[run] {len(plan.tdevs)} target + {len(plan.ddevs)} drafter threads started")
        if plan.ddevs[0].type == "cuda":
            torch.cuda.set_device(plan.ddevs[0])      # the gradient sum and the steps run from this thread
        return threads

    def loader(self):
        for j in itertools.count(self.cursor):
            self.threads.put(self.load, (j, self.load_batch(j)))

    def target(self, ti):
        dev, graphed = self.plan.tdevs[ti], self.graphed[ti]
        with compiled.own_stream(dev):
            while True:
                j, item = self.threads.get(self.load)
                t0 = time.time()
                item["feats"] = graphed(item["ids"])   # rows right-padded to S: no mask (dm.target_forward)
                compiled.sync_device(dev)            # busy = device time, not launch time; feats ready for any stream
                self.busy["target"][ti] += time.time() - t0
                self.feats.put(j, item)

    def drafter(self, r):
        dev, drafter = self.plan.ddevs[r], self.drafters[r]
        with compiled.own_stream(dev) as stream:
            while True:
                items, wsum = self.threads.get(self.inbox[r])
                if stream is not None:   # the step loop's AdamW pass, queued on the default stream, writes the weights
                    stream.wait_stream(torch.cuda.default_stream(dev))
                t0 = time.time()
                sums = replicas.forward_backward(drafter, [(b["feats"], b["batch"]) for b in items], wsum)
                compiled.sync_device(dev)      # the step waits for the grads anyway; this makes busy = device time
                self.busy["drafter"][r] += time.time() - t0
                self.threads.put(self.outbox[r], sums)

class Clock:
    """The run's time budget (--max-minutes, resumes included) and its stop signals. A step runs only if it ends within
    the budget, the next one predicted to take as long as the last; `frac`, the share of the budget used, is what the
    schedule reads. Ctrl-C or SIGTERM (a scheduler, `timeout`): the step under way ends, is checkpointed, and the run
    stops; a second signal acts at once (the handler restores the old one)."""
    def __init__(self, max_minutes):
        self.max_minutes, self.budget = max_minutes, 60 * max_minutes
        self.seconds_before = self.next_end_s = self.frac = 0.0
        self.asked, self.stopped, self.previous = 0, 0, {}   # this rank's signal; the one that stopped the run

    def resume(self, seconds_before, next_end_s):
        """Continue a run that trained `seconds_before` seconds, its next step predicted to end at `next_end_s`."""
        self.seconds_before, self.next_end_s = seconds_before, next_end_s
        self.frac = seconds_before / self.budget if self.budget else 0.0

    def used_up(self):
        return bool(self.budget and self.next_end_s >= self.budget)

    def stops_after(self, step, signalled, log):
        """Is `step` the last: the last within the budget, or a signal's (this rank's, or another's: torchrun passes a
        SIGTERM on to every rank)? Says why."""
        budget_end = self.used_up()
        if budget_end:
            log(f"[run] time budget of {self.max_minutes} min: step {step} is the last that ends within it")
        if signalled:
            self.stopped = self.asked or signal.SIGTERM
            log(f"[run] {signal.Signals(self.stopped).name}: step {step} is the last, checkpointed; run again with "
                "--resume (start_training.sh passes it) to go on from it")
        return budget_end or bool(signalled)

    def start(self):
        """The training window opens: the signals are caught (where handlers live: the main thread)."""
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        self.t_start, self.t_prev = time.time(), self.seconds_before      # t_prev: the last step's end
        return self.t_start

    def on_signal(self, signum, frame):
        self.asked = self.asked or signum
        signal.signal(signum, self.previous[signum])

    def tick(self, world):
        """Before a step's update: the budget's clock is every rank's latest (the same lr and last step everywhere)."""
        if self.budget:
            now = self.seconds()
            used, self.next_end_s = over_ranks(world, [now, 2 * now - self.t_prev], "MAX")
            self.t_prev, self.frac = now, used / self.budget

    def seconds(self):
        """Training time of the whole run, the runs it resumed included: what --max-minutes budgets."""
        return self.seconds_before + time.time() - self.t_start

    def stop(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

def init_distributed(plan, log):
    """Join torchrun's process group: NCCL on this rank's GPU (LOCAL_RANK), gloo without GPUs."""
    local, cuda = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.is_available()
    if cuda:   # before any collective: else every rank's NCCL runs on cuda:0
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=torch.device("cuda", local) if cuda else None)
    log(f"[dist] rank {plan.rank}/{plan.world} backend {dist.get_backend()}")

def over_ranks(world, values, op="SUM"):
    """Each number reduced over the ranks (SUM or MAX): a collective, so every rank calls it at the same point."""
    if world == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return t.tolist()

def gather_ints(world, value):
    values = [0] * world
    values[dist.get_rank() if world > 1 else 0] = value
    return [int(v) for v in over_ranks(world, values)]
