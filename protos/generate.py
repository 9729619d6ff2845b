"""Regenerate the protobuf and gRPC Python code from ``protos/*.proto``.

Run ``python -m potluck.protos.generate`` after editing a ``.proto`` file; ``--check`` exits 1
without writing when the committed code is stale (``tests/test_protos.py`` runs it). The protos are
compiled as ``potluck/protos/<name>.proto`` so the generated modules import each other as
``potluck.protos.<name>_pb2`` and never land at the top of a user's ``sys.path``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Compile every ``.proto`` next to this file into ``out_dir``; returns the files written."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        dst = Path(tmp) / "out"
        (src / "potluck" / "protos").mkdir(parents=True)
        dst.mkdir()
        protos = sorted(HERE.glob("*.proto"))
        for proto in protos:
            shutil.copy(proto, src / "potluck" / "protos" / proto.name)
        grpc_include = Path(protoc.__file__).parent / "_proto"
        args = [
            "protoc",
            f"-I{src}",
            f"-I{grpc_include}",
            f"--python_out={dst}",
            f"--pyi_out={dst}",
            f"--grpc_python_out={dst}",
            *(f"potluck/protos/{p.name}" for p in protos),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        written = []
        for f in sorted((dst / "potluck" / "protos").iterdir()):
            if f.name.endswith(SUFFIXES):
                target = out_dir / f.name
                shutil.copy(f, target)
                written.append(target)
        return written


def stale_files() -> list[str]:
    """Names of generated files that differ from what the ``.proto`` files produce now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = []
        for f in fresh:
            committed = HERE / f.name
            if not committed.exists() or committed.read_bytes() != f.read_bytes():
                stale.append(f.name)
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed code is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale generated code: {', '.join(stale)}; run `python -m potluck.protos.generate`")
            return 1
        print("generated code is up to date")
        return 0
    for f in generate(HERE):
        print(f"wrote {f.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
