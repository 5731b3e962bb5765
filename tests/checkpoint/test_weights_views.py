"""The safetensors header names as shared only tensors whose memory overlaps (issue 44 item 11): a fused QKV
weight split into three views of one storage is three separate tensors, not three tied ones; a weight used
twice (an embedding and the output layer) is still named."""
from __future__ import annotations

import json

import pytest
import torch

from ddp_kit.checkpoint.weights import save_weights

safetensors = pytest.importorskip("safetensors")


def _header(path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata() or {}


def test_disjoint_views_of_one_storage_are_not_tied_and_overlapping_ones_are(tmp_path):
    from safetensors.torch import load_file

    qkv = torch.arange(3 * 4 * 4, dtype=torch.float32).reshape(12, 4)
    q, k, v = qkv.split(4)  # views of one storage, disjoint
    embed = torch.randn(5, 4)
    state = {"attn.q.weight": q, "attn.k.weight": k, "attn.v.weight": v, "embed.weight": embed, "out.weight": embed,
             "first_rows": qkv[:6], "q_again": qkv[:4]}
    save_weights(state, tmp_path / "m.safetensors")
    shared = json.loads(_header(tmp_path / "m.safetensors").get("shared", "{}"))
    # out.weight is embed.weight; q_again and first_rows overlap q; k and v overlap nothing before them but first_rows
    assert shared == {"out.weight": "embed.weight", "first_rows": "attn.q.weight", "q_again": "attn.q.weight"}, shared
    back = load_file(str(tmp_path / "m.safetensors"))
    for key, value in state.items():
        assert torch.equal(back[key], value), key


def test_a_fused_qkv_split_alone_has_no_shared_entry(tmp_path):
    q, k, v = torch.randn(12, 4).split(4)
    save_weights({"q": q, "k": k, "v": v}, tmp_path / "m.safetensors")
    assert "shared" not in _header(tmp_path / "m.safetensors")
