"""The runtime runs a bundle in a fresh environment with numpy + onnxruntime only: no torch, no transformers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mambatrt.runtime.bundle import load_bundle
from mambatrt.runtime.engine import Sampling
from mambatrt.runtime.runners.ort.cpu import OrtCpuRunner
from mambatrt.testing import ReferenceLoop

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
from mambatrt.cli import main
code = main(sys.argv[1:])
# the CLI registers every subcommand (argparse only, and the pure-Python modules that hold `bundle`'s choices of
# --plans and --kernels); nothing else of export/compile may be imported
light = {"mambatrt.compile", "mambatrt.compile.builders", "mambatrt.compile.kernels"}
stages = [m for m in sys.modules if m.startswith(("mambatrt.export", "mambatrt.compile")) and m not in light]
heavy = sorted(stages + [m for m in ("torch", "transformers", "onnx", "polygraphy") if m in sys.modules])
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


@pytest.mark.slow
def test_bundle_runs_without_torch(bundle_factory, tmp_path):
    bundle = bundle_factory("tiny", "split", plans="none")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + ["numpy", "onnxruntime", "tokenizers", "tqdm"], check=True)
    subprocess.run(pip + ["--no-deps", str(REPO)], check=True, cwd=tmp_path)
    no_torch = subprocess.run([str(py), "-c", "import torch"], capture_output=True, cwd=tmp_path)
    assert no_torch.returncode != 0, "the fresh environment must not have torch"

    argv = ["run", str(bundle), "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "8", "--json"]
    proc = subprocess.run([str(py), "-c", PROBE, *argv], capture_output=True, text=True, cwd=tmp_path)
    print(proc.stderr[-2000:])
    probe = json.loads(proc.stderr.strip().splitlines()[-1])
    assert probe == {"code": 0, "heavy": []}
    got = json.loads(proc.stdout)
    want = ReferenceLoop(OrtCpuRunner(load_bundle(bundle))).generate([1, 2, 3, 4, 5], Sampling(max_new_tokens=8))
    assert got["tokens"] == want
