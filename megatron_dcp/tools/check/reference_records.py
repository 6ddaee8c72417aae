"""What ``megatron-dcp check``'s workers leave for its reference arm, in the layout's run folder
under ``reference/``, and how the arm reads it back:

- ``model.pt`` (rank 0, once): the model's description, its ``TransformerConfig`` and the
  GPT model's own arguments (vocabulary, positions, tied embeddings);
- ``weights_rank<r>.pt`` (every rank, once): its weights by single-process name
  (``tools.check.global_names``). The run trains with ``--lr 0``, so they hold for every batch;
- ``samples_b<n>.pt`` (rank 0): global batch ``n``'s samples as the data loader delivered them,
  before any plan, packing or routing (``tokens``, ``labels``, ``loss_mask``);
- ``gradients_b<n>_rank<r>.pt`` (every rank): per arm, the global loss ``(sum, tokens)`` and this
  rank's gradients after megatron's finalisation, by single-process name;
- ``findings.json``: what the reference arm found (``tools.check.reference_arm``).
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

REFERENCE_DIR = "reference"
FINDINGS_FILE = "findings.json"  # what the reference arm found, one entry per quantity
GPT_ARGUMENTS = (
    "vocab_size",
    "max_sequence_length",
    "position_embedding_type",
    "rotary_percent",
    "rotary_base",
    "share_embeddings_and_output_weights",
)  # the GPTModel attributes the reference model is built with, beside its TransformerConfig


def folder(out: Path) -> Path:
    path = Path(out) / REFERENCE_DIR
    path.mkdir(parents=True, exist_ok=True)
    return path


def findings_path(out: Path) -> Path:
    return folder(out) / FINDINGS_FILE


def save_model(out: Path, model: Any) -> None:
    """The description of the (unwrapped) GPT model chunk ``model``: its config's class and
    every field that pickles (the training loop hangs its hooks, such as the gradient scaling
    function, on the config: those stay behind), and its GPT arguments."""
    config = model.config
    fields = {}
    for spec in dataclasses.fields(config):
        value = getattr(config, spec.name)
        if spec.init and pickles(value):
            fields[spec.name] = value
    gpt = {name: getattr(model, name) for name in GPT_ARGUMENTS}
    gpt["rope_scaling"] = getattr(model, "rotary_scaling", False)
    description = {"config_class": type(config), "fields": fields, "gpt": gpt}
    torch.save(description, folder(out) / "model.pt")


def pickles(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except (pickle.PicklingError, AttributeError, TypeError):
        return False
    return True


def load_model(out: Path) -> Dict[str, Any]:
    """The description with the config rebuilt (``transformer``) beside the GPT arguments."""
    description = torch.load(folder(out) / "model.pt", weights_only=False)
    config = description["config_class"](**description["fields"])
    return {"transformer": config, "gpt": description["gpt"]}


def save_weights(out: Path, rank: int, weights: Dict[str, torch.Tensor]) -> None:
    torch.save(weights, folder(out) / f"weights_rank{rank}.pt")


def load_weights(out: Path) -> Dict[str, torch.Tensor]:
    """Every weight once (a name several ranks hold, such as the tied word embeddings, must be
    the same on each: a ValueError otherwise)."""
    merged: Dict[str, torch.Tensor] = {}
    for path in sorted(folder(out).glob("weights_rank*.pt")):
        for name, tensor in torch.load(path).items():
            if name in merged and not torch.equal(merged[name], tensor):
                raise ValueError(f"{path.name}: {name} differs from another rank's copy")
            merged[name] = tensor
    return merged


def save_samples(out: Path, batch: int, samples: List[Dict[str, torch.Tensor]]) -> None:
    torch.save(samples, folder(out) / f"samples_b{batch}.pt")


def load_samples(out: Path) -> Dict[int, List[Dict[str, torch.Tensor]]]:
    paths = folder(out).glob("samples_b*.pt")
    return {int(p.stem.removeprefix("samples_b")): torch.load(p) for p in paths}


Gradients = Dict[str, Tuple[Tuple[float, int], Dict[str, torch.Tensor]]]  # arm -> (loss, grads)


def save_gradients(out: Path, batch: int, rank: int, by_arm: Gradients) -> None:
    torch.save(by_arm, folder(out) / f"gradients_b{batch}_rank{rank}.pt")


def load_gradients(out: Path, batch: int) -> Dict[int, Gradients]:
    """Rank -> what that rank saved of batch ``batch``."""
    paths = folder(out).glob(f"gradients_b{batch}_rank*.pt")
    return {int(p.stem.rpartition("_rank")[2]): torch.load(p) for p in paths}


def clear(out: Path) -> None:
    for stale in folder(out).glob("*.pt"):
        stale.unlink()
