"""Shared fixtures: random HF checkpoints written per test session (real save_pretrained files)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """make(name) -> directory of a random HF checkpoint from mambatrt.testing.TINY_CONFIGS (cached per session)."""
    from mambatrt.testing import TINY_CONFIGS, write_hf_checkpoint

    made = {}

    def make(name: str = "tiny", seed: int = 0):
        key = (name, seed)
        if key not in made:
            made[key] = write_hf_checkpoint(tmp_path_factory.mktemp(f"ckpt-{name}"), seed=seed, **TINY_CONFIGS[name])
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoint_factory):
    """The default tiny HF checkpoint."""
    return checkpoint_factory("tiny")


@pytest.fixture(scope="session")
def bundle_factory(checkpoint_factory, tmp_path_factory):
    """make(name, layout, precision, plans) -> bundle directory, built once per session with `build_bundle`."""
    from mambatrt.compile.bundle import build_bundle

    made = {}

    def make(name="tiny", layout="split", precision="fp32", plans="auto"):
        key = (name, layout, precision, plans)
        if key not in made:
            out = tmp_path_factory.mktemp("bundles") / f"{name}-{layout}-{precision}-{plans}"
            made[key] = build_bundle(
                checkpoint_factory(name), out, precision=precision, layout=layout, plans=plans, quiet=True
            )
        return made[key]

    return make


@pytest.fixture
def cli(capsys):
    """call(*argv) -> (exit code, stdout, stderr) of the mambatrt command, run in-process."""
    from mambatrt.cli import main

    def call(*argv):
        code = main([str(a) for a in argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return call


@pytest.fixture(scope="session")
def default_bundle(tmp_path_factory):
    """The shipped default model's split fp32 bundle (ONNX only): a trained model, whose greedy tokens follow its
    input (a random tiny model's mostly repeat one token, whatever it is fed)."""
    from pathlib import Path

    from mambatrt.compile.bundle import build_bundle
    from mambatrt.runtime.bundle import load_bundle

    model = Path(__file__).resolve().parents[1] / "models" / "default"
    out = tmp_path_factory.mktemp("default") / "split"
    return load_bundle(build_bundle(model, out, plans="none", quiet=True))
