"""Text <-> token ids with the bundle's tokenizer.json (HF ``tokenizers``), and the model's EOS id."""

from __future__ import annotations

import json
from collections.abc import Callable

from mambatrt.errors import BundleError, InputError

from .bundle import Bundle


class Tokenizer:
    """A ``tokenizers.Tokenizer`` loaded from a bundle."""

    def __init__(self, bundle: Bundle, instead: str = "") -> None:
        """``instead``: what the caller's user can do without a tokenizer (e.g. "pass --prompt-ids 1,2,3"), if any."""
        path = bundle.tokenizer_path
        if path is None:
            alternative = f"{instead}, or " if instead else ""
            raise InputError(
                f"{bundle.path} has no tokenizer.json, so text cannot be encoded; {alternative}rebuild the bundle "
                "from a checkpoint that has tokenizer.json"
            )
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for bad files
            raise BundleError(f"{path}: cannot load tokenizer ({exc})") from None
        self.texts: dict[int, str] = {}  # token_text's, at most one per id of the vocabulary

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``."""
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """The text of one token alone, special tokens included (a piece of a character where the token holds
        part of one): what a log-probability is reported for."""
        text = self.texts.get(token)
        if text is None:
            text = self.texts[token] = self.tok.decode([int(token)], skip_special_tokens=False)
        return text

    def stream(self) -> Callable[[int], str]:
        """A decoder for tokens arriving one at a time: each call returns the text the token completes.

        A character of several bytes can be split across tokens; decoding each token alone would print
        replacement characters, so the text of such a token comes out with the token that completes it.
        """
        from tokenizers.decoders import DecodeStream

        state = DecodeStream(skip_special_tokens=True)
        return lambda token: state.step(self.tok, int(token)) or ""


def eos_id(bundle: Bundle) -> int | None:
    """The model's EOS token id from the bundle's config.json (``eos_token_id``), if any."""
    path = bundle.path / "config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if value is not None else None
