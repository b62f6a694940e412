"""A damaged checkpoint is refused with an error naming the file and the damage; a failed save leaves nothing.

:func:`dpcourse.ddp.checkpoint.save_checkpoint` writes through
:func:`~dpcourse.ddp.checkpoint.write_checkpoint_file` and
:func:`~dpcourse.ddp.checkpoint.load_checkpoint` reads through
:func:`~dpcourse.ddp.checkpoint.read_checkpoint_file`; these tests damage files
the ways disks, copies and crashes do.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from dpcourse.ddp import checkpoint
from dpcourse.ddp.checkpoint import CheckpointError, read_checkpoint_file, write_checkpoint_file

WEIGHT = torch.arange(4096, dtype=torch.float32)


def _saved(tmp_path) -> str:
    path = str(tmp_path / "ckpt.pt")
    write_checkpoint_file(path, {"model": {"weight": WEIGHT.clone()}, "step": 7})
    return path


def test_round_trip(tmp_path):
    state = read_checkpoint_file(_saved(tmp_path))
    assert state["step"] == 7 and torch.equal(state["model"]["weight"], WEIGHT)
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_overwritten_tensor_bytes_are_refused(tmp_path):
    path = _saved(tmp_path)
    data = bytearray(open(path, "rb").read())
    at = data.find(WEIGHT[1000:1016].numpy().tobytes())  # inside the tensor's storage
    assert at > 0
    data[at:at + 8] = bytes(8)  # two floats become 0.0: still a loadable file
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError) as info:
        read_checkpoint_file(path)
    msg = str(info.value)
    assert msg.startswith(f"{path} is damaged: its bytes no longer match the SHA-256 checksum")
    assert "resume from an earlier checkpoint" in msg


def test_cut_short_is_refused(tmp_path):
    path = _saved(tmp_path)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(CheckpointError, match="is damaged: .* of its .* bytes are there") as info:
        read_checkpoint_file(path)
    assert str(info.value).startswith(path)


@pytest.mark.parametrize("content", [b"", b"hello", None])
def test_not_a_checkpoint_is_refused(tmp_path, content):
    path = str(tmp_path / "other.pt")
    if content is None:
        torch.save({"model": {}}, path)  # a plain torch.save file
    else:
        open(path, "wb").write(content)
    with pytest.raises(CheckpointError, match="is not a checkpoint written by save_checkpoint"):
        read_checkpoint_file(path)


def test_missing_file_names_an_interrupted_save(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    with pytest.raises(CheckpointError, match="no checkpoint at .*ckpt.pt. Check the path"):
        read_checkpoint_file(path)
    open(path + ".tmp", "wb").write(b"half")
    with pytest.raises(CheckpointError, match="ckpt.pt.tmp exists: a save was interrupted"):
        read_checkpoint_file(path)


class Unpicklable:
    def __reduce__(self):
        raise pickle.PicklingError("not this one")


def test_failed_save_leaves_the_previous_checkpoint_and_no_temporary_file(tmp_path, monkeypatch):
    path = _saved(tmp_path)
    with pytest.raises(pickle.PicklingError):
        write_checkpoint_file(path, {"extra": Unpicklable()})
    assert os.listdir(tmp_path) == ["ckpt.pt"]

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_checkpoint_file(path, {"model": {"weight": -WEIGHT}, "step": 8})
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # the temporary file was removed
    assert read_checkpoint_file(path)["step"] == 7
