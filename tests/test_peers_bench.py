"""tools/peers_bench.sh: SonicMoE and QuACK install each with the CUTLASS DSL version it pins into a site folder of its
own (or are named as not installed), and `ops` times each in a process of its own on that folder, writing the process
folders notebook 10 reads."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lora_lab.experiments import peer_comparison

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "peers_bench.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

SONIC = ["sonic_moe-0.1.2.post1", "quack_kernels-0.4.1", "nvidia_cutlass_dsl-4.4.2",
         "nvidia_cutlass_dsl_libs_base-4.4.2", "apache_tvm_ffi-0.1.15", "torch_c_dlpack_ext-0.1.5", "einops-0.8.2",
         "cuda_python-12.9.10", "cuda_bindings-12.9.10", "cuda_pathfinder-1.9.1"]


def _wheel(folder: Path, stem: str) -> None:
    """A minimal installable wheel ``<stem>-py3-none-any.whl`` holding one module named after the project."""
    name, version = stem.split("-")
    info = f"{name}-{version}.dist-info"
    files = {f"{name}_probe.py": "x = 1\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},,\n" for path in files) + f"{info}/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as z:
        for path, text in {**files, f"{info}/RECORD": record}.items():
            z.writestr(path, text)


def _run(cwd: Path, *args, **env):
    full = {**os.environ, "RES": str(cwd / "res"), "SITE": str(cwd / "site"), **env}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=full, capture_output=True, text=True)


def test_install_puts_each_dsl_peer_with_its_pinned_dsl_in_its_own_site(tmp_path):
    for stem in SONIC:
        _wheel(tmp_path / "build" / "assembled", stem)  # as tools/parts.py assembles them
    _wheel(tmp_path / ".whl", "quack_kernels-0.6.5")  # QuACK's own DSL wheels are missing
    done = _run(tmp_path, "install")
    log = (tmp_path / "res" / "peers_install.log").read_text()
    assert done.returncode == 0, done.stderr
    assert f"{tmp_path}/site-sonicmoe: install exit 0" in log
    assert (tmp_path / "site-sonicmoe" / "sonic_moe_probe.py").is_file()
    assert (tmp_path / "site-sonicmoe" / "nvidia_cutlass_dsl_probe.py").is_file()
    assert f"{tmp_path}/site-quack: not installed, missing wheels" in log
    assert not (tmp_path / "site-quack").exists()


QUACK = ["quack_kernels-0.6.5", "nvidia_cutlass_dsl-4.7.1", "nvidia_cutlass_dsl_libs_base-4.7.1",
         "nvidia_cutlass_dsl_libs_core-4.7.1", "nvidia_cutlass_dsl_libs_cu12-4.7.1", "nvidia_cuda_nvdisasm-13.5.37",
         *SONIC[4:]]


def test_sites_installs_the_dsl_groups_alone_from_the_site_parts(tmp_path):
    """`sites`: the DSL site folders only (no peers' wheels needed), from what --site-parts assembled."""
    for stem in QUACK:
        _wheel(tmp_path / "build" / "assembled-sites", stem)
    done = _run(tmp_path, "sites", WHEELS=str(tmp_path / "none"))
    log = (tmp_path / "res" / "peers_install.log").read_text()
    assert done.returncode == 0, done.stderr
    assert not log.startswith("install exit")  # no peers' wheels asked for
    assert f"{tmp_path}/site-quack: install exit 0" in log
    assert (tmp_path / "site-quack" / "quack_kernels_probe.py").is_file()
    assert f"{tmp_path}/site-sonicmoe: not installed, missing wheels" in log


def test_ops_times_each_dsl_peer_in_its_own_process_and_folder(tmp_path):
    shutil.copytree(ROOT / "benchmarks", tmp_path / "benchmarks", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "site-sonicmoe").mkdir()  # installed; site-quack is not
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"  # records each benchmark process; `-c` snippets run in the real interpreter
    fake.write_text(f'#!/usr/bin/env bash\nif [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\n'
                    f'echo "PYTHONPATH=$PYTHONPATH ARGS=$*" >> {calls}\n')
    fake.chmod(0o755)
    done = _run(tmp_path, "ops", "--sessions", "2", PY=str(fake))
    assert done.returncode == 0, done.stderr
    lines = calls.read_text().splitlines()
    outs = [line.split("--out ")[1].split()[0] for line in lines]
    assert [Path(o).name for o in outs] == ["ops", "ops_unsloth", "ops_sonicmoe"]
    assert set(Path(o).name for o in outs) <= set(peer_comparison.RESULT_FOLDERS)
    sonic = lines[2]
    assert f"PYTHONPATH={tmp_path}:{tmp_path}/site-sonicmoe " in sonic
    assert sonic.endswith("--sessions 2 --peers sonicmoe --ops moe_full")
    assert "unsloth" not in lines[0].split("--peers ")[1]
    assert f"quack: {tmp_path}/site-quack not installed" in done.stdout


def test_call_runs_the_step_first_then_the_ops_each_in_a_folder_notebook_10_reads(tmp_path):
    """`call`: one device call's worth in order of what it tells (the full-depth step before the per-op panels),
    each part under its own time limit, into process folders that peer_comparison.read_results knows."""
    _wheel(tmp_path / ".whl", "axolotl-0.21.0")
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\nif [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\n'
                    f'if [ "$1" = -m ]; then exec {sys.executable} "$@"; fi\n'
                    f'echo "ARGS=$*" >> {calls}\n')
    fake.chmod(0o755)
    done = _run(tmp_path, "call", PY=str(fake), STEP_S="30", MOE_S="30", OPS_S="30", LOAD_S="30")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "axolotl_probe.py").is_file()  # installed first
    scripts = [line.split()[0].removeprefix("ARGS=") for line in calls.read_text().splitlines()]
    assert scripts == ["-", "benchmarks/bench_peers_step.py", "benchmarks/bench_peers.py",
                       "benchmarks/bench_peers.py"]  # load, the step, the MoE ops, the LoRA ops
    lines = calls.read_text().splitlines()[1:]
    outs = [Path(line.split("--out ")[1].split()[0]).name for line in lines]
    assert outs == ["step_ckpt_on", "ops_moe", "ops"]
    assert set(outs) <= set(peer_comparison.RESULT_FOLDERS)
    assert "--checkpointing on" in lines[0]
    assert "--impls ours peft_liger axolotl unsloth --steps 3" in lines[0]  # unsloth's import patches: last
    assert "--ops moe_full" in lines[1] and "moe_full" not in lines[2]
    assert "unsloth" not in lines[1] and "unsloth" not in lines[2]  # unsloth's ops: a process of their own
    assert done.stdout.index("== step") < done.stdout.index("== MoE ops") < done.stdout.index("== LoRA ops") \
        < done.stdout.index("== done")


def test_call_parts_pick_some_of_the_three_and_a_wrong_one_is_named(tmp_path):
    _wheel(tmp_path / ".whl", "axolotl-0.21.0")
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\nif [ "$1" = -c ] || [ "$1" = -m ]; then exec {sys.executable} "$@"; fi\n'
                    f'echo "ARGS=$*" >> {calls}\n')
    fake.chmod(0o755)
    done = _run(tmp_path, "call", PY=str(fake), CALL_PARTS="moe", MOE_S="30", LOAD_S="30")
    assert done.returncode == 0, done.stderr
    outs = [Path(line.split("--out ")[1].split()[0]).name for line in calls.read_text().splitlines()[1:]]
    assert outs == ["ops_moe"]
    assert "== step" not in done.stdout and "== LoRA ops" not in done.stdout
    wrong = _run(tmp_path, "call", PY=str(fake), CALL_PARTS="moe loss")
    assert wrong.returncode == 2 and "unknown part loss" in wrong.stdout


def _site_with_a_pth(site: Path) -> Path:
    """A site folder as `pip install --target` leaves the CUTLASS DSL: a package whose `.pth` file puts a folder
    inside it on sys.path (where the `cutlass` package lives); returns that folder."""
    inner = site / "dsl" / "dsl_packages"
    (inner / "cutlass_probe").mkdir(parents=True)
    (inner / "cutlass_probe" / "__init__.py").write_text("x = 1\n")
    (site / "dsl" / "__init__.py").write_text("")
    (site / "dsl_packages.pth").write_text(
        "import sys, os, dsl; sys.path.insert(0, os.path.join(dsl.__path__[0], 'dsl_packages'))\n")
    return inner


def test_path_adds_what_the_site_folders_pth_files_add(tmp_path):
    """A PYTHONPATH entry never runs a .pth file: `path quack` gives the folder and what its .pth files add, so
    `cutlass` imports as in a site directory."""
    inner = _site_with_a_pth(tmp_path / "site-quack")
    done = _run(tmp_path, "path", "quack", PY=sys.executable)
    assert done.returncode == 0, done.stderr
    entries = done.stdout.strip().split(":")
    assert entries[0] == str(tmp_path) and entries[1] == str(tmp_path / "site-quack") and str(inner) in entries
    bare = subprocess.run([sys.executable, "-c", "import cutlass_probe"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}/site-quack"})
    assert bare.returncode != 0  # the folder alone does not import it
    full = subprocess.run([sys.executable, "-c", "import cutlass_probe"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": done.stdout.strip()})
    assert full.returncode == 0, full.stderr
    missing = _run(tmp_path, "path", "sonicmoe", PY=sys.executable)
    assert missing.returncode == 1 and "site-sonicmoe is not installed" in missing.stderr
    wrong = _run(tmp_path, "path", "liger", PY=sys.executable)
    assert wrong.returncode == 2 and "unknown site liger" in wrong.stderr


def test_ops_puts_what_a_dsl_sites_pth_files_add_on_its_path(tmp_path):
    shutil.copytree(ROOT / "benchmarks", tmp_path / "benchmarks", ignore=shutil.ignore_patterns("__pycache__"))
    inner = _site_with_a_pth(tmp_path / "site-quack")
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\nif [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\n'
                    f'echo "PYTHONPATH=$PYTHONPATH ARGS=$*" >> {calls}\n')
    fake.chmod(0o755)
    done = _run(tmp_path, "ops", PY=str(fake))
    assert done.returncode == 0, done.stderr
    quack = [line for line in calls.read_text().splitlines() if "--peers quack" in line]
    assert len(quack) == 1 and str(inner) in quack[0].split()[0]


def test_warm_runs_each_installed_dsl_peer_once_under_its_limit_with_quacks_caches_kept(tmp_path):
    """`warm`: one repetition of each installed CUTLASS-DSL peer's op, QuACK's caches pointed at a folder that
    outlives the call and its autotuning printed into warm_<peer>.log; warm.txt records each one's exit status and
    seconds, and a peer not installed by name."""
    (tmp_path / "site-sonicmoe").mkdir()  # installed; site-quack is not
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\nif [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\n'
                    'echo "CACHE=$QUACK_CACHE_DIR TUNE=$QUACK_CACHE_AUTOTUNING PRINT=$QUACK_PRINT_AUTOTUNING ARGS=$*"'
                    f' >> {calls}\n'
                    'echo "Autotuning kernel gemm"\nexit 3\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUACK_")}
    done = subprocess.run(["bash", str(SCRIPT), "warm"], cwd=tmp_path, capture_output=True, text=True,
                          env={**env, "RES": str(tmp_path / "res"), "SITE": str(tmp_path / "site"),
                               "PY": str(fake), "WARM_S": "30"})
    assert done.returncode == 0, done.stderr
    (line,) = calls.read_text().splitlines()
    assert line.startswith("CACHE=/tmp/quack-cache TUNE=1 PRINT=1 ARGS=-X faulthandler benchmarks/bench_peers.py")
    assert f"--out {tmp_path}/res/warm_sonicmoe --peers sonicmoe --ops moe_full" in line
    assert line.endswith("--moe-shapes qwen3_30b_a3b --repetitions 1")
    assert (tmp_path / "res" / "warm_sonicmoe.log").read_text() == "Autotuning kernel gemm\n"
    assert "Autotuning kernel gemm" in done.stdout
    warm = (tmp_path / "res" / "warm.txt").read_text().splitlines()
    assert warm[0].startswith("warm sonicmoe: exit 3 after ") and warm[0].endswith(" s (limit 30 s)")
    assert warm[1] == f"warm quack: {tmp_path}/site-quack not installed (peers_bench.sh sites)"
    bad = subprocess.run(["bash", str(SCRIPT), "warm", "liger"], cwd=tmp_path, capture_output=True, text=True,
                         env={**env, "RES": str(tmp_path / "res"), "SITE": str(tmp_path / "site")})
    assert bad.returncode == 2 and "unknown peer liger" in bad.stderr
