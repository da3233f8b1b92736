"""What a DFlash training run runs on, what changed since a checkpoint, and the threaded compile race.

    python diagnose.py                            this machine's environment + the 15 newest packages
    python diagnose.py --against out/step_000690  what changed since that checkpoint's env.json
    python diagnose.py --race-test [--threads 3 --seconds 20 --modes nogate,gate]
        threads compiling at once, without and with compiled.GATE: errors, calls/s, who raises the FX flag

The race (compiled.py's torch notes): while one thread compiles, a compiled call in another fails or runs uncompiled."""
import argparse
import json
import os
import sys

import torch

import config
from environment import collect_env, diff_env, format_packages, format_report, installed_packages
import errors

def _against(folder, cache_dir):
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    if not os.path.isfile(path := os.path.join(folder, "env.json")):
        raise FileNotFoundError(f"{folder} has no env.json (not a checkpoint folder written by train_dflash.py)")
    try:
        with open(path) as f:
            old = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path} is cut or not JSON ({e})") from None
    if not isinstance(old, dict) or "time_unix" not in old:
        raise ValueError(f"{path} is not an env.json written by train_dflash.py (no time_unix)")
    diffs = diff_env(old, collect_env(cache_dir or (old.get("compile_cache") or {}).get("path")))
    newer = [r for r in installed_packages() if r[2] > old["time_unix"]]
    show, w = lambda x: json.dumps(x, default=str), max([len(k) for k, _, _ in diffs] + [10])
    text = [f"Changes since {folder} (its env.json: the environment of the run that wrote it, recorded "
            f"{old.get('time')} on {old.get('hostname')}):"]
    text += [f"  {k:<{w}}  {show(o)}  ->  {show(n)}" for k, o, n in diffs] or ["  no field differs"]
    text.append(format_packages(newer, f"Packages installed or modified after the checkpoint ({len(newer)}):"))
    return ({"checkpoint": folder, "checkpoint_time": old.get("time"),
             "differences": [{"field": k, "old": o, "new": n} for k, o, n in diffs],
             "packages_after": [{"name": n, "version": v, "mtime": t} for n, v, t in newer]}, "\n".join(text))

@errors.script
def main(argv=None):
    ap = config.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", metavar="CHECKPOINT", help="checkpoint folder with env.json: what changed since")
    ap.add_argument("--race-test", action="store_true", help="threaded cold-cache compile race, without and with gate")
    ap.add_argument("--threads", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0, help="per mode")
    ap.add_argument("--modes", default="nogate,gate", type=lambda s: s.split(","), help="comma list: nogate,gate")
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu", help="default: %(default)s")
    ap.add_argument("--cache-dir", help="compile cache to describe (default: the checkpoint's, or the current one)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a, rc = ap.parse_args(argv), 0
    if a.race_test:
        from compile_race import MODES, format_race_table, run_child   # the experiment: loaded only when asked for
        if bad := set(a.modes) - set(MODES):
            ap.error(f"unknown mode(s) {sorted(bad)}: use {', '.join(MODES)}")
        results = [run_child(mode=m, threads=a.threads, seconds=a.seconds, device=a.device) for m in a.modes]
        obj = {"command": "race-test", "device": a.device, "modes": results}
        text, rc = format_race_table(results), int(any(r.get("failed") for r in results))
    elif a.against:
        try:
            obj, text = _against(a.against, a.cache_dir)
        except (OSError, ValueError) as e:   # no such folder, no env.json, or not JSON
            if a.json:
                print(json.dumps({"error": str(e)}))
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        env = collect_env(a.cache_dir)
        recent = installed_packages()[:15]
        obj = {"env": env, "recent_packages": [{"name": n, "version": v, "mtime": t} for n, v, t in recent]}
        text = format_report(env) + "\n" + format_packages(recent, "15 most recently installed/modified packages:")
    print(json.dumps(obj, indent=1, default=str) if a.json else text)
    return rc

if __name__ == "__main__":
    sys.exit(main())
