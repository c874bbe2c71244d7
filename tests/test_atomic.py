"""Files written whole or not at all."""

import pytest

from pipedp.atomic import replace_atomically, write_text


def test_write_text_replaces_the_file(tmp_path):
    path = tmp_path / "f.txt"
    write_text(path, "one")
    write_text(path, "two")
    assert path.read_text() == "two" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="boom"):
        with replace_atomically(path) as f:
            f.write(b"half")
            raise RuntimeError("boom")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_a_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist; create it first"):
        write_text(tmp_path / "no" / "f.txt", "x")


def test_a_new_file_gets_the_umask_default_and_a_replaced_one_keeps_its_mode(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        write_text(tmp_path / "new.txt", "x")
        assert (tmp_path / "new.txt").stat().st_mode & 0o777 == 0o644
        (tmp_path / "new.txt").chmod(0o600)
        write_text(tmp_path / "new.txt", "y")
        assert (tmp_path / "new.txt").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)
