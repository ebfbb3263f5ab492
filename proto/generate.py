"""Regenerate the Python stubs of the control-plane API from proto/refit/v1/refit.proto.

    python proto/generate.py              # writes refit/control/v1/refit_pb2{.py,.pyi,_grpc.py}
    python proto/generate.py --out DIR    # writes them under DIR instead (the freshness test)

protoc writes `from refit.v1 import refit_pb2` (the proto's own path); the stubs live in the
package `refit.control.v1`, so that import is rewritten.  Generated files are committed, so that
users need no grpcio-tools; tests/integration/test_control_plane.py fails when they drift from the .proto.

Generated with grpcio-tools 1.66.0 (protobuf gencode 5.27.2), so that they import under every
grpcio >= 1.66 and protobuf >= 5.29 (what vLLM and Ray environments carry; newer runtimes accept
older gencode).  In a throwaway venv:

    python -m venv /tmp/oldgrpc && /tmp/oldgrpc/bin/pip install grpcio-tools==1.66.0 protobuf==5.29.1
    /tmp/oldgrpc/bin/python proto/generate.py
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO_DIR = os.path.join(ROOT, "proto")
PROTO = "refit/v1/refit.proto"
PACKAGE_DIR = os.path.join(ROOT, "refit", "control", "v1")
FILES = ("refit_pb2.py", "refit_pb2.pyi", "refit_pb2_grpc.py")
TOOLS_VERSION = "1.66.0"  # the grpcio-tools the committed stubs come from: their lowest grpcio


def tools_version() -> str:
    from importlib.metadata import version

    return version("grpcio-tools")


def descriptor_blob(stub_path: str) -> bytes:
    """The serialized FileDescriptorProto inside a generated ``refit_pb2.py``: what the .proto
    says, independent of the grpcio-tools release that wrote the file around it."""
    import ast

    with open(stub_path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "AddSerializedFile":
            return ast.literal_eval(node.args[0])
    raise ValueError(f"{stub_path}: no AddSerializedFile call")


def generate(out_dir: str, any_tools: bool = False) -> list[str]:
    """Run protoc (from grpcio-tools) and write the fixed-up stubs into ``out_dir``.  Refuses a
    grpcio-tools other than TOOLS_VERSION unless ``any_tools`` (newer tools raise the minimum
    grpcio/protobuf the stubs accept)."""
    from grpc_tools import protoc  # grpcio-tools: a development dependency only

    if not any_tools and tools_version() != TOOLS_VERSION:
        raise SystemExit(f"grpcio-tools {tools_version()} installed; the committed stubs come from {TOOLS_VERSION} "
                         f"(see this file's docstring), or pass --any-tools")

    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={tmp}",
                          f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", os.path.join(PROTO_DIR, PROTO)])
        if rc != 0:
            raise SystemExit(f"protoc failed with status {rc}")
        os.makedirs(out_dir, exist_ok=True)
        written = []
        for name in FILES:
            with open(os.path.join(tmp, "refit", "v1", name)) as f:
                text = f.read()
            text = re.sub(r"^from refit\.v1 import", "from refit.control.v1 import", text, flags=re.M)
            path = os.path.join(out_dir, name)
            with open(path, "w") as f:
                f.write(text)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=PACKAGE_DIR, help=f"output directory (default {PACKAGE_DIR})")
    p.add_argument("--any-tools", action="store_true", help=f"allow a grpcio-tools other than {TOOLS_VERSION}")
    args = p.parse_args(argv)
    for path in generate(args.out, args.any_tools):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
