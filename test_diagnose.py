"""CPU tests of diagnose.py: the environment, what changed, the report and --race-test.

The threaded exercise compiles flex cold in a child process (~30 s on a small CPU): it starts with
the module and runs while the quick tests do.
"""
import json
import re
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

import compile_race
import diagnose
import environment

HERE = os.path.dirname(os.path.abspath(__file__))
MISSING = environment.MISSING


def _start(*args):
    return subprocess.Popen([sys.executable, os.path.join(HERE, "diagnose.py"), *args], cwd=HERE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    return out


@pytest.fixture(scope="module", autouse=True)
def race_run():
    # the gate mode only: the flag rises in it as in the others (a compile is a compile), and one cold
    # child is the slow part of this file
    proc = _start("--race-test", "--modes", "gate", "--threads", "2", "--seconds", "1", "--device", "cpu", "--json")
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def _checkpoint(tmp_path, env, name="step_000010"):
    ckpt = tmp_path / name
    ckpt.mkdir()
    (ckpt / "env.json").write_text(json.dumps(env))
    return str(ckpt)


def _env(cache="/c", **env_vars):
    return {"compile_cache": {"path": cache}, "env_vars": env_vars}


# --- collect_env and the report

def test_collect_env_never_raises_has_the_keys_and_starts_no_python(tmp_path, monkeypatch):
    commands, run = [], subprocess.run
    monkeypatch.setattr(environment.subprocess, "run", lambda cmd, *a, **k: commands.append(cmd) or run(cmd, *a, **k))
    env = environment.collect_env(cache_dir=str(tmp_path / "no_cache"))
    assert not [c for c in commands if c[0] == sys.executable], commands   # the trainer calls it at every save
    for key in ("time", "time_unix", "hostname", "platform", "cpu_count", "python_executable", "python_prefix",
                "versions", "gpus", "env_vars", "compile_cache", "project", "packages"):
        assert key in env, key
    for key in ("python", "torch", "torch_git", "cuda", "cudnn", "triton", "transformers", "datasets", "numpy",
                "safetensors"):
        assert key in env["versions"], key
    assert env["versions"]["torch"] == environment.torch.__version__
    assert env["compile_cache"]["exists"] is False and env["compile_cache"]["source"] == "argument"
    assert env["project"]["commit"] or env["project"]["error"], env["project"]   # a copy may have no .git
    json.dumps(env)                                                               # env.json takes it as is
    text = environment.format_report(env)
    assert "torch" in text and "does not exist -> every shape compiles cold" in text


def test_collect_env_survives_broken_parts(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("broken")
    monkeypatch.setattr(environment, "_gpus", boom)
    monkeypatch.setattr(environment, "_git_state", boom)
    env = environment.collect_env()
    assert env["gpus"] == {"error": "RuntimeError: broken"} and "error" in env["project"]
    environment.format_report(env)


def test_env_records_the_python_in_use_not_the_interpreter_its_symlink_points_to(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    monkeypatch.setattr(environment.sys, "executable", str(venv / "bin" / "python"))
    monkeypatch.setattr(environment.sys, "prefix", str(venv))
    env = environment.collect_env(cache_dir=str(tmp_path / "cache"))
    assert env["python_executable"] == str(venv / "bin" / "python") and env["python_prefix"] == str(venv)
    assert f"{venv}/bin/python  (prefix {venv})" in environment.format_report(env)


def test_command_line_report_and_help_work(capsys):
    assert diagnose.main(["--json"]) == 0
    env = json.loads(capsys.readouterr().out)["env"]
    assert env["versions"]["torch"] == environment.torch.__version__
    assert diagnose.main([]) == 0
    text = capsys.readouterr().out
    assert "compile cache " in text and "15 most recently installed" in text
    with pytest.raises(SystemExit) as e:
        diagnose.main(["--help"])
    assert e.value.code == 0 and "--race-test" in capsys.readouterr().out
    # a mistyped option or mode: one line naming it, as every script answers
    for argv, needle in ((["--bogus"], "unrecognized arguments: --bogus"), (["--race-test", "--modes", "warm"],
                                                                             "unknown mode(s) ['warm']: use nogate, gate")):
        with pytest.raises(SystemExit) as e:
            diagnose.main(argv)
        assert str(e.value.code).startswith("error: ") and needle in str(e.value.code) and "\n" not in str(e.value.code)


def test_cache_state_counts_the_files_and_their_bytes(tmp_path):
    cache = tmp_path / "cache"
    (cache / "fxgraph").mkdir(parents=True)
    (cache / "fxgraph" / "entry").write_bytes(b"x" * 10)
    (cache / "lock").write_text("")
    c = environment.cache_state(str(cache))
    assert (c["exists"], c["file_count"], c["size_bytes"], c["source"]) == (True, 2, 10, "argument")
    assert "0.0 MiB in 2 files" in environment.format_report({"compile_cache": c})


# --- diff_env and --against

def test_against_reports_exactly_the_changed_fields(tmp_path, capsys):
    cache = str(tmp_path / "cache")
    old = environment.collect_env(cache_dir=cache)
    pkgs = environment.installed_packages()
    t_old = pkgs[2][2] - 1e-3                                 # just before the 3rd newest package
    old["versions"]["torch"] = "2.0.0+fake"                   # versions no real machine has
    old["versions"]["triton"] = "0.0.1-fake"
    old["time_unix"], old["time"] = t_old, "2020-01-01T00:00:00+00:00"
    ckpt = _checkpoint(tmp_path, old, "step_000690")

    assert diagnose.main(["--against", ckpt, "--cache-dir", cache, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # project.* may move on meanwhile: other people commit and edit in this checkout
    fields = {d["field"] for d in out["differences"] if not d["field"].startswith("project.")}
    assert fields == {"versions.torch", "versions.triton"}, out["differences"]
    by = {d["field"]: d for d in out["differences"]}
    assert (by["versions.torch"]["old"], by["versions.torch"]["new"]) == ("2.0.0+fake", environment.torch.__version__)
    newer = {n for n, _, t in pkgs if t > t_old}
    assert newer and newer <= {p["name"] for p in out["packages_after"]}
    assert all(p["mtime"] > t_old for p in out["packages_after"])

    assert diagnose.main(["--against", ckpt, "--cache-dir", cache]) == 0
    text = capsys.readouterr().out
    assert "versions.torch" in text and "2.0.0+fake" in text and "installed or modified after" in text


def test_against_clear_errors(tmp_path, capsys):
    assert diagnose.main(["--against", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert diagnose.main(["--against", str(tmp_path), "--json"]) == 2
    out, err = capsys.readouterr()
    assert "has no env.json" in err and "has no env.json" in json.loads(out)["error"]
    (tmp_path / "env.json").write_text('{"time": "2026-01-01", "time_u')     # cut mid-write
    assert diagnose.main(["--against", str(tmp_path)]) == 2
    assert f"error: {tmp_path / 'env.json'} is cut or not JSON" in capsys.readouterr().err


def test_diff_ignores_the_time_and_a_growing_cache_and_reports_every_other_field_that_differs():
    old = {"time_unix": 100.0, "time": "x", "compile_cache": {"path": "/c", "exists": True, "size_bytes": 1,
           "file_count": 5}, "env_vars": {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}}
    grown = json.loads(json.dumps(old))
    grown["compile_cache"].update(size_bytes=9, file_count=50)
    grown["time_unix"], grown["time"] = 600.0, "y"
    assert environment.diff_env(old, grown) == []
    grown["env_vars"]["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    assert environment.diff_env(old, grown) == [("env_vars.TORCHINDUCTOR_FX_GRAPH_CACHE", "1", "0")]
    # every recorded variable is compared as it is
    assert environment.diff_env(_env(), _env(HF_HOME="/hf")) == [("env_vars.HF_HOME", MISSING, "/hf")]
    assert environment.diff_env(_env(CUDA_VISIBLE_DEVICES="1,0"), _env()) == [
        ("env_vars.CUDA_VISIBLE_DEVICES", "1,0", MISSING)]
    assert environment.diff_env(_env(), _env("/other")) == [("compile_cache.path", "/c", "/other")]


# --- git, variables, nvidia-smi, packages

def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false",
                    *args], check=True, capture_output=True)


def test_git_state_hashes_the_diff_and_against_reports_a_further_edit(tmp_path, monkeypatch, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "model.py").write_text("x = 1\n")
    _git(repo, "add", "model.py")
    _git(repo, "commit", "-q", "-m", "init")
    clean = environment._git_state(str(repo))
    assert clean["dirty"] is False and clean["diff_sha256"] and "error" not in clean
    (repo / "model.py").write_text("x = 2\n")
    first = environment._git_state(str(repo))
    (repo / "model.py").write_text("x = 3\n")                   # a further edit of the same dirty file
    (repo / "new_module.py").write_text("y = 1\n")
    second = environment._git_state(str(repo))
    assert first["dirty_files"] == second["dirty_files"] == ["model.py"]
    assert len({clean["diff_sha256"], first["diff_sha256"], second["diff_sha256"]}) == 3
    assert first["untracked_files"] == [] and second["untracked_files"] == ["new_module.py"]
    assert second["untracked_count"] == 1

    # --against, with this repo as the project: the hash row names the edit
    (repo / "model.py").write_text("x = 2\n")
    (repo / "new_module.py").unlink()
    monkeypatch.setattr(environment, "_git_state", lambda path=str(repo), real=environment._git_state: real(path))
    cache = str(tmp_path / "cache")
    old = environment.collect_env(cache_dir=cache)
    assert old["project"]["diff_sha256"] == first["diff_sha256"]
    ckpt = _checkpoint(tmp_path, old, "step_000001")
    (repo / "model.py").write_text("x = 3\n")
    assert diagnose.main(["--against", ckpt, "--cache-dir", cache, "--json"]) == 0
    by = {d["field"]: d for d in json.loads(capsys.readouterr().out)["differences"]}
    assert by["project.diff_sha256"]["old"] == first["diff_sha256"]
    assert by["project.diff_sha256"]["new"] != first["diff_sha256"]
    assert "project.dirty_files" not in by                        # names alone would have missed it


def test_git_state_failing_command_is_unknown_not_clean(tmp_path, monkeypatch):
    """A git whose status fails (corrupt index, lock, ...) must not read as a clean tree."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "git"
    fake.write_text('#!/bin/sh\ncase "$*" in *rev-parse*) echo 0123abcd; exit 0;; esac\n'
                    'echo "fatal: index file corrupt" >&2\nexit 128\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir) + os.pathsep + os.environ["PATH"])
    g = environment._git_state(str(tmp_path))
    assert g["commit"] == "0123abcd"
    assert g["dirty"] is None and g["diff_sha256"] is None and g["untracked_files"] is None
    assert "git status: fatal: index file corrupt" in g["error"] and "git diff" in g["error"]
    text = environment.format_report({"project": g})
    assert "dirty: unknown" in text and "index file corrupt" in text


def test_env_vars_records_more_names_and_never_a_secret(monkeypatch):
    for k in list(os.environ):
        if k.startswith(environment.ENV_PREFIXES) or k in environment.ENV_NAMES:
            monkeypatch.delenv(k)
    recorded = {"LD_PRELOAD": "/x/libfoo.so", "LD_LIBRARY_PATH": "/usr/local/cuda/lib64", "PYTHONPATH": "/src",
                "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NVIDIA_TF32_OVERRIDE": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                "CUDA_MODULE_LOADING": "LAZY", "MKL_NUM_THREADS": "4", "HF_HOME": "/hf", "TORCH_LOGS": "recompiles"}
    secrets = {"HF_TOKEN": "hf_sEcReT1", "HF_API_KEY": "sEcReT2", "TORCH_SECRET_X": "sEcReT3",
               "NCCL_PASSWORD": "sEcReT4", "hf_hub_token": "sEcReT5"}
    for k, v in {**recorded, **secrets, "UNRELATED_VAR": "1", "AWS_SECRET_ACCESS_KEY": "sEcReT6"}.items():
        monkeypatch.setenv(k, v)
    env = environment._env_vars()
    assert env == {**recorded, **{k: "<set>" for k in secrets if k.startswith(environment.ENV_PREFIXES)}}
    assert env["HF_TOKEN"] == env["HF_API_KEY"] == "<set>"
    assert "sEcReT" not in json.dumps(env) + environment.format_report({"env_vars": env})


def _fake_nvidia_smi(tmp_path, monkeypatch, stdout, rc):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "out.txt").write_text(stdout)
    fake = bin_dir / "nvidia-smi"
    fake.write_text(f'#!/bin/sh\ncat "{bin_dir / "out.txt"}"\nexit {rc}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir) + os.pathsep + os.environ["PATH"])
    monkeypatch.setattr(environment.torch.cuda, "is_available", lambda: False)


def test_gpus_keep_nvidia_smi_failure_message(tmp_path, monkeypatch):
    msg = "Failed to initialize NVML: Driver/library version mismatch"
    _fake_nvidia_smi(tmp_path, monkeypatch, msg + "\nNVML library version: 570.86\n", 18)
    g = environment._gpus()
    assert g["nvidia_smi"] == [f"error: exit 18: {msg}"] and g["driver"] is None
    assert msg in environment.format_report({"gpus": g})


def test_gpus_nvidia_smi_unexpected_output(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, monkeypatch, "No devices were found\n" + "z" * 5000 + "\n", 0)
    g = environment._gpus()
    assert g["nvidia_smi"] == ["error: unexpected output: No devices were found"] and g["driver"] is None


def test_gpus_nvidia_smi_normal_output(tmp_path, monkeypatch):
    lines = ["0, NVIDIA H200, 570.86.15, 143771 MiB", "1, NVIDIA H200, 570.86.15, 143771 MiB"]
    _fake_nvidia_smi(tmp_path, monkeypatch, "\n".join(lines) + "\n", 0)
    g = environment._gpus()
    assert g["nvidia_smi"] == lines and g["driver"] == "570.86.15"


def test_installed_packages_skip_vendored_copies(monkeypatch, tmp_path):
    """Once setuptools is imported (inductor's CPU compiler does), its _vendor folder is on sys.path
    and importlib lists the copies bundled there: they are not installed, and a report written after
    a compile must not differ from one written before."""
    real = tmp_path / "site-packages" / "numpy-2.0.0.dist-info"
    vendored = tmp_path / "site-packages" / "setuptools" / "_vendor" / "autocommand-2.2.2.dist-info"
    for p in (real, vendored):
        p.mkdir(parents=True)
    fake = [SimpleNamespace(metadata={"Name": "autocommand"}, version="2.2.2", _path=vendored),
            SimpleNamespace(metadata={"Name": "numpy"}, version="2.0.0", _path=real)]
    monkeypatch.setattr(environment.importlib.metadata, "distributions", lambda: fake)
    assert [(n, v) for n, v, _ in environment.installed_packages()] == [("numpy", "2.0.0")]


# --- the threaded exercise (started by the fixture, at the top)

def test_race_test_gate_keeps_calls_off_compiles_and_names_who_raises_the_flag(race_run):
    out = json.loads(_finish(race_run))
    assert out["command"] == "race-test" and [r.get("mode") for r in out["modes"]] == ["gate"], out
    r = out["modes"][0]
    assert not r.get("failed"), r["failed"]
    assert r["device"] == "cpu" and len(r["calls"]) == 2 and r["natural_race_expected"]
    assert all(n >= 1 for n in r["calls"]), r["calls"]
    assert r["other_errors"] == 0, r["error_samples"]
    assert r["fx_errors"] == 0                                           # no call ever overlaps a compile
    assert r["flag_raises"] >= 2 and r["flag_up_after_run"] is False
    text = compile_race.format_race_table([r])
    assert text.splitlines()[2].split()[:3] == ["gate", "0", "0"], text
    sites = re.findall(r"^  \d+x in worker-.*: traced at (\S+).*, for (\S+).*, called from (\S+)", text, re.M)
    assert sites and all(s[0].startswith("torch/fx/") for s in sites), text
    # AOTAutograd's graph capture, asked for by the exercise's compiled call through the gate
    assert any(s[1].startswith("torch/_functorch/") and s[2].startswith("compiled.py") for s in sites), text
