"""Small llama GGUFs with random weights and the default model's tokenizer and chat template,
written by the ``gguf`` package: other models to serve in tests (another model id, an embedding
model, a model whose decode step is short), nothing downloaded.

Their answers are noise, but they are real models to llama.cpp: they load, decode, sample,
tokenize and apply the template exactly as a trained one would.
"""

from __future__ import annotations

import pathlib

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter


def write_tiny_llama(
    path: pathlib.Path,
    source: pathlib.Path,
    *,
    name: str,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    seed: int = 0,
) -> pathlib.Path:
    """Write a llama of the given shape to ``path`` with ``source``'s tokenizer (every
    ``tokenizer.*`` key, the chat template included) and ``general.name`` = ``name``."""
    reader = GGUFReader(source)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    n_vocab = len(tokens)
    writer = GGUFWriter(path, "llama")
    writer.add_name(name)
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(1)  # mostly F16
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float16)

    def norm() -> np.ndarray:
        return np.ones(n_embd, dtype=np.float32)

    writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd))  # output tied to it
    writer.add_tensor("output_norm.weight", norm())
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(n_embd, n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
