"""The threads of a run: any exception in any thread is recorded with its traceback and stops the whole run. Every
blocking wait here looks at the stop flag every 0.2 s, so no thread hangs on a partner that died."""
import queue
import threading
import traceback

import compiled

class Stop(Exception):
    """Raised inside a thread when another thread failed: unwind quietly."""

class Run:
    def __init__(self):
        self.stop, self.failures = threading.Event(), []

    def fail(self, name, exc):
        """Record a thread's failure and stop the run: its traceback, or one line for an error that says it all."""
        report = f" {exc}" if getattr(exc, "one_line", False) else "\n" + "".join(traceback.format_exception(exc))
        self.failures.append((name, report))      # atomic: no lock
        self.stop.set()

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

    def __init__(self, run, start, capacity):
        self.run, self.lo, self.cap, self.items, self.cond = run, start, capacity, {}, threading.Condition()

    def put(self, j, item):
        with self.cond:
            while not self.cond.wait_for(lambda: j < self.lo + self.cap, 0.2):
                self.run.check()
            self.items[j] = item
            self.cond.notify_all()

    def take(self, j):
        with self.cond:
            while not self.cond.wait_for(lambda: j in self.items, 0.2):
                self.run.check()
            self.lo = j + 1
            self.cond.notify_all()
            return self.items.pop(j)
