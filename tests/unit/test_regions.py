"""`refit.regions`: which blocks of a rank's local tensors hold a canonical box."""

from __future__ import annotations

from refit.boxes import volume
from refit.layouts import resolve_layout
from refit.layouts.base import LocalTensor, Piece
from refit.regions import Block, PieceIndex, slices
from refit.sides import Side
from refit.spec import ModelConfig, build_spec


def test_blocks_of_a_box_across_two_pieces() -> None:
    # One local tensor [4, 6] holding rows 0-1 of canonical "a" at local rows 2-3, and rows 4-5 at rows 0-1.
    lt = LocalTensor("x", (4, 6), "bfloat16", (Piece("a", (0, 0), (2, 6), (2, 0)), Piece("a", (4, 0), (2, 6), (0, 0))))
    index = PieceIndex([lt])
    got = index.regions("a", ((1, 2), (4, 3)))  # rows 1-4, columns 2-4
    assert sorted(got) == sorted([Block("x", (3, 2), (0, 0), (1, 3)), Block("x", (0, 2), (3, 0), (1, 3))])
    assert index.regions("a", ((2, 0), (2, 6))) == []  # rows 2-3 are held by no piece
    assert index.regions("b", ((0,), (1,))) == []


def test_blocks_tile_every_local_piece_of_a_real_layout() -> None:
    spec = build_spec("t", ModelConfig(arch="qwen2", hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2,
                                       head_dim=8, intermediate_size=64, vocab_size=250))
    layout = resolve_layout("tp2", spec, Side.ENGINE)
    for rank in range(2):
        index = PieceIndex(layout.local_tensors(spec, rank))
        for t in spec.tensors:
            blocks = index.regions(t.name, ((0,) * len(t.shape), t.shape))
            held = sum(volume(p.size) for lt in layout.local_tensors(spec, rank) for p in lt.pieces if p.tensor == t.name)
            assert sum(volume(b.size) for b in blocks) == held


def test_slices() -> None:
    assert slices((1, 2), (3, 4)) == (slice(1, 4), slice(2, 6))


def _brute(index: PieceIndex, tensor: str, box) -> list[Block]:
    from refit.boxes import intersect

    out = []
    for lt, p in index.by_tensor.get(tensor, ()):
        inter = intersect(box, (p.start, p.size))
        if inter:
            start, size = inter
            local = tuple(ls + s - ps for ls, s, ps in zip(p.local_start, start, p.start))
            out.append(Block(lt.name, local, tuple(s - b for s, b in zip(start, box[0])), size))
    return out


def test_many_pieces_are_found_by_bisection_and_agree_with_a_scan(monkeypatch) -> None:
    """A rank holding 30 layers x 16 experts of one canonical tensor: before, every query compared
    the box with all 480 pieces (a large MoE's share took minutes to compile); now only with the
    few that can meet it, and the answer is the same blocks in the same order."""
    import random

    import refit.regions as regions_mod

    pieces = [Piece("e", (layer, e, 0), (1, 1, 8), (0, 0, 0)) for layer in range(30) for e in range(16)]
    lts = [LocalTensor(f"l{layer}.e{e}", (1, 1, 8), "bfloat16", (p,))
           for (layer, e), p in zip([(la, e) for la in range(30) for e in range(16)], pieces)]
    index = PieceIndex(lts)
    rng = random.Random(0)
    real = regions_mod.intersect
    calls = [0]

    def counted(a, b):
        calls[0] += 1
        return real(a, b)

    for _ in range(200):
        lo = [rng.randrange(30), rng.randrange(16), rng.randrange(8)]
        size = (rng.randint(1, 30 - lo[0]), rng.randint(1, 16 - lo[1]), rng.randint(1, 8 - lo[2]))
        box = (tuple(lo), size)
        assert index.regions("e", box) == _brute(index, "e", box)
    monkeypatch.setattr(regions_mod, "intersect", counted)
    assert len(index.regions("e", ((7, 3, 0), (1, 1, 8)))) == 1
    assert calls[0] <= 16, calls[0]  # the pieces of one layer at most, not all 480
