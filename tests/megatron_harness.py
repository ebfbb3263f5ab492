"""Ground truth from Megatron-Core's *real* code, runnable on a CPU-only box.

Every public function here answers a layout question by executing the code of the
installed ``megatron-core`` package (0.16.1), not by re-deriving the rule:

* ``megatron_rank_coords``            -> ``parallel_state.RankGenerator.get_ranks`` (pure, in process)
* ``megatron_rank_coords_via_initialize`` -> the full ``parallel_state.initialize_model_parallel``
  + ``get_*_rank()`` getters, once per global rank, on torch's in-memory "fake" process-group
  backend (subprocess)
* ``megatron_layer_ids``              -> ``get_num_layers_to_build`` + ``get_transformer_layer_offset``
  (pure, in process; the flexible ``pipeline_model_parallel_layout`` path needs parallel_state's
  pp-rank setter, which is set and restored around the call)
* ``megatron_qkv_rows``               -> a real ``SelfAttention`` (local spec) per TP rank, weights
  initialised through Megatron's own CPU master-weight split, then
  ``SelfAttention.get_query_key_value_tensors`` (subprocess)
* ``megatron_fc1_rows``               -> a real gated ``MLP`` per TP rank, forward through
  ``MLP.forward`` (subprocess)
* ``megatron_fc1_checkpoint_offsets`` -> ``MLP.sharded_state_dict`` / ``apply_swiglu_sharded_factory``
  (where each local fc1 half lands in the dist checkpoint) (subprocess)
* ``te_spec_param_name``              -> NOT executed: documented local->TE name mapping
* ``megatron_gpt_param_names``        -> a real tiny ``GPTModel`` (local, non-TE spec) for every
  (global rank, vp chunk), its ``named_parameters``/persistent buffers and its
  ``sharded_state_dict`` (dist-checkpoint keys, global shapes/offsets) (subprocess)

Subprocess work runs in a separate helper interpreter (``python this_file.py --serve``, started
on first use, imports megatron once, one JSON request per line; every request tears its process
groups / parallel_state down in ``finally``; restarted if it dies; results cached per argument
set).  So the process-global state of ``parallel_state`` / ``torch.distributed`` and the CPU shims
below never touch the calling (pytest) process, and every call can be repeated.
``MEGATRON_HARNESS_FRESH=1`` runs each call in a brand-new interpreter instead
(``python this_file.py <fn>``, JSON on stdin/stdout).

CPU shims used inside the subprocesses only (Megatron hard-codes CUDA in two construction paths):
  * ``torch.cuda.current_device = lambda: "cpu"``  (TopKRouter allocates its expert_bias /
    local_tokens_per_expert buffers with ``device=torch.cuda.current_device()``)
  * ``torch.Tensor.cuda = identity``  (LanguageModule.setup_embeddings_and_output_layer does
    ``weight.data.cuda()`` before the tied-embedding all-reduce when pp > 1)
  * only for ``moe_grouped_gemm=True`` with the local spec: ``grouped_gemm_util.
    assert_grouped_gemm_is_available`` is bypassed so the legacy ``GroupedMLP`` can be *constructed*
    (parameter names/shapes only; its CUDA kernel is never called).
Distributed groups use ``torch.testing._internal.distributed.fake_pg`` (backend ``"fake"``): the
real ``torch.distributed.new_group`` / ``initialize_model_parallel`` code runs and every rank gets
its real group membership and rank, but collectives are no-ops, so any world size can be
simulated one rank at a time in a single process.

Errors raised by Megatron inside a subprocess are re-raised here with the same builtin exception
type (AssertionError, ValueError, RuntimeError, ...) and Megatron's message; non-builtin types
become ``MegatronError``.
"""

from __future__ import annotations

import atexit
import builtins
import functools
import json
import os
import subprocess
import sys
import queue
import tempfile
import threading
import time
import traceback
from typing import Any, Optional

_THIS_FILE = os.path.abspath(__file__)
_SUBPROCESS_TIMEOUT_S = 300
_RESULT_MARK = "@@MEGATRON_HARNESS_RESULT@@"


class MegatronError(Exception):
    """A non-builtin exception raised by Megatron code inside a harness subprocess."""

    def __init__(self, exc_type: str, message: str, tb: str = ""):
        super().__init__(f"{exc_type}: {message}")
        self.exc_type = exc_type
        self.message = message
        self.tb = tb


# --------------------------------------------------------------------------------------------
# subprocess plumbing
# --------------------------------------------------------------------------------------------


def _raise_from_payload(err: dict) -> None:
    exc_type = err.get("type", "Exception")
    message = err.get("message", "")
    builtin = getattr(builtins, exc_type, None)
    if isinstance(builtin, type) and issubclass(builtin, Exception):
        exc = builtin(message)
        exc.megatron_traceback = err.get("traceback", "")  # type: ignore[attr-defined]
        raise exc
    raise MegatronError(exc_type, message, err.get("traceback", ""))


def _subprocess_env() -> dict:
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class _Worker:
    """One long-lived helper interpreter (``python this_file.py --serve``) that imports
    megatron.core once and then runs requests one at a time (JSON line in, marked JSON line out).
    Every request cleans up its process groups / parallel_state in ``finally``; if the worker
    dies it is restarted once.  Set MEGATRON_HARNESS_FRESH=1 to use a brand-new interpreter per
    call instead."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.lock = threading.Lock()
        self.stderr_file = None
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()

    def _start(self) -> None:
        self.stderr_file = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, _THIS_FILE, "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr_file,
            text=True,
            bufsize=1,
            env=_subprocess_env(),
        )
        self.lines = queue.Queue()
        proc, lines = self.proc, self.lines

        def pump() -> None:
            for out in proc.stdout:
                lines.put(out)
            lines.put(None)  # EOF

        threading.Thread(target=pump, daemon=True).start()

    def _stderr_tail(self) -> str:
        try:
            self.stderr_file.seek(0)
            return self.stderr_file.read()[-4000:]
        except Exception:  # noqa: BLE001
            return ""

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001
                self.proc.kill()
        self.proc = None

    def _request_once(self, line: str) -> str:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        tail = []
        deadline = time.monotonic() + _SUBPROCESS_TIMEOUT_S
        while True:
            try:
                out = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                self.proc = None
                raise TimeoutError(f"megatron harness worker timed out: {line[:200]}")
            if out is None:
                raise _WorkerDied("".join(tail[-50:]) + "\n--- stderr ---\n" + self._stderr_tail())
            if out.startswith(_RESULT_MARK):
                return out[len(_RESULT_MARK) :].rstrip("\n")
            tail.append(out)

    def request(self, fn_name: str, kwargs_json: str) -> str:
        line = json.dumps({"fn": fn_name, "kwargs": json.loads(kwargs_json)})
        with self.lock:
            try:
                return self._request_once(line)
            except _WorkerDied:
                self.close()
                return self._request_once(line)


class _WorkerDied(RuntimeError):
    pass


_WORKER = _Worker()
atexit.register(_WORKER.close)


@functools.lru_cache(maxsize=256)
def _run_subprocess_cached(fn_name: str, kwargs_json: str) -> str:
    if os.environ.get("MEGATRON_HARNESS_FRESH"):
        proc = subprocess.run(
            [sys.executable, _THIS_FILE, fn_name],
            input=kwargs_json,
            capture_output=True,
            text=True,
            timeout=_SUBPROCESS_TIMEOUT_S,
            env=_subprocess_env(),
        )
        for line in reversed(proc.stdout.splitlines()):
            if line.startswith(_RESULT_MARK):
                return line[len(_RESULT_MARK) :]
        raise RuntimeError(
            f"megatron harness subprocess {fn_name} produced no result (rc={proc.returncode})\n"
            f"--- stdout tail ---\n{proc.stdout[-4000:]}\n--- stderr tail ---\n{proc.stderr[-4000:]}"
        )
    return _WORKER.request(fn_name, kwargs_json)


def _run_subprocess(fn_name: str, **kwargs) -> Any:
    payload = json.loads(_run_subprocess_cached(fn_name, json.dumps(kwargs, sort_keys=True)))
    if "error" in payload:
        _raise_from_payload(payload["error"])
    return payload["result"]


def _call_impl(fn_name: str, kwargs: dict) -> dict:
    try:
        fn = globals()["_impl_" + fn_name]
        return {"result": fn(**kwargs)}
    except BaseException as e:  # noqa: BLE001 - we forward everything to the parent
        return {
            "error": {
                "type": type(e).__name__,
                "message": str(e),
                "traceback": traceback.format_exc(),
            }
        }


def _subprocess_main() -> None:
    if sys.argv[1] == "--serve":
        # import once up front so that every request is fast
        _install_cpu_shims()
        import megatron.core.models.gpt  # noqa: F401

        for line in sys.stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            out = _call_impl(req["fn"], req["kwargs"])
            sys.stdout.write("\n" + _RESULT_MARK + json.dumps(out) + "\n")
            sys.stdout.flush()
        return
    kwargs = json.loads(sys.stdin.read() or "{}")
    out = _call_impl(sys.argv[1], kwargs)
    sys.stdout.write("\n" + _RESULT_MARK + json.dumps(out) + "\n")
    sys.stdout.flush()


def _install_cpu_shims() -> None:
    """See module docstring.  Only ever called inside a harness subprocess."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment]


def _fake_world(rank: int, world_size: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def _teardown_world() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _ps_coords() -> dict:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
        "dp": ps.get_data_parallel_rank(with_context_parallel=False),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "etp": ps.get_expert_tensor_parallel_rank(),
        "ep": ps.get_expert_model_parallel_rank(),
        "edp": ps.get_expert_data_parallel_rank(),
    }


# --------------------------------------------------------------------------------------------
# 1. rank coordinates
# --------------------------------------------------------------------------------------------

DEFAULT_ORDER = "tp-cp-ep-dp-pp"  # parallel_state.initialize_model_parallel(order=...) default


def megatron_rank_coords(
    world_size: int,
    tp: int,
    pp: int,
    cp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    order: str = DEFAULT_ORDER,
) -> list[dict[str, int]]:
    """Per global rank: {'tp','cp','dp','pp','etp','ep','edp'} as Megatron assigns them.

    Builds the same two ``RankGenerator`` objects ``initialize_model_parallel`` builds
    (parallel_state.py: ``decoder_rank_generator`` with ep=1 and ``expert_decoder_rank_generator``
    with cp=1) and reads every coordinate off the group-membership lists ``get_ranks(token)``
    returns: a rank's coordinate along a dimension is its index in the (ascending) group list that
    contains it -- exactly what ``torch.distributed.get_rank(group)`` returns for those groups.

    The dp/edp sizes and the two divisibility errors replicate the first lines of
    ``initialize_model_parallel`` (dp = world // (tp*pp*cp), edp = world // (etp*ep*pp),
    etp=None -> tp). ``megatron_rank_coords_via_initialize`` runs the real function instead.
    """
    from megatron.core.parallel_state import RankGenerator

    if etp is None:
        etp = tp
    model_size = tp * pp * cp
    if world_size % model_size != 0:
        raise RuntimeError(f"world_size ({world_size}) is not divisible by {model_size}")
    dp = world_size // model_size
    etmp = etp * ep * pp
    if world_size % etmp != 0:
        raise RuntimeError(
            f"world_size ({world_size}) is not divisible by expert_tensor_model_pipeline_parallel"
            f" size ({etmp})"
        )
    edp = world_size // etmp

    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order, rank_offset=0)
    expert = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order, rank_offset=0)
    assert (
        order.endswith("pp") or pp == 1 or edp == dp
    ), "When not using pp-last rank ordering, the data parallel size of the attention and moe layers must be the same"
    if dense.get_ranks("pp") != expert.get_ranks("pp"):
        raise AssertionError(
            "Pipeline parallel groups are expected to be the same for Non-Expert and Expert part"
        )

    coords: list[dict[str, int]] = [dict() for _ in range(world_size)]

    def fill(gen, token: str, key: str) -> None:
        seen = set()
        for group in gen.get_ranks(token):
            assert list(group) == sorted(group), (token, group)
            for idx, r in enumerate(group):
                assert r not in seen, (token, r)
                seen.add(r)
                coords[r][key] = idx
        assert seen == set(range(world_size)), (token, sorted(seen))

    # key order matches the documented dict layout
    fill(dense, "tp", "tp")
    fill(dense, "cp", "cp")
    fill(dense, "dp", "dp")
    fill(dense, "pp", "pp")
    fill(expert, "tp", "etp")
    fill(expert, "ep", "ep")
    fill(expert, "dp", "edp")
    return [
        {k: c[k] for k in ("tp", "cp", "dp", "pp", "etp", "ep", "edp")} for c in coords
    ]


def megatron_rank_coords_via_initialize(
    world_size: int,
    tp: int,
    pp: int,
    cp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    order: str = DEFAULT_ORDER,
    vpp: Optional[int] = None,
) -> list[dict[str, int]]:
    """Same as ``megatron_rank_coords`` but by running the complete
    ``parallel_state.initialize_model_parallel`` once per global rank (fake process groups) and
    reading ``get_tensor_model_parallel_rank()``, ``get_context_parallel_rank()``,
    ``get_data_parallel_rank()``, ``get_pipeline_model_parallel_rank()``,
    ``get_expert_tensor_parallel_rank()``, ``get_expert_model_parallel_rank()``,
    ``get_expert_data_parallel_rank()``.  Raises whatever initialize_model_parallel raises."""
    return _run_subprocess(
        "rank_coords_via_initialize",
        world_size=world_size,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        etp=etp,
        order=order,
        vpp=vpp,
    )


def _impl_rank_coords_via_initialize(world_size, tp, pp, cp, ep, etp, order, vpp):
    _install_cpu_shims()
    from megatron.core import parallel_state as ps

    out = []
    for r in range(world_size):
        _fake_world(r, world_size)
        try:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vpp,
                context_parallel_size=cp,
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=etp,
                order=order,
                create_gloo_process_groups=False,
            )
            out.append(_ps_coords())
        finally:
            _teardown_world()
    return out


# --------------------------------------------------------------------------------------------
# 2. pipeline layer assignment
# --------------------------------------------------------------------------------------------


def _layer_config(
    num_layers, pp, vpp, first, last, account_for_embedding, account_for_loss, layout=None
):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=8,
        num_attention_heads=1,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        account_for_embedding_in_pipeline_split=account_for_embedding,
        account_for_loss_in_pipeline_split=account_for_loss,
        pipeline_model_parallel_layout=layout,
        pipeline_dtype=torch.float32,
    )


def megatron_layer_ids(
    num_layers: int,
    pp: int,
    vpp: Optional[int],
    first: Optional[int] = None,
    last: Optional[int] = None,
    account_for_embedding: bool = False,
    account_for_loss: bool = False,
    layout: Optional[str | list] = None,
) -> dict[tuple[int, int], list[int]]:
    """(pp_rank, vp_chunk) -> global 0-based decoder layer indices that model chunk builds.

    Runs ``TransformerConfig(...)`` (its ``__post_init__`` validation), then for every
    (pp_rank, vp_stage) ``transformer_block.get_num_layers_to_build(config, vp_stage, pp_rank)``
    and ``transformer_layer.get_transformer_layer_offset(config, vp_stage, pp_rank)``; the chunk
    builds layers ``offset .. offset+num-1`` (TransformerBlock._build_layers / TransformerLayer
    use ``layer_number = local_1_based + offset``).  vp_chunk is 0 when vpp is None.

    ``first``/``last`` are ``num_layers_in_first/last_pipeline_stage`` (training flags
    --decoder-first/last-pipeline-num-layers).  ``layout`` is the optional
    ``pipeline_model_parallel_layout`` (e.g. "Et|tt|tt|tL"); that code path reads
    parallel_state's pp rank / vpp world size, which are set and restored around the call.

    Megatron's own exceptions propagate unchanged (ValueError from TransformerConfig,
    AssertionError from the two functions) -- see MEGATRON_FACTS.md for the list.
    Note: the result is returned raw; Megatron does not itself check that the chunks partition
    range(num_layers).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = _layer_config(
        num_layers, pp, vpp, first, last, account_for_embedding, account_for_loss, layout
    )
    eff_vpp = cfg.virtual_pipeline_model_parallel_size  # layout may set it
    chunks = eff_vpp if eff_vpp is not None else 1
    out: dict[tuple[int, int], list[int]] = {}

    saved_pp_rank = ps._MPU_PIPELINE_MODEL_PARALLEL_RANK
    saved_vpp_ws = ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    try:
        if layout is not None:
            ps.set_virtual_pipeline_model_parallel_world_size(eff_vpp)
        for pp_rank in range(pp):
            if layout is not None:
                ps.set_pipeline_model_parallel_rank(pp_rank)
            for v in range(chunks):
                vp_stage = v if eff_vpp is not None else None
                n = get_num_layers_to_build(cfg, vp_stage=vp_stage, pp_rank=pp_rank)
                off = get_transformer_layer_offset(cfg, vp_stage=vp_stage, pp_rank=pp_rank)
                out[(pp_rank, v)] = list(range(off, off + n))
    finally:
        ps.set_pipeline_model_parallel_rank(saved_pp_rank)
        ps.set_virtual_pipeline_model_parallel_world_size(saved_vpp_ws)
    return out


# --------------------------------------------------------------------------------------------
# 3. fused QKV row layout
# --------------------------------------------------------------------------------------------


def megatron_qkv_rows(
    num_heads: int, num_kv_heads: int, head_dim: int, tp: int
) -> list[list[tuple[str, int, int]]]:
    """For each TP rank, for each row of that rank's local ``linear_qkv.weight``:
    ``(kind, canonical_row, global_megatron_row)`` where kind is 'q'|'k'|'v',
    canonical_row indexes HF ``q_proj/k_proj/v_proj.weight`` rows (head*head_dim + d) and
    global_megatron_row is the row of the unsharded (checkpoint / master) ``linear_qkv.weight``.

    How it is determined (all Megatron code, per TP rank t, fake process groups):
      * a real ``SelfAttention`` is built from ``get_gpt_layer_local_spec()`` with
        ``use_cpu_initialization=True``; ``init_method`` writes the master-row index into column 0
        of the master weight, so ``_initialize_affine_weight_cpu``'s split tells which global rows
        rank t holds; ``output_layer_init_method`` likewise writes the column index into row 0 of
        ``linear_proj``'s master weight, so rank t's local attention-output slot j*hd+d is
        global o_proj input column code -> global q head = code // head_dim.
      * ``SelfAttention.get_query_key_value_tensors(e_0)`` (which runs ``linear_qkv`` forward and
        Megatron's split) returns query [1,1,np,hd], key/value [1,1,ng,hd] filled with the global
        row codes.  When num_kv_heads < tp Megatron all-gathers mixed_qkv over TP first; with
        fake groups that all-gather is replaced by the concatenation of the ranks' real local
        ``linear_qkv`` outputs (the only substitution).
      * local kv slot g serves local q heads j with j // (np/ng) == g (DotProductAttention's
        ``repeat_interleave``), so its global kv head = global_q_head(j) // (num_heads/num_kv_heads)
        (the HF GQA convention); all local q heads of a slot must agree, which is asserted.
    """
    res = _run_subprocess(
        "qkv_rows", num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, tp=tp
    )
    return [[tuple(x) for x in rank_rows] for rank_rows in res]


def _impl_qkv_rows(num_heads, num_kv_heads, head_dim, tp):
    _install_cpu_shims()
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import attention as attn_mod
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    hidden = 4

    def enc_rows(w):
        with torch.no_grad():
            w.zero_()
            w[:, 0] = torch.arange(w.shape[0], dtype=w.dtype)

    def enc_cols(w):
        with torch.no_grad():
            w.zero_()
            w[0, :] = torch.arange(w.shape[1], dtype=w.dtype)

    attn_spec = get_gpt_layer_local_spec().submodules.self_attention

    def build(rank):
        _fake_world(rank, tp)
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
        cfg = TransformerConfig(
            num_layers=1,
            hidden_size=hidden,
            num_attention_heads=num_heads,
            num_query_groups=num_kv_heads,
            kv_channels=head_dim,
            tensor_model_parallel_size=tp,
            use_cpu_initialization=True,
            add_bias_linear=False,
            init_method=enc_rows,
            output_layer_init_method=enc_cols,
            params_dtype=torch.float64,
        )
        return build_module(attn_spec, config=cfg, layer_number=1)

    x = torch.zeros(1, 1, hidden, dtype=torch.float64)
    x[..., 0] = 1.0

    # pass 1: local weight row codes + local mixed_qkv (needed to emulate the TP all-gather)
    local_codes, local_mixed, proj_cols = [], [], []
    for t in range(tp):
        try:
            a = build(t)
            with torch.no_grad():
                local_codes.append([int(v) for v in a.linear_qkv.weight[:, 0].tolist()])
                mixed, _ = a.linear_qkv(x)
                local_mixed.append(mixed.clone())
                proj_cols.append([int(v) for v in a.linear_proj.weight[0, :].tolist()])
        finally:
            _teardown_world()

    real_ag = attn_mod.all_gather_last_dim_from_tensor_parallel_region
    attn_mod.all_gather_last_dim_from_tensor_parallel_region = lambda t_, *a_, **k_: torch.cat(
        local_mixed, dim=-1
    )
    code_map: dict[int, tuple[str, int]] = {}

    def put(code, val):
        old = code_map.setdefault(code, val)
        assert old == val, f"inconsistent mapping for megatron row {code}: {old} vs {val}"

    group_size = num_heads // num_kv_heads
    try:
        for t in range(tp):
            try:
                a = build(t)
                with torch.no_grad():
                    q, k, v = a.get_query_key_value_tensors(x, None)
                np_, ng = q.shape[2], k.shape[2]
                # per-rank q heads after Megatron's own sub-selection (kv < tp case): nh / tp
                assert np_ == num_heads // tp, (np_, num_heads, tp)
                assert ng == a.num_query_groups_per_partition
                per_slot = np_ // ng
                slot_kv_head: dict[int, int] = {}
                for j in range(np_):
                    col_codes = proj_cols[t][j * head_dim : (j + 1) * head_dim]
                    gh = col_codes[0] // head_dim
                    assert col_codes == list(range(gh * head_dim, (gh + 1) * head_dim))
                    for d in range(head_dim):
                        put(int(q[0, 0, j, d].item()), ("q", gh * head_dim + d))
                    kvh = gh // group_size
                    g = j // per_slot
                    assert slot_kv_head.setdefault(g, kvh) == kvh, "q heads of one kv slot disagree"
                for g in range(ng):
                    kvh = slot_kv_head[g]
                    for d in range(head_dim):
                        put(int(k[0, 0, g, d].item()), ("k", kvh * head_dim + d))
                        put(int(v[0, 0, g, d].item()), ("v", kvh * head_dim + d))
            finally:
                _teardown_world()
    finally:
        attn_mod.all_gather_last_dim_from_tensor_parallel_region = real_ag

    total = (num_heads + 2 * num_kv_heads) * head_dim
    assert sorted(code_map) == list(range(total)), "not every megatron row was identified"
    for kind, n in (("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads)):
        rows = sorted(c for (kk, c) in code_map.values() if kk == kind)
        assert rows == list(range(n * head_dim)), kind
    return [[[*code_map[c], c] for c in local_codes[t]] for t in range(tp)]


# --------------------------------------------------------------------------------------------
# 3b. gated MLP fc1 row layout
# --------------------------------------------------------------------------------------------


def megatron_fc1_rows(ffn_hidden: int, tp: int) -> list[list[tuple[str, int, int]]]:
    """For each TP rank, for each row of the local (gated / SwiGLU) ``linear_fc1.weight``:
    ``(kind, canonical_row, global_megatron_row)``; kind is 'gate' (goes through the activation,
    HF gate_proj) or 'up' (the linear factor, HF up_proj); canonical_row is the global ffn index;
    global_megatron_row is the row of the unsharded master weight Megatron's CPU init splits.

    Runs a real ``MLP`` (local spec, gated_linear_unit=True, TP group of size tp, fake process
    groups) per rank: fc1 master rows are encoded, ``MLP.forward`` is executed with an
    activation that records its input and returns ones, and a forward pre-hook on ``linear_fc2``
    records its input (= the 'up' half); fc2's master columns are encoded, giving the global ffn
    index of each local intermediate slot.  Applies equally to expert MLPs (SequentialMLP uses the
    same MLP class with the expert-TP group, tp=etp).
    Also returns the same for the dist-checkpoint view via ``apply_swiglu_sharded_factory`` in
    ``megatron_fc1_checkpoint_offsets``.
    """
    res = _run_subprocess("fc1_rows", ffn_hidden=ffn_hidden, tp=tp)
    return [[tuple(x) for x in r] for r in res["rows"]]


def megatron_fc1_checkpoint_offsets(ffn_hidden: int, tp: int) -> list[list[tuple[int, int, int]]]:
    """For each TP rank: the ShardedTensors ``MLP.sharded_state_dict`` (via
    ``apply_swiglu_sharded_factory``) builds for the local fc1 weight, as
    (local_row_start, local_row_stop, global_row_offset) in the checkpoint tensor of shape
    [2*ffn, hidden] -- i.e. where each local half lands in the checkpoint."""
    res = _run_subprocess("fc1_rows", ffn_hidden=ffn_hidden, tp=tp)
    return [[tuple(x) for x in r] for r in res["ckpt"]]


def _impl_fc1_rows(ffn_hidden, tp):
    _install_cpu_shims()
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    hidden = 4
    recorded = {}

    def act(x_):
        recorded["gate"] = x_.detach().clone()
        return torch.ones_like(x_)

    def enc_rows(w):
        with torch.no_grad():
            w.zero_()
            w[:, 0] = torch.arange(w.shape[0], dtype=w.dtype)

    def enc_cols(w):
        with torch.no_grad():
            w.zero_()
            w[0, :] = torch.arange(w.shape[1], dtype=w.dtype)

    mlp_spec = get_gpt_layer_local_spec().submodules.mlp
    x = torch.zeros(1, 1, hidden, dtype=torch.float64)
    x[..., 0] = 1.0
    rows, ckpt = [], []
    for t in range(tp):
        _fake_world(t, tp)
        try:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp, create_gloo_process_groups=False
            )
            cfg = TransformerConfig(
                num_layers=1,
                hidden_size=hidden,
                num_attention_heads=tp,
                kv_channels=1,
                ffn_hidden_size=ffn_hidden,
                tensor_model_parallel_size=tp,
                gated_linear_unit=True,
                activation_func=act,
                bias_activation_fusion=False,
                add_bias_linear=False,
                use_cpu_initialization=True,
                init_method=enc_rows,
                output_layer_init_method=enc_cols,
                params_dtype=torch.float64,
            )
            mlp = build_module(mlp_spec, config=cfg)
            fc2_in = {}
            mlp.linear_fc2.register_forward_pre_hook(
                lambda m, args: fc2_in.setdefault("up", args[0].detach().clone())
            )
            with torch.no_grad():
                mlp(x)
            local_codes = [int(v) for v in mlp.linear_fc1.weight[:, 0].tolist()]
            ffn_idx = [int(v) for v in mlp.linear_fc2.weight[0, :].tolist()]
            gate = [int(v) for v in recorded["gate"].reshape(-1).tolist()]
            up = [int(v) for v in fc2_in["up"].reshape(-1).tolist()]
            assert len(gate) == len(up) == len(ffn_idx)
            code_to = {}
            for m, c in enumerate(gate):
                code_to[c] = ("gate", ffn_idx[m])
            for m, c in enumerate(up):
                code_to[c] = ("up", ffn_idx[m])
            rows.append([[*code_to[c], c] for c in local_codes])

            sd = mlp.sharded_state_dict(
                prefix="", sharded_offsets=(), metadata=ensure_metadata_has_dp_cp_group(None)
            )
            fac = sd["linear_fc1.weight"]
            assert isinstance(fac, ShardedTensorFactory)
            built = fac.build()
            built = built if isinstance(built, list) else [built]
            start, spans = 0, []
            for sh in built:
                n = sh.local_shape[0]
                assert tuple(sh.global_shape) == (2 * ffn_hidden, hidden)
                spans.append([start, start + n, int(sh.global_offset[0])])
                start += n
            ckpt.append(spans)
        finally:
            _teardown_world()
    return {"rows": rows, "ckpt": ckpt}


# --------------------------------------------------------------------------------------------
# 4. GPTModel parameter names
# --------------------------------------------------------------------------------------------


def megatron_gpt_param_names(
    *,
    num_layers: int = 2,
    hidden_size: int = 16,
    num_attention_heads: int = 4,
    num_query_groups: int = 2,
    kv_channels: Optional[int] = None,
    ffn_hidden_size: int = 32,
    moe_ffn_hidden_size: int = 8,
    num_experts: Optional[int] = 4,
    moe_layer_freq: int | list = 1,
    vocab_size: int = 128,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    vpp: Optional[int] = None,
    first: Optional[int] = None,
    last: Optional[int] = None,
    share_embeddings_and_output_weights: bool = False,
    qk_layernorm: bool = True,
    moe_grouped_gemm: bool = False,
    moe_router_enable_expert_bias: bool = True,
    moe_shared_expert_intermediate_size: Optional[int] = None,
    normalization: str = "RMSNorm",
    add_bias_linear: bool = False,
    add_qkv_bias: bool = False,
    world_size: Optional[int] = None,
    ranks: Optional[list[int]] = None,
    with_sharded: bool = True,
    sharded_metadata: Optional[dict] = None,
) -> dict[tuple[int, int], dict]:
    """Build a real tiny ``GPTModel`` with the local (non-TE) spec
    (``get_gpt_decoder_block_spec(config, use_transformer_engine=False, ...)``) for every
    (global rank, vp chunk) of the world and report what it contains.  world_size defaults to
    the smallest world in which both grids fit: pp * lcm(tp, ep*etp) (etp None -> tp).

    Returns {(rank, vp_chunk): entry}, entry = {
      'coords': Megatron's ranks (tp/cp/dp/pp/etp/ep/edp) of that rank,
      'pre_process', 'post_process': bool,
      'params':  [(name, shape)] from named_parameters(),
      'buffers': [(name, shape)] persistent buffers that appear in state_dict() (e.g.
                 mlp.router.expert_bias),
      'layer_numbers': [layer.layer_number - 1 for layer in decoder.layers] (global 0-based),
      'local_expert_indices': {module_prefix: MoELayer.local_expert_indices},
      'sharded': [(local_name, ckpt_key, local_shape, global_shape, global_offset)] from
                 model.sharded_state_dict() (factories such as the SwiGLU fc1 are expanded;
                 _extra_state ShardedObjects are skipped), only if with_sharded; the metadata
                 passed is ``sharded_metadata`` (e.g. {'non_homogeneous_layers': True}; default
                 None -> layers are stacked under 'decoder.layers.<name>' with a leading layer axis
                 unless moe_layer_freq is a list / >1, then per-layer 'decoder.layers.<global i>.'),
    }
    ``moe_grouped_gemm=True`` builds the legacy ``GroupedMLP`` (see module docstring shim).
    """
    res = _run_subprocess(
        "gpt_param_names",
        cfg=dict(
            num_layers=num_layers,
            hidden_size=hidden_size,
            num_attention_heads=num_attention_heads,
            num_query_groups=num_query_groups,
            kv_channels=kv_channels,
            ffn_hidden_size=ffn_hidden_size,
            moe_ffn_hidden_size=moe_ffn_hidden_size,
            num_experts=num_experts,
            moe_layer_freq=moe_layer_freq,
            vocab_size=vocab_size,
            tp=tp,
            pp=pp,
            ep=ep,
            etp=etp,
            vpp=vpp,
            first=first,
            last=last,
            share=share_embeddings_and_output_weights,
            qk_layernorm=qk_layernorm,
            moe_grouped_gemm=moe_grouped_gemm,
            expert_bias=moe_router_enable_expert_bias,
            shared_expert=moe_shared_expert_intermediate_size,
            normalization=normalization,
            add_bias_linear=add_bias_linear,
            add_qkv_bias=add_qkv_bias,
        ),
        world_size=world_size,
        ranks=ranks,
        with_sharded=with_sharded,
        sharded_metadata=sharded_metadata,
    )
    out = {}
    for e in res:
        key = (e.pop("rank"), e.pop("vp_chunk"))
        e["params"] = [(n, tuple(s)) for n, s in e["params"]]
        e["buffers"] = [(n, tuple(s)) for n, s in e["buffers"]]
        e["sharded"] = [
            (a, b, tuple(c), tuple(d), tuple(f)) for a, b, c, d, f in e.get("sharded", [])
        ]
        out[key] = e
    return out


def _impl_gpt_param_names(cfg, world_size, ranks, with_sharded, sharded_metadata):
    _install_cpu_shims()
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    if cfg["moe_grouped_gemm"]:
        from megatron.core.transformer.moe import grouped_gemm_util

        grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None

    tp, pp, ep = cfg["tp"], cfg["pp"], cfg["ep"]
    etp = cfg["etp"] if cfg["etp"] is not None else tp
    import math

    world = world_size if world_size is not None else pp * math.lcm(tp, ep * etp)
    vpp = cfg["vpp"]
    chunks = vpp if vpp is not None else 1
    moe = cfg["num_experts"] is not None
    freq = cfg["moe_layer_freq"]

    out = []
    for r in ranks if ranks is not None else range(world):
        _fake_world(r, world)
        try:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vpp,
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=cfg["etp"],
                create_gloo_process_groups=False,
            )
            coords = _ps_coords()
            pp_rank = coords["pp"]
            tc_kwargs = dict(
                num_layers=cfg["num_layers"],
                hidden_size=cfg["hidden_size"],
                num_attention_heads=cfg["num_attention_heads"],
                num_query_groups=cfg["num_query_groups"],
                kv_channels=cfg["kv_channels"],
                ffn_hidden_size=cfg["ffn_hidden_size"],
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vpp,
                num_layers_in_first_pipeline_stage=cfg["first"],
                num_layers_in_last_pipeline_stage=cfg["last"],
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=cfg["etp"],
                pipeline_dtype=torch.float32,
                params_dtype=torch.float32,
                use_cpu_initialization=True,
                qk_layernorm=cfg["qk_layernorm"],
                normalization=cfg["normalization"],
                gated_linear_unit=True,
                activation_func=F.silu,
                bias_activation_fusion=False,
                bias_dropout_fusion=False,
                add_bias_linear=cfg["add_bias_linear"],
                add_qkv_bias=cfg["add_qkv_bias"],
            )
            if moe:
                tc_kwargs.update(
                    num_moe_experts=cfg["num_experts"],
                    moe_ffn_hidden_size=cfg["moe_ffn_hidden_size"],
                    moe_router_topk=min(2, cfg["num_experts"]),
                    moe_router_enable_expert_bias=cfg["expert_bias"],
                    moe_router_score_function="sigmoid" if cfg["expert_bias"] else "softmax",
                    moe_layer_freq=freq,
                    moe_grouped_gemm=cfg["moe_grouped_gemm"],
                    moe_shared_expert_intermediate_size=cfg["shared_expert"],
                )
            config = TransformerConfig(**tc_kwargs)
            for v in range(chunks):
                vp_stage = v if vpp is not None else None
                pre = pp_rank == 0 and v == 0
                post = pp_rank == pp - 1 and v == chunks - 1
                spec = get_gpt_decoder_block_spec(
                    config,
                    use_transformer_engine=False,
                    normalization=cfg["normalization"],
                    vp_stage=vp_stage,
                    pp_rank=pp_rank,
                )
                model = GPTModel(
                    config,
                    spec,
                    vocab_size=cfg["vocab_size"],
                    max_sequence_length=32,
                    pre_process=pre,
                    post_process=post,
                    share_embeddings_and_output_weights=cfg["share"],
                    position_embedding_type="rope",
                    vp_stage=vp_stage,
                )
                params = [[n, list(p.shape)] for n, p in model.named_parameters()]
                sd = model.state_dict()
                pnames = {n for n, _ in params}
                buffers = [
                    [n, list(b.shape)]
                    for n, b in model.named_buffers()
                    if n in sd and n not in pnames
                ]
                layer_numbers = [int(l.layer_number) - 1 for l in model.decoder.layers]
                lei = {
                    n: list(m.local_expert_indices)
                    for n, m in model.named_modules()
                    if isinstance(m, BaseMoELayer)
                }
                entry = dict(
                    rank=r,
                    vp_chunk=v,
                    coords=coords,
                    pre_process=pre,
                    post_process=post,
                    params=params,
                    buffers=buffers,
                    layer_numbers=layer_numbers,
                    local_expert_indices=lei,
                )
                if with_sharded:
                    sharded = []
                    ssd = model.sharded_state_dict(
                        metadata=dict(sharded_metadata) if sharded_metadata is not None else None
                    )
                    for k, obj in ssd.items():
                        if isinstance(obj, ShardedTensorFactory):
                            built = obj.build()
                            built = built if isinstance(built, list) else [built]
                        elif isinstance(obj, ShardedTensor):
                            built = [obj]
                        else:
                            continue
                        for sh in built:
                            sharded.append(
                                [
                                    k,
                                    sh.key,
                                    list(sh.local_shape),
                                    list(sh.global_shape),
                                    [int(o) for o in sh.global_offset],
                                ]
                            )
                    entry["sharded"] = sharded
                out.append(entry)
        finally:
            _teardown_world()
    return out


# --------------------------------------------------------------------------------------------
# documented (not executed) TE-spec names
# --------------------------------------------------------------------------------------------


def te_spec_param_name(local_name: str, is_moe_layer: bool, moe_grouped_gemm: bool = True) -> str:
    """Map a local-spec ``named_parameters`` name to the name the TE spec
    (``get_gpt_layer_with_transformer_engine_spec`` / ``get_gpt_decoder_block_spec(...,
    use_transformer_engine=True)``) gives the same tensor.  THIS IS A DOCUMENTED MAPPING, NOT
    EXECUTED MEGATRON CODE (Transformer Engine cannot be imported here); sources:
      * TE spec: ``input_layernorm`` is IdentityOp and ``linear_qkv`` is
        TELayerNormColumnParallelLinear (TE LayerNormLinear: params ``layer_norm_weight``
        [+ ``layer_norm_bias`` for LayerNorm], ``weight`` [, ``bias``]);
      * dense layer: ``pre_mlp_layernorm`` is IdentityOp, ``mlp.linear_fc1`` is
        TELayerNormColumnParallelLinear -> ``mlp.linear_fc1.layer_norm_weight``;
      * MoE layer: ``pre_mlp_layernorm`` is TENorm (param ``weight``) -> name unchanged;
        experts: moe_grouped_gemm=True -> TEGroupedMLP with TE GroupedLinear (params
        ``weight{i}``/``bias{i}``) -> ``mlp.experts.linear_fc1.weight{i}``; moe_grouped_gemm=False
        -> SequentialMLP of TEColumn/RowParallelLinear -> names unchanged
        (``mlp.experts.local_experts.{i}.linear_fc1.weight``);
      * q/k layernorm TENorm (weight), final_layernorm TENorm (weight), router, embedding,
        output_layer: unchanged.
    """
    import re

    n = local_name
    n = re.sub(r"\.input_layernorm\.(weight|bias)$", r".self_attention.linear_qkv.layer_norm_\1", n)
    if not is_moe_layer:
        n = re.sub(r"\.pre_mlp_layernorm\.(weight|bias)$", r".mlp.linear_fc1.layer_norm_\1", n)
    elif moe_grouped_gemm:
        n = re.sub(
            r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$",
            r".mlp.experts.\2.\3\1",
            n,
        )
    return n


if __name__ == "__main__":
    _subprocess_main()
