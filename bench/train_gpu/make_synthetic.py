"""Synthetic inputs for the training stage at Kimi-K2.5 dimensions, built on the GPU host.

    python bench/train_gpu/make_synthetic.py --out /tmp/train_bench

Writes under OUT (skipped when OUT/done exists):
- verifier/: config.json (Llama-style, 61 layers, hidden 7168, vocab 163,840) and a
  model.safetensors with only what `speculators train` reads from a verifier:
  model.embed_tokens.weight, lm_head.weight and model.norm.weight (bf16, ~4.7 GB).
  No tokenizer: the benchmark passes --mask-token-id, the one thing it would load.
- dataset/: the prepared dataset as `speculators prepare-data` writes it (Arrow rows of
  input_ids, loss_mask, seq_len in torch format) plus token_freq.pt.
- hidden_states/hs_<row>.safetensors: `hidden_states` [seq_len, 4, 7168] bf16 (aux vLLM
  ids 3 31 59 + final) and `token_ids`, as vLLM's extraction writes them.

Only --unique distinct hidden-state files are written (~57 KiB per token); row r reuses
the tokens of file r % unique through a link, as the training view links shard files.
Their values are random: throughput does not depend on them.

Draft shape. speculators sizes the drafter from the verifier config: heads, KV heads,
head_dim and intermediate_size. Kimi-K2.5's own (remote-code) DeepSeek-V3 config has 64
heads, 64 KV heads, intermediate_size 18432 and no head_dim, so the draft gets
head_dim 7168 / 64 = 112; transformers' built-in DeepseekV3Config would give 64.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN = 7168
VOCAB = 163_840
STORED_LAYERS = 4  # aux vLLM ids 3, 31, 59 + the final layer


def verifier_config(args: argparse.Namespace) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": 61,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": VOCAB,
        "max_position_embeddings": 262_144,
        "rope_theta": 50_000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def write_verifier(out: Path, args: argparse.Namespace) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(verifier_config(args), indent=2) + "\n")
    gen = torch.Generator("cuda").manual_seed(args.seed)

    def matrix() -> torch.Tensor:
        return (0.02 * torch.randn(VOCAB, HIDDEN, device="cuda", generator=gen)).bfloat16().cpu()

    save_file(
        {
            "model.embed_tokens.weight": matrix(),
            "lm_head.weight": matrix(),
            "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        },
        str(out / "model.safetensors"),
    )


def make_rows(args: argparse.Namespace) -> list[torch.Tensor]:
    """Token ids of the distinct rows, lengths uniform in [min_len, max_len]."""
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.unique,), generator=gen)
    return [torch.randint(0, VOCAB, (int(n),), generator=gen) for n in lengths]


def loss_mask(length: int) -> list[int]:
    prompt = length // 10  # a prompt without loss, then the answer
    return [0] * prompt + [1] * (length - prompt)


def write_dataset(out: Path, rows: list[torch.Tensor], n_rows: int) -> None:
    from datasets import Dataset  # imported late: only needed here

    ids = [rows[r % len(rows)] for r in range(n_rows)]
    data = Dataset.from_dict(
        {
            "input_ids": [t.tolist() for t in ids],
            "loss_mask": [loss_mask(len(t)) for t in ids],
            "seq_len": [len(t) for t in ids],
        }
    )
    data.set_format(type="torch")  # as prepare-data leaves it
    data.save_to_disk(str(out))
    # token_freq.pt: {token id: count over loss-masked tokens}, as prepare-data writes it.
    counts = torch.zeros(VOCAB, dtype=torch.long)
    for t in ids:
        counts += torch.bincount(t[len(t) // 10 :], minlength=VOCAB)
    nonzero = counts.nonzero().flatten()
    torch.save(dict(zip(nonzero.tolist(), counts[nonzero].tolist(), strict=True)), out / "token_freq.pt")


def write_hidden_states(out: Path, rows: list[torch.Tensor], n_rows: int, seed: int) -> None:
    unique = out.parent / "hs_unique"
    unique.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator("cuda").manual_seed(seed + 1)
    for k, tokens in enumerate(rows):
        shape = (len(tokens), STORED_LAYERS, HIDDEN)
        states = torch.randn(shape, device="cuda", generator=gen).bfloat16().cpu()
        save_file({"hidden_states": states, "token_ids": tokens}, str(unique / f"u_{k}.safetensors"))
    for r in range(n_rows):
        link = out / f"hs_{r}.safetensors"
        if not link.exists():
            os.symlink(unique / f"u_{r % len(rows)}.safetensors", link)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=600, help="dataset rows (90%% train)")
    parser.add_argument("--unique", type=int, default=24, help="distinct hidden-state files")
    parser.add_argument("--min-len", type=int, default=2048)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=112)
    parser.add_argument("--intermediate-size", type=int, default=18432)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if (args.out / "done").exists():
        print(f"{args.out}: synthetic data already there")
        return
    rows = make_rows(args)
    write_verifier(args.out / "verifier", args)
    write_dataset(args.out / "dataset", rows, args.rows)
    write_hidden_states(args.out / "hidden_states", rows, args.rows, args.seed)
    (args.out / "done").write_text(json.dumps(vars(args), default=str) + "\n")
    tokens = sum(len(rows[r % len(rows)]) for r in range(args.rows))
    print(f"{args.out}: {args.rows} rows, {tokens} tokens, {len(rows)} distinct hidden-state files")


if __name__ == "__main__":
    main()
