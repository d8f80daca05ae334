"""The benchmark images' recipes: every spec buildable, cache keys, bytecode valid in the image."""

from __future__ import annotations

import importlib.util
import marshal
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from bench import image
from tests.harness.oci import MTIME


@pytest.mark.parametrize("spec", image.IMAGES.values(), ids=image.IMAGES.keys())
def test_every_image_names_a_data_layer_and_a_start_script(spec: image.ImageSpec) -> None:
    assert spec.data in image.DATA_LAYERS
    assert (Path(image.__file__).parent / spec.start).is_file()
    assert spec.requirements


def test_the_recipe_key_follows_the_spec_and_the_resolved_wheels() -> None:
    wheels = ["numpy-2.4.6-cp311-cp311-manylinux_2_28_x86_64.whl"]
    key = image._recipe_key(image.TABULAR, wheels)
    assert image._recipe_key(image.TABULAR, list(wheels)) == key
    assert image._recipe_key(replace(image.TABULAR, shards=5), wheels) != key
    assert image._recipe_key(image.TABULAR, ["numpy-2.4.7-cp311-cp311-manylinux_2_28_x86_64.whl"]) != key
    # Same layers, another start script: another image.
    assert image._recipe_key(replace(image.TABULAR, start=image.FULL.start), wheels) != key


@pytest.mark.skipif(not image.HOST_PYTHON.exists(), reason="needs the image's interpreter on the host")
def test_bytecode_is_valid_for_the_mtime_the_layer_gives_its_source(tmp_path: Path) -> None:
    source = tmp_path / "usr/lib/pkg/mod.py"
    source.parent.mkdir(parents=True)
    source.write_text("VALUE = 1\n")
    image._compile_bytecode(tmp_path)
    pyc = Path(importlib.util.cache_from_source(str(source)))
    data = pyc.read_bytes()
    flags, mtime, size = struct.unpack("<III", data[4:16])
    # Timestamp-checked bytecode for the tar's MTIME, so the container's
    # Python loads it instead of compiling the module again.
    assert (flags, mtime, size) == (0, MTIME, len("VALUE = 1\n"))
    assert marshal.loads(data[16:]).co_filename == "/usr/lib/pkg/mod.py"
