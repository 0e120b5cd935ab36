"""`xla-ckpt demo`: a real fine-tuning run on emulated TPU workers, preempted and resumed.

Modules: ``corpus`` (a small real text corpus), ``model`` (all-MiniLM-L6-v2 or a tiny BERT, the
contrastive criterion), ``worker`` (one training process), ``fsdp`` (one training process of the
sharded leg: the same run with FSDP2), ``run`` (the orchestrator behind the CLI: the legs in
order), ``phase`` (one phase's worker processes), ``link`` (the GCS emulator and the shaped
proxy restores go through), ``report`` (verdicts, tables, the PASS/FAIL line), ``progress``
(progress lines).
"""

__all__ = ["corpus", "fsdp", "link", "model", "phase", "progress", "report", "run", "worker"]
