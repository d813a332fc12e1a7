"""Generate the Python protobuf module from ``proto/lr.proto``.

The generated ``lr_pb2.py`` is committed and shipped in the package, so installing lr never needs
protoc; this module exists to regenerate it and to let a test prove the shipped copy is current.
The ``lr_pb2.pyi`` stub is generated beside it: protoc's module builds its classes at import time,
so without the stub a type checker sees none of the messages or enum values.
Run: ``python -m airflow_provider_lr.proto.build [--check]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO_DIR = PACKAGE_DIR.parents[1] / "proto"
PROTO_FILES = ("lr.proto",)


def generate(out_dir: Path) -> list[Path]:
    """Compile every proto file into ``out_dir``; returns the generated files."""
    from grpc_tools import protoc  # build-time tool only

    for name in PROTO_FILES:
        rc = protoc.main(
            ["protoc", f"-I{PROTO_DIR}", f"--python_out={out_dir}", f"--pyi_out={out_dir}", str(PROTO_DIR / name)]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed ({rc}) on {PROTO_DIR / name}")
    return [out_dir / (Path(n).stem + "_pb2" + suffix) for n in PROTO_FILES for suffix in (".py", ".pyi")]


def stale_files() -> list[str]:
    """Names of shipped generated modules that differ from a fresh compile."""
    with tempfile.TemporaryDirectory() as tmp:
        return [
            path.name
            for path in generate(Path(tmp))
            if not (PACKAGE_DIR / path.name).exists() or (PACKAGE_DIR / path.name).read_bytes() != path.read_bytes()
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the shipped code is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale generated protobuf code: {', '.join(stale)}; run python -m airflow_provider_lr.proto.build")
            return 1
        return 0
    generate(PACKAGE_DIR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
