"""Regenerate node_service_pb2.py and node_service_pb2_grpc.py from node_service.proto.

usage: python -m exo.networking.grpc.generate [OUT_DIR]   (default: this package's folder)
Needs grpcio-tools; the committed stubs were made with the version named in their headers, and the stubs
require at least that grpcio/protobuf at run time."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE / "node_service.proto"
# protoc writes a top-level import; the stubs live in a package, so make it relative.
TOP_LEVEL_IMPORT = "import node_service_pb2 as node__service__pb2"
PACKAGE_IMPORT = "from . import node_service_pb2 as node__service__pb2"


def generate(out_dir: Path = HERE) -> None:
  from grpc_tools import protoc
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  rc = protoc.main(["grpc_tools.protoc", f"-I{HERE}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", str(PROTO)])
  if rc != 0:
    raise RuntimeError(f"protoc failed with exit code {rc}")
  grpc_stub = out_dir / "node_service_pb2_grpc.py"
  text = grpc_stub.read_text()
  if TOP_LEVEL_IMPORT not in text:
    raise RuntimeError(f"unexpected protoc output: {TOP_LEVEL_IMPORT!r} not found in {grpc_stub}")
  grpc_stub.write_text(text.replace(TOP_LEVEL_IMPORT, PACKAGE_IMPORT))


if __name__ == "__main__":
  generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
