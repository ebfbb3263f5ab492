"""`refit`: plan refits, inspect layouts, reshard checkpoints offline.

What each command does; their options and help text are `refit.cli_parser`'s.  User errors
(`RefitError`) print one line and exit with status 2; no tracebacks for bad input (the shared
tail is `refit.entrypoint`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from typing import Any, Callable

from refit import settings
from refit.casts import casts_between
from refit.catalog import CATALOG
from refit.cli_parser import build_parser
from refit.dtypes import DTYPE_BYTES
from refit.entrypoint import EXIT_FAILED, run_main, setup_logging
from refit.errors import InvalidInput
from refit.hf_checkpoint import hf_config, load_spec
from refit.layouts import resolve_layout
from refit.planners import make_plan
from refit.predict import TERMS, engine_cost, hardware, predict
from refit.reshard import check_output, reshard
from refit.quantization import FORMATS, hf_quantization_config
from refit.sides import Side
from refit.spec import ModelSpec, build_spec, quantize_spec
from refit.units import MiB, fmt_bytes

# ---------------------------------------------------------------------------------------------
# models


def cmd_models(args: argparse.Namespace) -> int:
    rows = []
    for name in CATALOG:
        spec = load_spec(name)
        c = spec.config
        rows.append({"name": name, "arch": c.arch, "params": spec.num_params,
                     "bf16_bytes": spec.num_params * DTYPE_BYTES["bfloat16"],
                     "layers": c.num_layers, "hidden": c.hidden_size, "heads": c.num_heads, "kv_heads": c.num_kv_heads,
                     "experts": c.num_experts, "vocab": c.vocab_size})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'model':<16}{'arch':<11}{'params':>9}{'bf16':>11}{'layers':>8}{'hidden':>8}{'heads':>7}{'kv':>4}"
          f"{'experts':>9}{'vocab':>8}")
    for r in rows:
        print(f"{r['name']:<16}{r['arch']:<11}{r['params'] / 1e9:>8.2f}B{fmt_bytes(r['bf16_bytes']):>11}"
              f"{r['layers']:>8}{r['hidden']:>8}{r['heads']:>7}{r['kv_heads']:>4}{r['experts']:>9}{r['vocab']:>8}")
    return 0


# ---------------------------------------------------------------------------------------------
# settings


def json_schema(what: str) -> dict[str, Any]:
    """The JSON schema of the REFIT_* settings, of a plan file or a plan's summary, or of the vLLM
    backend's init_info / update_info."""
    if what == "settings":
        return settings.json_schema()
    from refit.validation import json_schema as schema_of

    if what in ("plan", "summary"):
        from refit import plan_schema

        return schema_of(plan_schema.SCHEMAS[what])
    try:
        from refit.integrations.vllm import infos
    except ImportError as e:
        raise InvalidInput(f"the {what} schema is the vLLM backend's: install vLLM ('refit[vllm]') ({e})") from None
    return schema_of(infos.RefitInitInfo if what == "init_info" else infos.RefitUpdateInfo)


def cmd_settings(args: argparse.Namespace) -> int:
    if args.json_schema:
        print(json.dumps(json_schema(args.json_schema), indent=2))
        return 0
    here = settings.current()
    rows = []
    for k in settings.KNOBS:
        value = getattr(here, k.field)
        if k.secret:
            value = "(set)" if value else ""  # whether it is set, never what it is
        rows.append({"name": k.name, "scope": k.scope, "value": value, "default": k.default,
                     "set_here": k.name in os.environ, "what": k.what})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'variable':<20}{'scope':<9}{'value here':<16}")
    for r in rows:
        shown = ",".join(map(str, r["value"])) if isinstance(r["value"], tuple) else str(r["value"])
        print(f"{r['name']:<20}{r['scope']:<9}{shown or '-':<16}{'(set here)' if r['set_here'] else ''}")
    return 0


# ---------------------------------------------------------------------------------------------
# layout


def cmd_layout(args: argparse.Namespace) -> int:
    spec = load_spec(args.model)
    layout = resolve_layout(args.layout, spec, Side.of_end(args.role))  # --role keeps its src/dst values
    if args.rank is not None and not 0 <= args.rank < layout.world_size:
        raise InvalidInput(f"rank {args.rank} is outside {layout.describe()} (world size {layout.world_size})")
    ranks = [args.rank] if args.rank is not None else list(range(layout.world_size))
    out: dict[str, Any] = {"layout": layout.describe(), "degrees": layout.details(), "ranks": {}}
    for r in ranks:
        tensors = layout.local_tensors(spec, r)
        out["ranks"][r] = {"bytes": sum(t.nbytes for t in tensors),
                           "tensors": [[t.name, list(t.shape), t.dtype] for t in tensors] if args.rank is not None else len(tensors)}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"layout: {out['layout']}  ({_degrees(out['degrees'])})")
    for r, info in out["ranks"].items():
        if isinstance(info["tensors"], int):
            print(f"  rank {r:>4}: {info['tensors']:>6} tensors, {fmt_bytes(info['bytes'])}")
        else:
            print(f"rank {r}: {len(info['tensors'])} tensors, {fmt_bytes(info['bytes'])}")
            for name, shape, dtype in info["tensors"]:
                print(f"  {name:<64} {str(shape):<22} {dtype}")
    return 0


def _degrees(d: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in d.items())


# ---------------------------------------------------------------------------------------------
# plan


def cmd_plan(args: argparse.Namespace) -> int:
    spec = _served_spec(load_spec(args.model), args.dst_dtype)
    if args.phase_layers < 0:
        raise InvalidInput(f"--phase-layers must be >= 0, got {args.phase_layers}")
    casts = {}
    if args.src_dtype and args.src_dtype != spec.config.dtype:  # the trainer's dtype: a plan that casts
        trainer = build_spec(spec.name, dataclasses.replace(spec.config, dtype=args.src_dtype, quantization=""))
        casts = casts_between(trainer, spec)
    result = make_plan(spec, args.src, args.dst, args.placement, args.planner, int(args.bucket_mb * MiB),
                       args.phase_layers, casts)
    s = result.summary
    prediction = None
    if args.predict:
        prediction = predict(result.plan, hardware(args.hardware or "h200-nvl8", args.link_gbps, args.nic_gbps),
                             args.transport, engine_cost(args.engine) if args.engine else None)
        s = {**s, **prediction.to_dict()}
    elif (args.hardware, args.link_gbps, args.nic_gbps, args.transport, args.engine) != (None,) * 5:
        raise InvalidInput("--hardware, --link-gbps, --nic-gbps, --transport and --engine shape a prediction: "
                           "add --predict")
    if args.out:
        write_file_atomically(args.out, json.dumps(result.plan.to_dict(), separators=(",", ":")))
    if args.json:
        print(json.dumps({"src": {"layout": result.src.describe(), **result.src.details()},
                          "dst": {"layout": result.dst.describe(), **result.dst.details()},
                          "summary": s}, indent=2))
        return 0
    served = f"{spec.config.dtype}, linear weights {spec.config.quantization}" if spec.config.quantization \
        else spec.config.dtype
    print(f"model    {spec.name}: {spec.num_params / 1e9:.2f}B parameters, {fmt_bytes(spec.nbytes)} in {served}")
    print(f"source   {result.src.describe():<36} {_degrees(result.src.details())}")
    print(f"dest     {result.dst.describe():<36} {_degrees(result.dst.details())}")
    print(f"planner  {s['planner']}, {s['placement']} on {s['num_gpus']} GPUs, buckets of {fmt_bytes(s['bucket_bytes'])}")
    print(f"plan_hash {s['plan_hash']}  ({s['plan_seconds'] * 1e3:.1f} ms to plan; the content hash, not the id "
          f"`Refit` takes: that is create_plan's plan_id)")
    print()
    rows = [("destination weights", s["total_bytes"]), ("moved within a GPU", s["local_bytes"]),
            ("moved across GPUs", s["remote_bytes"]), ("largest send per GPU", s["max_send_bytes"]),
            ("largest receive per GPU", s["max_recv_bytes"])]
    for label, n in rows:
        print(f"  {label:<26}{fmt_bytes(n):>12}")
    print(f"  {'transfers / buckets':<26}{s['num_transfers']:>6} / {s['num_buckets']}")
    print(f"  {'plan size (JSON)':<26}{fmt_bytes(s['plan_json_bytes']):>12}")
    if "num_phases" in s:
        print(f"  {'phases':<26}{s['num_phases']:>6}  ({args.phase_layers} layers each; "
              "non-layer tensors one each)")
    for kind, n in s.get("casts", {}).items():
        print(f"  cast on the trainers    {kind}: {n} tensors")
    if "quantization" in s:
        q = s["quantization"]
        print(f"  quantized on the trainers {q['from']} -> {q['format']}: {q['tensors']} stacked weight tensors; "
              f"{fmt_bytes(q['bytes'])} served against {fmt_bytes(q['unquantized_bytes'])} unquantized")
    for line in s.get("not_moved", ()):
        print(f"  not moved: {line}")
    if prediction is not None:
        _print_prediction(prediction)
    if args.out:
        print(f"\nplan written to {args.out}")
    return 0


def _print_prediction(p: Any) -> None:
    hw = p.hardware
    print(f"\npredicted {p.seconds * 1e3:.1f} ms  on {hw.name}, {p.num_hosts} host(s) of {hw.gpus_per_host} GPUs, "
          f"transport {p.transport} (a model, not a measurement: `refit plan --help`)")
    print(f"  bottleneck  {p.bottleneck}")
    for ph in p.phases:
        print(f"  {ph.name}: {ph.seconds * 1e3:.1f} ms")
        for term in TERMS:
            t = ph.largest.get(term)
            if t is not None:
                print(f"    {term:<11} largest on gpu {t.gpu:<4} {t.nbytes / 1e9:>9.2f} GB at {t.rate_gbs:>6.0f} GB/s "
                      f"= {t.seconds * 1e3:8.2f} ms")
    print(f"  + fixed overhead {hw.overhead_s * 1e3:.1f} ms")
    if p.engine is not None:
        phases = f" + {p.engine.phase_s * 1e3:.2f} ms per phase" if p.engine_seconds > p.engine.loop_s else ""
        print(f"  + engine {p.engine.name} {p.engine_seconds * 1e3:.1f} ms ({p.engine.loop_s * 1e3:.2f} ms the loop's "
              f"calls and control{phases})")


# ---------------------------------------------------------------------------------------------
# reshard


def write_file_atomically(path: str, text: str) -> None:
    """Write ``path`` whole or not at all (a temporary file beside it, fsynced, then renamed)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InvalidInput(f"--out {path}: folder {folder} does not exist")
    if os.path.isdir(path):
        raise InvalidInput(f"--out {path} is a directory")
    fd, tmp = -1, ""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=folder)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # as open() makes files: mkstemp makes them 0600
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise InvalidInput(f"writing {path}: {e.strerror or e}") from None
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)


def _umask() -> int:
    """The process's umask.  Reading it means setting it, put straight back: the `refit` command
    runs one thread."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def cmd_reshard(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.in_dir):
        raise InvalidInput(f"--in {args.in_dir} is not a directory")
    check_output(args.in_dir, args.out_dir, args.force)
    spec = load_spec(args.model)
    out_spec = _served_spec(spec, args.dst_dtype)
    src = resolve_layout(args.src, spec, Side.TRAINER)
    dst = resolve_layout(args.dst, out_spec, Side.ENGINE)
    print(f"source  {src.describe():<36} {_degrees(src.details())}", file=sys.stderr)
    print(f"dest    {dst.describe():<36} {_degrees(dst.details())}"
          f"{'  quantized to ' + out_spec.config.quantization if out_spec is not spec else ''}", file=sys.stderr)
    config = hf_config(args.model, spec) if dst.framework == "hf" else None
    if config is not None and out_spec is not spec:  # what vLLM reads to serve the checkpoint quantized
        config = {**config, "quantization_config": hf_quantization_config(out_spec.config.quantization,
                                                                            out_spec.config.moe_layers)}
    bar = _progress(total=_dst_bytes(out_spec, dst), disable=args.json or not sys.stderr.isatty(), unit="B")
    try:
        report = reshard(spec, src, dst, args.in_dir, args.out_dir, config, progress=bar.update, force=args.force)
    finally:
        bar.close()
    report.update(src=src.describe(), dst=dst.describe())
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"wrote {report['files']} files, {report['tensors']} tensors, {fmt_bytes(report['bytes'])} to {args.out_dir}")
    return 0


def _served_spec(spec: ModelSpec, dst_dtype: str | None) -> ModelSpec:
    """The model as the engines hold it: ``spec``, or quantized (``--dst-dtype fp8``)."""
    if not dst_dtype or dst_dtype == spec.config.dtype:
        return spec
    if dst_dtype in FORMATS:
        return quantize_spec(spec, dst_dtype)
    raise InvalidInput(f"--dst-dtype {dst_dtype}: the engines hold the model in {spec.config.dtype} or quantized "
                       f"({', '.join(FORMATS)}); a dtype cast belongs to the trainer (--src-dtype)")


def _dst_bytes(spec: Any, dst: Any) -> int:
    return sum(t.nbytes for r in range(dst.world_size) for t in dst.local_tensors(spec, r))


def _progress(total: int, disable: bool, unit: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, disable=disable, unit=unit, unit_scale=True, unit_divisor=1024, file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# verify


def cmd_verify(args: argparse.Namespace) -> int:
    from refit.control.client import Client, ControlError
    from refit.control.server import read_token

    try:
        with Client(args.coordinator, token=read_token(args)) as client:
            result = client.check(args.plan, timeout=args.timeout, check=False)
    except ControlError as e:
        raise InvalidInput(f"coordinator {args.coordinator or '$REFIT_ADDRESS'}: {e.code().name}: {e.details()}") \
            from None
    if args.json:
        print(json.dumps({"ok": result.ok, "plan_id": result.plan_id, "version": result.version,
                          "verified_transfers": result.verified_transfers, "seconds": result.seconds,
                          "error": result.error}))
    elif result.ok:
        print(f"plan {result.plan_id}: the engines hold version {result.version} exactly as the trainers' weights: "
              f"{result.verified_transfers} transfers checked at both ends ({result.seconds:.3f} s)")
    else:
        print(f"plan {result.plan_id}: {result.error}")
    return 0 if result.ok else EXIT_FAILED


# What runs each command `refit.cli_parser.build_parser` parses (`serve`: `main` hands it over first).
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "models": cmd_models, "layout": cmd_layout, "plan": cmd_plan, "reshard": cmd_reshard,
    "settings": cmd_settings, "verify": cmd_verify,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # `refit serve` has its own parser; `refit -v serve ...` too (its -v goes along: serve has one).
    i = argv.index("serve") if "serve" in argv else -1
    if i >= 0 and all(a in ("-v", "--verbose") for a in argv[:i]):
        from refit.control.server import serve_main

        return serve_main(argv[:i] + argv[i + 1:])
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    func = COMMANDS[args.command]
    return run_main(lambda: func(args), "refit")


if __name__ == "__main__":
    sys.exit(main())
