"""Save a local WordLevel tokenizer for inference-perf, so it never downloads one from a hub.

Its vocabulary is the simulated pods' single-token words (`bench.workloads.words`: words that are
one token each, with a leading space, for the pods' shipped byte-level BPE), split on spaces. So
a prompt inference-perf makes of N of its tokens is N tokens for the pods too (plus the BOS the
pods add to a completion): the lengths the scenario states are the lengths the pods prefill.
(An earlier vocabulary of 3-letter words was ~2.3 pod tokens each: every prompt cost the pods
2.3× its nominal length.) Pointing inference-perf at the pods' BPE itself would also be exact, but
its random ids rarely re-tokenize to themselves and it spends ~60 ms of CPU per 800-token prompt
converging, more than the load generator can spare at 20 req/s on a small machine.

Runs in the project's venv (`tokenizers` is a dependency); the files are what transformers'
`PreTrainedTokenizerFast` loads:

    .venv/bin/python -m bench.tokenizer .venv-bench312/pod-words-tokenizer
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.workloads import pod_words

SPECIALS = {"unk_token": "[UNK]", "bos_token": "[BOS]", "eos_token": "[EOS]"}


def build(directory: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIALS.values())}
    for w in pod_words():
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with single spaces
    tok.add_special_tokens(list(SPECIALS.values()))
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 131072,
         "clean_up_tokenization_spaces": False, **SPECIALS}, indent=1))


if __name__ == "__main__":
    build(sys.argv[1] if len(sys.argv) > 1 else ".venv-bench312/pod-words-tokenizer")
