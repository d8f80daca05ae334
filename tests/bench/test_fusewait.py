"""The FUSE wait of a start, from the kernel's request tracepoints: pairing
sends with their ends, and what the requests kept their tasks waiting."""

from __future__ import annotations

import pytest

from bench import fusewait
from bench.fusewait import Request

# As tracefs prints them (the trace instance's clock is the monotonic one).
TRACE = """\
# tracer: nop
#
#           TASK-PID     CPU#  |||||  TIMESTAMP  FUNCTION
         python3-4242    [001] ...1.   100.000000: fuse_request_send: connection 43 req 2 opcode 1 (FUSE_LOOKUP) len 56
        bootseer-10009   [000] .....   100.000100: fuse_request_end: connection 43 req 2 len 144 error 0
         python3-4242    [001] ...1.   100.001000: fuse_request_send: connection 43 req 4 opcode 15 (FUSE_READ) len 80
 check from snap-10019   [000] ...1.   100.001500: fuse_request_send: connection 44 req 4 opcode 3 (FUSE_GETATTR) len 56
        bootseer-10009   [000] .....   100.002000: fuse_request_end: connection 44 req 4 len 120 error 0
        bootseer-10009   [000] .....   100.004000: fuse_request_end: connection 43 req 4 len 131088 error 0
         python3-4242    [001] ...1.   100.010000: fuse_request_send: connection 43 req 6 opcode 1 (FUSE_LOOKUP) len 56
        bootseer-10009   [000] .....   100.010000: fuse_request_end: connection 43 req 8 len 16 error -2
"""


def test_each_end_is_paired_with_its_send_by_connection_and_id() -> None:
    requests = fusewait.parse(TRACE.splitlines())
    assert [(r.opcode, r.task, round(r.seconds, 6)) for r in requests] == [
        ("LOOKUP", "python3", 0.0001),
        ("GETATTR", "check from snap", 0.0005),  # a task name with spaces
        ("READ", "python3", 0.003),  # same id as the GETATTR, another connection
    ]


def test_requests_unanswered_or_sent_before_the_trace_are_left_out() -> None:
    requests = fusewait.parse(TRACE.splitlines())
    # req 6 was never answered; req 8's send is not in the trace.
    assert len(requests) == 3
    assert all(r.sent <= r.ended for r in requests)


def test_outstanding_time_counts_overlapping_requests_once() -> None:
    wait = fusewait.summarise(
        [
            Request(10.0, 10.5, "READ", "python3"),
            Request(10.2, 10.4, "LOOKUP", "python3"),  # inside the READ
            Request(10.45, 11.0, "READ", "python3"),  # overlaps its end
            Request(12.0, 12.0005, "LOOKUP", "python3"),  # apart, fast
        ]
    )
    assert wait.requests == 4
    assert wait.outstanding_s == pytest.approx(1.0 + 0.0005)
    assert wait.latency_sum_s == pytest.approx(0.5 + 0.2 + 0.55 + 0.0005)
    assert wait.slow_requests == 3
    assert wait.slow_sum_s == pytest.approx(1.25)
    assert wait.by_opcode_s == pytest.approx({"READ": 1.05, "LOOKUP": 0.2005})


def test_no_requests_is_no_wait() -> None:
    wait = fusewait.summarise([])
    assert (wait.requests, wait.outstanding_s, wait.slow_requests, wait.by_opcode_s) == (0, 0.0, 0, {})
