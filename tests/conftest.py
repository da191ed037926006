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
