"""A tokenizer for a random checkpoint of a larger vocabulary than its tokenizer's: ids past the tokenizer's own become
added tokens ``<tN>``, so that every id a random model generates has text, and AIPerf (which counts output tokens by
tokenizing the text it receives) counts each as one token.

Usage: python scripts/tokenizer_ids.py SRC_TOKENIZER_JSON VOCAB OUT_DIR
(OUT_DIR gets tokenizer.json and a tokenizer_config.json for transformers' AutoTokenizer, as AIPerf's --tokenizer
folder; copy its tokenizer.json into a checkpoint folder before `mambatrt bundle` for a bundle that takes text)
"""

import json
import sys
from pathlib import Path


def extend(source: Path, vocab: int, out: Path) -> int:
    """Write ``out``/tokenizer.json (``source`` with added tokens up to ``vocab`` ids); return how many it added."""
    spec = json.loads(source.read_text(encoding="utf-8"))
    taken = set(spec["model"]["vocab"].values()) | {t["id"] for t in spec["added_tokens"]}
    new = [i for i in range(vocab) if i not in taken]
    spec["added_tokens"] += [
        {"id": i, "content": f"<t{i}>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": False}
        for i in new
    ]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    (out / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}\n', encoding="utf-8")
    return len(new)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    added = extend(Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
    print(f"{sys.argv[3]}/tokenizer.json: {added} added tokens")
