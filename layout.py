"""Which split of a node's GPUs trains fastest: every layout's tokens/s, predicted from the seconds of one target
forward and one drafter step per shape bucket (mixed by their share of the batches), and a warning for a slow one.

- Every GPU both roles: tokens / (t_target + t_drafter) per GPU, the sum of its parts (bench.py measures it).
- k target GPUs feeding N - k drafter GPUs: the slower side binds, min(k / t_target, (N - k) / t_drafter).
More than one drafter replica: the drafter side's rate times `sync`, the gradient-sync efficiency.
"""
from typing import NamedTuple

SYNC = 0.95          # assumed gradient-sync efficiency of more than one replica, until measured


class Bucket(NamedTuple):
    share: float         # share of the batches in this shape bucket (normalised over the buckets)
    tokens: float        # target tokens per batch
    t_target: float      # seconds of one target forward of such a batch
    t_drafter: float     # seconds of one drafter step (forward + backward) of such a batch


class Layout(NamedTuple):
    target_devices: str     # as --target-devices takes it
    drafter_devices: str    # as --drafter-devices takes it
    tok_s: float            # predicted target tokens/s
    binds: str              # the side that sets the rate: target | drafter | both (every GPU runs both roles)


def devices(ids):
    return ",".join(f"cuda:{i}" for i in ids)


def predict(n_target, n_drafter, buckets, shared=False, sync=SYNC):
    """(tokens/s, binding side) of n_target target and n_drafter drafter GPUs; shared: the same GPUs do both."""
    w = sum(b.share for b in buckets)
    tokens, tt, td = (sum(b.share * getattr(b, f) for b in buckets) / w for f in ("tokens", "t_target", "t_drafter"))
    eff = sync if n_drafter > 1 else 1.0
    if shared:
        return n_drafter * eff * tokens / (tt + td), "both"
    target, drafter = n_target / tt, n_drafter * eff / td
    return min(target, drafter) * tokens, "target" if target < drafter else "drafter"


def layouts(n, buckets, sync=SYNC):
    """Every layout of n GPUs, best first: all n doing both roles, and k target + n - k drafter GPUs."""
    rows = [Layout(devices(range(n)), devices(range(n)), *predict(n, n, buckets, True, sync))]
    rows += [Layout(devices(range(k)), devices(range(k, n)), *predict(k, n - k, buckets, False, sync))
             for k in range(1, n)]
    return sorted(rows, key=lambda r: -r.tok_s)


def predict_devices(tdevs, ddevs, buckets, sync=SYNC):
    """(tokens/s, side) of the trainer's device lists, or None where a GPU is shared by only some of them."""
    t, d = {str(x) for x in tdevs}, {str(x) for x in ddevs}
    return None if t & d and t != d else predict(len(t), len(d), buckets, t == d, sync)


def format_table(rows):
    short = lambda s: s if "," not in s else f"{s.split(',')[0]}-{s.split(',')[-1].split(':')[1]}"
    lines = [f"{'layout':<22} {'tok/s':>9}  {'binds':<8} --target-devices / --drafter-devices"]
    for r in rows:
        nt, nd = r.target_devices.count(",") + 1, r.drafter_devices.count(",") + 1
        name = f"{nd} GPU{'s' * (nd > 1)} both roles" if r.binds == "both" else f"{nt} target + {nd} drafter"
        lines.append(f"{name:<22} {r.tok_s:>9,.0f}  {r.binds:<8} {short(r.target_devices)} / "
                     f"{short(r.drafter_devices)}")
    return "\n".join(lines)


def warning(rows, buckets, tdevs, ddevs, sync=SYNC, margin=0.10):
    """A warning naming the best layout when it is predicted more than `margin` faster than the run's, else ''."""
    best, mine = rows[0], predict_devices(tdevs, ddevs, buckets, sync)
    if mine is None or best.tok_s <= (1 + margin) * mine[0]:
        return ""
    t, d = ",".join(map(str, tdevs)), ",".join(map(str, ddevs))
    return (f"WARNING: --target-devices {t} --drafter-devices {d} is predicted at {mine[0]:,.0f} tok/s "
            f"({mine[1]} binds); --target-devices {best.target_devices} --drafter-devices "
            f"{best.drafter_devices} at {best.tok_s:,.0f} tok/s ({best.tok_s / mine[0] - 1:.0%} faster)")
