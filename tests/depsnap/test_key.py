"""The key: every input changes it, nothing else does, no secret is shown."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from depsnap import inputs as inputs_mod
from depsnap.inputs import EnvRequest, RunRequest
from depsnap.key import Input, compute, describe, environment_inputs, redact
from depsnap.requirements import RequirementsError, collect
from tests.depsnap.conftest import PYTHON

ENVIRON = {"HOME": "/nonexistent", "PIP_CONFIG_FILE": "/dev/null", "UV_NO_CONFIG": "1"}


@pytest.fixture
def reqs(tmp_path: Path) -> Path:
    (tmp_path / "base.txt").write_text("numpy==2.0\n-c constraints.txt\n")
    (tmp_path / "constraints.txt").write_text("pandas<3\n")
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "pyproject.toml").write_text("[project]\nname='proj'\n")
    top = tmp_path / "requirements.txt"
    top.write_text("# top\n-r base.txt\n-e ./proj\nrequests  # pinned elsewhere\n")
    return top


def env_key(request: EnvRequest, environ: dict[str, str] = ENVIRON, cwd: Path = Path("/")) -> str:
    return compute(inputs_mod.for_env(request, environ, cwd))


def test_requirements_follow_includes_and_local_projects(reqs: Path) -> None:
    found = collect([reqs])
    assert [(f.role, f.path.name) for f in found] == [
        ("requirement", "requirements.txt"),
        ("requirement", "base.txt"),
        ("constraint", "constraints.txt"),
        ("project", "pyproject.toml"),
    ]


def test_missing_and_circular_includes_are_errors(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("-r b.txt\n")
    with pytest.raises(RequirementsError, match=r"not found.*b\.txt.*included from.*a\.txt"):
        collect([tmp_path / "a.txt"])
    (tmp_path / "b.txt").write_text("--requirement=a.txt\n")
    with pytest.raises(RequirementsError, match="include each other"):
        collect([tmp_path / "a.txt"])


def test_every_input_changes_the_key() -> None:
    inputs = [Input(f"name{i}", f"value{i}") for i in range(6)]
    base = compute(inputs)
    for i in range(len(inputs)):
        changed = list(inputs)
        changed[i] = dataclasses.replace(inputs[i], value=inputs[i].value + "x")
        assert compute(changed) != base, inputs[i].name
    assert compute(inputs[:-1]) != base
    # Notes are for people only; order does not matter.
    assert compute([dataclasses.replace(inputs[0], note="n"), *reversed(inputs[1:])]) == base


def test_gathered_inputs_each_move_the_key(reqs: Path, tmp_path: Path) -> None:
    request = EnvRequest([reqs], tmp_path / "env", PYTHON, "uv", None)
    base = env_key(request)
    assert env_key(request) == base

    variants = {
        "pip installer": (dataclasses.replace(request, installer="pip"), ENVIRON),
        "another target path": (dataclasses.replace(request, target=tmp_path / "other"), ENVIRON),
        "another interpreter path": (
            dataclasses.replace(request, python=Path("/usr/bin/python3")),
            ENVIRON,
        ),
        "base image": (dataclasses.replace(request, base_image="sha256:1"), ENVIRON),
        "index url": (request, {**ENVIRON, "UV_INDEX_URL": "https://mirror/simple"}),
        "pip index url": (request, {**ENVIRON, "PIP_EXTRA_INDEX_URL": "https://m/simple"}),
        "compiler flags": (request, {**ENVIRON, "CFLAGS": "-O3"}),
    }
    seen = {base}
    for what, (variant, environ) in variants.items():
        key = env_key(variant, environ)
        assert key not in seen, what
        seen.add(key)

    for path, text in [
        (reqs, "requests==2.0\n-r base.txt\n"),
        (tmp_path / "base.txt", "numpy==2.1\n-c constraints.txt\n"),
        (tmp_path / "constraints.txt", "pandas<2\n"),
        (tmp_path / "proj" / "pyproject.toml", "[project]\nname='proj2'\n"),
    ]:
        original = path.read_text()
        path.write_text(text)
        assert env_key(request) not in seen, path.name
        path.write_text(original)
    assert env_key(request) == base


def test_irrelevant_settings_and_credentials_keep_the_key(reqs: Path, tmp_path: Path) -> None:
    request = EnvRequest([reqs], tmp_path / "env", PYTHON, "uv", None)
    base = env_key(request, {**ENVIRON, "UV_INDEX_URL": "https://alice:s3cret@mirror/simple"})
    assert env_key(request, {**ENVIRON, "UV_INDEX_URL": "https://bob:other@mirror/simple"}) == base
    assert (
        env_key(
            request,
            {
                **ENVIRON,
                "UV_INDEX_URL": "https://bob:other@mirror/simple",
                "UV_CACHE_DIR": "/x",
                "PIP_PROGRESS_BAR": "off",
            },
        )
        == base
    )
    # The working directory does not matter: paths in files resolve from the file.
    assert env_key(request, cwd=tmp_path) == env_key(request)


def test_key_listing_names_every_input_and_no_secret(reqs: Path, tmp_path: Path) -> None:
    environ = {**ENVIRON, "PIP_INDEX_URL": "https://alice:s3cret@mirror/simple"}
    request = EnvRequest([reqs], tmp_path / "env", PYTHON, "pip", "sha256:feed")
    gathered = inputs_mod.for_env(request, environ, Path("/"))
    text = describe(compute(gathered), gathered)
    assert "s3cret" not in text and "***@mirror" in text
    for name in (
        "target",
        "installer",
        "python.version",
        "python.abi",
        "platform",
        "libc",
        "base_image",
        "requirement[0]",
        "constraint[2]",
        "project[3]",
        "env:PIP_INDEX_URL",
    ):
        assert f"  {name} = " in text, name
    assert redact("git+https://tok@host/repo") == "git+https://***@host/repo"


def test_environment_inputs_select_installer_settings() -> None:
    chosen = environment_inputs({"PIP_INDEX_URL": "a", "UV_CACHE_DIR": "b", "PATH": "c", "CC": "gcc", "HOME": "/"})
    assert [i.name for i in chosen] == ["env:CC", "env:PIP_INDEX_URL"]


def test_run_key_covers_command_inputs_and_paths(tmp_path: Path) -> None:
    script = tmp_path / "setup.sh"
    script.write_text("echo one\n")
    request = RunRequest(["sh", str(script)], [script], [tmp_path / "out"])
    base = compute(inputs_mod.for_run(request, ENVIRON, tmp_path))
    script.write_text("echo two\n")
    assert compute(inputs_mod.for_run(request, ENVIRON, tmp_path)) != base
    script.write_text("echo one\n")
    for variant in (
        dataclasses.replace(request, command=["sh", "-e", str(script)]),
        dataclasses.replace(request, paths=[tmp_path / "elsewhere"]),
    ):
        assert compute(inputs_mod.for_run(variant, ENVIRON, tmp_path)) != base
