"""`xla-ckpt demo`: a real fine-tuning run on emulated TPU workers, preempted and resumed.

Modules: ``corpus`` (a small real text corpus), ``model`` (all-MiniLM-L6-v2 or a tiny BERT, the
contrastive criterion), ``worker`` (one training process), ``run`` (the orchestrator behind the
CLI).
"""

__all__ = ["corpus", "model", "run", "worker"]
