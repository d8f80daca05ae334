"""A wheelhouse built on the spot, so installs need no network:

- `dsdemo` 1.0: pure Python, a console script `dsdemo-hello` and a .pth file
  that puts an extra directory on sys.path (`dsdemo_extra`);
- `dsspeed` 1.0 as an sdist with a C extension and an in-tree PEP 517
  backend that compiles it with gcc, so pip and uv really build it.
"""

from __future__ import annotations

import base64
import hashlib
import io
import tarfile
import textwrap
import zipfile
from pathlib import Path


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def write_wheel(path: Path, files: dict[str, bytes], dist_info: str) -> None:
    record = [_record_line(name, data) for name, data in files.items()]
    record.append(f"{dist_info}/RECORD,,")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")


def _wheel_meta(name: str, version: str, tag: str, requires: tuple[str, ...] = ()) -> dict[str, bytes]:
    dist = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    purelib = "true" if tag.startswith("py3") else "false"
    wheel = f"Wheel-Version: 1.0\nGenerator: depsnap-tests\nRoot-Is-Purelib: {purelib}\nTag: {tag}\n"
    return {f"{dist}/METADATA": metadata.encode(), f"{dist}/WHEEL": wheel.encode()}


def build_pure(out: Path, version: str = "1.0") -> Path:
    name = "dsdemo"
    files = {
        "dsdemo/__init__.py": (
            f'VERSION = "{version}"\n\ndef hello() -> None:\n    print("hello from dsdemo", VERSION)\n'
        ).encode(),
        "dsdemo/cli.py": b"import dsdemo\n\ndef main() -> int:\n    dsdemo.hello()\n    return 0\n",
        "dsdemo_extra/dsdemo_plugin.py": b'PLUGIN = "loaded through the .pth file"\n',
        "dsdemo.pth": b"dsdemo_extra\n",
    }
    files.update(_wheel_meta(name, version, "py3-none-any", ("dsspeed>=1.0",)))
    files[f"{name}-{version}.dist-info/entry_points.txt"] = b"[console_scripts]\ndsdemo-hello = dsdemo.cli:main\n"
    path = out / f"{name}-{version}-py3-none-any.whl"
    write_wheel(path, files, f"{name}-{version}.dist-info")
    return path


_BACKEND = '''
"""A PEP 517 backend that compiles one C file with gcc: no build dependencies."""
import base64, hashlib, os, subprocess, sys, sysconfig, zipfile

NAME, VERSION = "dsspeed", "1.0"


def get_requires_for_build_wheel(config_settings=None):
    return []


def _line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    so = os.path.abspath("build_" + NAME + suffix)
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O2", "-I", sysconfig.get_paths()["include"],
         "src/_speed.c", "-o", so],
        check=True,
    )
    py = sys.implementation.cache_tag.replace("cpython-", "cp")
    tag = f"{py}-{py}-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")
    dist = f"{NAME}-{VERSION}.dist-info"
    files = {
        f"{NAME}/__init__.py": b"from dsspeed._speed import add\\n",
        f"{NAME}/_speed{suffix}": open(so, "rb").read(),
        f"{dist}/METADATA": (
            f"Metadata-Version: 2.1\\nName: {NAME}\\nVersion: {VERSION}\\n".encode()
        ),
        f"{dist}/WHEEL": (
            "Wheel-Version: 1.0\\nGenerator: dsbackend\\nRoot-Is-Purelib: false\\n"
            f"Tag: {tag}\\n"
        ).encode(),
    }
    name = f"{NAME}-{VERSION}-{tag}.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
        record = [_line(p, d) for p, d in files.items()] + [f"{dist}/RECORD,,"]
        zf.writestr(f"{dist}/RECORD", "\\n".join(record) + "\\n")
    return name
'''

_C_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *add(PyObject *self, PyObject *args) {
    long a, b;
    if (!PyArg_ParseTuple(args, "ll", &a, &b)) return NULL;
    return PyLong_FromLong(a + b);
}

static PyMethodDef methods[] = {{"add", add, METH_VARARGS, "a + b, in C"}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_speed", NULL, -1, methods};
PyMODINIT_FUNC PyInit__speed(void) { return PyModule_Create(&module); }
"""


def build_sdist(out: Path) -> Path:
    root = "dsspeed-1.0"
    files = {
        "pyproject.toml": textwrap.dedent(
            """
            [build-system]
            requires = []
            build-backend = "dsbackend"
            backend-path = ["."]

            [project]
            name = "dsspeed"
            version = "1.0"
            """
        ).encode(),
        "dsbackend.py": _BACKEND.encode(),
        "src/_speed.c": _C_SOURCE.encode(),
        "PKG-INFO": b"Metadata-Version: 2.1\nName: dsspeed\nVersion: 1.0\n",
    }
    path = out / f"{root}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{root}/{name}")
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return path


def build(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    build_pure(out)
    build_sdist(out)
    return out
