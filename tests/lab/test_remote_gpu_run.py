"""tools/remote_gpu_run.sh: on a copy of the tree it declares the commit, so provenance.git_state records that commit
(source "declared", dirty unknown) instead of the copy's stale repository's, which stays in place (the host updates
the copy through it on its next call);
it runs the command under its limit and packs build/runs/gpu; bad arguments are refused before anything runs."""
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "remote_gpu_run.sh"
COMMIT = "abc1234" + "0" * 33

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@pytest.fixture
def copy(tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "lora_lab", copy / "lora_lab", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["git", "init", "-q", str(copy)], check=True)  # the stale repository of a copied tree, at
    (copy / "stale.txt").write_text("the host's own commit")  # a commit other than the declared one
    subprocess.run(["git", "-C", str(copy), "add", "stale.txt"], check=True)
    subprocess.run(["git", "-C", str(copy), "-c", "user.name=host", "-c", "user.email=host@example.org", "commit",
                    "-q", "-m", "host"], check=True)
    (tmp_path / "out").mkdir()
    return copy


def run(copy, *args, out=True, **extra_env):
    env = {k: v for k, v in os.environ.items() if k != "LORA_LAB_SOURCE_COMMIT"}
    env.update(extra_env)
    env["PYTHONPATH"] = str(copy)
    if out:
        env["OUT"] = str(copy.parent / "out")
    else:
        env.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=copy, env=env, capture_output=True, text=True)


def test_declares_the_commit_runs_and_packs(copy):
    probe = ("from pathlib import Path; from lora_lab.lab.provenance import git_state; "
             "Path('build/runs/gpu').mkdir(parents=True); Path('build/runs/gpu/x.csv').write_text('1'); "
             "print(git_state(Path('.')))")
    done = run(copy, COMMIT, "--no-install", "--limit", "60", "command", "--", sys.executable, "-c", probe)
    assert done.returncode == 0, done.stderr
    out = copy.parent / "out"
    assert (copy / ".git").is_dir() and not list(copy.parent.glob("stale-copy-git.*"))  # left where it was
    assert f"declared commit {COMMIT}" in (out / "declared.log").read_text()
    log = (out / "run.log").read_text()
    assert f"'git_commit': '{COMMIT}'" in log and "'git_source': \"declared (the copy's .git is at" in log
    with tarfile.open(out / "results.tgz") as packed:
        assert "build/runs/gpu/x.csv" in packed.getnames()
    assert "exit 0" in (out / "summary.txt").read_text()


def test_another_gpu_profile_packs_its_own_folder(copy):
    probe = ("from pathlib import Path; Path('build/runs/gpu-24g').mkdir(parents=True); "
             "Path('build/runs/gpu-24g/y.csv').write_text('1'); Path('build/runs/gpu').mkdir(); "
             "Path('build/runs/gpu/x.csv').write_text('1')")
    done = run(copy, COMMIT, "--no-install", "--profile", "gpu-24g", "command", "--", sys.executable, "-c", probe)
    assert done.returncode == 0, done.stderr
    with tarfile.open(copy.parent / "out" / "results.tgz") as packed:
        assert packed.getnames() == ["build/runs/gpu-24g", "build/runs/gpu-24g/y.csv"]


def test_a_large_pack_comes_back_in_parts_that_join_into_it(copy):
    probe = ("import os; from pathlib import Path; Path('build/runs/gpu').mkdir(parents=True); "
             "Path('build/runs/gpu/big.bin.png').write_bytes(os.urandom(17 * 2**20))")
    done = run(copy, COMMIT, "--no-install", "command", "--", sys.executable, "-c", probe)
    assert done.returncode == 0, done.stderr
    out = copy.parent / "out"
    parts = sorted(out.glob("results.tgz.part*"))
    assert len(parts) == 2 and not (out / "results.tgz").exists()
    assert all(p.stat().st_size <= 15 * 2**20 for p in parts)
    joined = out / "joined.tgz"
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(joined) as packed:
        assert "build/runs/gpu/big.bin.png" in packed.getnames()


def test_the_run_s_exit_status_and_the_limit(copy):
    assert run(copy, COMMIT, "--no-install", "command", "--", "bash", "-c", "exit 3").returncode == 3
    stopped = run(copy, COMMIT, "--no-install", "--limit", "1", "command", "--", "sleep", "30")
    assert stopped.returncode == 124 and "exit 124" in stopped.stdout


def test_parts_carried_over_two_calls_are_assembled_after_the_second(copy, tmp_path):
    wheel = tmp_path / "weights-0.1-py3-none-any.whl"
    wheel.write_bytes(os.urandom(3000))
    split = subprocess.run([sys.executable, str(ROOT / "tools" / "parts.py"), "split", str(wheel), "--out",
                            str(copy / ".parts"), "--part-mib", "0.002", "--calls", "2"],
                           capture_output=True, text=True)
    assert split.returncode == 0, split.stderr
    store = str(tmp_path / "store")
    first = run(copy, COMMIT, "--no-install", "--parts", ".parts/1", "command", "--", "true",
                LORA_LAB_PARTS_STORE=store)
    assert first.returncode == 0, first.stderr
    log = (copy.parent / "out" / "parts.log").read_text()
    assert "incomplete: weights-0.1-py3-none-any.whl" in log
    assert not list((copy / "build/assembled").glob("*.whl"))
    second = run(copy, COMMIT, "--no-install", "--parts", ".parts/2", "command", "--", "true",
                 LORA_LAB_PARTS_STORE=store)
    assert second.returncode == 0, second.stderr
    log = (copy.parent / "out" / "parts.log").read_text()
    assert "complete: build/assembled/weights-0.1-py3-none-any.whl" in log
    assert "not installed (no .venv-gpu yet)" in log  # this copy has no environment to install into
    assert (copy / "build/assembled" / wheel.name).read_bytes() == wheel.read_bytes()


def test_site_parts_are_assembled_apart_and_never_installed(copy, tmp_path):
    wheel = tmp_path / "nvidia_cutlass_dsl-4.7.1-py3-none-any.whl"
    wheel.write_bytes(os.urandom(3000))
    split = subprocess.run([sys.executable, str(ROOT / "tools" / "parts.py"), "split", str(wheel), "--out",
                            str(copy / ".parts-quack"), "--part-mib", "0.01"], capture_output=True, text=True)
    assert split.returncode == 0, split.stderr
    venv_bin = copy / ".venv-gpu" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text("#!/bin/sh\necho \"pip ran: $*\"\n")
    (venv_bin / "python").chmod(0o755)
    done = run(copy, COMMIT, "--no-install", "--site-parts", ".parts-quack", "command", "--", "true",
               LORA_LAB_SITE_PARTS_STORE=str(tmp_path / "site-store"), LORA_LAB_PARTS_STORE=str(tmp_path / "store"))
    assert done.returncode == 0, done.stderr
    log = (copy.parent / "out" / "site_parts.log").read_text()
    assert "complete: build/assembled-sites/" + wheel.name in log and "not installed" in log
    assert "pip ran" not in done.stdout + log
    assert (copy / "build/assembled-sites" / wheel.name).read_bytes() == wheel.read_bytes()
    assert not (copy / "build/assembled").exists()


@pytest.mark.parametrize("with_ruff", [True, False])
def test_the_install_leaves_out_the_test_extra_when_ruff_is_not_carried(copy, tmp_path, with_ruff):
    """A call short of transfer room carries the wheels without ruff (lint is CPU work): the install then asks make
    for the notebooks' extras only and installs the carried pytest-xdist and nbval by name."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    (bin_dir / "make").write_text(f"#!/bin/sh\necho \"make $*\" >> {calls}\n")
    venv_bin = copy / ".venv-gpu" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(f"#!/bin/sh\necho \"python $*\" >> {calls}\n")
    for tool in (bin_dir / "make", venv_bin / "python"):
        tool.chmod(0o755)
    (copy / ".whl").mkdir()
    names = ["pytest_xdist-3.8.0-py3-none-any.whl", "nbval-0.11.0-py2.py3-none-any.whl"]
    for name in names + (["ruff-0.17.6-py3-none-any.whl"] if with_ruff else []):
        (copy / ".whl" / name).write_bytes(b"")
    done = run(copy, COMMIT, "command", "--", "true", PATH=f"{bin_dir}:{os.environ['PATH']}")
    assert done.returncode == 0, done.stderr
    log = calls.read_text()
    if with_ruff:
        assert "EXTRAS=kernels,liger,notebooks,test" in log and "pytest-xdist" not in log
    else:
        assert "EXTRAS=kernels,liger,notebooks\n" in log
        assert "pytest-xdist" in log and "nbval" in log
    assert "cut-cross-entropy" in log
    # neither peer's wheel was carried: said in the call's output and its summary, not only in install.log
    for peer in ("liger-kernel", "cut-cross-entropy"):
        assert f"WARNING: no {peer} wheel in .whl" in done.stdout
        assert f"no {peer} wheel" in (copy.parent / "out" / "summary.txt").read_text()


def test_carried_peers_raise_no_warning(copy, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").write_text("#!/bin/sh\nexit 0\n")
    venv_bin = copy / ".venv-gpu" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text("#!/bin/sh\nexit 0\n")
    for tool in (bin_dir / "make", venv_bin / "python"):
        tool.chmod(0o755)
    (copy / ".whl").mkdir()
    for name in ("liger_kernel-0.8.5-py3-none-any.whl", "cut_cross_entropy-25.1.1-py3-none-any.whl"):
        (copy / ".whl" / name).write_bytes(b"")
    done = run(copy, COMMIT, "command", "--", "true", PATH=f"{bin_dir}:{os.environ['PATH']}")
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stdout and "wheel" not in (copy.parent / "out" / "summary.txt").read_text()


@pytest.mark.parametrize("args, message", [
    ([COMMIT[:7], "notebooks", "07"], "full 40-digit commit"),  # a typed short prefix can name no commit at all
    ([COMMIT, "--limit", "ten", "notebooks", "07"], "--limit takes whole seconds"),
    ([COMMIT, "benchmarks", "07"], "the mode is 'notebooks' or 'command'"),
    ([COMMIT, "notebooks"], "notebooks takes one ONLY list"),
    ([COMMIT, "command", "--"], "command needs the command"),
    ([COMMIT, "--profile", "cpu", "notebooks", "07"], "--profile takes a gpu profile"),
])
def test_bad_arguments_are_refused_before_anything_runs(copy, args, message):
    done = run(copy, *args)
    assert done.returncode == 2 and message in done.stderr
    assert (copy / ".git").exists()  # nothing moved


def test_out_is_required(copy):
    done = run(copy, COMMIT, "notebooks", "07", out=False)
    assert done.returncode == 2 and "$OUT must name an existing folder" in done.stderr
