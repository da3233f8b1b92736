"""CPU tests of diagnose.py: the report, --against and --race-test (environment.py's parts: test_environment.py).

The threaded exercise compiles flex cold in a child process (~30 s on a small CPU): it starts with
the module and runs while the quick tests do.
"""
import json
import re
import os
import subprocess
import sys

import pytest

import compile_race
import diagnose
import environment
from helpers import REPO, _checkpoint


def _start(*args):
    return subprocess.Popen([sys.executable, os.path.join(REPO, "diagnose.py"), *args], cwd=REPO,
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


# -----------------------------------------------------------------------------
# the report and --against


def test_command_line_report_and_help_work(capsys):
    assert diagnose.main(["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    env = out["env"]
    assert env["versions"]["torch"] == environment.torch.__version__
    assert len(out["recent_packages"]) == min(15, len(environment.installed_packages()))
    # without --json the report is text for people, on stdout only: it says what --json gives
    assert diagnose.main([]) == 0
    text = capsys.readouterr().out
    cache = env["compile_cache"]
    assert f"  torch {env['versions']['torch']}  " in text
    assert f"compile cache {cache['path']} ({cache['source']})" in text
    assert "15 most recently installed" in text
    with pytest.raises(SystemExit) as e:
        diagnose.main(["--help"])
    assert e.value.code == 0 and "--race-test" in capsys.readouterr().out
    # a mistyped option or mode: one line naming it, as every script answers
    for argv, needle in ((["--bogus"], "unrecognized arguments: --bogus"), (["--race-test", "--modes", "warm"],
                                                                             "unknown mode(s) ['warm']: use nogate, gate")):
        with pytest.raises(SystemExit) as e:
            diagnose.main(argv)
        assert str(e.value.code).startswith("error: ") and needle in str(e.value.code) and "\n" not in str(e.value.code)


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

    # without --json: the same differences as text for people, on stdout only, a field's old -> new on its line
    assert diagnose.main(["--against", ckpt, "--cache-dir", cache]) == 0
    text = capsys.readouterr().out
    for field in ("versions.torch", "versions.triton"):
        line = f"{json.dumps(by[field]['old'])}  ->  {json.dumps(by[field]['new'])}"
        assert re.search(rf"^  {re.escape(field)} +{re.escape(line)}$", text, re.M), text
    assert "installed or modified after" in text


def test_against_clear_errors(tmp_path, capsys):
    assert diagnose.main(["--against", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert diagnose.main(["--against", str(tmp_path), "--json"]) == 2
    out, err = capsys.readouterr()
    assert "has no env.json" in err and "has no env.json" in json.loads(out)["error"]
    (tmp_path / "env.json").write_text('{"time": "2026-01-01", "time_u')     # cut mid-write
    assert diagnose.main(["--against", str(tmp_path)]) == 2
    assert f"error: {tmp_path / 'env.json'} is cut or not JSON" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# the threaded exercise (started by the fixture, at the top)


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
    # who raised the flag: every rise at a site, each site fx's tracing frame in the exercise's worker threads
    sites = r["sites"]
    assert sites and sum(s["count"] for s in sites) == r["flag_raises"], sites
    assert all(s["tracing_frame"].startswith("torch/fx/") and s["threads"] for s in sites), sites
    assert all(t.startswith("worker-") and n >= 1 for s in sites for t, n in s["threads"].items()), sites
    # AOTAutograd's graph capture, asked for by the exercise's compiled call through the gate
    assert any(str(s["requested_by"]).startswith("torch/_functorch/") and str(s["user_frame"]).startswith("compiled.py")
               for s in sites), sites
    compile_race.format_race_table([r])          # the same result as diagnose.py's table without --json
