"""Convert Google's TF1 BERT checkpoint (MLPerf phase 1: model.ckpt-28252) to our safetensors weights.

    python data/convert_tf_checkpoint.py --tf_checkpoint phase1/model.ckpt-28252 \\
        --bert_config_path phase1/bert_config.json --output phase1/model.ckpt-28252.safetensors

TensorFlow is needed only here, to read the checkpoint. Names map as in NVIDIA's loader:
`layer_N` -> `layer.N`, `kernel` -> `weight` (transposed: TF stores (in, out)), `gamma`/`beta` ->
`weight`/`bias`, `output_bias`/`output_weights` -> `bias`/`weight`; optimizer slots are skipped.
Loading then concatenates each layer's query, key and value into the fused `qkv` (`bert.model.checkpoint`).
The 30522-row vocabulary is zero-padded to the config's 30528 when loaded into the model, which
also checks that every tensor is present and has the right shape.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping

import numpy as np
import torch

from bert.model import BertConfig, BertForPreTraining
from bert.model.checkpoint import load_state, save_weights

OPTIMIZER_STATE = re.compile(r"(^|/)(adam_[mv]|global_step|LAMB(_\d+)?|beta[12]_power|good_steps|loss_scale)($|/)")
LEAF_NAMES = {"kernel": "weight", "gamma": "weight", "beta": "bias", "output_bias": "bias",
              "output_weights": "weight", "bias": "bias"}


def torch_name(tf_name: str) -> str | None:
    """Our parameter name for a TF variable, or None for optimizer state."""
    if OPTIMIZER_STATE.search(tf_name):
        return None
    *scopes, leaf = re.sub(r"layer_(\d+)", r"layer.\1", tf_name).split("/")
    if leaf.endswith("_embeddings"):
        return ".".join([*scopes, leaf, "weight"])
    if leaf not in LEAF_NAMES:
        raise ValueError(f"TF variable {tf_name!r} has no known PyTorch name")
    return ".".join([*scopes, LEAF_NAMES[leaf]])


def convert(variables: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """TF variables (name -> array) to a state dict with our names."""
    state = {}
    for tf_name, array in variables.items():
        name = torch_name(tf_name)
        if name is None:
            continue
        tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
        state[name] = tensor.t().contiguous() if tf_name.endswith("/kernel") else tensor
    return state


def read_tf_checkpoint(path: str) -> dict[str, np.ndarray]:
    import tensorflow as tf  # optional dependency, needed only to read TF checkpoints

    reader = tf.train.load_checkpoint(path)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if torch_name(name) is not None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tf_checkpoint", required=True, help="checkpoint prefix, e.g. phase1/model.ckpt-28252")
    parser.add_argument("--bert_config_path", required=True, help="Google's bert_config.json")
    parser.add_argument("--output", required=True, help="output .safetensors")
    args = parser.parse_args(argv)
    try:
        model = BertForPreTraining(BertConfig.load(args.bert_config_path), attention="loop")
        loaded = load_state(model, convert(read_tf_checkpoint(args.tf_checkpoint)))
    except (ValueError, ImportError) as err:
        print(f"convert_tf_checkpoint: {err}", file=sys.stderr)
        return 1
    save_weights(model, args.output)
    print(f"wrote {len(loaded)} tensors to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
