"""Independent references the cache is checked against (plain HF calls, no producer code)."""

from __future__ import annotations

import re

import torch

ASSISTANT_TURN = re.compile(r"<\|im_start\|>assistant\n.*?<\|im_end\|>\n", re.S)


def normalise(row: dict) -> list[dict]:
    """Test-side conversion of a sample-data row into OpenAI messages."""
    if "messages" in row:
        return row["messages"]
    names = {"system": "system", "human": "user", "gpt": "assistant"}
    return [{"role": names[t["from"]], "content": t["value"]} for t in row["conversations"]]


def chatml_mask(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Ids and a mask covering every rendered ``<|im_start|>assistant ... <|im_end|>\\n`` turn."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [m.span() for m in ASSISTANT_TURN.finditer(text)]
    mask = [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def generation_mask(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    enc = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(enc["input_ids"]), list(enc["assistant_masks"])


def reference_hidden(model, ids: list[int], layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """NeMo's convention from ``output_hidden_states`` on the unpadded sequence."""
    n = model.config.num_hidden_layers
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    feats = [hs[0 if i == -1 else i + 1][0] for i in layer_ids]
    return torch.cat(feats, dim=-1), hs[n][0]
