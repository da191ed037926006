"""Weights streamed through a build: parameters that view the mapped checkpoint, graphs traced in worker processes
that name the model's tensors, weights.bin written from the model's memory."""

import filecmp
import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from mambatrt.errors import InputError
from mambatrt.export import onnx_export
from mambatrt.export.checkpoint import load_model, load_state_dict
from mambatrt.export.onnx_export import export_onnx


def test_parameters_view_the_checkpoint(tiny_checkpoint):
    """An fp32 model of an fp32 checkpoint holds no copy: every parameter views the one mapped file. At fp16 its
    large matrices are converted copies and its small tensors still view the file."""
    model = load_model(tiny_checkpoint)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    file = (tiny_checkpoint / "model.safetensors").stat().st_size
    assert len(storages) == 1 and next(model.parameters()).untyped_storage().nbytes() == file
    half = load_model(tiny_checkpoint, precision="fp16")
    in_proj, norm = half.backbone.layers[0].mixer.in_proj.weight, half.backbone.layers[0].norm.weight
    assert in_proj.dtype == torch.float16 and norm.dtype == torch.float32
    assert norm.untyped_storage().nbytes() == file and in_proj.untyped_storage().nbytes() == in_proj.nbytes


def test_misaligned_safetensors_tensor_is_read(tmp_path):
    """A tensor whose offset is not a multiple of its element size (one byte of U8 before it) is read as a copy."""
    header = {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
    header["b"] = {"dtype": "F32", "shape": [2, 2], "data_offsets": [1, 17]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    values = torch.tensor([[1.5, -2.0], [3.25, 0.0]])
    (tmp_path / "model.safetensors").write_bytes(
        len(raw).to_bytes(8, "little") + raw + b"\x07" + values.numpy().tobytes()
    )
    tensors = load_state_dict(tmp_path)
    assert tensors["a"].tolist() == [7] and torch.equal(tensors["b"], values)


def test_loaded_tensors_equal_safetensors(checkpoint_factory):
    ckpt = checkpoint_factory("tiny-odd")
    want, got = load_file(str(ckpt / "model.safetensors")), load_state_dict(ckpt)
    assert sorted(want) == sorted(got)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_workers_write_the_same_files(checkpoint_factory, tmp_path):
    """Graphs traced three at once in forked processes: the same files, byte for byte, as traced in this process."""
    ckpt = checkpoint_factory("tiny")
    export_onnx(ckpt, tmp_path / "one", cpu_linear=True, progress=False, workers=1)
    export_onnx(ckpt, tmp_path / "three", cpu_linear=True, progress=False, workers=3)
    names = sorted(os.listdir(tmp_path / "one"))
    assert names == sorted(os.listdir(tmp_path / "three")) and "weights.bin" in names
    differ = [n for n in names if not filecmp.cmp(tmp_path / "one" / n, tmp_path / "three" / n, shallow=False)]
    assert differ == []


@pytest.mark.parametrize("how", ["raises", "killed"])
def test_failed_worker_names_its_graph_and_leaves_nothing(tiny_checkpoint, tmp_path, monkeypatch, how):
    """A tracing process that fails (an exception: its traceback comes back) or dies (killed, as the OOM killer
    does) fails the export with the graph's name; no output appears and no process is left."""
    real = onnx_export.export_graph

    def export_graph(model, contract, flavour):
        if contract.graph == "prefill" and flavour == "portable":
            if how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("a tracing bug")
        return real(model, contract, flavour)

    monkeypatch.setattr(onnx_export, "export_graph", export_graph)  # forked processes inherit it
    want = "a tracing bug" if how == "raises" else "exit code -9"
    with pytest.raises(RuntimeError, match=rf"tracing prefill\.onnx failed in its process: (.|\n)*{want}"):
        export_onnx(tiny_checkpoint, tmp_path / "out", kernels=False, progress=False, workers=2)
    assert list(tmp_path.iterdir()) == []
    assert not _children(), "tracing processes left running"


def _children() -> list[int]:
    """Live child processes of this one (Linux /proc)."""
    me, found = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me and fields[0] != "Z":
            found.append(int(pid))
    return found


def test_bad_worker_count_refused(tiny_checkpoint, tmp_path):
    with pytest.raises(InputError, match="workers must be in 1..4096, got 0"):
        export_onnx(tiny_checkpoint, tmp_path / "x", progress=False, workers=0)
    assert list(tmp_path.iterdir()) == []
