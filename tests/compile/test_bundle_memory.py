"""Bundle builds hold the weights one tensor at a time: peak memory against the checkpoint's weight bytes."""

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="pages of a mapped file are handed back with Linux's madvise")
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_build_peak_memory_below_the_weights(tmp_path, precision):
    """`mambatrt bundle` of 1.6 GB of fp32 weights (4 layers of width 4096) peaks below those bytes, as its last
    line says: the parameters view the mapped checkpoint and each is resident only while weights.bin takes it. A
    build holding one copy of the weights needs them plus the python and torch baseline (~0.3 GB), the loader that
    copied them twice 2x plus that. int8 quantizes each matrix a block of rows at a time and hands its source's
    pages back once its rows are made, so it holds the int8 rows (a quarter of the bytes) and one source
    (quantizing every matrix before handing any back would hold the weights, their rows and a matrix's float32
    temporaries: 1.6x the weights)."""
    from mambatrt.testing import write_hf_checkpoint

    ckpt = write_hf_checkpoint(tmp_path / "ck", hidden_size=4096, num_hidden_layers=4, vocab_size=1000)
    weights = (ckpt / "model.safetensors").stat().st_size
    out = tmp_path / "b"
    cmd = [sys.executable, "-m", "mambatrt.cli", "bundle", str(ckpt), "--out", str(out), "--layout", "single"]
    cmd += ["--precision", precision]
    done = subprocess.run([*cmd, "--plans", "none", "--kernels", "none", "-q"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    print(f"{line}\ncheckpoint weights {weights / 2**30:.2f} GiB")
    peak = float(re.search(r"peak memory ([0-9.]+) GiB", line).group(1)) * 2**30
    stored = weights if precision == "fp32" else weights // 4  # int8: a byte a weight (and a scale a row)
    assert (out / "weights.bin").stat().st_size >= stored - 2**20
    assert peak < weights
