"""The jobstart benchmark's arithmetic (bench/jobtimeline.py)."""

from __future__ import annotations

import pytest

from bench.jobtimeline import MODES, PHASES, Run, limit_s, parse_output, phases, ratios, round_order, summarise

T = 1_700_000_000.0
OUTPUT = "\n".join(
    [
        "some pip noise",
        f"PHASE container {T + 3:.6f}",
        "  | depsnap: hit abc",
        f"PHASE deps {T + 4:.6f}",
        f"PHASE imports {T + 6:.6f}",
        f"PHASE torch {T + 6.25:.6f}",
        f"PHASE model {T + 6.5:.6f}",
        f"PHASE checkpoint {T + 20:.6f}",
        f"PHASE step {T + 21:.6f}",
        "STEP loss=0.1 checkpoint_bytes=10 head_sha256=00ff00ff00ff00ff",
    ]
)


def test_the_phases_add_up_to_the_time_to_first_step() -> None:
    job = parse_output(OUTPUT)
    assert job.head_sha256 == "00ff00ff00ff00ff"
    split = phases(T, T + 2, job)
    assert list(split) == list(PHASES)
    assert split["pull"] == pytest.approx(2.0) and split["checkpoint"] == pytest.approx(13.5)
    assert sum(split.values()) == pytest.approx(job.marks["step"] - T)


@pytest.mark.parametrize("drop", ["PHASE checkpoint", "STEP "])
def test_a_job_that_did_not_get_there_is_an_error(drop: str) -> None:
    text = "\n".join(line for line in OUTPUT.splitlines() if not line.startswith(drop))
    with pytest.raises(ValueError, match="lacks"):
        parse_output(text)


def test_medians_limit_and_ratios() -> None:
    def run(mode: str, seconds: float, moved: int) -> Run:
        return Run(mode, seconds, moved, dict.fromkeys(PHASES, seconds / len(PHASES)))

    summary = summarise([run("bootseer-fresh-node", s, m) for s, m in ((30, 100), (20, 300), (25, 200))])
    assert summary["median_s"] == 25 and summary["bytes_over_link"] == 200 and summary["runs"] == 3
    limit = limit_s(5.0, 2.0e9, 125e6)
    assert limit == pytest.approx(21.0)
    got = ratios({"baseline": 150.0, "bootseer-fresh-node": 25.0, "warm": 5.0}, limit)
    assert got["fresh_node_vs_baseline"] == pytest.approx(0.167, abs=1e-3)
    assert got["fresh_node_vs_limit"] == pytest.approx(25 / 21, abs=1e-3)
    assert got["first_vs_baseline"] is None


@pytest.mark.parametrize("number", range(4))
def test_every_round_runs_each_mode_once_and_the_first_start_right_before_the_fresh_node(number: int) -> None:
    order = round_order(list(MODES), number)
    assert sorted(order) == sorted(MODES)
    first = order.index("bootseer-first")
    assert order[first + 1] == "bootseer-fresh-node"


def test_rounds_rotate_the_other_modes() -> None:
    assert {tuple(round_order(list(MODES), n)) for n in range(6)} != {tuple(round_order(list(MODES), 0))}
    assert round_order(["warm"], 3) == ["warm"]
