"""Snapshot errors, one class per gRPC status code containerd understands.

containerd maps the status code of a proxy plugin's answer back to its own
error kinds (errdefs.FromGRPC), so the code matters more than the class name:
NOT_FOUND makes containerd fall through to creating a snapshot, ALREADY_EXISTS
makes it skip a layer, and so on.
"""

from __future__ import annotations

import grpc


class SnapshotError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class NotFound(SnapshotError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SnapshotError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(SnapshotError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class InvalidArgument(SnapshotError):
    code = grpc.StatusCode.INVALID_ARGUMENT
