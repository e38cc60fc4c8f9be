"""TLS on the ext_proc port: a given certificate, the self-signed default, and hot reload."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import orjson

from epp.extproc.tls import self_signed
from tests.conftest import running_picker
from tests.extproc.client import ExtProcClient, body_msg, headers_msg, request_headers, set_headers


def write_pair(directory: Path) -> bytes:
    cert, key = self_signed()
    (directory / "tls.crt").write_bytes(cert)
    (directory / "tls.key").write_bytes(key)
    return cert


async def pick_over_tls(port: int, root_cert: bytes) -> str:
    credentials = grpc.ssl_channel_credentials(root_certificates=root_cert)
    async with grpc.aio.secure_channel(f"localhost:{port}", credentials) as channel:
        client = ExtProcClient(channel)
        await client.send(headers_msg(request_headers()),
                          body_msg(orjson.dumps({"model": "m", "prompt": "hi"})))
        return set_headers((await client.recv(2))[0])["x-gateway-destination-endpoint"]


async def test_certificate_from_cert_path_is_served(tmp_path: Path) -> None:
    cert = write_pair(tmp_path)
    async with running_picker(secure_serving=True, cert_path=str(tmp_path)) as picker:
        assert await pick_over_tls(picker.grpc_port, cert)


async def test_self_signed_default_refuses_plaintext_clients() -> None:
    async with running_picker(secure_serving=True) as picker:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as channel:
            client = ExtProcClient(channel)
            await client.send(headers_msg(request_headers()), body_msg(b"{}"))
            try:
                await client.recv(1, timeout=5)
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE
            else:
                raise AssertionError("a plaintext client was served on the TLS port")


async def test_rotated_certificate_is_picked_up_with_reload(tmp_path: Path) -> None:
    first = write_pair(tmp_path)
    async with running_picker(secure_serving=True, cert_path=str(tmp_path), enable_cert_reload=True) as picker:
        assert await pick_over_tls(picker.grpc_port, first)
        second = write_pair(tmp_path)
        await asyncio.sleep(0.1)
        assert await pick_over_tls(picker.grpc_port, second)
