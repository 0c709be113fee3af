"""Write a copy of a wheel without some of its files, so that it fits a size-limited transfer to a GPU host.

Two peers' wheels are larger than what reaches the GPU machine in one call: bitsandbytes (43 MB, a native library
for every CUDA and ROCm release) and unsloth (29 MB, 26 of them its web UI, the separate top-level package
``studio``). The copy keeps everything else byte for byte and drops the removed files' lines from the wheel's
RECORD, so pip installs it as the same distribution and version. ``--lzma`` also stores every member
LZMA-compressed instead of deflated (a zip method pip's extraction reads): the CUTLASS DSL's 89 MB CUDA library
wheel, which nothing can be dropped from, comes down to about 63 MB (RECORD's hashes are of the uncompressed
files, so they stay valid).

    python tools/slim_wheel.py WHEEL OUTDIR --drop 'studio/*' --drop 'unsloth_cli/*'
    python tools/slim_wheel.py bitsandbytes-*.whl .whl --drop 'bitsandbytes/libbitsandbytes_*' \
        --keep 'bitsandbytes/libbitsandbytes_cuda13*'
    python tools/slim_wheel.py nvidia_cutlass_dsl_libs_cu12-*.whl .whl-quack --lzma

A path is dropped when it matches a --drop pattern (fnmatch) and no --keep pattern; give --drop, --lzma or both.
The output has the input's file name; prints what was dropped and the sizes before and after.
"""
from __future__ import annotations

import argparse
import fnmatch
import sys
import zipfile
from pathlib import Path


def slim(wheel: Path, outdir: Path, drop: list[str], keep: list[str], lzma: bool = False) -> tuple[Path, list[str]]:
    """The slimmed copy's path and the dropped member names (``lzma``: every member stored LZMA-compressed)."""
    if not wheel.is_file() or wheel.suffix != ".whl":
        raise SystemExit(f"slim_wheel: {wheel} is not a wheel file")
    outdir.mkdir(parents=True, exist_ok=True)
    out = outdir / wheel.name
    if out.resolve() == wheel.resolve():
        raise SystemExit(f"slim_wheel: {outdir} holds the input wheel itself; give another folder")

    def dropped(name: str) -> bool:
        return any(fnmatch.fnmatch(name, p) for p in drop) and not any(fnmatch.fnmatch(name, p) for p in keep)

    gone: list[str] = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        names = [i.filename for i in src.infolist()]
        gone = [n for n in names if dropped(n)]
        if any(n.endswith(".dist-info/RECORD") for n in gone):
            raise SystemExit("slim_wheel: a --drop pattern matches the wheel's RECORD; narrow it")
        for info in src.infolist():
            if info.filename in gone:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(line for line in lines if line.split(",")[0] not in gone) + "\n").encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_LZMA if lzma else info.compress_type)
    return out, gone


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--drop", action="append", default=[], help="fnmatch pattern of members to leave out")
    parser.add_argument("--keep", action="append", default=[], help="pattern kept even where --drop matches")
    parser.add_argument("--lzma", action="store_true", help="store every member LZMA-compressed (smaller transfers)")
    args = parser.parse_args(argv)
    if not args.drop and not args.lzma:
        parser.error("give --drop PATTERN, --lzma or both")
    out, gone = slim(args.wheel, args.outdir, args.drop, args.keep, lzma=args.lzma)
    if args.drop and not gone:
        print(f"slim_wheel: no member of {args.wheel.name} matches {args.drop}", file=sys.stderr)
        return 1
    before, after = args.wheel.stat().st_size, out.stat().st_size
    print(f"{out}: {len(gone)} files dropped, {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
