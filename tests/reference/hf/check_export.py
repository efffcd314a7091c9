"""The fine-tuning round trip, outside CI: the loss `transformers` computes with the weights
`pipec export` wrote, on the windows pipec trained on.

    python tests/reference/hf/check_export.py EXPORT_DIR TOKENS.bin SEQ

prints the mean next-token cross-entropy over the file's windows of SEQ tokens (uint16 ids,
window k = tokens k·SEQ .. k·SEQ + SEQ, its targets shifted by one), the number to compare
with the `loss` pipec reported for a step that trained on those weights.
"""

import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM

export, tokens, seq = sys.argv[1], sys.argv[2], int(sys.argv[3])
ids = torch.from_numpy(np.fromfile(tokens, dtype="<u2").astype(np.int64))
windows = (len(ids) - 1) // seq
x = ids[: windows * seq].view(windows, seq)
y = ids[1 : windows * seq + 1].view(windows, seq)
model = AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(input_ids=x).logits
loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
print(f"transformers loss {loss.item():.9f}")
