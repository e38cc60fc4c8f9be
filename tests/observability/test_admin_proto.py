"""The committed generated code of our own protos matches the .proto sources (`make proto`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

from epp.admin.v1 import admin_pb2

ROOT = Path(__file__).resolve().parents[2]


def test_generated_admin_code_is_current(tmp_path: Path) -> None:
    out = tmp_path / "admin.pb"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "--proto_path", str(ROOT / "proto"),
                    "--descriptor_set_out", str(out), "epp/admin/v1/admin.proto"], check=True)
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    for message in fresh.message_type:  # the python generator drops the derived json names
        for f in message.field:
            f.ClearField("json_name")
        for nested in message.nested_type:
            for f in nested.field:
                f.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto.FromString(admin_pb2.DESCRIPTOR.serialized_pb)
    assert fresh == committed, "proto/epp/admin/v1/admin.proto changed: run `make proto`"
