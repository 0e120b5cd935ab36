"""xla-ckpt train: one rank of a real job (the demo's training loop), under any launcher.

Run it once per process the way the platform starts ranks: every TPU VM worker (PJRT, with
`--device xla`), every pod of a GKE JobSet, or under torchrun on CUDA/CPU. The rank, world size
and rendezvous come from the environment (torchrun's RANK/WORLD_SIZE/MASTER_ADDR, or the TPU
runtime with dist.init_method=xla://). It restores the latest committed checkpoint under
checkpoint.save_dir (or starts fresh), trains, checkpoints on schedule, and on SIGTERM saves on
every rank at the next update boundary and exits 0.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from xla_ckpt.cli.common import Parents, Subparsers, plain


def register(sub: Subparsers, parents: Parents) -> None:
    p = sub.add_parser("train", parents=parents, help="run one rank of a checkpointed training job",
                       description=plain(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config, e.g. configs/tpu-vm.yaml")
    p.add_argument("--device", choices=("cpu", "xla", "cuda"), default="xla",
                   help="where this rank trains (default: its XLA device)")
    p.add_argument("--out", default=None,
                   help="folder for this rank's JSON report (losses, digest, restore figures)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from xla_ckpt.demo import worker  # noqa: PLC0415 - the demo and its extra load only for `train`

    out = args.out or tempfile.mkdtemp(prefix="xla-ckpt-train-")
    os.makedirs(out, exist_ok=True)
    argv = ["--config", args.config, "--phase", "train", "--out", out, "--device", args.device]
    for o in args.overrides:
        argv += ["--set", o]
    return worker.main(argv)
