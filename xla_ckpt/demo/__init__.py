"""`xla-ckpt demo`: a real fine-tuning run on emulated TPU workers, preempted and resumed.

Modules: ``corpus`` (a small real text corpus), ``model`` (all-MiniLM-L6-v2 or a tiny BERT, the
contrastive criterion), ``worker`` (one training process), ``fsdp`` (one training process of the
sharded leg: the same run with FSDP2), ``run`` (the orchestrator behind the CLI).
"""

__all__ = ["corpus", "fsdp", "model", "run", "worker"]
