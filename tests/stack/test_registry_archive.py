"""The schema registry's archive is unpacked on every Python runlog supports.

``tarfile``'s ``filter="data"`` exists from Python 3.11.4 on; Debian 12's python3 is 3.11.2,
and a fresh machine's `.ci/run` failed there on the keyword alone. Both paths (with the
filter and without it) unpack files and folders and refuse anything else.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from runlog.errors import StackError
from runlog.stack._registry import _extract


def _archive(path: Path, *members: tarfile.TarInfo, data: bytes = b"jar") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for m in members:
            if m.isfile():
                m.size = len(data)
                tar.addfile(m, io.BytesIO(data))
            else:
                tar.addfile(m)
    return path


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.linkname = kind, link
    if kind == tarfile.DIRTYPE:
        m.mode = 0o755
    return m


@pytest.fixture(params=["with the data filter", "without it (Python < 3.11.4)"])
def python(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param.startswith("without"):
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    return str(request.param)


def test_files_and_folders_are_unpacked(tmp_path: Path, python: str) -> None:
    arc = _archive(
        tmp_path / "a.tar.gz",
        _member("app", tarfile.DIRTYPE),
        _member("app/lib", tarfile.DIRTYPE),
        _member("app/lib/x.jar"),
    )
    out = tmp_path / "out"
    with tarfile.open(arc) as tar:
        _extract(tar, out)
    assert (out / "app/lib/x.jar").read_bytes() == b"jar"


@pytest.mark.parametrize(
    "member",
    [
        _member("../outside.jar"),
        _member("app/../../outside.jar"),
        _member("/tmp/absolute.jar"),
        _member("app/link", tarfile.SYMTYPE, "/etc/passwd"),
        _member("app/hard", tarfile.LNKTYPE, "app/x.jar"),
        _member("app/fifo", tarfile.FIFOTYPE),
    ],
    ids=["parent", "nested parent", "absolute", "symlink", "hard link", "fifo"],
)
def test_anything_else_is_refused_by_name_and_nothing_is_written(
    tmp_path: Path, python: str, member: tarfile.TarInfo
) -> None:
    arc = _archive(tmp_path / "a.tar.gz", _member("app/x.jar"), member)
    out = tmp_path / "deep" / "out"
    with tarfile.open(arc) as tar, pytest.raises(StackError) as err:
        _extract(tar, out)
    assert member.name in str(err.value)
    assert not out.exists()
    assert not (tmp_path / "deep" / "outside.jar").exists()
    assert not (tmp_path / "outside.jar").exists()
