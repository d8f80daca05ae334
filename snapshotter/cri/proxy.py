"""The CRI image-service proxy: kubelet's `--image-service-endpoint`.

Every call to a CRI ImageService (`runtime.v1`, and `runtime.v1alpha2`,
which containerd 1.6 and 1.7 still serve) is forwarded to containerd's CRI
plugin as it came: request and response messages are passed through as
bytes (so fields this proxy's proto subset does not know survive), with the
caller's metadata, its deadline and cancellation, and containerd's initial
and trailing metadata, status code and message coming back. Each call is
forwarded as a stream in both directions, which is what any gRPC method is
on the wire, so streaming methods (StreamImages) pass as well as unary ones.
Other services are not served (UNIMPLEMENTED): kubelet's runtime endpoint
stays containerd.

Only PullImage is looked at: before it is forwarded, the request's
AuthConfig (kubelet's imagePullSecrets for that image) is decoded and, if
it is new for the image's repository, checked against the registry with one
authenticated manifest HEAD and written to the credentials store, so the
snapshotter's index fetches and the layer server's block fetches for the
pull that follows can use it. Credentials the registry refuses are not
kept (whatever worked before stays); the pull is forwarded either way and
fails in containerd as it would without the proxy.

A pod's `bootseer.io/prefetch` annotation, in the same request's sandbox
config, starts the checkpoint prefetches it asks for (`prefetch`), in the
background.

Secrets are never logged, nor are containerd's error messages for PullImage
(containerd 1.6 quotes an undecodable `auth` back in its error).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from pathlib import Path

import grpc
import structlog
from google.protobuf.message import DecodeError

from proto.k8s.cri.runtime.v1 import api_pb2 as cri
from snapshotter.cri import metrics
from snapshotter.cri.credentials import CriCredentialStore, InvalidAuth, PullSecret, secret_from_auth, server_matches
from snapshotter.cri.prefetch import PodPrefetch
from snapshotter.registry import media
from snapshotter.registry.auth import Credentials
from snapshotter.registry.config import client_with_credentials
from snapshotter.registry.errors import RegistryError, Unauthorized
from snapshotter.registry.hosts import Endpoint
from snapshotter.registry.reference import InvalidReference, Reference
from snapshotter.registry.reference import parse as parse_reference
from snapshotter.registry.settings import RegistryConfig
from snapshotter.registry.transport import Request

log = structlog.get_logger("bootseer.cri")

IMAGE_SERVICES = frozenset({"runtime.v1.ImageService", "runtime.v1alpha2.ImageService"})
PULL_IMAGE = "PullImage"
# kubelet's CRI client allows 16 MiB messages (ListImages on a busy node); gRPC's default is 4 MiB.
MAX_MESSAGE_BYTES = 16 << 20
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)
# Concurrent calls; a PullImage holds one for the whole pull.
WORKERS = 16
SHUTDOWN_GRACE_S = 5.0
# Metadata gRPC itself owns on each hop; everything else is the caller's and passes.
_HOP_METADATA = frozenset({"user-agent", "content-type", "te", "host", "authority"})

# grpc reports "no deadline" as ~292 billion years remaining; anything past
# this many seconds means the caller set none, so neither does the forwarded call.
_NO_DEADLINE_S = 1e9

Check = Callable[[Reference, Credentials], bool]


def _timeout(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None or remaining > _NO_DEADLINE_S else remaining


Metadata = tuple[tuple[str, str | bytes], ...]


def _forwardable(metadata: Sequence[tuple[str, str | bytes]] | None) -> Metadata:
    return tuple(
        (key, value)
        for key, value in metadata or ()
        if not key.startswith((":", "grpc-")) and key.lower() not in _HOP_METADATA
    )


def registry_accepts(registry: RegistryConfig) -> Check:
    """A check of credentials against the registry: one manifest HEAD of the
    image, authenticated with them alone. Only a refusal counts against
    them; an unreachable registry or a missing tag does not."""

    def check(ref: Reference, creds: Credentials) -> bool:
        with client_with_credentials(registry, ref, creds, source=Path("the PullImage AuthConfig")) as client:

            def head(endpoint: Endpoint) -> int:
                response = client.transport.send(
                    Request(
                        endpoint,
                        ref,
                        "HEAD",
                        f"/{ref.repository}/manifests/{ref.object}",
                        headers={"Accept": ", ".join(media.MANIFEST_ACCEPT)},
                    )
                )
                response.close()
                return response.status_code

            try:
                client.transport.over_endpoints(ref, "pull" if ref.digest else "resolve", head)
            except Unauthorized:
                return False
            except RegistryError as exc:
                log.info(
                    "cri.credentials_unchecked", host=ref.domain, repository=ref.repository, reason=type(exc).__name__
                )
            return True

    return check


class CredentialCapture:
    """What the proxy does with a PullImage request before forwarding it."""

    def __init__(self, store: CriCredentialStore, check: Check) -> None:
        self.store = store
        self.check = check

    def pull_image(self, request_bytes: bytes) -> str:
        """Keep the credentials of one PullImage request; the image it names.
        Never raises: the pull goes ahead whatever happens here."""
        try:
            request = cri.PullImageRequest.FromString(request_bytes)
        except DecodeError:
            log.warning("cri.pull_undecodable")
            return ""
        image = request.image.image
        if not request.HasField("auth"):
            return image
        try:
            ref = parse_reference(image)
        except InvalidReference:
            return image  # containerd answers it with its own error
        try:
            self._keep(ref, request.auth)
        except Exception as exc:
            # The pull must not fail because the store could not be written.
            log.error(
                "cri.credentials_not_stored", host=ref.domain, repository=ref.repository, error=type(exc).__name__
            )
        return image

    def _keep(self, ref: Reference, auth: cri.AuthConfig) -> None:
        where = {"host": ref.domain, "repository": ref.repository}
        if not server_matches(auth.server_address, ref.domain):
            metrics.CREDENTIALS.labels("ignored").inc()
            log.info("cri.credentials_for_another_server", server_address=auth.server_address, **where)
            return
        try:
            secret = secret_from_auth(auth.username, auth.password, auth.auth, auth.identity_token, auth.registry_token)
        except InvalidAuth as exc:
            metrics.CREDENTIALS.labels("ignored").inc()
            log.warning("cri.credentials_malformed", reason=str(exc), **where)
            return
        if secret is None:
            return
        if self.store.get(ref.domain, ref.repository) == secret:
            metrics.CREDENTIALS.labels("unchanged").inc()
            return
        if not self._accepted(ref, secret):
            metrics.CREDENTIALS.labels("refused").inc()
            log.warning("cri.credentials_refused", **where)
            return
        self.store.put(ref.domain, ref.repository, secret)
        metrics.CREDENTIALS.labels("stored").inc()
        log.info("cri.credentials_stored", kind=_kind(secret), **where)

    def _accepted(self, ref: Reference, secret: PullSecret) -> bool:
        creds = secret.credentials()
        return creds is None or self.check(ref, creds)


def _kind(secret: PullSecret) -> str:
    if secret.username:
        return "basic"
    return "identity_token" if secret.identity_token else "registry_token"


class _Forwarder(grpc.GenericRpcHandler):
    def __init__(self, channel: grpc.Channel, capture: CredentialCapture | None, prefetch: PodPrefetch | None) -> None:
        self._channel = channel
        self._capture = capture
        self._prefetch = prefetch

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[bytes, bytes] | None:
        full = handler_call_details.method
        service, _, method = full.lstrip("/").partition("/")
        if service not in IMAGE_SERVICES or not method:
            return None

        def forward(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
            return self._forward(full, method, requests, context)

        return grpc.stream_stream_rpc_method_handler(forward)

    def _forward(
        self, full: str, method: str, requests: Iterator[bytes], context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        began = time.perf_counter()
        code = grpc.StatusCode.OK
        image = ""
        try:
            if method == PULL_IMAGE and (self._capture is not None or self._prefetch is not None):
                first = next(requests, None)
                if first is not None:
                    if self._prefetch is not None:
                        self._prefetch.pull_image(first)
                    if self._capture is not None:
                        image = self._capture.pull_image(first)
                    requests = itertools.chain([first], requests)
            upstream: grpc.StreamStreamMultiCallable[bytes, bytes] = self._channel.stream_stream(full)
            call = upstream(requests, timeout=_timeout(context), metadata=_forwardable(context.invocation_metadata()))

            def cancel() -> None:
                # The caller went away (or its deadline passed): so does the upstream call.
                call.cancel()

            context.add_callback(cancel)
            try:
                context.send_initial_metadata(_forwardable(call.initial_metadata()))
                yield from call
            except grpc.RpcError as err:
                code = err.code() if isinstance(err, grpc.Call) else grpc.StatusCode.UNKNOWN
                if isinstance(err, grpc.Call):
                    context.set_trailing_metadata(_forwardable(err.trailing_metadata()))
                    details = err.details() or ""
                else:
                    details = str(err)
                context.abort(code, details)
            else:
                context.set_trailing_metadata(_forwardable(call.trailing_metadata()))
        finally:
            metrics.REQUESTS.labels(method, code.name).inc()
            metrics.REQUEST_SECONDS.labels(method).observe(time.perf_counter() - began)
            if method == PULL_IMAGE:
                log.info("cri.pull_image", image=image, code=code.name, seconds=round(time.perf_counter() - began, 3))
            else:
                log.debug("cri.forwarded", method=method, code=code.name)


class CriProxy:
    """The proxy's gRPC server on a unix socket, forwarding to containerd."""

    def __init__(
        self,
        address: Path,
        containerd_address: Path,
        store: CriCredentialStore | None,
        check: Check,
        prefetch_roots: Sequence[str] = (),
    ) -> None:
        self.address = address
        self.containerd_address = containerd_address
        self._channel = grpc.insecure_channel(f"unix://{containerd_address.resolve()}", options=CHANNEL_OPTIONS)
        self._prefetch = PodPrefetch(prefetch_roots) if prefetch_roots else None
        capture = CredentialCapture(store, check) if store is not None else None
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="cri"),
            handlers=[_Forwarder(self._channel, capture, self._prefetch)],
            options=CHANNEL_OPTIONS,
        )

    def start(self) -> None:
        self.address.parent.mkdir(parents=True, exist_ok=True)
        if self.address.is_socket():
            # Left by a previous instance that was killed; nobody serves it.
            self.address.unlink()
        elif self.address.exists():
            raise FileExistsError(f"{self.address} exists and is not a socket; refusing to replace it")
        self._server.add_insecure_port(f"unix://{self.address.resolve()}")
        self._server.start()
        os.chmod(self.address, 0o660)
        log.info("cri proxy serving", address=str(self.address), containerd=str(self.containerd_address))

    def stop(self, grace: float = SHUTDOWN_GRACE_S) -> None:
        self._server.stop(grace).wait()
        if self._prefetch is not None:
            self._prefetch.close()
        self._channel.close()
        self.address.unlink(missing_ok=True)
