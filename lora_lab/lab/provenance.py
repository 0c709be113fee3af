"""What produced a result: the code (a content hash), the notebook (a hash of its cells), git, versions, device.

Every notebook run and every benchmark CSV records :func:`provenance`. The **code hash** is a SHA-256 over the
source files of the code that produces results (path and bytes, in path order), so it is the same on any machine
holding the same code — also where there is no git (the GPU machine receives a copy of the working tree).
``lora-lab verify`` recomputes it from git history for the commit a run names, and ``lora-lab publish`` refuses a
run whose hashes differ from the working tree's.

Which files the hash covers is its **scope**, recorded with it as ``code_hash_scope``: new runs hash
``lora_lab/`` and ``benchmarks/`` (which produces every timing) — scope ``lora_lab+benchmarks``; older runs
recorded no scope and hashed ``lora_lab/`` only (scope ``lora_lab``), and are still verified that way.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import subprocess
import tokenize
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "CODE_DIR",
    "code_hash",
    "code_hash_at",
    "code_hash_scope_of",
    "CODE_HASH_SCOPE",
    "LEGACY_CODE_HASH_SCOPE",
    "notebook_hash",
    "notebook_text_hash",
    "code_cells_hash",
    "git_state",
    "find_repo_root",
    "package_versions",
    "device_name",
    "provenance",
]

CODE_DIR = "lora_lab"
CODE_SUFFIXES = (".py", ".json")
# scope name -> {top-level folder: file suffixes hashed in it}
CODE_HASH_SCOPES: dict[str, dict[str, tuple[str, ...]]] = {
    "lora_lab": {CODE_DIR: CODE_SUFFIXES},
    "lora_lab+benchmarks": {CODE_DIR: CODE_SUFFIXES, "benchmarks": (".py", ".json", ".sh")},
}
CODE_HASH_SCOPE = "lora_lab+benchmarks"  # what new runs record
LEGACY_CODE_HASH_SCOPE = "lora_lab"  # what a run that records no scope was hashed with
VERSIONED_PACKAGES = ("torch", "triton", "transformers", "peft")
# paths whose uncommitted changes make a run "dirty" (outputs written by runs do not)
CODE_PATHS = ("lora_lab", "notebooks", "benchmarks", "predictions", "pyproject.toml")
DECLARED_COMMIT_ENV = "LORA_LAB_SOURCE_COMMIT"


def find_repo_root(start: Path | None = None) -> Path | None:
    """The nearest directory at or above ``start`` (default: cwd) holding pyproject.toml and lora_lab/."""
    here = Path(start or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        if (candidate / "pyproject.toml").is_file() and (candidate / CODE_DIR).is_dir():
            return candidate
    return None


def _package_dir() -> Path:
    return Path(__file__).resolve().parents[1]


def _hash_files(items) -> str:
    digest = hashlib.sha256()
    for relative, data in sorted(items):
        digest.update(relative.encode())
        digest.update(b"\0")
        digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()


def _scope(scope: str) -> dict[str, tuple[str, ...]]:
    if scope not in CODE_HASH_SCOPES:
        raise ValueError(f"unknown code hash scope {scope!r} (known: {', '.join(CODE_HASH_SCOPES)})")
    return CODE_HASH_SCOPES[scope]


def code_hash_scope_of(provenance_record: dict[str, Any]) -> str:
    """The scope a recorded ``code_hash`` was computed with (runs before scopes existed: the legacy one)."""
    return provenance_record.get("code_hash_scope") or LEGACY_CODE_HASH_SCOPE


def code_hash(package_dir: Path | None = None, scope: str = CODE_HASH_SCOPE) -> str:
    """SHA-256 over the scope's files: ``*.py`` / ``*.json`` under the package (default: the imported lora_lab)
    and, for the default scope, ``*.py`` / ``*.json`` / ``*.sh`` under ``benchmarks/`` next to it (if present)."""
    package = Path(package_dir) if package_dir is not None else _package_dir()
    items = []
    for folder, suffixes in _scope(scope).items():
        root = package if folder == CODE_DIR else package.parent / folder
        if not root.is_dir():
            continue
        for path in root.rglob("*"):
            if path.is_file() and path.suffix in suffixes and "__pycache__" not in path.parts:
                items.append((f"{folder}/{path.relative_to(root).as_posix()}", path.read_bytes()))
    return _hash_files(items)


def _git(repo: Path, *args: str, binary: bool = False):
    try:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout if binary else done.stdout.decode().strip()


def code_hash_at(repo: Path | str, commit: str, scope: str = CODE_HASH_SCOPE) -> str | None:
    """:func:`code_hash` of the scope's files as committed in ``commit`` (None if git cannot tell)."""
    repo = Path(repo)
    folders = _scope(scope)
    listing = _git(repo, "ls-tree", "-r", "--name-only", commit, "--", *folders)
    if listing is None:
        return None
    items = []
    for relative in listing.splitlines():
        if Path(relative).suffix in folders.get(relative.split("/", 1)[0], ()):
            data = _git(repo, "show", f"{commit}:{relative}", binary=True)
            if data is None:
                return None
            items.append((relative, data))
    return _hash_files(items)


def _cell_sources(text: str, code_only: bool) -> list[list[str]]:
    sources = []
    for cell in json.loads(text).get("cells", []):
        if "injected-parameters" in (cell.get("metadata", {}).get("tags") or []):
            continue  # papermill's cell: parameters are recorded on their own
        if code_only and cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        sources.append([cell.get("cell_type"), "".join(source) if isinstance(source, list) else source])
    return sources


def notebook_hash(path: Path | str) -> str:
    """SHA-256 of a notebook's cell types and sources (outputs, counts and metadata excluded)."""
    sources = _cell_sources(Path(path).read_text(encoding="utf-8"), code_only=False)
    return hashlib.sha256(json.dumps(sources, ensure_ascii=False).encode()).hexdigest()


def notebook_text_hash(text: str) -> str:
    """:func:`notebook_hash` of a notebook's JSON text."""
    return hashlib.sha256(json.dumps(_cell_sources(text, code_only=False), ensure_ascii=False).encode()).hexdigest()


def executed_tokens(source: str) -> str:
    """What of a code cell's ``source`` Python executes: its tokens without comments, blank lines and spacing inside
    a line (a cell that does not tokenize, e.g. one with IPython magics, is taken whole).

    The same on every Python the lab runs on: tokens are named (their numbers differ between versions), and an
    f-string is one string token with its source text, as before Python 3.12 (which splits it into parts)."""
    skip = {"COMMENT", "NL", "ENCODING", "ENDMARKER"}
    lines = source.splitlines(keepends=True)
    try:
        tokens, depth, start = [], 0, None
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            name = tokenize.tok_name[tok.type]
            if name in ("FSTRING_START", "TSTRING_START"):
                depth, start = depth + 1, start if depth else tok.start
            elif name in ("FSTRING_END", "TSTRING_END"):
                depth -= 1
                if depth == 0:
                    tokens.append(("STRING", _source_slice(lines, start, tok.end)))
            elif depth == 0 and name not in skip:
                tokens.append((name, tok.string))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return source
    return json.dumps(tokens, ensure_ascii=False)


def _source_slice(lines: list[str], start: tuple[int, int], end: tuple[int, int]) -> str:
    """The text from ``start`` to ``end`` ((row from 1, column) positions, as tokenize gives them)."""
    (row0, col0), (row1, col1) = start, end
    if row0 == row1:
        return lines[row0 - 1][col0:col1]
    return lines[row0 - 1][col0:] + "".join(lines[row0:row1 - 1]) + lines[row1 - 1][:col1]


def code_cells_hash(text: str) -> str:
    """SHA-256 of what a notebook's code cells execute (its JSON ``text``; papermill's cell excluded;
    :func:`executed_tokens`, so a comment is not code). Markdown and comments may change after a run (a corrected
    figure, a clearer comment); code may not."""
    executed = [executed_tokens(source) for _, source in _cell_sources(text, code_only=True)]
    return hashlib.sha256(json.dumps(executed, ensure_ascii=False).encode()).hexdigest()


def git_state(root: Path | None = None) -> dict[str, Any]:
    """``{"git_commit", "git_dirty", "git_source"}``: from git when the code sits in a repository; else the commit
    declared by ``$LORA_LAB_SOURCE_COMMIT`` (a copy of a committed tree sent to another machine), dirty unknown. A
    declaration that disagrees with the repository's HEAD wins: the copy's .git is then a stale one."""
    root = root or find_repo_root(_package_dir())
    commit = _git(root, "rev-parse", "HEAD") if root is not None else None
    declared = os.environ.get(DECLARED_COMMIT_ENV, "").strip() or None
    if commit and declared and commit != declared:
        # a copied tree whose .git came along from an older checkout: the declaration names the tree's commit
        return {"git_commit": declared, "git_dirty": None, "git_source": f"declared (the copy's .git is at {commit})"}
    if commit:
        porcelain = _git(root, "status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS)
        return {"git_commit": commit, "git_dirty": bool(porcelain) if porcelain is not None else None,
                "git_source": "repository"}
    return {"git_commit": declared, "git_dirty": None, "git_source": "declared" if declared else None}


def package_versions() -> dict[str, str | None]:
    """Installed versions of python and the packages results depend on (None if absent)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cpu_name() -> str:
    """The CPU model as the OS names it, with the number of cores."""
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.lower().startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    return f"{model} ({os.cpu_count()} cores)"


def forced_settings() -> str:
    """What this process forces on the GPU, in words ('' for nothing): the GPU class of ``$LORA_LAB_ARCH`` and the
    memory cap of ``$LORA_LAB_MEMORY_CAP_GIB``, e.g. ``class ampere forced by LORA_LAB_ARCH=sm80; memory cap 22
    GiB``."""
    from lora_lab import gpu_arch
    from lora_lab.memory.budget import memory_cap_gib

    parts = []
    if gpu_arch.arch_override() is not None:
        parts.append(f"class {gpu_arch.gpu_class()} forced by {gpu_arch.ARCH_ENV}="
                     f"{os.environ[gpu_arch.ARCH_ENV].strip()}")
    cap = memory_cap_gib()
    if cap is not None:
        parts.append(f"memory cap {cap:g} GiB")
    return "; ".join(parts)


def device_name(profile: str) -> str:
    """The GPU's name on a gpu profile (with :func:`forced_settings` in brackets when there are any, so a ledger row
    or a run names them), else the CPU's."""
    if profile != "cpu":
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(torch.cuda.current_device())
            forced = forced_settings()
            return f"{name} [{forced}]" if forced else name
        return "no CUDA device"
    return cpu_name()


def provenance(profile: str, notebook_path: Path | str | None = None) -> dict[str, Any]:
    """Everything that ties a result to the code and machine that produced it."""
    record: dict[str, Any] = {
        "device": device_name(profile),
        "versions": package_versions(),
        "code_hash": code_hash(),
        "code_hash_scope": CODE_HASH_SCOPE,
        **git_state(),
    }
    if notebook_path is not None and Path(notebook_path).is_file():
        record["notebook_hash"] = notebook_hash(notebook_path)
        record["code_cells_hash"] = code_cells_hash(Path(notebook_path).read_text(encoding="utf-8"))
    return record
