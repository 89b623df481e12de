"""Write a tiny word-level tokenizer next to a tiny checkpoint, so text-serving paths (the OpenAI server) work.

The vocabulary is ``<unk>``, ``<s>``, ``</s>`` (ids 0, 1, 2: the Llama config's bos/eos ids)
and ``t3`` … ``t{vocab_size-1}``; text is split on whitespace, so ``"t5 t17"`` is ``[5, 17]``
and any token id decodes to a readable word. Nothing is downloaded (built with ``tokenizers``).

    python -m harness.tiny_tokenizer MODEL_DIR [--vocab-size 512]

Limits: a test fixture, not a language tokenizer — unknown words map to ``<unk>``; no chat template.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIALS = ("<unk>", "<s>", "</s>")


def build_tokenizer(out: Path, vocab_size: int = 512) -> Path:
    """Write tokenizer.json + tokenizer_config.json (+ special_tokens_map.json) into ``out``; return ``out``.

    Idempotent: an existing tokenizer.json is kept. ``vocab_size`` must match the model's.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    out = Path(out)
    if (out / "tokenizer.json").exists():
        return out
    if vocab_size <= len(SPECIALS):
        raise ValueError(f"vocab_size must exceed {len(SPECIALS)}")
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256, "add_bos_token": False,
        "add_eos_token": False, "clean_up_tokenization_spaces": False, **special,
    }, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args()
    print(build_tokenizer(args.out, args.vocab_size))


if __name__ == "__main__":
    main()
