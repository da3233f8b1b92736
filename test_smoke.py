"""The test command: `python test_smoke.py` installs what is missing (install.py --test), then runs the whole CPU
suite, every tests/test_*.py (one file per project file it tests: tests/test_<file>.py; shared fixtures in
tests/conftest.py, plain helpers in tests/helpers.py). `python test_smoke.py -m gpu` runs the GPU tests
(tests/test_gpu.py, skipped without CUDA); other arguments pass through to pytest.
"""
import importlib.util
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent

# The files that need the embedded default first, the slowest first: one worker converts the default while the
# other starts on the files that need none of it; a worker whose tests run out takes the other's last ones
# (worksteal), so both end together.
FIRST = ["test_train_dflash.py", "test_decoding.py", "test_warmup.py", "test_start_training.py", "test_data_dflash.py",
         "test_generate_data.py", "test_errors.py", "test_eval_dflash.py", "test_records.py"]


def main(argv):
    import pytest
    files = sorted((HERE / "tests").glob("test_*.py"),
                   key=lambda p: (FIRST.index(p.name) if p.name in FIRST else len(FIRST), p.name))
    # Most tests run a script in a process of its own, so two pytest workers (pytest-xdist, in
    # requirements-test.txt) take about half the time.
    workers = ["-n", "2", "--dist", "worksteal"] if importlib.util.find_spec("xdist") else []
    workers += ["--timeout", "900"] if importlib.util.find_spec("pytest_timeout") else []   # a hang fails its test
    # one intra-op thread per worker: two workers and their scripts share the cores, and torch's threads
    # spinning on an oversubscribed core slow a worker's own tests many times over
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # nothing written into the checkout: pytest's own cache, and pytest-benchmark's folder where it is installed
    quiet = ["-p", "no:cacheprovider"]
    quiet += ["-p", "no:benchmark"] if importlib.util.find_spec("pytest_benchmark") else []
    return pytest.main(["-q", "--rootdir", str(HERE), *quiet, *workers, *map(str, files), *argv])


if __name__ == "__main__":   # the test command sets itself up: it installs what is missing, and says what
    import install
    install.main(["--test"])
    sys.exit(main(sys.argv[1:]))
