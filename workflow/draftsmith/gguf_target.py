"""GGUF target: a llama.cpp GGUF file -> the checkpoint folder vLLM and speculators read.

Many users hold a model only as a GGUF. transformers reads it (with the ``gguf`` package) and
dequantizes every tensor into ordinary layers, in the dtype asked for; the tokenizer and its
chat template come from the file's metadata. The model keeps a GGUF quantizer marker that makes
``save_pretrained`` refuse, although nothing is quantized any more: it is dropped before saving.
The folder is written beside the output and renamed into place, so a killed job leaves no
half-written target.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.progress import log

DTYPES = ("bfloat16", "float16", "float32")


class GgufTargetError(DraftsmithError):
    pass


def convert(gguf_file: Path, output: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:  # transformers needs both for GGUF, and says so only deep inside from_pretrained
        import accelerate  # noqa: F401
        import gguf  # noqa: F401
    except ImportError as error:
        raise GgufTargetError(
            f"reading a GGUF target needs {error.name}; reinstall draftsmith (pip install -e .)"
        ) from error
    if not gguf_file.is_file():
        raise GgufTargetError(f"target.gguf {gguf_file} does not exist; fix target.gguf (make real-data fetches one)")
    folder, name = gguf_file.parent, gguf_file.name
    log(f"reading {gguf_file} ({gguf_file.stat().st_size / 1e6:.0f} MB) as {dtype}")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    # Dequantized on load: the marker is all that is left of the quantization.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = output.with_name(output.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(output, ignore_errors=True)
    partial.rename(output)
    parameters = sum(p.numel() for p in model.parameters())
    log(f"wrote {output}: {model.config.architectures}, {parameters / 1e6:.0f}M parameters in {dtype}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True, type=Path)
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--output", required=True, type=Path)
    args = parser.parse_args(argv)
    convert(args.gguf, args.output, args.dtype)


if __name__ == "__main__":
    from draftsmith.cli import run_main

    run_main(main)
