"""Checkpoint loading: HF safetensors, sharded safetensors, original .bin; clear errors for bad files."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mambatrt.errors import CheckpointError, ConfigError
from mambatrt.export.checkpoint import load_model
from mambatrt.testing import assert_close, write_original_checkpoint

IDS = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])


def _logits(ckpt):
    model = load_model(ckpt)
    return model.prefill(IDS)[0][0, : model.config.vocab_size]


def test_original_checkpoint_matches_hf(checkpoint_factory, tmp_path):
    hf_dir = checkpoint_factory("tiny-n8-k3")  # vocab 101: padded to 104 in the original file
    orig = write_original_checkpoint(hf_dir, tmp_path / "orig")
    assert (orig / "pytorch_model.bin").is_file() and not (orig / "model.safetensors").exists()
    assert load_model(orig).config.vocab_padded == 104
    assert_close("original vs HF logits", _logits(orig), _logits(hf_dir), 0.0)


def test_sharded_safetensors(tiny_checkpoint, tmp_path):
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    keys = sorted(tensors)
    half = len(keys) // 2
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(tiny_checkpoint / "config.json", out)
    weight_map = {}
    for i, part in enumerate((keys[:half], keys[half:])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(out / name))
        weight_map.update({k: name for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert_close("sharded vs single file", _logits(out), _logits(tiny_checkpoint), 0.0)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_weights_file(tiny_checkpoint, tmp_path):
    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights found; expected one of model.safetensors"):
        load_model(ckpt)


def test_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_model(tmp_path / "nowhere")


def test_truncated_safetensors_names_the_file(tiny_checkpoint, tmp_path):
    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read safetensors file"):
        load_model(ckpt)


def test_corrupt_bin_names_the_file(checkpoint_factory, tmp_path):
    orig = write_original_checkpoint(checkpoint_factory("tiny"), tmp_path / "orig")
    (orig / "pytorch_model.bin").write_bytes(b"not a zip archive")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: cannot read PyTorch weights"):
        load_model(orig)


def test_missing_unexpected_and_misshaped_tensors_are_named(tiny_checkpoint, tmp_path):
    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["backbone.layers.1.mixer.D"]
    tensors["backbone.layers.0.mixer.extra"] = torch.zeros(2)
    tensors["backbone.layers.0.mixer.A_log"] = torch.zeros(3, 3)
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        load_model(ckpt)
    message = str(info.value)
    print(message)
    assert "missing tensors ['backbone.layers.1.mixer.D']" in message
    assert "unexpected tensors ['backbone.layers.0.mixer.extra']" in message
    assert "backbone.layers.0.mixer.A_log: checkpoint (3, 3)" in message


def test_corrupt_config(tiny_checkpoint, tmp_path):
    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    (ckpt / "config.json").write_text("{ not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        load_model(ckpt)
