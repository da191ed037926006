"""Train mambatrt's small default Mamba-1 model with the project's own model code (``mambatrt.export.model``).

Reproducible: fixed seeds, a deterministic corpus (training/corpus.py) and tokenizer. Writes an HF-format
checkpoint (config.json, model.safetensors in fp16, tokenizer.json) that ``mambatrt bundle`` and transformers'
``MambaForCausalLM`` both load, plus train_log.json with the settings, timings and held-out perplexity.

    python training/corpus.py /usr/share/info/python3.11.info.gz /tmp/corpus
    python training/train_default.py --corpus /tmp/corpus --out models/default [--device cuda] [--minutes 20]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mambatrt.config import MambaConfig
from mambatrt.export.model import MambaLM

EOS = "<|endoftext|>"


def train_tokenizer(train_txt: Path, vocab: int):
    """Byte-level BPE (HF tokenizers) on the training split; id 0 is the end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train([str(train_txt)], trainer)
    return tok


def encode_file(tok, path: Path) -> np.ndarray:
    """One paragraph per line, each followed by the end-of-text token, as one int64 stream."""
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    ids = []
    for enc in tok.encode_batch(lines):
        ids.extend(enc.ids)
        ids.append(0)
    return np.asarray(ids, dtype=np.int64)


def hf_init(config: MambaConfig, seed: int) -> dict[str, torch.Tensor]:
    """The standard Mamba initialization (A_log, dt bias, scaled out_proj), taken from transformers."""
    from transformers import MambaConfig as HFConfig
    from transformers import MambaForCausalLM

    torch.manual_seed(seed)
    hf = MambaForCausalLM(hf_config(config, HFConfig))
    return hf.state_dict()


def hf_config(config: MambaConfig, cls=None):
    """The transformers config (object when ``cls`` is given, else a dict for config.json)."""
    d = dict(
        model_type="mamba",
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        num_hidden_layers=config.n_layer,
        intermediate_size=config.d_inner,
        state_size=config.d_state,
        conv_kernel=config.d_conv,
        expand=config.expand,
        time_step_rank=config.dt_rank,
        use_bias=config.proj_bias,
        use_conv_bias=config.conv_bias,
        layer_norm_epsilon=config.norm_eps,
        tie_word_embeddings=True,
        residual_in_fp32=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    if cls is None:
        return {**d, "architectures": ["MambaForCausalLM"], "torch_dtype": "float16"}
    d.pop("model_type")
    return cls(**d)


def batch_loss(model: MambaLM, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of [B, T+1] windows, from zero states (vmap over the batch)."""
    conv0, ssm0 = model.zero_states()

    def rows(ids):
        x, _, _ = model.backbone_rows(ids, conv0, ssm0, "hillis-steele")  # [T, D]
        return model.head(model.backbone.norm_f(x))  # [T, Vp]

    logits = torch.vmap(rows)(batch[:, :-1])  # [B, T, Vp]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def perplexity(model: MambaLM, stream: np.ndarray, seq: int, batch: int, device: str) -> float:
    """Token perplexity over consecutive non-overlapping windows of the stream."""
    n = (len(stream) - 1) // seq
    windows = torch.as_tensor(np.stack([stream[i * seq : i * seq + seq + 1] for i in range(n)]))
    total = 0.0
    for i in range(0, n, batch):
        chunk = windows[i : i + batch].to(device)
        total += batch_loss(model, chunk).item() * len(chunk)
    return math.exp(total / n)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, required=True, help="directory with train.txt and heldout.txt")
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary (default: %(default)s)")
    p.add_argument("--d-model", type=int, default=256, help="model width D (default: %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="layers L (default: %(default)s)")
    p.add_argument("--seq", type=int, default=128, help="training window (default: %(default)s)")
    p.add_argument("--batch", type=int, default=16, help="windows per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default: %(default)s)")
    p.add_argument("--steps", type=int, default=100000, help="step limit (default: %(default)s)")
    p.add_argument("--minutes", type=float, default=20.0, help="time limit (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed (default: %(default)s)")
    return p.parse_args()


def train(model: MambaLM, train_ids: np.ndarray, args: argparse.Namespace) -> tuple[int, float, list[dict]]:
    """AdamW with warm-up and a cosine schedule over the step or time budget, whichever ends first; returns (steps,
    seconds, the loss log)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "conv1d" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "conv1d" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    rng = np.random.default_rng(args.seed)
    start, step, log = time.perf_counter(), 0, []
    budget = args.minutes * 60
    warmup = 100
    while step < args.steps and (elapsed := time.perf_counter() - start) < budget:
        frac = max(elapsed / budget, step / args.steps)  # progress through the run, by time or by steps
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = rng.integers(0, len(train_ids) - args.seq - 1, args.batch)
        batch = torch.as_tensor(np.stack([train_ids[s : s + args.seq + 1] for s in starts])).to(args.device)
        loss = batch_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 25 == 0:
            log.append({"step": step, "seconds": round(elapsed, 1), "loss": round(loss.item(), 4)})
            print(f"step {step} {elapsed:.0f}s loss {loss.item():.3f} lr {lr:.2e}", flush=True)
    return step, time.perf_counter() - start, log


def main() -> None:
    """Train, evaluate, save."""
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = False
    args.out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(args.corpus / "train.txt", args.vocab)
    tok.save(str(args.out / "tokenizer.json"))
    train_ids = encode_file(tok, args.corpus / "train.txt")
    held = encode_file(tok, args.corpus / "heldout.txt")
    config = MambaConfig(d_model=args.d_model, n_layer=args.layers, vocab_size=tok.get_vocab_size())
    model = MambaLM(config, max_rows=args.seq)
    model.load_state_dict({k: v for k, v in hf_init(config, args.seed).items() if k != "lm_head.weight"})
    model.to(args.device).train()
    params = sum(p.numel() for p in model.parameters())
    print(f"{params} parameters; {len(train_ids)} training tokens, {len(held)} held-out tokens", flush=True)
    step, train_seconds, log = train(model, train_ids, args)
    model.eval()
    held_ppl = perplexity(model, held, args.seq, args.batch, args.device)
    print(f"held-out perplexity {held_ppl:.2f} after {step} steps, {train_seconds:.0f} s", flush=True)

    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    counts = np.bincount(train_ids, minlength=config.vocab_size).tolist()
    (args.out / "unigram_counts.json").write_text(json.dumps(counts) + "\n")
    shutil.copy(args.corpus / "cloze.jsonl", args.out / "cloze.jsonl")
    (args.out / "config.json").write_text(json.dumps(hf_config(config), indent=2) + "\n")
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    record = {
        "parameters": params,
        "steps": step,
        "train_seconds": round(train_seconds, 1),
        "device": device_name,
        "train_tokens": int(len(train_ids)),
        "heldout_tokens": int(len(held)),
        "tokens_seen": step * args.batch * args.seq,
        "heldout_perplexity": round(held_ppl, 3),
        "args": {k: str(v) for k, v in vars(args).items()},
        "log": log,
    }
    (args.out / "train_log.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
