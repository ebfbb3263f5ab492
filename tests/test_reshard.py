"""Offline resharding: round trips bit-exact, inputs checked before anything is written."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open

from refit.cli import main
from refit.hf_checkpoint import checkpoint_tensors
from tests.tiny import write_hf_checkpoint


def load_dir(directory: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, (_, _, path) in checkpoint_tensors(directory).items():
        with safe_open(path, framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def assert_same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)), k


def reshard(model: str, src: str, dst: str, i: str, o: str) -> None:
    assert main(["reshard", "--model", model, "--src", src, "--dst", dst, "--in", i, "--out", o]) == 0


CHAINS = {
    "tiny-qwen3-moe": [["megatron:tp2ep2etp2", "vllm:tp2"], ["megatron:tp2pp2vpp2ep4cp2", "vllm:tp2ep2"],
                       ["fsdp:dp3", "megatron:pp3first2ep8", "vllm:tp1dp2"], ["megatron:tp2pp2ep2dp2", "fsdp:dp4", "vllm:tp2dp2ep4"]],
    "tiny-qwen2": [["megatron:tp2", "vllm:tp2"], ["megatron:tp2pp2", "vllm:tp4"], ["fsdp:dp3", "vllm:tp2dp2"]],
    "tiny-llama": [["megatron:tp4pp2vpp2", "vllm:tp8"], ["vllm:tp2", "megatron:tp8"]],
}


@pytest.mark.parametrize("model,chain", [(m, c) for m, cs in CHAINS.items() for c in cs],
                         ids=lambda x: x if isinstance(x, str) else "-".join(x))
def test_round_trip_is_bit_exact(tmp_path, model, chain):
    src = str(tmp_path / "hf")
    write_hf_checkpoint(src, model)
    prev, prev_layout = src, "hf"
    for i, layout in enumerate(chain + ["hf"]):
        out = str(tmp_path / f"step{i}")
        reshard(src, prev_layout, layout, prev, out)
        prev, prev_layout = out, layout
    assert_same_bits(load_dir(src), load_dir(prev))
    assert os.path.exists(os.path.join(prev, "config.json"))


def test_padding_rows_are_zero_and_names_are_the_frameworks(tmp_path):
    src = str(tmp_path / "hf")
    write_hf_checkpoint(src, "tiny-qwen3-moe")
    reshard(src, "hf", "megatron:tp2ep2", src, str(tmp_path / "m"))
    with safe_open(str(tmp_path / "m" / "rank-00001.safetensors"), framework="pt") as f:
        names = set(f.keys())
        emb = f.get_tensor("embedding.word_embeddings.weight")
    # vocab 300 padded to a multiple of 128*2 = 512: rank 1 holds rows 256..511, real rows 256..299
    assert emb.shape == (256, 32)
    assert torch.count_nonzero(emb[44:]) == 0 and torch.count_nonzero(emb[:44]) > 0
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight3" in names
    assert "decoder.layers.1.mlp.linear_fc1.weight" in names  # layer 1 is dense (mlp_only_layers)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names


def test_hf_spec_from_headers_only(tmp_path):
    """Without config.json the spec is inferred from safetensors headers (no data read)."""
    from refit.hf_checkpoint import spec_from_dir
    from tests.tiny import tiny_spec

    src = str(tmp_path / "hf")
    write_hf_checkpoint(src, "tiny-qwen3-moe")
    os.remove(os.path.join(src, "config.json"))
    inferred = spec_from_dir(src)
    assert inferred.digest() == tiny_spec("tiny-qwen3-moe").digest()


@pytest.mark.parametrize("damage,message", [
    ("missing_rank", "missing rank-00001.safetensors"),
    ("wrong_shape", "has shape"),
    ("wrong_dtype", "is float32"),
    ("extra_rank", "beyond the 2 ranks"),
])
def test_bad_reshard_input_is_refused_before_writing(tmp_path, capsys, damage, message):
    from refit.reshard import SafetensorsWriter, rank_file

    src = str(tmp_path / "hf")
    write_hf_checkpoint(src, "tiny-qwen2")
    mdir = str(tmp_path / "m")
    reshard(src, "hf", "megatron:tp2", src, mdir)
    if damage == "missing_rank":
        os.remove(rank_file(mdir, 1))
    elif damage == "extra_rank":
        os.link(rank_file(mdir, 1), rank_file(mdir, 2))
    else:
        with safe_open(rank_file(mdir, 0), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        key = "decoder.layers.0.self_attention.linear_proj.weight"
        tensors[key] = tensors[key][:, :-1].contiguous() if damage == "wrong_shape" else tensors[key].float()
        w = SafetensorsWriter(rank_file(mdir, 0), [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in tensors.items()])
        for k, v in tensors.items():
            w.write(k, v)
        w.close()
    out = str(tmp_path / "out")
    rc = main(["reshard", "--model", src, "--src", "megatron:tp2", "--dst", "vllm:tp2", "--in", mdir, "--out", out])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert not os.path.exists(out) or not os.listdir(out)
