"""CPU tests of environment.py: what a run records of its environment (env.json) and how two records differ; git,
variables, nvidia-smi and packages."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import diagnose
import environment
from helpers import _checkpoint


MISSING = environment.MISSING


def _env(cache="/c", **env_vars):
    return {"compile_cache": {"path": cache}, "env_vars": env_vars}


# -----------------------------------------------------------------------------
# collect_env and the report


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


def test_cache_state_counts_the_files_and_their_bytes(tmp_path):
    cache = tmp_path / "cache"
    (cache / "fxgraph").mkdir(parents=True)
    (cache / "fxgraph" / "entry").write_bytes(b"x" * 10)
    (cache / "lock").write_text("")
    c = environment.cache_state(str(cache))
    assert (c["exists"], c["file_count"], c["size_bytes"], c["source"]) == (True, 2, 10, "argument")
    assert "0.0 MiB in 2 files" in environment.format_report({"compile_cache": c})


def test_checkpoints_record_the_start_environment_and_the_cache_as_it_is(tmp_path, monkeypatch):
    """A checkpoint's env.json is the environment the run started in (what --against compares with; the run
    keeps the code and packages it loaded), with the compile cache as it is at the save."""
    import config
    import environment
    import train_dflash as tr
    cfg = config.parse_args(["--out-dir", str(tmp_path)])
    trainer = tr.Trainer(cfg, print, environment.collect_env(str(tmp_path / "compile_cache")))
    packages = environment.installed_packages
    monkeypatch.setattr(environment, "installed_packages", lambda: packages() + [("newpkg", "1.0", 0.0)])
    (tmp_path / "compile_cache").mkdir()
    (tmp_path / "compile_cache" / "entry").write_text("x")
    env = environment.with_cache(trainer.env_at_start, cfg.compile_cache)     # what Trainer.checkpoint writes
    assert "newpkg" not in env["packages"]                             # the start's environment
    assert env["compile_cache"]["file_count"] == 1                     # the cache as it is now


# -----------------------------------------------------------------------------
# diff_env


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


# -----------------------------------------------------------------------------
# git, variables, nvidia-smi, packages


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
