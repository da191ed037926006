"""Test support shared by the test suite and the benchmarks: tiny model registry, checkpoint writers, comparisons.

Checkpoints are real: ``transformers.MambaForCausalLM(...).save_pretrained(dir)`` with random weights.
Importing this module needs torch and transformers (the test extra), never at runtime.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# Tiny models by name: transformers MambaConfig keyword arguments. Sizes are odd on purpose.
TINY_CONFIGS: dict[str, dict] = {
    "tiny": dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, state_size=16, conv_kernel=4, time_step_rank=4),
    "tiny-n8-k3": dict(vocab_size=101, hidden_size=24, num_hidden_layers=1, state_size=8, conv_kernel=3, expand=2),
    "tiny-odd": dict(vocab_size=203, hidden_size=40, num_hidden_layers=3, state_size=12, conv_kernel=4, expand=3),
    "tiny-bias": dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, use_bias=True, tie_word_embeddings=False),
    # a dt rank as large as mamba-2.8b's (160) is: the CUDA chunk kernel stages more than 48 KiB of shared memory
    "tiny-rank": dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, state_size=16, time_step_rank=120),
    # dt ranks that are multiples of 16: the CUDA scan step's dt inputs as float4s (four lanes of a multiple of 4),
    # their count fixed at compile time for mamba-130m's 48, counted at run time for 32
    "tiny-r32": dict(vocab_size=64, hidden_size=24, num_hidden_layers=2, state_size=16, time_step_rank=32),
    "tiny-r48": dict(vocab_size=64, hidden_size=24, num_hidden_layers=1, state_size=16, time_step_rank=48),
    # mamba-2.8b's dt rank at 1024 channels: the CUDA scan's dt products as a GEMM on CUTLASS's 64 x 64 tiles
    "tiny-r160": dict(vocab_size=64, hidden_size=512, num_hidden_layers=1, state_size=16, time_step_rank=160),
    # 320 channels: the CPU kernels' tasks are five blocks of the scan's 64 channels and a block and a part of the
    # conv's 256, with the AVX-512 build's passes for N = 16
    "tiny-wide": dict(vocab_size=64, hidden_size=160, num_hidden_layers=2, state_size=16, conv_kernel=4, expand=2),
    # many layers: a bundle build that lasts seconds, long enough to be interrupted inside its export
    "tiny-deep": dict(vocab_size=64, hidden_size=16, num_hidden_layers=12, state_size=4, conv_kernel=4, expand=2),
}
# mamba-130m shapes (random weights), for export/compile figures and benchmarks.
MAMBA_130M = dict(vocab_size=50280, hidden_size=768, num_hidden_layers=24, state_size=16, conv_kernel=4, expand=2)
MAMBA_2_8B = dict(vocab_size=50280, hidden_size=2560, num_hidden_layers=64, state_size=16, conv_kernel=4, expand=2)


def write_hf_checkpoint(directory: str | Path, seed: int = 0, dtype: str | None = None, **config_kwargs) -> Path:
    """Write a random ``MambaForCausalLM`` checkpoint (config.json + model.safetensors) and return the directory.

    ``dtype`` ("float16", "bfloat16"): store the weights in that dtype (halves the files of big shapes).
    """
    import torch
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(seed)
    model = MambaForCausalLM(MambaConfig(**config_kwargs))
    _spread_dt_and_weights(model, seed)
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    directory = Path(directory)
    model.save_pretrained(directory)
    return directory


def _spread_dt_and_weights(model, seed: int) -> None:
    """Random-init HF Mamba models have near-identical logits; give A_log and D some spread for sharper tests."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.backbone.layers:
            mixer = layer.mixer
            mixer.A_log.add_(torch.rand(mixer.A_log.shape, generator=g) * 0.5)
            mixer.D.copy_(torch.rand(mixer.D.shape, generator=g) + 0.5)
            layer.norm.weight.copy_(torch.rand(layer.norm.weight.shape, generator=g) + 0.5)


def write_original_checkpoint(hf_dir: str | Path, directory: str | Path) -> Path:
    """Rewrite an HF checkpoint in the original state-spaces form (renamed keys, original config, .bin)."""
    import torch
    from safetensors.torch import load_file

    hf_dir, directory = Path(hf_dir), Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    renamed = {k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in tensors.items()}
    renamed.pop("lm_head.weight", None)
    multiple = 8
    vocab = hf["vocab_size"]
    padded = (vocab + multiple - 1) // multiple * multiple
    emb = renamed["backbone.embedding.weight"]
    renamed["backbone.embedding.weight"] = torch.cat([emb, torch.zeros(padded - vocab, emb.shape[1])])
    torch.save(renamed, directory / "pytorch_model.bin")
    original = {
        "d_model": hf["hidden_size"],
        "n_layer": hf["num_hidden_layers"],
        "vocab_size": vocab,
        "ssm_cfg": {"d_state": hf["state_size"], "d_conv": hf["conv_kernel"], "expand": hf["expand"]},
        "rms_norm": True,
        "residual_in_fp32": True,
        "fused_add_norm": True,
        "pad_vocab_size_multiple": multiple,
        "tie_embeddings": True,
    }
    if hf.get("time_step_rank") not in (None, "auto"):
        original["ssm_cfg"]["dt_rank"] = hf["time_step_rank"]
    (directory / "config.json").write_text(json.dumps(original))
    return directory


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max |expected| (arrays or tensors)."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    scale = max(float(np.abs(e).max()), 1e-30)
    return float(np.abs(a - e).max()) / scale


def assert_close(name: str, actual, expected, rtol: float) -> float:
    """Print the worst relative difference, then assert it is within ``rtol``; returns it."""
    err = rel_err(actual, expected)
    print(f"{name}: worst relative difference {err:.3e} (tolerance {rtol:.1e})")
    assert err <= rtol, f"{name}: relative difference {err:.3e} > {rtol:.1e}"
    return err


# MambaLinear shapes the op tests run: (N, K) of mamba-130m's in_proj, x_proj and out_proj (on the GPU each takes
# another kernel config, in_proj above 16 rows the 2 x 2 tiles), an odd one (K neither a multiple of 32 nor 8), and an
# x_proj of a long K (mamba-2.8b's is 192 x 5120: CUTLASS's GEMMs at many rows, not cuBLAS's, as N is below 512)
LINEAR_SHAPES = ((3072, 768), (80, 1536), (768, 1536), (44, 40), (192, 2560), (192, 5120))


def linear_on_other_kernel(rows: int, n: int, k: int) -> bool:
    """Whether the CUDA kernel of MambaLinear hands a product of ``rows`` x ``n`` x ``k`` to another kernel than its
    own, one that sums K in another order than the row alone: CUTLASS (where the library has it;
    compile/kernels/mamba_linear_cutlass.cuh's ``wins``) or, on sm_90, the cluster kernel or from 65 rows the staged
    kernel (mamba_linear.cuh's ``cluster_wins``, ``staged_wins``)."""
    cluster = 32 <= rows <= 128 and 512 <= n <= 768 and k >= 1024
    return cluster or linear_split(rows, n, k) or (rows >= 16 and (rows * n >= 1 << 17 or rows * n * k >= 1 << 27))


def linear_split(rows: int, n: int, k: int) -> bool:
    """Whether the CUDA kernel of MambaLinear runs a product of ``rows`` x ``n`` x ``k`` as cuBLAS's TF32 GEMMs on
    split operands on sm_90 and newer (compile/kernels/mamba_linear_blas.cuh's ``wins``)."""
    return rows >= 512 and n >= 512 and k % 4 == 0 and n % 4 == 0


def check_mamba_linear(library: str | Path, provider: str, rows: tuple[int, ...] = (1, 7, 64, 100)) -> None:
    """MambaLinear alone (a one-node graph, the weight an initializer) under onnxruntime's ``provider``: x w^T within
    1e-5 of a float64 product at LINEAR_SHAPES and each of ``rows``, and a batch's last row equal bit for bit to that
    row computed alone (its sums do not depend on the batch), or within 1e-5 of it where the CUDA kernel hands the
    batch to CUTLASS, its cluster kernel or cuBLAS, which sum K in another order than the row alone
    (:func:`linear_on_other_kernel`). On CUDA with a device of compute capability 9 or more, the products that
    :func:`linear_split` names ran on cuBLAS's TF32 GEMMs (the library counts them)."""
    import ctypes

    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    split_count = None
    if provider == "CUDAExecutionProvider":
        lib = ctypes.CDLL(str(library))  # the library onnxruntime loads: one copy in the process, one count
        lib.mambatrt_ops_linear_split_products.restype = ctypes.c_int64
        split_count = lib.mambatrt_ops_linear_split_products
    before = split_count() if split_count else 0
    rng = np.random.default_rng(11)
    for n, k in LINEAR_SHAPES:
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        node = helper.make_node("MambaLinear", ["x", "w"], ["y"], domain="mambatrt")
        io = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["rows", d]) for name, d in (("x", k), ("y", n))]
        graph = helper.make_graph([node], "linear", io[:1], io[1:], [numpy_helper.from_array(w, "w")])
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("mambatrt", 1)]
        model = helper.make_model(graph, opset_imports=opsets)
        model.ir_version = 10  # what onnxruntime 1.31 reads (a newer onnx writes a newer IR)
        options = ort.SessionOptions()
        options.register_custom_ops_library(str(library))
        session = ort.InferenceSession(model.SerializeToString(), options, providers=[provider])
        for m in rows:
            x = rng.standard_normal((m, k)).astype(np.float32)
            (y,) = session.run(None, {"x": x})
            want = x.astype(np.float64) @ w.T.astype(np.float64)
            assert_close(f"MambaLinear {provider} {m} x {n} x {k}", y, want, 1e-5)
            (alone,) = session.run(None, {"x": x[-1:]})
            if provider == "CUDAExecutionProvider" and linear_on_other_kernel(m, n, k):
                assert_close(f"{m} x {n} x {k}: the last row alone", alone[0], y[-1], 1e-5)
            else:
                assert np.array_equal(alone[0], y[-1]), f"{m} x {n} x {k}: the last row differs alone"
    if split_count is not None:
        from mambatrt.runtime.runners import cudart

        ran = split_count() - before
        want = sum(linear_split(m, n, k) for n, k in LINEAR_SHAPES for m in rows)
        print(f"products on cuBLAS's TF32 GEMMs (split operands): {ran}, expected {want} on sm_90 and newer")
        assert ran == (want if cudart.compute_major() >= 9 else 0)


def hf_reference(checkpoint_dir: str | Path, token_ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """transformers' MambaForCausalLM on a whole prompt, fp32: last-row logits [V] and states [L,E,K-1], [L,E,N]."""
    import torch
    from transformers import MambaForCausalLM

    model = MambaForCausalLM.from_pretrained(str(checkpoint_dir), torch_dtype=torch.float32).eval()
    ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))[None]  # [1, S]
    with torch.no_grad():
        out = model(ids, use_cache=True)
    cache = out.cache_params if getattr(out, "cache_params", None) is not None else out.past_key_values
    layers = range(model.config.num_hidden_layers)
    if hasattr(cache, "get_conv_state"):  # transformers >= 5
        conv = [cache.get_conv_state(i)[0] for i in layers]
        ssm = [cache.get_recurrent_state(i)[0] for i in layers]
    else:  # transformers 4.x MambaCache
        conv = [cache.conv_states[i][0] for i in layers]
        ssm = [cache.ssm_states[i][0] for i in layers]
    conv = torch.stack(conv)[:, :, 1:]  # HF keeps K columns (the current input too); ours are the K-1 before
    return out.logits[0, -1].numpy(), conv.numpy(), torch.stack(ssm).numpy()


def hf_greedy(checkpoint_dir: str | Path, prompt: list[int], new_tokens: int) -> list[int]:
    """New tokens of ``MambaForCausalLM.generate(do_sample=False)`` (fp32, CPU)."""
    import torch
    from transformers import MambaForCausalLM

    model = MambaForCausalLM.from_pretrained(str(checkpoint_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


class ReferenceLoop:
    """The plainest generation loop on a runner's face, the reference the engine is held to: the prompt (after the
    token generated last, not fed yet) in chunks of the prefill graph's rows (one row on the decode graph of a
    "single" bundle, or ``token_by_token``), then one decode launch per new token, picked by the host's sampler
    with one RNG per call seeded by the sampling's seed."""

    def __init__(self, runner, eos_id: int | None = None, token_by_token: bool = False) -> None:
        self.runner, self.eos_id, self.token_by_token = runner, eos_id, token_by_token
        self.pending: int | None = None  # the last generated token, not fed yet
        self.prefill_launches = 0

    def prefill(self, prompt) -> np.ndarray:
        """Feed ``prompt`` (after any pending token); the last row's logits over the vocabulary."""
        from mambatrt.contract import DECODE, PREFILL

        runner = self.runner
        ids = ([self.pending] if self.pending is not None else []) + [int(t) for t in prompt]
        self.pending = None
        graph = PREFILL if PREFILL in runner.graphs and not self.token_by_token else DECODE
        rows = runner.max_rows[graph]
        self.prefill_launches = 0
        for start in range(0, len(ids), rows):
            logits = runner.run(graph, np.asarray(ids[start : start + rows], np.int64))
            self.prefill_launches += 1
        return logits[: runner.config.vocab_size]

    def generate(self, prompt, sampling, reset: bool = True) -> list[int]:
        """The tokens for ``prompt``; ``reset`` False continues from the last call's state."""
        from mambatrt.contract import DECODE
        from mambatrt.runtime.engine.sampling import sample_token

        if reset:
            self.runner.reset()
            self.pending = None
        logits = self.prefill(prompt)
        rng = np.random.default_rng(sampling.seed)
        tokens: list[int] = []
        while len(tokens) < sampling.max_new_tokens:
            token = sample_token(logits, sampling, rng, tokens)
            tokens.append(token)
            if sampling.stop_on_eos and self.eos_id is not None and token == self.eos_id:
                break
            if len(tokens) < sampling.max_new_tokens:
                logits = self.runner.run(DECODE, [token])[: self.runner.config.vocab_size]
        if tokens:
            self.pending = tokens[-1]
        return tokens
