"""Bundles of manifest schema 1 (unbatched graphs, built before the batch axis) keep working in every command."""

import json
import shutil
import threading
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from mambatrt.compile.bundle import build_bundle
from mambatrt.runtime.bundle import load_bundle
from mambatrt.runtime.engine import Engine, EngineConfig, Sampling
from mambatrt.runtime.runners.ort.cpu import OrtCpuRunner
from mambatrt.testing import ReferenceLoop, hf_greedy

DATA = Path(__file__).resolve().parents[1] / "data" / "schema1"


@pytest.fixture(scope="module")
def old(tmp_path_factory):
    """A copy of the shipped schema-1 bundle (tests must not write into the repository)."""
    path = tmp_path_factory.mktemp("old") / "bundle"
    shutil.copytree(DATA / "bundle", path)
    return path


@pytest.fixture(scope="module")
def new(tmp_path_factory):
    return build_bundle(DATA / "checkpoint", tmp_path_factory.mktemp("new") / "bundle", plans="none", quiet=True)


def test_old_bundle_loads_as_batch_of_one(old):
    bundle = load_bundle(old)
    assert bundle.manifest.schema_version == 1 and not bundle.manifest.batched and bundle.manifest.max_batch == 1
    assert json.loads((old / "manifest.json").read_text())["schema_version"] == 1


@pytest.mark.parametrize("prompt_len", [1, 63, 64, 65, 130])
def test_old_and_new_schema_give_the_same_tokens(old, new, prompt_len):
    prompt = np.random.default_rng(prompt_len).integers(0, 203, prompt_len).tolist()
    got = {}
    for name, path in (("old", old), ("new", new)):
        for token_by_token in (False, True):
            gen = ReferenceLoop(OrtCpuRunner(load_bundle(path)), token_by_token=token_by_token)
            got[name, token_by_token] = gen.generate(prompt, Sampling(max_new_tokens=10, stop_on_eos=False))
    want = hf_greedy(DATA / "checkpoint", prompt, 10)
    print(got, want)
    assert all(tokens == want for tokens in got.values())


def test_every_command_runs_the_old_bundle(old, new, cli, tmp_path):
    code, out, err = cli("run", old, "--prompt-ids", "5,6,7", "--max-new-tokens", "6", "--ignore-eos", "--json")
    assert code == 0, err
    code2, out2, _ = cli("run", new, "--prompt-ids", "5,6,7", "--max-new-tokens", "6", "--ignore-eos", "--json")
    assert json.loads(out)["tokens"] == json.loads(out2)["tokens"]
    state = tmp_path / "s.npz"
    assert cli("run", old, "--prompt-ids", "5,6", "--save-state", state)[0] == 0
    assert cli("run", old, "--prompt-ids", "7", "--load-state", state)[0] == 0
    code, out, err = cli("bench", old, "--prompt-lengths", "3,70", "--repeat", "1", "--new-tokens", "2", "--json")
    assert code == 0 and [r["prompt_len"] for r in json.loads(out)["results"]] == [3, 70], err
    code, out, err = cli("compare", old, "--checkpoint", DATA / "checkpoint")
    print(out, err)
    assert code == 0 and out.count("PASS") == 2


def test_schema2_bundle_prefills_one_prompt_per_launch(tmp_path):
    """A schema-2 bundle (prefill graphs of one sequence, no max_prefill_batch) is read with prefill batch 1, and the
    serving engine stages one prompt at a time on it."""
    path = build_bundle(DATA / "checkpoint", tmp_path / "b2", plans="none", kernels="none", quiet=True,
                        max_prefill_batch=1)  # fmt: skip
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["max_prefill_batch"] == 1
    manifest["schema_version"] = 2  # the portable graphs are the same in schemas 2 to 4
    del manifest["max_prefill_batch"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    bundle = load_bundle(path)
    assert bundle.manifest.schema_version == 2 and bundle.manifest.max_prefill_batch == 1
    assert all(bundle.prefill_batch(f) == 1 for f in bundle.flavours)
    prompts = [np.random.default_rng(n).integers(0, 203, n).tolist() for n in (70, 70, 3)]
    want = [
        ReferenceLoop(OrtCpuRunner(bundle)).generate(p, Sampling(max_new_tokens=6, stop_on_eos=False)) for p in prompts
    ]
    for flavour in bundle.flavours:
        engine = Engine(OrtCpuRunner(bundle, flavour), EngineConfig(max_batch=3))
        assert engine.pool.staging_rows == 1 and engine.scheduler.prefill_rows == bundle.max_prefill_rows
        got = _serve(engine, prompts)
        print(flavour, got, want)
        assert got == want


def _serve(engine, prompts: list[list[int]], new_tokens: int = 6) -> list[list[int]]:
    """Each prompt's greedy tokens, all submitted at once to ``engine`` (started and stopped here)."""
    from mambatrt.runtime.engine import Request

    got, ended = {i: [] for i in range(len(prompts))}, threading.Semaphore(0)

    def emit(event, tokens, ended):
        if event.token is not None:
            tokens.append(event.token)
        if event.finish_reason is not None:
            ended.release()

    engine.start()
    try:
        for i, p in enumerate(prompts):
            sampling = Sampling(max_new_tokens=new_tokens, stop_on_eos=False)
            engine.submit(Request(p, sampling, partial(emit, tokens=got[i], ended=ended)))
        assert all(ended.acquire(timeout=60) for _ in prompts)
    finally:
        engine.stop()
    return [got[i] for i in range(len(prompts))]
