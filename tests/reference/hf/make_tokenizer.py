"""A small byte-level BPE tokenizer (GPT-2's kind, 512 tokens: the 256 bytes and 256 merges) trained on
specs/data/architecture.txt, and the ids Hugging Face's `tokenizers` gives for a sample of
it: what pipec's text data with `tokenizer:` is tested against (tests/cli.rs).

    python tests/reference/hf/make_tokenizer.py      (tokenizers 0.20.3, in a throwaway venv)
"""

import json
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = pathlib.Path(__file__).resolve().parents[3]
text = (ROOT / "specs/data/architecture.txt").read_text()
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
tok.train_from_iterator([text], trainer)
out = ROOT / "specs/data/bpe-512.json"
tok.save(str(out))
sample = text[:2000]
ids = tok.encode(sample).ids
(pathlib.Path(__file__).parent / "tokenizer-sample.json").write_text(
    json.dumps({"text": sample, "ids": ids, "vocab_size": tok.get_vocab_size()}) + "\n"
)
print(tok.get_vocab_size(), len(ids), len(tok.encode(text).ids), len(text))
