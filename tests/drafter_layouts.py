"""Drafters in the layouts training.from_pretrained reads, written from a trained demo drafter.

``write_research_checkpoint`` writes what the EAGLE authors and SpecForge publish (a
``LlamaForCausalLMEagle3`` config.json and ``midlayer.*`` weights, the names speculators'
converter reads), so the conversion path is tested on real trained weights.
"""

import json
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file


def read_weights(drafter: Path) -> dict:
    with safe_open(str(drafter / "model.safetensors"), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def write_research_checkpoint(drafter: Path, output: Path) -> Path:
    """The speculators drafter ``drafter`` in the research EAGLE-3 layout."""
    config = json.loads((drafter / "config.json").read_text())
    layer = config["transformer_layer_config"]
    research = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": layer["hidden_size"],
        "intermediate_size": layer["intermediate_size"],
        "num_attention_heads": layer["num_attention_heads"],
        "num_key_value_heads": layer["num_key_value_heads"],
        "head_dim": layer["head_dim"],
        "num_hidden_layers": 1,
        "hidden_act": layer["hidden_act"],
        "rms_norm_eps": layer["rms_norm_eps"],
        "rope_theta": layer["rope_parameters"]["rope_theta"],
        "max_position_embeddings": layer["max_position_embeddings"],
        "vocab_size": layer["vocab_size"],
        "draft_vocab_size": config["draft_vocab_size"],
        "torch_dtype": "bfloat16",
        "norm_before_fc": config["norm_before_fc"],
        "norm_output": config["norm_output"],
        "norm_before_residual": config["norm_before_residual"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": config["eagle_aux_hidden_state_layer_ids"]},
    }
    output.mkdir(parents=True)
    (output / "config.json").write_text(json.dumps(research, indent=2))
    weights = {name.replace("layers.0.", "midlayer.", 1): tensor for name, tensor in read_weights(drafter).items()}
    save_file(weights, str(output / "model.safetensors"))
    return output


def copy_drafter(drafter: Path, output: Path, **config_changes) -> Path:
    """A copy of a speculators drafter, its config.json changed as given (a key
    ``section__name`` changes ``name`` inside ``section``)."""
    shutil.copytree(drafter, output)
    config = json.loads((output / "config.json").read_text())
    for key, value in config_changes.items():
        section, _, name = key.rpartition("__")
        (config[section] if section else config)[name] = value
    (output / "config.json").write_text(json.dumps(config, indent=2))
    return output


def write_speculators_drafter(
    output: Path,
    *,
    hidden: int = 128,
    vocab: int = 226,
    draft_vocab: int = 200,
    aux_ids: tuple[int, ...] = (2, 3, 5),
    kind: str = "eagle3",
    lm_head_rows: int | None = None,
) -> Path:
    """A speculators-format drafter of the demo target's shapes with small random weights:
    what the preflight reads (config.json and the weights' headers), in milliseconds."""
    import torch

    config = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": kind,
        "draft_vocab_size": draft_vocab,
        "eagle_aux_hidden_state_layer_ids": list(aux_ids),
        "target_hidden_size": None,
        "norm_before_residual": True,
        "transformer_layer_config": {"hidden_size": hidden, "vocab_size": vocab, "model_type": "llama"},
    }
    output.mkdir(parents=True)
    (output / "config.json").write_text(json.dumps(config, indent=2))
    weights = {
        "d2t": torch.zeros(draft_vocab, dtype=torch.int64),
        "t2d": torch.zeros(vocab, dtype=torch.bool),
        "fc.weight": torch.zeros(hidden, len(aux_ids) * hidden),
        "lm_head.weight": torch.zeros(lm_head_rows or draft_vocab, hidden),
    }
    save_file(weights, str(output / "model.safetensors"))
    return output
