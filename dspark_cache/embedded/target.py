"""Build the embedded default target offline: a tiny random-init Qwen3 and its tokenizer.

The tokenizer is a byte-level BPE trained here on the sample corpus, with Qwen's special
tokens (``<|endoftext|>`` pad, ``<|im_start|>``, ``<|im_end|>`` end of turn) and ``<think>``,
``</think>``; it carries a Qwen3-style chat template. The result is a normal Hugging Face
checkpoint directory, loaded by the producer exactly like a real target.
"""

from __future__ import annotations

import os

from dspark_cache.embedded.data import corpus
from dspark_cache.embedded.templates import QWEN3_GENERATION, QWEN3_STOCK

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
TEMPLATES = {"stock": QWEN3_STOCK, "generation": QWEN3_GENERATION}


def build_tokenizer(vocab_size: int = 2048, template: str = "stock"):
    """Train the byte-level BPE tokenizer (deterministic, ~0.2 s) and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[3:],
        model_max_length=131072,
    )
    fast.chat_template = TEMPLATES[template]
    return fast


def build_target(
    out_dir: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 8,
    intermediate_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    template: str = "stock",
    vocab_size: int = 2048,
    model_vocab_size: int | None = None,
    head_dim: int | None = None,
    seed: int = 0,
) -> str:
    """Write a random-init Qwen3 checkpoint + tokenizer into ``out_dir`` and return it.

    ``model_vocab_size`` widens the embedding and LM head beyond the tokenizer (real Qwen3 has
    151,936 rows for 151,669 tokens), which matters when benchmarking LM-head cost. ``head_dim``
    defaults to ``hidden_size // num_heads``; real Qwen3 models use 128 whatever their width.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tokenizer(vocab_size, template)
    config = Qwen3Config(
        vocab_size=max(model_vocab_size or 0, len(tokenizer)),  # a larger head, as real targets have
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or max(8, hidden_size // num_heads),
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
    return out_dir
