"""A tensor the format has no layout for is refused by name, never as a meta tensor (issue 25).

Every non-strided layout (sparse COO, CSR, CSC, BSR, BSC, mkldnn, nested strided and jagged)
and a quantized tensor: ``UnsupportedTensorError`` naming the key and the layout and saying
what to save instead, from ``xla_ckpt.save`` and from the manager's blocking and async saves;
nothing is committed.  The advice given for sparse COO round-trips bitwise.
"""

import os
import warnings

import pytest
import torch

import xla_ckpt
from xla_ckpt.errors import CheckpointSaveError, MetaTensorError, UnsupportedTensorError
from xla_ckpt.manager import CheckpointConfig, CheckpointManager

warnings.filterwarnings("ignore", message=".*(sparse|nested).*")


def _cases() -> dict:
    d = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 3.0]])
    return {
        "torch.sparse_coo": d.to_sparse(),
        "torch.sparse_csr": d.to_sparse_csr(),
        "torch.sparse_csc": d.to_sparse_csc(),
        "torch.sparse_bsr": d.to_sparse_bsr((1, 1)),
        "torch.sparse_bsc": d.to_sparse_bsc((1, 1)),
        "torch._mkldnn": d.to_mkldnn(),
        "nested torch.strided": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "nested torch.jagged": torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)],
                                                          layout=torch.jagged),
        "quantized torch.qint8": torch.quantize_per_tensor(d, 0.1, 0, torch.qint8),
    }


ADVICE = {
    "torch.sparse_coo": "save t.to_dense(), or, to keep it sparse, its parts "
                        "t.coalesce().indices(), t.coalesce().values() and list(t.shape), and "
                        "rebuild it with torch.sparse_coo_tensor(indices, values, shape) after "
                        "loading",
    "torch.sparse_csr": "its parts t.crow_indices(), t.col_indices(), t.values() and "
                        "list(t.shape), and rebuild it with torch.sparse_compressed_tensor(..., "
                        "layout=torch.sparse_csr) after loading",
    "torch.sparse_csc": "its parts t.ccol_indices(), t.row_indices(), t.values()",
    "torch.sparse_bsr": "layout=torch.sparse_bsr",
    "torch.sparse_bsc": "layout=torch.sparse_bsc",
    "torch._mkldnn": "save t.to_dense() (a strided tensor) instead",
    "nested torch.strided": "save t.unbind() (the list of its tensors)",
    "nested torch.jagged": "save t.unbind() (the list of its tensors)",
    "quantized torch.qint8": "save t.dequantize(), or t.int_repr() with its scale and zero point",
}


@pytest.mark.parametrize("layout", list(_cases()))
def test_save_refuses_each_layout_naming_key_and_layout(tmp_path, layout):
    t = _cases()[layout]
    for state, key in (({"emb": t}, "state['emb']"),
                       ({"model": {"layers": [torch.ones(1), t]}},
                        "state['model']['layers'][1]")):
        ck = tmp_path / "ck"
        with pytest.raises(UnsupportedTensorError) as e:
            xla_ckpt.save(state, str(ck))
        assert not isinstance(e.value, MetaTensorError)
        assert isinstance(e.value, TypeError)
        assert (e.value.key, e.value.layout) == (key, layout)
        assert str(e.value).startswith(f"tensor at {key} ")
        assert "which xla_ckpt does not store" in str(e.value)
        assert ADVICE[layout] in str(e.value)
        assert not (ck / "manifest.json").exists()


@pytest.mark.parametrize("async_save", [False, True])
def test_manager_saves_refuse_sparse_by_name(tmp_path, async_save):
    cfg = CheckpointConfig(save_dir=str(tmp_path), handle_sigterm=False, async_save=async_save,
                           save_interval_epochs=0)
    with CheckpointManager(cfg) as mgr:
        with pytest.raises(CheckpointSaveError) as e:
            mgr.save({"model": {"emb": torch.eye(3).to_sparse_csr()}}, epoch=1, num_updates=1)
            mgr.wait()
        assert ("UnsupportedTensorError: tensor at state['model']['emb'] is sparse (layout "
                "torch.sparse_csr)") in str(e.value)
        assert mgr.all_steps() == []


def test_the_advice_for_sparse_coo_round_trips(tmp_path):
    t = torch.sparse_coo_tensor(torch.tensor([[0, 1, 1], [2, 0, 2]]),
                                torch.tensor([1.5, -2.0, 3.25]), (2, 3))
    c = t.coalesce()
    xla_ckpt.save({"emb": {"indices": c.indices(), "values": c.values(),
                           "shape": list(t.shape)}}, str(tmp_path / "ck"))
    got = xla_ckpt.load(str(tmp_path / "ck"))["emb"]
    back = torch.sparse_coo_tensor(got["indices"], got["values"], got["shape"])
    assert back.layout == torch.sparse_coo
    assert torch.equal(back.to_dense(), t.to_dense())
    assert os.listdir(tmp_path / "ck")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_chunked_save_refuses_a_sparse_tensor_on_every_rank(tmp_path):
    import layout_workers as W  # type: ignore[import-not-found]  # a sibling module on sys.path (pytest's prepend mode), as the pool's workers import it

    from xla_ckpt.testing.launcher import shared_pool

    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    results = [r.unwrap() for r in shared_pool(2, xla=False).run(
        W.chunked_save_with_a_sparse_tensor, run_dir, timeout_s=240)]
    for rank_result in results:
        for mode in ("block", "async"):
            kind, message = rank_result[mode]
            assert kind == "CheckpointSaveError", (mode, message)
            assert "nothing was written" in message
            assert ("UnsupportedTensorError: tensor at state['emb'] is sparse (layout "
                    "torch.sparse_coo), which xla_ckpt does not store") in message
        assert rank_result["steps"] == [3]
