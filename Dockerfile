# syntax=docker/dockerfile:1
# xla_ckpt image for Cloud TPU VMs and GKE TPU node pools.
#
#   docker build -t REGION-docker.pkg.dev/PROJECT/REPO/xla-ckpt:0.1.0 .
#   # Cloud TPU VM (every worker):
#   docker run --rm --privileged --net host -e XLA_CKPT_BUCKET=my-bucket \
#     REGION-docker.pkg.dev/PROJECT/REPO/xla-ckpt:0.1.0 demo --config /opt/xla-ckpt/configs/tpu-vm.yaml
#   # GKE: configs/gke/jobset.yaml
#
# Pins match pyproject.toml's `tpu` extra (tests/test_dockerfile.py checks it):
# torch_xla 2.9.0 needs torch 2.9.0 exactly (binary ABI).
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PJRT_DEVICE=TPU \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

# torch from the CPU wheel index (the TPU computes; no CUDA libraries in the image), then
# torch_xla with libtpu; the -f indexes are the ones the torch_xla README gives for libtpu.
RUN pip install "torch==2.9.0" --index-url https://download.pytorch.org/whl/cpu \
 && pip install "torch_xla[tpu]==2.9.0" \
      -f https://storage.googleapis.com/libtpu-releases/index.html \
      -f https://storage.googleapis.com/libtpu-wheels/index.html

WORKDIR /opt/xla-ckpt
COPY pyproject.toml README.md ./
COPY xla_ckpt ./xla_ckpt
COPY configs ./configs
# The package with its `tpu` extra (already satisfied above) and the demo's model and data.
RUN pip install ".[tpu,demo]" \
      -f https://storage.googleapis.com/libtpu-releases/index.html \
      -f https://storage.googleapis.com/libtpu-wheels/index.html \
 && python -c "import xla_ckpt, torch, torch_xla; print('xla_ckpt', xla_ckpt.__version__, 'torch', torch.__version__, 'torch_xla', torch_xla.__version__)"

# Run as a non-root user.  On a TPU VM the container needs the TPU device nodes
# (--privileged, or --device /dev/accel* / /dev/vfio); on GKE the TPU device plugin provides them.
RUN useradd --create-home --uid 1000 --user-group --shell /usr/sbin/nologin xla
USER 1000:1000
WORKDIR /home/xla

ENTRYPOINT ["xla-ckpt"]
CMD ["--help"]
