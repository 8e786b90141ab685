"""A checkpoint's identity is its content: a copy at another path has the same one; other weights
of the same architecture, or another config, have another; it is memoised on the files' stats."""

from __future__ import annotations

import json
import shutil

import pytest

from deltaserve.model import identity
from deltaserve.model.identity import IdentityError, checkpoint_identity
from deltaserve.tiny import make_tiny


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("id") / "k3", "kimi_k3", "tiny", seed=3)


def test_a_copy_elsewhere_has_the_same_identity(ckpt, tmp_path):
    copy = shutil.copytree(ckpt, tmp_path / "elsewhere" / "renamed")
    assert checkpoint_identity(copy) == checkpoint_identity(ckpt)
    assert len(checkpoint_identity(ckpt)) == 64


def test_other_weights_or_config_differ(ckpt, tmp_path):
    other = make_tiny(tmp_path / "seed4", "kimi_k3", "tiny", seed=4)
    assert checkpoint_identity(other) != checkpoint_identity(ckpt)
    edited = shutil.copytree(ckpt, tmp_path / "edited")
    cfg = json.loads((edited / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-3
    (edited / "config.json").write_text(json.dumps(cfg))
    assert checkpoint_identity(edited) != checkpoint_identity(ckpt)


def test_memoised_until_a_file_changes(ckpt, tmp_path, monkeypatch):
    copy = shutil.copytree(ckpt, tmp_path / "memo")
    first = checkpoint_identity(copy)
    reads = []
    monkeypatch.setattr(identity, "_file_digest", lambda h, p: reads.append(p))
    assert checkpoint_identity(copy) == first and reads == []
    (copy / "config.json").write_text((copy / "config.json").read_text() + "\n")  # same content, new stat
    checkpoint_identity(copy)
    assert reads


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(IdentityError, match="config.json"):
        checkpoint_identity(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\x01")
    with pytest.raises(IdentityError, match="not a safetensors"):
        checkpoint_identity(tmp_path)


def test_a_change_to_any_tensor_over_a_window_spacing_changes_it(ckpt, tmp_path):
    """A fine-tune rewriting one tensor (headers and config unchanged) is another model, for every
    tensor at least 2/WINDOWS of its file (it covers a window); smaller ones may go unseen."""
    from safetensors.torch import load_file, save_file

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    seen = 0
    for name in sorted(index):
        if seen == 3:
            break
        size = (ckpt / index[name]).stat().st_size
        tensors = load_file(ckpt / index[name])
        if tensors[name].numel() * tensors[name].element_size() < 2 * size // identity.WINDOWS:
            continue
        edited = shutil.copytree(ckpt, tmp_path / f"tuned{seen}")
        tensors[name] = tensors[name] + 1
        save_file(tensors, edited / index[name], metadata={"format": "pt"})
        assert checkpoint_identity(edited) != checkpoint_identity(ckpt), name
        seen += 1
    assert seen >= 3
