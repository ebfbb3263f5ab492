"""Offline resharding: a directory of one layout's per-rank safetensors into another's.

Offline form of a layout: ``rank-{r:05d}.safetensors`` per rank, holding that rank's local tensors
under the framework's own local names; for ``hf``, an ordinary HF checkpoint directory (one or
several ``*.safetensors`` plus ``config.json``).

Outputs never lie: everything is written into a temporary directory beside ``out_dir``, each file
fsynced, and published with a rename only once complete (an existing ``out_dir`` is replaced only
with ``force``).  A run that dies leaves the old ``out_dir`` as it was; a run that fails removes its
temporary directory, and one killed outright (no ``finally`` runs) leaves it to the next run for
the same ``out_dir``, which removes it once its creator is gone (`remove_stale_staging`).  The
output is created as ``mkdir`` would, honoring the umask.  Inputs are checked — headers parsed and
bounded, byte ranges as the safetensors library wants them, every byte present — before anything
is written; an error the library raises anyway is one `RefitError` line, naming the file.

Memory stays bounded by one output tensor plus the slices read for it: inputs are read lazily,
slice by slice (``safe_open(...).get_slice``), and outputs are streamed to disk one tensor at a time
(`SafetensorsWriter`), so a rank's file never has to fit in memory whole.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import socket
import struct
from contextlib import ExitStack
from typing import Any, Callable, Iterable, Iterator

from refit.dtypes import DTYPE_BYTES, DTYPES, FROM_SAFETENSORS, TO_SAFETENSORS
from refit.errors import InvalidInput
from refit.hf_checkpoint import check_checkpoint, checkpoint_tensors, read_safetensors_header
from refit.layouts import Layout, LocalTensor, QuantizedLayout
from refit.planners.base import SourceIndex, source_index, sources_for
from refit.regions import PieceIndex, slices
from refit.spec import ModelSpec, check_tensor_table, quantize_spec

log = logging.getLogger(__name__)


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank:05d}.safetensors")


# ---------------------------------------------------------------------------------------------
# Reading and checking the input


class ShardReader:
    """Lazy access to one layout's offline form: ``read(rank, local_name, start, size)``."""

    def __init__(self, spec: ModelSpec, layout: Layout, directory: str) -> None:
        self.spec, self.layout, self.directory = spec, layout, directory
        self._stack = ExitStack()
        self._files: dict[tuple[int, str], Any] = {}
        self.locations: dict[tuple[int, str], str] = {}  # (rank, local name) -> file
        self._indexes: dict[int, PieceIndex] = {}
        if not os.path.isdir(directory):
            raise InvalidInput(f"input directory {directory} does not exist")
        if layout.framework == "hf":
            found = checkpoint_tensors(directory)
            if not found:
                raise InvalidInput(f"{directory}: no *.safetensors files (expected an HF checkpoint)")
            check_checkpoint(spec, found, directory)
            self.locations = {(0, name): path for name, (_, _, path) in found.items()}
        else:
            self._check_rank_files()

    def _check_rank_files(self) -> None:
        world = self.layout.world_size
        if not os.path.isdir(self.directory):
            raise InvalidInput(f"input directory {self.directory} does not exist")
        extra = sorted(f for f in os.listdir(self.directory) if f.startswith("rank-") and f.endswith(".safetensors")
                       and f > os.path.basename(rank_file(self.directory, world - 1)))
        if extra:
            raise InvalidInput(f"{self.directory}: {extra[0]} is beyond the {world} ranks of {self.layout.describe()}")
        for rank in range(world):
            path = rank_file(self.directory, rank)
            if not os.path.exists(path):
                raise InvalidInput(f"{self.directory}: missing {os.path.basename(path)} "
                                 f"({self.layout.describe()} has {world} ranks)")
            header = read_safetensors_header(path)
            expected = self.layout.local_tensors(self.spec, rank)
            check_rank_header(header, expected, path)
            for lt in expected:
                self.locations[(rank, lt.name)] = path

    def index(self, rank: int) -> PieceIndex:
        """The pieces of a source rank (computed once per rank)."""
        if rank not in self._indexes:
            self._indexes[rank] = PieceIndex(self.layout.local_tensors(self.spec, rank))
        return self._indexes[rank]

    def read(self, rank: int, local: str, start: tuple[int, ...], size: tuple[int, ...]) -> "Any":
        """Elements ``start/size`` of local tensor ``local`` on ``rank`` (coordinates on the
        tensor's own dimensions), as a torch tensor."""
        from safetensors import SafetensorError, safe_open

        path = self.locations[(rank, local)]
        key = (rank, path)
        try:
            if key not in self._files:
                self._files[key] = self._stack.enter_context(safe_open(path, framework="pt"))
            return self._files[key].get_slice(local)[slices(start, size)]
        except SafetensorError as e:  # the headers were checked: a file changed since, or a check missed
            raise InvalidInput(f"{path}: safetensors cannot read tensor {local[:80]!r}: {str(e)[:200]}") from None
        except OSError as e:
            raise InvalidInput(f"{path}: cannot read: {e.strerror or e}") from None

    def close(self) -> None:
        self._stack.close()


def check_rank_header(header: dict[str, dict[str, Any]], expected: list[LocalTensor], path: str) -> None:
    """Refuse a rank file whose tensors differ from the layout's: name the first difference."""
    found = {n: (tuple(i["shape"]), FROM_SAFETENSORS.get(i["dtype"], i["dtype"])) for n, i in header.items()}
    check_tensor_table(found, {lt.name: (lt.shape, lt.dtype) for lt in expected}, os.path.basename(path))


# ---------------------------------------------------------------------------------------------
# Writing


class SafetensorsWriter:
    """Writes a .safetensors file one tensor at a time; the header is known up front."""

    def __init__(self, path: str, tensors: Iterable[tuple[str, tuple[int, ...], str]],
                 metadata: dict[str, str] | None = None) -> None:
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        self._order: list[str] = []
        self._nbytes: dict[str, int] = {}
        for name, shape, dtype in tensors:
            n = DTYPE_BYTES[dtype]
            for d in shape:
                n *= d
            header[name] = {"dtype": TO_SAFETENSORS[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._order.append(name)
            self._nbytes[name] = n
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._file = open(path + ".partial", "wb")
        self._path = path
        self._file.write(struct.pack("<Q", len(blob)) + blob)
        self._next = 0

    def write(self, name: str, tensor: Any) -> None:
        """Tensors must come in the order they were declared."""
        if self._order[self._next] != name:
            raise AssertionError(f"wrote {name} but {self._order[self._next]} is next")
        import torch

        data = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        if len(data) != self._nbytes[name]:
            raise AssertionError(f"{name}: {len(data)} bytes, declared {self._nbytes[name]}")
        self._file.write(data)
        self._next += 1

    def abort(self) -> None:
        """Close the partial file (a run that failed; the caller removes its directory)."""
        if not self._file.closed:
            self._file.close()

    def close(self) -> None:
        if self._next != len(self._order):
            raise AssertionError(f"{len(self._order) - self._next} tensors not written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._path + ".partial", self._path)


# ---------------------------------------------------------------------------------------------
# Resharding


def assemble(spec: ModelSpec, lt: LocalTensor, reader: ShardReader, src_index: SourceIndex) -> "Any":
    """Build one destination local tensor from the source files; padding stays zero."""
    import torch

    out = torch.zeros(lt.shape, dtype=getattr(torch, DTYPES[lt.dtype].torch))
    ndim_cache: dict[str, int] = {}
    for piece in lt.pieces:
        ndim = ndim_cache.setdefault(piece.tensor, len(spec[piece.tensor].shape))
        view = out.view(lt.view_shape(ndim))
        for part, ranks in sources_for(src_index, piece.tensor, (piece.start, piece.size), f"{lt.name}"):
            rank = ranks[0]
            src = reader.index(rank)
            for region in src.regions(piece.tensor, part):
                canon = tuple(p + b for p, b in zip(part[0], region.box_start))
                src_lt = src.tensors[region.local]
                lead = ndim - len(src_lt.shape)
                data = reader.read(rank, region.local, region.local_start[lead:], region.size[lead:])
                at = tuple(l + c - s for l, c, s in zip(piece.local_start, canon, piece.start))
                view[slices(at, region.size)] = data.reshape(region.size)
    return out


def _quantized_locals(spec: ModelSpec, dst: QuantizedLayout, out_spec: ModelSpec, rank: int, reader: ShardReader,
                      index: SourceIndex) -> Iterator[tuple[str, Any]]:
    """A rank's local tensors of a quantized ``dst``, in its order: each local tensor of the
    framework's unquantized layout assembled, and where it holds quantized weights, quantized
    into its values and its scales (`refit.executor.quantize`, as vLLM quantizes)."""
    from refit.executor.quantize import quantize

    scales = dst.scale_locals(out_spec, rank)
    for lt in dst.inner.local_tensors(spec, rank):
        data = assemble(spec, lt, reader, index)
        if lt.name not in scales:
            yield lt.name, data
            continue
        values, scale = quantize(dst.quantization, data)
        yield lt.name, values
        yield scales[lt.name], scale


def check_output(in_dir: str, out_dir: str, force: bool = False) -> None:
    """Refuse an output that would overwrite the input, a file, or (without ``force``) a
    directory that holds anything."""
    if os.path.islink(out_dir):
        raise InvalidInput(f"--out {out_dir} is a symlink: give the directory itself")
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise InvalidInput(f"--out {out_dir} is a file, not a directory")
    src, dst = os.path.realpath(in_dir), os.path.realpath(out_dir)
    if src == dst or dst.startswith(src + os.sep) or src.startswith(dst + os.sep):
        raise InvalidInput(f"--in {in_dir} and --out {out_dir} overlap: write somewhere else")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not force:
        entries = sorted(os.listdir(out_dir))
        raise InvalidInput(f"--out {out_dir} is not empty ({len(entries)} entries, e.g. {entries[0]}): "
                         f"pass --force to replace it")


STAGING_TAG = re.compile(r"(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}(?P<old>\.old)?")


def staging_dir(out_dir: str) -> str:
    """A new, empty directory beside ``out_dir`` to write into, named
    ``.<name>.refit-<host>-<pid>-<random>``: host and pid let a later run tell whether the run that
    made it is still alive.  Made as ``mkdir`` makes directories, honoring the umask
    (`tempfile.mkdtemp` makes them 0700, and the published output kept that mode)."""
    prefix = os.path.join(os.path.dirname(out_dir), f".{os.path.basename(out_dir)}.refit-{_host()}-{os.getpid()}-")
    while True:
        path = prefix + secrets.token_hex(4)
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def remove_stale_staging(out_dir: str) -> None:
    """Remove the staging directories beside ``out_dir`` (`staging_dir`) of runs for it that were
    killed mid-write — ``.partial`` files, up to a model's size, that nothing else removes.  A
    directory whose process is alive (a concurrent run), or was made on another host (which we
    cannot ask), is left alone; so is an old output a dead run had moved aside (``.old``) while
    ``out_dir`` is missing: it may be the only copy."""
    parent, name = os.path.split(out_dir)
    stem = f".{name}.refit-"
    try:
        entries = sorted(e for e in os.listdir(parent) if e.startswith(stem))
    except OSError:  # no parent yet, or not readable: nothing of ours there
        return
    for entry in entries:
        path, m = os.path.join(parent, entry), STAGING_TAG.fullmatch(entry[len(stem):])
        if m is None or m["host"] != _host():
            log.warning("%s: left alone, made by a run refit cannot check (another host, or an older refit); "
                        "delete it if no reshard into %s is running", path, out_dir)
        elif _alive(int(m["pid"])):
            continue
        elif m["old"] and not os.path.isdir(out_dir):
            log.warning("%s holds the output a killed run had moved aside from %s: rename it back", path, out_dir)
        else:
            log.warning("removing %s, left by a reshard (pid %s) that did not finish", path, m["pid"])
            shutil.rmtree(path, ignore_errors=True)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "localhost"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


def publish(tmp: str, out_dir: str) -> None:
    """Make the complete ``tmp`` directory ``out_dir`` with renames (and fsyncs): readers see the
    old directory or the new one, never a mix."""
    _fsync_dir(tmp)
    old = None
    if os.path.isdir(out_dir):
        old = f"{tmp}.old"
        os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        if old:  # the old output goes back where it was: no run leaves --out missing
            os.rename(old, out_dir)
        raise
    _fsync_dir(os.path.dirname(out_dir))
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def reshard(spec: ModelSpec, src: Layout, dst: Layout, in_dir: str, out_dir: str,
            hf_config: dict[str, Any] | None = None, progress: Callable[[int], None] | None = None,
            force: bool = False) -> dict[str, Any]:
    """Convert ``in_dir`` (layout ``src``) into ``out_dir`` (layout ``dst``), bit-exact.  Layouts
    must be resolved.  A ``dst`` resolved on the quantized form of ``spec`` (`refit.spec.quantize_spec`)
    quantizes on the way: each weight it covers is written as values and block scales, as vLLM's
    block quantization of it gives.  ``force``: replace a non-empty ``out_dir``.  Returns a small report
    (files, tensors, bytes).  Raises `refit.InvalidInput` (nothing published) on any bad input or I/O error."""
    out_dir = os.path.abspath(out_dir)
    remove_stale_staging(out_dir)
    check_output(in_dir, out_dir, force)
    reader = ShardReader(spec, src, in_dir)  # checks every input file before writing anything
    index = source_index(spec, src)
    # quantizing on the way: ``dst`` was resolved on the quantized spec (`refit.layouts.quantized`)
    quantize = isinstance(dst, QuantizedLayout) and not spec.config.quantization
    out_spec = quantize_spec(spec, dst.quantization) if quantize else spec
    tmp = ""
    files, tensors, nbytes = [], 0, 0
    try:
        os.makedirs(os.path.dirname(out_dir), exist_ok=True)
        tmp = staging_dir(out_dir)
        for rank in range(dst.world_size):
            locals_ = dst.local_tensors(out_spec, rank)
            name = "model.safetensors" if dst.framework == "hf" else os.path.basename(rank_file(out_dir, rank))
            writer = SafetensorsWriter(os.path.join(tmp, name), [(lt.name, lt.shape, lt.dtype) for lt in locals_],
                                       {"format": "pt", "refit_layout": dst.describe(), "refit_rank": str(rank)})
            try:
                made = _quantized_locals(spec, dst, out_spec, rank, reader, index) if quantize else \
                    ((lt.name, assemble(spec, lt, reader, index)) for lt in locals_)
                for lt, (local, data) in zip(locals_, made):  # both in the layout's order (the writer checks)
                    writer.write(local, data)
                    tensors += 1
                    nbytes += lt.nbytes
                    if progress:
                        progress(lt.nbytes)
                writer.close()
            finally:
                writer.abort()
            files.append(name)
            log.info("wrote %s (%d tensors)", name, len(locals_))
        if dst.framework == "hf" and hf_config is not None:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(hf_config, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            files.append("config.json")
        publish(tmp, out_dir)
    except OSError as e:
        raise InvalidInput(f"writing {out_dir}: {e.strerror or e}{f' ({e.filename})' if e.filename else ''}") from None
    finally:
        reader.close()
        if tmp and os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return {"files": len(files), "tensors": tensors, "bytes": nbytes, "out": out_dir}
