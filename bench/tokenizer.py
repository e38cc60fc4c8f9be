"""Save a local WordLevel tokenizer for inference-perf, so it never downloads one from a hub.

Its vocabulary is the benchmarks' 3-letter words (`bench.workloads.WORDS`), split on spaces, so a
token is 4 characters of text: the same count the simulated pods use. Runs in the Python 3.12
venv that holds inference-perf (`tokenizers` and `transformers` come with it):

    .venv-bench312/bin/python -m bench.tokenizer .venv-bench312/tokenizer
"""

from __future__ import annotations

import sys
from itertools import product
from string import ascii_lowercase


def build(directory: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # The same words as bench.workloads.WORDS (not imported: this runs without the bench deps).
    words = ["".join(p) for p in product(ascii_lowercase, repeat=3)][:4000]
    vocab = {"[UNK]": 0, "[BOS]": 1, "[EOS]": 2}
    for w in words:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with single spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]")
    fast.save_pretrained(directory)


if __name__ == "__main__":
    build(sys.argv[1] if len(sys.argv) > 1 else ".venv-bench312/tokenizer")
