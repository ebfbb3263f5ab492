"""Offline resharding: round trips bit-exact, inputs checked before anything is written."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open

from refit.cli import main
from refit.hf_checkpoint import checkpoint_tensors
from refit.sides import Side
from tests.harness.tiny import write_hf_checkpoint


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
                       ["fsdp:dp3", "megatron:pp3first2ep8", "vllm:tp1dp2"], ["megatron:tp2pp2ep2dp2", "fsdp:dp4", "vllm:tp2dp2ep4"],
                       ["fsdp:dp3fused1", "vllm:tp2", "fsdp:dp8fused1rep2"]],
    "tiny-qwen2": [["megatron:tp2", "vllm:tp2"], ["megatron:tp2pp2", "vllm:tp4"], ["fsdp:dp3", "vllm:tp2dp2"],
                   ["megatron:tp2vocabdiv1", "fsdp:dp2rep2", "megatron:tp2vocabdiv4", "vllm:tp2"],
                   ["fsdp:dp2tp2", "megatron:tp2"]],
    "tiny-llama": [["megatron:tp4pp2vpp2", "vllm:tp8"], ["vllm:tp2", "megatron:tp8"],
                   ["fsdp:dp3tp2", "vllm:tp2", "fsdp:dp2rep2tp3"]],
    # MLA: the local spec's split down-projections (local1), the TE spec's whole ones
    "tiny-deepseek-v3": [["megatron:tp2ep2local1", "vllm:tp2", "megatron:tp2pp2ep2", "megatron:tp4local1"]],
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


def test_vocab_padded_as_the_trainer_pads_it(tmp_path):
    """``vocabdiv``: a trainer that pads the vocab otherwise than Megatron's 128 * tp (mbridge and
    verl's Megatron bridge build DeepSeek-V3's embedding unpadded: vocab 250 at tp2, 125 rows)."""
    src = str(tmp_path / "hf")
    write_hf_checkpoint(src, "tiny-qwen2")
    for layout, rows in (("megatron:tp2vocabdiv1", 125), ("megatron:tp2vocabdiv4", 128), ("megatron:tp2", 128)):
        out = tmp_path / layout.replace(":", "-")
        reshard(src, "hf", layout, src, str(out))
        with safe_open(str(out / "rank-00001.safetensors"), framework="pt") as f:
            assert f.get_tensor("embedding.word_embeddings.weight").shape == (rows, 32), layout


def test_hf_spec_from_headers_only(tmp_path):
    """Without config.json the spec is inferred from safetensors headers (no data read)."""
    from refit.hf_checkpoint import spec_from_dir
    from tests.harness.tiny import tiny_spec

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


# ---------------------------------------------------------------------------------------------
# Outputs that never lie, inputs refused before anything is written (one line, exit 2).


def _rc(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    err = capsys.readouterr().err
    return rc, err


def _tp2(tmp_path) -> tuple[str, str]:
    src = str(tmp_path / "hf")
    write_hf_checkpoint(src, "tiny-qwen2")
    mdir = str(tmp_path / "m")
    reshard(src, "hf", "megatron:tp2", src, mdir)
    return src, mdir


def _no_leftovers(tmp_path) -> None:
    left = [p for p in tmp_path.rglob("*") if ".refit-" in p.name or p.name.endswith(".partial")]
    assert not left, left


def test_killed_run_leaves_the_old_output_as_it_was(tmp_path):
    import subprocess
    import sys

    src, mdir = _tp2(tmp_path)
    out = str(tmp_path / "out")
    reshard(src, "megatron:tp2", "vllm:tp2", mdir, out)
    before = load_dir_ranks(out)
    write_hf_checkpoint(src, "tiny-qwen2", seed=1)  # new weights, same model
    reshard(src, "hf", "megatron:tp2", src, str(tmp_path / "m2"))
    code = ("import os, sys; import refit.reshard as r; n = [0]; w = r.SafetensorsWriter.write\n"
            "def write(self, name, t):\n    n[0] += 1\n    w(self, name, t)\n    if n[0] == 5: os._exit(9)\n"
            "r.SafetensorsWriter.write = write\nfrom refit.cli import main\n"
            f"sys.exit(main(['reshard', '--model', {src!r}, '--src', 'megatron:tp2', '--dst', 'vllm:tp2', "
            f"'--in', {str(tmp_path / 'm2')!r}, '--out', {out!r}, '--force']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    after = load_dir_ranks(out)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k].view(torch.int16), after[k].view(torch.int16)), k


def load_dir_ranks(directory: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(directory)):
        with safe_open(os.path.join(directory, f), framework="pt") as g:
            out.update({f"{f}:{k}": g.get_tensor(k) for k in g.keys()})
    return out


def test_non_empty_out_is_refused_unless_forced(tmp_path, capsys):
    src, mdir = _tp2(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "rank-00007.safetensors").write_bytes(b"stale")
    args = ["reshard", "--model", src, "--src", "megatron:tp2", "--dst", "vllm:tp2", "--in", mdir, "--out", str(out)]
    rc, err = _rc(capsys, *args)
    assert rc == 2 and "is not empty" in err and "--force" in err
    assert main(args + ["--force"]) == 0
    assert sorted(os.listdir(out)) == ["rank-00000.safetensors", "rank-00001.safetensors"]  # the stale rank is gone
    _no_leftovers(tmp_path)


def test_out_that_is_the_input_or_a_file_is_refused(tmp_path, capsys):
    src, mdir = _tp2(tmp_path)
    before = load_dir_ranks(mdir)
    link = tmp_path / "link"
    link.symlink_to(mdir)
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, msg in ((str(link), "symlink"), (mdir, "overlap"), (os.path.join(mdir, "sub"), "overlap"),
                     (str(afile), "is a file")):
        rc, err = _rc(capsys, "reshard", "--model", src, "--src", "megatron:tp2", "--dst", "megatron:tp2", "--in", mdir,
                      "--out", out, "--force")
        assert rc == 2 and msg in err and "Traceback" not in err, (out, err)
    after = load_dir_ranks(mdir)
    assert all(torch.equal(before[k].view(torch.int16), after[k].view(torch.int16)) for k in before)


@pytest.mark.parametrize("damage,message", [
    ("truncated", "truncated"),
    ("cut_header", "not a safetensors file"),
    ("not_json", "header is not JSON"),
    ("deep_json", "header is not JSON"),
    ("bad_entry", "malformed header entry"),
    ("tiny", "not a safetensors file"),
])
def test_damaged_input_is_one_line_and_nothing_is_written(tmp_path, capsys, damage, message):
    import struct

    src, mdir = _tp2(tmp_path)
    path = os.path.join(mdir, "rank-00001.safetensors")
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    blob = {"truncated": data[:-100], "cut_header": data[:8 + n // 2], "tiny": data[:5],
            "not_json": data[:8] + b"\xff" * n + data[8 + n:],
            "deep_json": struct.pack("<Q", 200_000) + b"[" * 200_000,
            "bad_entry": (lambda h: struct.pack("<Q", len(h)) + h)(b'{"x": {"dtype": "BF16", "shape": "no"}}')}[damage]
    open(path, "wb").write(blob)
    out = str(tmp_path / "out")
    rc, err = _rc(capsys, "reshard", "--model", src, "--src", "megatron:tp2", "--dst", "vllm:tp2", "--in", mdir,
                  "--out", out)
    errors = [line for line in err.splitlines() if line.startswith("refit: error:")]
    assert rc == 2 and len(errors) == 1 and message in errors[0] and "Traceback" not in err, err
    assert not os.path.exists(out)
    _no_leftovers(tmp_path)


def test_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    import errno

    from refit import reshard as mod

    src, mdir = _tp2(tmp_path)
    calls = [0]
    real = mod.SafetensorsWriter.write

    def write(self, name, t):
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, name, t)

    monkeypatch.setattr(mod.SafetensorsWriter, "write", write)
    out = str(tmp_path / "out")
    rc, err = _rc(capsys, "reshard", "--model", src, "--src", "megatron:tp2", "--dst", "vllm:tp2", "--in", mdir,
                  "--out", out)
    assert rc == 2 and "No space left on device" in err and "Traceback" not in err, err
    assert not os.path.exists(out)
    _no_leftovers(tmp_path)


def test_missing_input_is_one_line(tmp_path, capsys):
    src, _ = _tp2(tmp_path)
    rc, err = _rc(capsys, "reshard", "--model", src, "--src", "megatron:tp2", "--dst", "vllm:tp2",
                  "--in", str(tmp_path / "nope"), "--out", str(tmp_path / "out"))
    assert rc == 2 and "is not a directory" in err


def test_hf_stray_file_is_refused_and_the_index_is_followed(tmp_path, capsys):
    import json
    import shutil

    src = str(tmp_path / "hf")
    write_hf_checkpoint(src, "tiny-qwen2", files=1)
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    main_file = files[0]
    stray = str(tmp_path / "stray")
    write_hf_checkpoint(stray, "tiny-qwen2", seed=5, files=1)
    shutil.copy(os.path.join(stray, main_file), os.path.join(src, "zz-stray.safetensors"))
    out = str(tmp_path / "out")
    args = ["reshard", "--model", src, "--src", "hf", "--dst", "vllm:tp2", "--in", src, "--out", out]
    rc, err = _rc(capsys, *args)
    assert rc == 2 and "is in both" in err and not os.path.exists(out), err
    with safe_open(os.path.join(src, main_file), framework="pt") as f:
        names = list(f.keys())
    with open(os.path.join(src, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: main_file for n in names}}, f)
    assert main(args) == 0
    back = str(tmp_path / "back")
    reshard(src, "vllm:tp2", "hf", out, back)
    want = {}
    with safe_open(os.path.join(src, main_file), framework="pt") as f:
        want = {n: f.get_tensor(n) for n in names}
    assert_same_bits(want, load_dir(back))


@pytest.mark.parametrize("model,dst,whole", [
    ("tiny-deepseek-v3", "vllm:tp2ep4", True),  # tp2 dp2 with expert parallel: MoE runs sequence parallel
    ("tiny-deepseek-v3", "vllm:tp2dp2", False),  # no expert parallel: split over tp
    ("tiny-glm4-moe", "vllm:tp2ep4", False),  # Glm4MoE always splits its shared experts over tp
])
def test_vllm_shared_experts_follow_sequence_parallel_moe(tmp_path, model, dst, whole):
    """vLLM 0.32's DeepseekV2MoE builds its shared experts with disable_tp when
    ParallelConfig.use_sequence_parallel_moe (expert parallel, tp > 1, dp > 1, default all2all
    backend): every rank then holds [gate; up] and down whole."""
    src = str(tmp_path / "hf")
    write_hf_checkpoint(src, model)
    reshard(src, "hf", dst, src, str(tmp_path / "v"))
    hf = load_dir(src)
    gate, up, down = (hf[f"model.layers.1.mlp.shared_experts.{x}_proj.weight"] for x in ("gate", "up", "down"))
    n = gate.shape[0] if whole else gate.shape[0] // 2
    for rank in range(4):
        with safe_open(str(tmp_path / "v" / f"rank-{rank:05d}.safetensors"), framework="pt") as f:
            gate_up = f.get_tensor("model.layers.1.mlp.shared_experts.gate_up_proj.weight")
            got_down = f.get_tensor("model.layers.1.mlp.shared_experts.down_proj.weight")
        t = 0 if whole else rank % 2
        want = torch.cat([gate[t * n:(t + 1) * n], up[t * n:(t + 1) * n]])
        assert torch.equal(gate_up.view(torch.int16), want.view(torch.int16)), rank
        assert torch.equal(got_down.view(torch.int16), down[:, t * n:(t + 1) * n].contiguous().view(torch.int16)), rank


def test_a_failed_publish_puts_the_old_output_back(tmp_path, capsys, monkeypatch):
    """The rename of the new directory into place fails after the old one was moved aside:
    before, --out was left missing (the old output hidden in a .refit-*.old directory)."""
    import errno

    from refit import reshard as mod

    src, mdir = _tp2(tmp_path)
    out = str(tmp_path / "out")
    reshard(src, "megatron:tp2", "vllm:tp2", mdir, out)
    before = load_dir_ranks(out)
    real = os.rename

    def rename(a, b):
        if os.path.abspath(b) == out and ".refit-" in a and not a.endswith(".old"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), a)
        real(a, b)

    monkeypatch.setattr(mod.os, "rename", rename)
    rc, err = _rc(capsys, "reshard", "--model", src, "--src", "megatron:tp2", "--dst", "vllm:tp2", "--in", mdir,
                  "--out", out, "--force")
    assert rc == 2 and "Input/output error" in err, err
    after = load_dir_ranks(out)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_failed_run_closes_its_partial_file(tmp_path, monkeypatch):
    from refit import reshard as mod
    from refit.errors import RefitError
    from refit.layouts import resolve_layout
    from refit.hf_checkpoint import load_spec

    src, mdir = _tp2(tmp_path)
    spec = load_spec(src)
    writers = []
    init = mod.SafetensorsWriter.__init__

    def remember(self, *a, **k):
        init(self, *a, **k)
        writers.append(self)

    def fail(*a, **k):
        raise RefitError("source layout does not hold it")

    monkeypatch.setattr(mod.SafetensorsWriter, "__init__", remember)
    monkeypatch.setattr(mod, "assemble", fail)
    with pytest.raises(RefitError):
        mod.reshard(spec, resolve_layout("megatron:tp2", spec, Side.TRAINER), resolve_layout("vllm:tp2", spec, Side.ENGINE),
                    mdir, str(tmp_path / "out"))
    assert writers and all(w._file.closed for w in writers)


# ---------------------------------------------------------------------------------------------
# Headers the safetensors library refuses: one line naming file and tensor, exit 2 (an overlap
# was a SafetensorError traceback, exit 1, after files had been written).


def _edit_rank_file(path: str, damage: str) -> str:
    """Rewrite ``path``'s header (and data length) by hand; returns the tensor the damage is on."""
    import json
    import struct

    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    second, last = header[names[1]], header[names[-1]]
    if damage == "overlap":  # the second tensor starts 2 bytes inside the first
        second["data_offsets"] = [o - 2 for o in second["data_offsets"]]
    elif damage == "same_range":
        second["data_offsets"] = list(header[names[0]]["data_offsets"])
    elif damage == "gap":
        last["data_offsets"] = [o + 2 for o in last["data_offsets"]]
        body += b"\0\0"
    elif damage == "size":  # offsets that do not match shape x dtype
        last["data_offsets"][1] -= 2
        body = body[:-2]
    elif damage == "trailing":
        body += b"\0" * 8
    elif damage == "dtype":
        last["dtype"] = "Q9"
    blob = json.dumps(header).encode()
    open(path, "wb").write(struct.pack("<Q", len(blob)) + blob + body)
    return {"overlap": names[1], "same_range": names[1], "trailing": ""}.get(damage, names[-1])


@pytest.mark.parametrize("damage,message", [
    ("overlap", "overlaps tensor"),
    ("same_range", "overlaps tensor"),
    ("gap", "leaves a gap of 2 bytes"),
    ("size", "takes"),
    ("trailing", "8 bytes after the last tensor"),
    ("dtype", "not a safetensors dtype"),
])
def test_a_header_the_library_refuses_is_one_line_naming_file_and_tensor(tmp_path, capsys, damage, message):
    from safetensors import SafetensorError

    src, mdir = _tp2(tmp_path)
    path = os.path.join(mdir, "rank-00001.safetensors")
    tensor = _edit_rank_file(path, damage)
    with pytest.raises(SafetensorError):  # the library refuses the file: we must too, first
        safe_open(path, framework="pt")
    out = str(tmp_path / "out")
    rc, err = _rc(capsys, "reshard", "--model", src, "--src", "megatron:tp2", "--dst", "vllm:tp2", "--in", mdir,
                  "--out", out)
    errors = [line for line in err.splitlines() if line.startswith("refit: error:")]
    assert rc == 2 and len(errors) == 1 and message in errors[0] and "Traceback" not in err, err
    assert path in errors[0] and repr(tensor)[1:-1] in errors[0], errors[0]
    assert not os.path.exists(out)
    _no_leftovers(tmp_path)


def test_a_safetensors_error_raised_mid_run_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """Whatever the header check misses (or a file changed after it): the library's
    SafetensorError, raised while outputs are being written, is one line, exit 2, and the
    staging directory is removed."""
    from refit import hf_checkpoint

    src, mdir = _tp2(tmp_path)
    _edit_rank_file(os.path.join(mdir, "rank-00001.safetensors"), "overlap")
    monkeypatch.setattr(hf_checkpoint, "check_data_offsets", lambda *a: None, raising=False)  # absent before it existed
    out = str(tmp_path / "out")
    rc, err = _rc(capsys, "reshard", "--model", src, "--src", "megatron:tp2", "--dst", "vllm:tp2", "--in", mdir,
                  "--out", out)
    errors = [line for line in err.splitlines() if line.startswith("refit: error:")]
    assert rc == 2 and len(errors) == 1 and "safetensors cannot read tensor" in errors[0], err
    assert "rank-00001.safetensors" in errors[0] and "Traceback" not in err
    assert not os.path.exists(out)
    _no_leftovers(tmp_path)


# ---------------------------------------------------------------------------------------------
# What killed runs leave behind is removed by the next run; outputs honor the umask.


def _staging_dirs(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if ".refit-" in p.name)


def test_a_killed_runs_staging_directory_is_removed_by_the_next_run(tmp_path):
    """A run killed mid-write (no `finally` runs) leaves .<out>.refit-* of .partial files; it was
    never removed.  The next run for the same --out removes it."""
    import subprocess
    import sys

    src, mdir = _tp2(tmp_path)
    out = str(tmp_path / "out")
    code = ("import os, sys; import refit.reshard as r; w = r.SafetensorsWriter.write\n"
            "def write(self, name, t):\n    w(self, name, t)\n    os._exit(9)\n"
            "r.SafetensorsWriter.write = write\nfrom refit.cli import main\n"
            f"sys.exit(main(['reshard', '--model', {src!r}, '--src', 'megatron:tp2', '--dst', 'vllm:tp2', "
            f"'--in', {mdir!r}, '--out', {out!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    left = _staging_dirs(tmp_path)
    assert len(left) == 1 and any(f.endswith(".partial") for f in os.listdir(tmp_path / left[0])), left
    reshard(src, "megatron:tp2", "vllm:tp2", mdir, out)
    assert _staging_dirs(tmp_path) == [] and sorted(os.listdir(out)) == ["rank-00000.safetensors",
                                                                          "rank-00001.safetensors"]


def test_only_dead_runs_staging_directories_are_removed(tmp_path):
    """A concurrent live run's directory (its pid alive) and another host's are left alone; a dead
    run's, and the old output a dead run moved aside once --out exists again, are removed."""
    import subprocess

    from refit.reshard import _host

    src, mdir = _tp2(tmp_path)
    out = tmp_path / "out"
    dead = subprocess.Popen(["true"])
    dead.wait()
    names = {"dead": f".out.refit-{_host()}-{dead.pid}-0123abcd", "dead_old": f".out.refit-{_host()}-{dead.pid}-4567abcd.old",
             "live": f".out.refit-{_host()}-{os.getpid()}-89abcdef", "other_host": f".out.refit-elsewhere-{dead.pid}-0123abcd",
             "other_out": f".out2.refit-{_host()}-{dead.pid}-0123abcd"}
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "rank-00000.safetensors.partial").write_bytes(b"x" * 100)
    out.mkdir()  # --out is there: the .old is a leftover, not the only copy
    reshard(src, "megatron:tp2", "vllm:tp2", mdir, str(out))
    assert _staging_dirs(tmp_path) == sorted([names["live"], names["other_host"], names["other_out"]])


def test_an_old_output_moved_aside_by_a_killed_run_is_kept_while_out_is_missing(tmp_path):
    from refit.reshard import _host, remove_stale_staging

    dead = __import__("subprocess").Popen(["true"])
    dead.wait()
    old = tmp_path / f".out.refit-{_host()}-{dead.pid}-0123abcd.old"
    old.mkdir()
    remove_stale_staging(str(tmp_path / "out"))
    assert old.is_dir()  # the only copy of the previous output: not ours to delete


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_outputs_honor_the_umask(tmp_path, umask):
    """Output directories were created 0700 (tempfile.mkdtemp), whatever the umask."""
    src, mdir = _tp2(tmp_path)
    out = tmp_path / "new" / "out"
    old = os.umask(umask)
    try:
        reshard(src, "megatron:tp2", "vllm:tp2", mdir, str(out))
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777, out.parent.stat().st_mode & 0o777) == (0o777 & ~umask,) * 2
    assert {f.stat().st_mode & 0o777 for f in out.iterdir()} == {0o666 & ~umask}
