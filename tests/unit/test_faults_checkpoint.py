"""Disk full while writing a checkpoint (issue 15, item 3): the previous checkpoint stays the
latest and loadable, no half-written folder is left, and the next save works once space is back.

The disk is a real, small tmpfs mounted for the test (needs the right to mount: root in a
container with CAP_SYS_ADMIN, as on this project's machines). Where mounting is refused the same
assertions run with the write failing through a test double (the only fault we cannot cause).
"""

from __future__ import annotations

import errno
import os
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

from areal_env.trainer import checkpoint as ckpt


def _tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg)


def _save(root: Path, step: int, model, opt) -> Path:
    return ckpt.save_checkpoint(
        root,
        step,
        model=model,
        tokenizer=None,
        optimizer=opt,
        trainer_state={"version": step, "data": {"epoch": 0, "batch_index": step}},
        keep_last=2,
    )


def _checkpoint_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MiB tmpfs; skipped where mounting is not allowed."""
    mnt = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _assert_previous_kept(root: Path, model_before: dict, previous: str) -> None:
    assert (root / "latest").read_text().strip() == previous
    assert ckpt.latest_checkpoint(root).name == previous
    assert not [p for p in root.iterdir() if p.name.startswith(".step_")], "temp folder left"
    fresh = _tiny_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)  # make sure the load really overwrites
    state = ckpt.restore_checkpoint(root / previous, model=fresh, optimizer=None)
    assert state["step"] == int(previous.split("_")[1])
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, model_before[k]), k


def test_disk_full_on_a_real_small_filesystem(small_disk):
    root = small_disk / "ckpts"
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = _save(root, 1, model, opt)
    size = _checkpoint_bytes(first)
    weights_at_1 = {k: v.clone() for k, v in model.state_dict().items()}
    # fill the disk so that less than one checkpoint fits
    st = os.statvfs(small_disk)
    free = st.f_bavail * st.f_frsize
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * max(0, free - size // 2))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # a later step's weights
    with pytest.raises(ckpt.CheckpointWriteError) as err:
        _save(root, 2, model, opt)
    # torch's writers report a full disk in their own words (safetensors: "No space left on
    # device"; torch.save inside DCP: "unexpected pos"): one error type, the cause kept
    assert "the previous checkpoint stays the latest" in str(err.value)
    assert err.value.__cause__ is not None
    _assert_previous_kept(root, weights_at_1, "step_1")
    # space comes back: the next save succeeds and becomes the latest
    filler.unlink()
    _save(root, 3, model, opt)
    assert ckpt.latest_checkpoint(root).name == "step_3"


@pytest.mark.parametrize("fail_on", ["rng_state", "pointer"])
def test_disk_full_through_a_test_double(tmp_path, monkeypatch, fail_on):
    """Where no small file system can be mounted: the write fails with ENOSPC part-way."""
    root = tmp_path / "ckpts"
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _save(root, 1, model, opt)
    weights_at_1 = {k: v.clone() for k, v in model.state_dict().items()}
    full = OSError(errno.ENOSPC, "No space left on device")
    if fail_on == "rng_state":
        real_save = torch.save

        def save(obj, f, *a, **kw):
            if str(f).endswith(ckpt.RNG_FILE):
                raise full
            return real_save(obj, f, *a, **kw)

        monkeypatch.setattr(ckpt.torch, "save", save)
    else:  # the checkpoint folder is complete but the pointer cannot be written
        real_write = Path.write_text

        def write_text(self, *a, **kw):
            if self.name == f".{ckpt.LATEST}.tmp":
                raise full
            return real_write(self, *a, **kw)

        monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(ckpt.CheckpointWriteError) as err:
        _save(root, 2, model, opt)
    assert err.value.errno == errno.ENOSPC
    monkeypatch.undo()
    if fail_on == "rng_state":
        _assert_previous_kept(root, weights_at_1, "step_1")
    else:
        # the pointer still names step_1, which is complete and loadable
        assert (root / "latest").read_text().strip() == "step_1"
        assert ckpt.latest_checkpoint(root).name == "step_1"
