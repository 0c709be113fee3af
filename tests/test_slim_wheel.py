"""tools/slim_wheel.py: a wheel's copy without the dropped members, its RECORD without their lines."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "slim_wheel.py"


def _wheel(path: Path) -> Path:
    members = {"pkg/__init__.py": "x = 1\n", "pkg/lib_cuda118.so": "a" * 100, "pkg/lib_cuda130.so": "b" * 10,
               "ui/app.js": "c" * 100}
    record = "".join(f"{n},sha256=fake,{len(t)}\n" for n, t in members.items()) + "pkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in members.items():
            z.writestr(name, text)
        z.writestr("pkg-1.0.dist-info/RECORD", record)
    return path


def _run(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True)


def test_drops_matching_members_keeps_the_kept_and_fixes_record(tmp_path):
    wheel = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl")
    done = _run(wheel, tmp_path / "out", "--drop", "pkg/lib_*", "--keep", "pkg/lib_cuda13*", "--drop", "ui/*")
    assert done.returncode == 0, done.stderr
    with zipfile.ZipFile(tmp_path / "out" / wheel.name) as z:
        names = set(z.namelist())
        record = z.read("pkg-1.0.dist-info/RECORD").decode()
    assert names == {"pkg/__init__.py", "pkg/lib_cuda130.so", "pkg-1.0.dist-info/RECORD"}
    assert "lib_cuda118" not in record and "ui/app.js" not in record and "pkg/lib_cuda130.so" in record


def test_refuses_a_pattern_that_drops_nothing_or_the_record(tmp_path):
    wheel = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl")
    nothing = _run(wheel, tmp_path / "out", "--drop", "absent/*")
    assert nothing.returncode == 1 and "no member" in nothing.stderr
    record = _run(wheel, tmp_path / "out2", "--drop", "*RECORD")
    assert record.returncode != 0 and "RECORD" in record.stderr


def test_lzma_recompresses_every_member_and_keeps_its_bytes(tmp_path):
    wheel = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl")
    done = _run(wheel, tmp_path / "out", "--lzma")
    assert done.returncode == 0, done.stderr
    with zipfile.ZipFile(wheel) as before, zipfile.ZipFile(tmp_path / "out" / wheel.name) as after:
        assert after.namelist() == before.namelist()
        assert {i.compress_type for i in after.infolist()} == {zipfile.ZIP_LZMA}
        assert all(after.read(n) == before.read(n) for n in before.namelist())


def test_needs_drop_or_lzma(tmp_path):
    done = _run(_wheel(tmp_path / "pkg-1.0-py3-none-any.whl"), tmp_path / "out")
    assert done.returncode == 2 and "--drop" in done.stderr
