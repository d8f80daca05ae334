"""The CRI proxy's forwarding, against a fake containerd that records what
reaches it: bytes pass untouched (fields the proto subset does not know
included), metadata both ways, deadlines and cancellation, status codes,
streaming; only ImageService is served; PullImage's credentials are kept
once the registry check accepts them, and never logged."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import structlog

from proto.k8s.cri.runtime.v1 import api_pb2 as cri
from snapshotter.cri.credentials import CriCredentialStore, PullSecret
from snapshotter.cri.proxy import CriProxy
from snapshotter.registry.auth import Credentials
from snapshotter.registry.reference import Reference

SERVICE = "/runtime.v1.ImageService/"
# Field 99, varint 7: a field no version of this proto subset knows.
UNKNOWN_FIELD = bytes([0x98, 0x06, 0x07])


@dataclass
class Seen:
    method: str
    request: bytes
    metadata: dict[str, str | bytes]
    time_remaining: float | None


@dataclass
class FakeContainerd(grpc.GenericRpcHandler):
    seen: list[Seen] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[bytes, bytes] | None:
        method = details.method

        def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
            self.seen.append(Seen(method, request, dict(context.invocation_metadata()), context.time_remaining()))
            name = method.rsplit("/", 1)[1]
            if name == "ListImages":
                context.set_trailing_metadata((("x-why", "fake"),))
                context.abort(grpc.StatusCode.NOT_FOUND, "no such image here")
            if name == "PullImage" and request.endswith(b"hang"):
                context.add_callback(self.cancelled.set)
                while context.is_active():
                    time.sleep(0.01)
                return b""
            context.send_initial_metadata((("x-initial", "from-containerd"),))
            context.set_trailing_metadata((("x-trailing", "from-containerd"), ("x-raw-bin", b"\x00\x01")))
            return cri.ImageFsInfoResponse(image_filesystems=[cri.FilesystemUsage(timestamp=1)]).SerializeToString() + (
                UNKNOWN_FIELD
            )

        def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            self.seen.append(Seen(method, request, dict(context.invocation_metadata()), context.time_remaining()))
            for n in range(3):
                yield cri.StreamImagesResponse(images=[cri.Image(id=f"sha256:{n}")]).SerializeToString()

        if method.endswith("/StreamImages"):
            return grpc.unary_stream_rpc_method_handler(stream)
        return grpc.unary_unary_rpc_method_handler(unary)


@dataclass
class Checks:
    answer: bool = True
    calls: list[tuple[Reference, Credentials]] = field(default_factory=list)

    def __call__(self, ref: Reference, creds: Credentials) -> bool:
        self.calls.append((ref, creds))
        return self.answer


@dataclass
class Rig:
    fake: FakeContainerd
    checks: Checks
    store: CriCredentialStore
    channel: grpc.Channel

    def call(self, method: str, request: bytes, **kwargs: object) -> tuple[bytes, grpc.Call]:
        stub: grpc.UnaryUnaryMultiCallable[bytes, bytes] = self.channel.unary_unary(SERVICE + method)
        response, call = stub.with_call(request, **kwargs)  # type: ignore[arg-type]
        return response, call

    def pull(self, image: str, **auth: str) -> None:
        request = cri.PullImageRequest(image=cri.ImageSpec(image=image), auth=cri.AuthConfig(**auth))
        self.call("PullImage", request.SerializeToString(), timeout=10)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    # Unix socket paths must stay short (108 bytes); tmp_path may not be.
    sockets = Path(tempfile.mkdtemp(prefix="bs-crit-", dir="/tmp"))
    fake = FakeContainerd()
    upstream = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[fake])
    upstream.add_insecure_port(f"unix://{sockets}/containerd.sock")
    upstream.start()
    checks = Checks()
    store = CriCredentialStore(tmp_path / "cri" / "credentials.json")
    proxy = CriProxy(sockets / "cri.sock", sockets / "containerd.sock", store, checks)
    proxy.start()
    channel = grpc.insecure_channel(f"unix://{sockets}/cri.sock")
    try:
        yield Rig(fake, checks, store, channel)
    finally:
        channel.close()
        proxy.stop(grace=0)
        upstream.stop(0).wait()
        shutil.rmtree(sockets, ignore_errors=True)


def test_bytes_metadata_and_deadline_pass_through(rig: Rig) -> None:
    request = cri.ImageFsInfoRequest().SerializeToString() + UNKNOWN_FIELD
    response, call = rig.call(
        "ImageFsInfo", request, timeout=30, metadata=(("x-kubelet", "hello"), ("x-trace-bin", b"\xff"))
    )
    (seen,) = rig.fake.seen
    assert seen.method == SERVICE + "ImageFsInfo" and seen.request == request
    assert seen.metadata["x-kubelet"] == "hello" and seen.metadata["x-trace-bin"] == b"\xff"
    # Propagated, not dropped (a dropped deadline reads as none or ~1e9 s);
    # gRPC rounds the wire timeout, so it may read a little over 30.
    assert seen.time_remaining is not None and 20 < seen.time_remaining < 60
    assert response.endswith(UNKNOWN_FIELD)
    assert cri.ImageFsInfoResponse.FromString(response).image_filesystems[0].timestamp == 1
    assert ("x-initial", "from-containerd") in call.initial_metadata()
    trailing = dict(call.trailing_metadata())
    assert trailing["x-trailing"] == "from-containerd" and trailing["x-raw-bin"] == b"\x00\x01"


def test_no_deadline_stays_no_deadline(rig: Rig) -> None:
    rig.call("ImageFsInfo", b"")
    (seen,) = rig.fake.seen
    assert seen.time_remaining is None or seen.time_remaining > 1e9


def test_status_code_message_and_trailers_come_back(rig: Rig) -> None:
    with pytest.raises(grpc.RpcError) as info:
        rig.call("ListImages", b"", timeout=10)
    error = info.value
    assert isinstance(error, grpc.Call)
    assert error.code() == grpc.StatusCode.NOT_FOUND and error.details() == "no such image here"
    assert ("x-why", "fake") in error.trailing_metadata()


def test_server_streaming_methods_pass(rig: Rig) -> None:
    stub: grpc.UnaryStreamMultiCallable[bytes, bytes] = rig.channel.unary_stream(SERVICE + "StreamImages")
    ids = [cri.StreamImagesResponse.FromString(r).images[0].id for r in stub(b"", timeout=10)]
    assert ids == ["sha256:0", "sha256:1", "sha256:2"]


def test_deadline_cancels_the_forwarded_call(rig: Rig) -> None:
    request = cri.PullImageRequest(image=cri.ImageSpec(image="reg.example.com/a:b")).SerializeToString()
    with pytest.raises(grpc.RpcError) as info:
        rig.call("PullImage", request + _hang_marker(), timeout=0.5)
    assert isinstance(info.value, grpc.Call) and info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert rig.fake.cancelled.wait(10), "containerd's side of the call was never cancelled"


def _hang_marker() -> bytes:
    # An unknown length-delimited field 100 whose bytes end in "hang": the
    # fake containerd hangs on it; the proxy forwards it like any other field.
    return bytes([0xA2, 0x06, 0x04]) + b"hang"


def test_only_image_service_is_served(rig: Rig) -> None:
    stub: grpc.UnaryUnaryMultiCallable[bytes, bytes] = rig.channel.unary_unary("/runtime.v1.RuntimeService/Version")
    with pytest.raises(grpc.RpcError) as info:
        stub(b"", timeout=10)
    assert isinstance(info.value, grpc.Call) and info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert rig.fake.seen == []


def test_v1alpha2_is_forwarded_too(rig: Rig) -> None:
    stub: grpc.UnaryUnaryMultiCallable[bytes, bytes] = rig.channel.unary_unary(
        "/runtime.v1alpha2.ImageService/ImageFsInfo"
    )
    stub(b"", timeout=10)
    assert [s.method for s in rig.fake.seen] == ["/runtime.v1alpha2.ImageService/ImageFsInfo"]


def test_pull_credentials_are_checked_kept_and_never_logged(rig: Rig) -> None:
    with structlog.testing.capture_logs() as logs:
        rig.pull("reg.example.com:5000/team/app:v1", username="alice", password="hunter2")
        rig.pull("reg.example.com:5000/team/app:v2", username="alice", password="hunter2")
    ((ref, creds),) = rig.checks.calls  # the second pull's credentials were already kept
    assert (ref.domain, ref.repository, creds.username) == ("reg.example.com:5000", "team/app", "alice")
    assert rig.store.get("reg.example.com:5000", "team/app") == PullSecret("alice", "hunter2")
    assert "hunter2" not in repr(logs)
    # The forwarded request is the one kubelet sent, credentials included.
    assert [cri.PullImageRequest.FromString(s.request).auth.password for s in rig.fake.seen] == ["hunter2"] * 2


def test_refused_credentials_are_not_kept(rig: Rig) -> None:
    rig.pull("reg.example.com/team/app:v1", username="alice", password="right")
    rig.checks.answer = False
    rig.pull("reg.example.com/team/app:v1", username="alice", password="wrong")
    assert rig.store.get("reg.example.com", "team/app") == PullSecret("alice", "right")
    assert len(rig.fake.seen) == 2  # forwarded anyway: containerd gives kubelet the real error


def test_credentials_for_another_server_or_malformed_are_ignored(rig: Rig) -> None:
    rig.pull("reg.example.com/team/app:v1", username="a", password="p", server_address="https://other.example.com")
    rig.pull("reg.example.com/team/app:v1", auth="not base64!")
    rig.pull("reg.example.com/team/app:v1")  # anonymous
    assert rig.store.get("reg.example.com", "team/app") is None
    assert rig.checks.calls == [] and len(rig.fake.seen) == 3
