"""`make protos`: regenerate the committed stubs in jlora/api/gen/ from jlora/api/protos/.

1. protoc (grpc_tools, a dev dependency) compiles every .proto under `protos/`, with
   `protos/` as the include root, so the files register in the descriptor pool under
   their package paths (`jlora/v1/jlora.proto`), which is what reflection reports.
2. The messages (`*_pb2.py`), their type stubs (`*_pb2.pyi`) and the service stubs
   (`*_pb2_grpc.py`) land flat in `gen/`; protoc's absolute imports of sibling modules
   (`from jlora.v1 import jlora_pb2`) are rewritten to `jlora.api.gen`, since `jlora` is
   this package, not the proto package.

`python -m jlora.api.protoc [OUT_DIR]` writes to OUT_DIR (default: gen/);
tests/test_api_protos.py regenerates into a temporary directory and compares.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

API_DIR = Path(__file__).resolve().parent
PROTO_ROOT = API_DIR / "protos"
GEN_DIR = API_DIR / "gen"
GEN_PACKAGE = "jlora.api.gen"
_INIT = '"""Generated from jlora/api/protos/ by `make protos` (jlora/api/protoc.py)."""\n'


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path = GEN_DIR) -> list[Path]:
    """Compile every .proto into `out_dir` (replacing its generated files); return them."""
    from grpc_tools import protoc  # dev dependency: only `make protos` needs it

    include = Path(protoc.__file__).resolve().parent / "_proto"  # google/protobuf/*.proto
    protos = proto_files()
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(p.relative_to(PROTO_ROOT)) for p in protos),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        out_dir.mkdir(parents=True, exist_ok=True)
        for stale in out_dir.glob("*_pb2*.py*"):
            stale.unlink()
        written = [out_dir / "__init__.py"]
        written[0].write_text(_INIT)
        for produced in sorted(Path(tmp).rglob("*_pb2*.py*")):
            target = out_dir / produced.name
            target.write_text(_rewrite_imports(produced.read_text(), protos))
            written.append(target)
    return written


def _rewrite_imports(source: str, protos: list[Path]) -> str:
    """`from jlora.v1 import jlora_pb2` -> `from jlora.api.gen import jlora_pb2`."""
    for proto in protos:
        package = ".".join(proto.relative_to(PROTO_ROOT).parent.parts)
        source = re.sub(
            rf"^from {re.escape(package)} import ",
            f"from {GEN_PACKAGE} import ",
            source,
            flags=re.MULTILINE,
        )
    return source


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out_dir = Path(args[0]) if args else GEN_DIR
    for path in generate(out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
