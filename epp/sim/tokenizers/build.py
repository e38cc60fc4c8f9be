"""Builds the shipped BPE tokenizer (`bpe/`) from the project's own corpus, deterministically.

    python -m epp.sim.tokenizers.build            # rewrite epp/sim/tokenizers/bpe/
    python -m epp.sim.tokenizers.build --check    # exit 1 if the shipped files are not what it builds

Why build one rather than ship a model's: a real tokenizer cannot be downloaded here and its
licence may not allow shipping, and the simulator needs only the *behaviour* of one — byte-level
BPE with Llama-3's pre-tokenization, so characters per token vary with the text (frequent words
are one token, rare words, numbers and identifiers several). It is trained with the `tokenizers`
library on text from `corpus.py`, the same language workloads send, so the simulated engine
counts workload prompts the way a real tokenizer counts natural text (about 4.2 characters per
token on average, 1 to 13 per token).

Special tokens are Llama-3's names (BOS `<|begin_of_text|>`, headers, `<|eot_id|>`); completions
get BOS prepended (`add_special_tokens`), chat prompts get it from the chat template.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from importlib import resources
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from epp.sim.tokenizers import corpus

VOCAB_SIZE = 24576
CORPUS_DOCUMENTS = 1000  # of 8 paragraphs each: about 3 MB of text
CORPUS_SEED = "epp-bpe-corpus-v1"
BOS = "<|begin_of_text|>"
EOS = "<|eot_id|>"
SPECIAL_TOKENS = (BOS, "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", EOS)
# Llama-3's pre-tokenization: contractions, words with one leading non-letter, numbers in groups
# of up to three digits, punctuation runs with their newlines, whitespace.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama-3-style: every message under a role header, closed by <|eot_id|>; content trimmed.
CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
TOKENIZER_CONFIG = {
    "bos_token": BOS,
    "eos_token": EOS,
    "model_max_length": 131072,
    "tokenizer_class": "PreTrainedTokenizerFast",
    "clean_up_tokenization_spaces": False,
}


def corpus_documents() -> list[str]:
    rng = random.Random(CORPUS_SEED)
    return [corpus.document(rng, 8) for _ in range(CORPUS_DOCUMENTS)]


def train() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    docs = corpus_documents()
    tok.train_from_iterator(docs, trainer, length=len(docs))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def build_files() -> dict[str, str]:
    """File name -> content of the `bpe/` directory."""
    return {
        "tokenizer.json": train().to_str(pretty=False),
        "tokenizer_config.json": json.dumps(TOKENIZER_CONFIG, indent=2) + "\n",
        "chat_template.jinja": CHAT_TEMPLATE,
    }


def shipped_dir() -> Path:
    return Path(str(resources.files("epp.sim.tokenizers").joinpath("bpe")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epp.sim.tokenizers.build", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped files, write nothing")
    parser.add_argument("--out", type=Path, default=None, help="directory to write (default: the shipped bpe/)")
    args = parser.parse_args(argv)
    out = args.out or shipped_dir()
    files = build_files()
    if args.check:
        stale = [name for name, text in files.items()
                 if not (out / name).is_file() or (out / name).read_text(encoding="utf-8") != text]
        for name in stale:
            print(f"{out / name}: differs from what the build makes", file=sys.stderr)
        return 1 if stale else 0
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
        print(f"wrote {out / name} ({len(text.encode()):,} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
