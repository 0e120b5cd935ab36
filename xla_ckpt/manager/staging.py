"""Stage a state to host memory: a snapshot the training loop can no longer change.

The async save path calls :func:`stage_to_host` on the training thread, then
uploads the snapshot in a background thread while training goes on.  The
snapshot:

* holds a host (CPU) copy of every tensor: XLA tensors in one batched
  transfer, CUDA tensors with ``.to("cpu")``, CPU tensors copied (the
  optimizer steps them in place next update);
* keeps aliasing: tensors that shared storage (tied weights) still share one
  copy, so the saved checkpoint is the same as a synchronous save's;
* freezes non-tensor values by passing them through the typed encoding, which
  also refuses what could not be saved (meta tensors, unsupported types) here,
  on the caller's thread, naming the key.

Peak extra host memory is one copy of the staged tensors (the manager keeps
at most one snapshot alive).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from xla_ckpt.errors import MetaTensorError
from xla_ckpt.format import typed


@dataclass
class Staged:
    """A host snapshot of a state: ``state`` (same structure) and its tensor bytes."""

    state: Any
    nbytes: int


def stage_to_host(state: Any) -> Staged:
    """Deep snapshot of ``state`` with every tensor copied to host memory.

    Raises:
        MetaTensorError: a tensor is on the meta device (names its key).
        UnsupportedTypeError: a value the checkpoint format cannot hold (names its key).
    """
    found: list[torch.Tensor] = []

    def hook(t: torch.Tensor, path: tuple) -> int:
        if t.device.type == "meta":
            raise MetaTensorError(
                f"tensor at {typed.format_path(path)} is on the meta device and holds no data; "
                "materialise it (e.g. model.to_empty(device=...) and load/initialise weights) "
                "before saving")
        found.append(t)
        return len(found) - 1

    encoded = typed.encode(state, hook)
    host = _host_copies(found)
    nbytes = sum(t.numel() * t.element_size() for t in host)
    return Staged(typed.decode(encoded, lambda i: host[i]), nbytes)


def _host_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    out: list[torch.Tensor | None] = [None] * len(tensors)
    xla_idx = [i for i, t in enumerate(tensors) if t.device.type == "xla"]
    if xla_idx:
        import torch_xla.core.xla_model as xm  # noqa: PLC0415 - optional dependency

        for i, t in zip(xla_idx, xm._maybe_convert_to_cpu([tensors[i] for i in xla_idx])):
            out[i] = t.detach()
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        if out[i] is not None:
            continue
        if t.device.type != "cpu":
            out[i] = t.detach().to("cpu", copy=True)
            continue
        ptr = t.untyped_storage().data_ptr()
        if not ptr or t.numel() == 0:
            out[i] = t.detach().clone()
            continue
        groups.setdefault(ptr, []).append(i)
    for members in groups.values():
        if len(members) == 1:
            out[members[0]] = tensors[members[0]].detach().clone()
            continue
        for i, t in zip(members, _copy_shared([tensors[i] for i in members])):
            out[i] = t
    return out  # type: ignore[return-value]


def _copy_shared(views: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy tensors that share one storage as views of one new buffer (aliasing kept)."""
    spans = []
    for t in views:
        isz = t.element_size()
        start = t.storage_offset() * isz
        last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
        spans.append((start, start + (last + 1) * isz))
    align = max(t.element_size() for t in views)
    lo = min(s for s, _ in spans)
    lo -= lo % align
    hi = max(e for _, e in spans)
    src = torch.empty(0, dtype=torch.uint8).set_(views[0].untyped_storage(), lo, (hi - lo,), (1,))
    buf = src.clone().untyped_storage()
    out = []
    for t, (start, _end) in zip(views, spans):
        isz = t.element_size()
        out.append(torch.empty(0, dtype=t.dtype).set_(buf, (start - lo) // isz, t.shape,
                                                       t.stride()))
    return out
