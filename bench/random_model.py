"""Random-weight llama GGUF files with the default model's tokenizer, for speed measurements
where the weights do not matter (the answers are noise) and none can be downloaded.

``save_tokenizer`` keeps only the tokenizer and chat template of a GGUF (a file of about 1 MiB,
no tensors); ``write_model`` makes a llama model of a given shape around it, f16, with tied
embeddings as SmolLM2's. Shapes: ``tiny`` (64 wide, 2 layers: a decode step of a few ms on a
CPU, so the host path per token shows) and ``1b`` (Llama 3.2 1B's shape, with SmolLM2's 49152
tokens: 1.07 B parameters, 2.1 GB).

    python -m bench.random_model --shape tiny --out /tmp/tiny.gguf [--tokenizer FILE]
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import time
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

_TOKENIZER_PREFIX = "tokenizer."


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx: int = 8192

    def n_params(self, n_vocab: int) -> int:
        head = self.n_embd // self.n_head
        attn = 2 * self.n_embd * self.n_embd + 2 * self.n_embd * self.n_head_kv * head
        per_layer = attn + 3 * self.n_embd * self.n_ff + 2 * self.n_embd
        return n_vocab * self.n_embd + self.n_layer * per_layer + self.n_embd


SHAPES = {
    "tiny": Shape(n_embd=64, n_layer=2, n_head=2, n_head_kv=2, n_ff=256),
    "1b": Shape(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192),
}


def default_model() -> pathlib.Path:
    from server.model_files import default_model_path

    return default_model_path()


def save_tokenizer(source: pathlib.Path, target: pathlib.Path) -> None:
    """Write a GGUF that holds only ``source``'s tokenizer keys (``tokenizer.*``: vocabulary,
    merges, token types, special tokens, chat template)."""
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(target), reader.fields["general.architecture"].contents())
    _copy_tokenizer(source, writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _copy_tokenizer(source: pathlib.Path, writer: gguf.GGUFWriter, leave_out: frozenset[str] = frozenset()) -> int:
    """Copy the tokenizer keys (but those in ``leave_out``); the vocabulary's size."""
    n_vocab = 0
    for key, value, types in _tokenizer_fields(source.resolve()):
        if key not in leave_out:
            writer.add_key_value(key, value, *types)
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(value)
    if not n_vocab:
        raise ValueError("no tokenizer.ggml.tokens in the tokenizer file")
    return n_vocab


@functools.cache
def _tokenizer_fields(path: pathlib.Path) -> tuple[tuple[str, Any, tuple[gguf.GGUFValueType, ...]], ...]:
    """The tokenizer keys of the GGUF at ``path``: name, value, and its type (an array's element
    type after it). Read once per process: gguf's reader takes seconds over 49,152 tokens, and
    the tests write several models."""
    reader = gguf.GGUFReader(str(path))
    fields = []
    for key, field in reader.fields.items():
        if key.startswith(_TOKENIZER_PREFIX):
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            types = (field.types[0], field.types[-1]) if array else (field.types[0],)
            fields.append((key, field.contents(), types))
    return tuple(fields)


def _weights(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    return (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(np.float16)


def write_model(
    tokenizer: pathlib.Path,
    target: pathlib.Path,
    shape: Shape,
    seed: int = 0,
    *,
    fim: tuple[int, int, int] | None = None,
    add_bos: bool | None = None,
) -> int:
    """A random-weight f16 llama model of ``shape`` with ``tokenizer``'s vocabulary at ``target``;
    its parameter count. ``fim``: the ids its metadata names as fill-in-the-middle prefix,
    suffix and middle tokens (the default model has none). ``add_bos``: whether its tokenizer
    adds BOS (the default model's does not)."""
    writer = gguf.GGUFWriter(str(target), "llama")
    n_vocab = _copy_tokenizer(
        tokenizer, writer, frozenset() if add_bos is None else frozenset({gguf.Keys.Tokenizer.ADD_BOS})
    )
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    head = shape.n_embd // shape.n_head
    writer.add_name(f"random llama {shape.n_embd}x{shape.n_layer}")
    writer.add_context_length(shape.n_ctx)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(head)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if fim is not None:
        keys = (gguf.Keys.Tokenizer.FIM_PRE_ID, gguf.Keys.Tokenizer.FIM_SUF_ID, gguf.Keys.Tokenizer.FIM_MID_ID)
        for key, token in zip(keys, fim, strict=True):
            writer.add_uint32(key, token)
    rng = np.random.default_rng(seed)
    std = 1.0 / np.sqrt(shape.n_embd)
    ones = np.ones(shape.n_embd, dtype=np.float32)
    writer.add_tensor("token_embd.weight", _weights(rng, n_vocab, shape.n_embd, 1.0))
    for i in range(shape.n_layer):
        blk = f"blk.{i}."
        writer.add_tensor(blk + "attn_norm.weight", ones)
        writer.add_tensor(blk + "attn_q.weight", _weights(rng, shape.n_head * head, shape.n_embd, std))
        writer.add_tensor(blk + "attn_k.weight", _weights(rng, shape.n_head_kv * head, shape.n_embd, std))
        writer.add_tensor(blk + "attn_v.weight", _weights(rng, shape.n_head_kv * head, shape.n_embd, std))
        writer.add_tensor(blk + "attn_output.weight", _weights(rng, shape.n_embd, shape.n_head * head, std))
        writer.add_tensor(blk + "ffn_norm.weight", ones)
        writer.add_tensor(blk + "ffn_gate.weight", _weights(rng, shape.n_ff, shape.n_embd, std))
        writer.add_tensor(blk + "ffn_up.weight", _weights(rng, shape.n_ff, shape.n_embd, std))
        writer.add_tensor(blk + "ffn_down.weight", _weights(rng, shape.n_embd, shape.n_ff, 1.0 / np.sqrt(shape.n_ff)))
    writer.add_tensor("output_norm.weight", ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return shape.n_params(n_vocab)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--tokenizer", type=pathlib.Path, help="a GGUF with the tokenizer (default: the default model)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.monotonic()
    n = write_model(args.tokenizer or default_model(), args.out, SHAPES[args.shape], args.seed)
    size = args.out.stat().st_size / 2**20
    print(f"wrote {args.out}: {n / 1e6:.1f} M parameters, {size:.0f} MiB in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
