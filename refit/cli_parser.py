"""The `refit` command line: each command's options, help text and examples (argparse).

Kept apart from `refit.cli`, which runs the commands: the option text (the ``--predict`` group's
alone is a page) outweighed the code that runs them, and one is read without the other.
"""

from __future__ import annotations

import argparse

from refit import __version__
from refit.casts import CASTABLE
from refit.layouts import LAYOUT_HELP
from refit.plan import DEFAULT_BUCKET_BYTES
from refit.predict import ENGINES, HARDWARE, TRANSPORTS
from refit.quantization import FORMATS
from refit.units import MiB

EPILOG = f"""\
{LAYOUT_HELP}

examples:
  refit models
  refit plan --model qwen3-30b-moe --src tp4ep8 --dst tp8
  refit plan --model qwen3-235b-moe --src megatron:tp4pp4ep16 --dst vllm:tp8dp8 --json
  refit plan --model qwen3-30b-moe --src tp4ep8 --dst tp8 --phase-layers 4
  refit plan --model qwen3-30b-moe --src fsdp:dp8 --dst tp8 --src-dtype float32
  refit plan --model qwen3-30b-moe --src tp4ep8 --dst vllm:tp8ep8 --dst-dtype fp8
  refit layout --model qwen3-30b-moe megatron:tp4ep8 --rank 3
  refit reshard --model ./Qwen3-30B-A3B --src hf --dst megatron:tp4ep8 --in ./Qwen3-30B-A3B --out ./mcore
  refit reshard --model ./Qwen3-30B-A3B --src hf --dst hf --dst-dtype fp8 --in ./Qwen3-30B-A3B --out ./fp8
  REFIT_TOKEN=... refit serve --port 50051
  refit verify --plan PLAN_ID --coordinator 127.0.0.1:50051
"""

SCHEMAS = ("settings", "init_info", "update_info", "plan", "summary")  # what `refit settings --json-schema` describes


def dst_dtype_arg(p: argparse.ArgumentParser) -> None:
    """``--dst-dtype``, which `refit plan` and `refit reshard` both take."""
    p.add_argument("--dst-dtype", metavar="FORMAT", choices=sorted(FORMATS),
                   help="serve the model quantized: fp8 = float8 e4m3 weights with 128x128 block scales "
                        "(weight_scale_inv: the DeepSeek-V3 / Qwen3-FP8 format, vLLM's fp8 checkpoints); "
                        "mxfp8 = 1x32 blocks with e8m0 scales (weight_scale; no checkpoint format).  The "
                        "trainers quantize their shards before sending, bit for bit as vLLM quantizes; "
                        "layouts whose shards cut blocks are refused")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command but `serve` (refit.control.server parses its own); ``command``
    names the one given, which `refit.cli.COMMANDS` runs."""
    p = argparse.ArgumentParser(
        prog="refit",
        description="Plan and run weight refits between training layouts (Megatron-Core, FSDP2, HF) and "
                    "inference layouts (vLLM).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="log what refit does")
    p.add_argument("--version", action="version", version=f"refit {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    m = sub.add_parser("models", help="list the model catalog with parameter counts and sizes")
    m.add_argument("--json", action="store_true", help="print JSON")

    def model_arg(q: argparse.ArgumentParser) -> None:
        q.add_argument("--model", required=True, help="catalog name (see `refit models`) or a directory holding an "
                       "HF config.json and/or *.safetensors")

    lay = sub.add_parser("layout", help="show a resolved layout and each rank's local tensors",
                         epilog=LAYOUT_HELP)
    model_arg(lay)
    lay.add_argument("layout", help="layout string, e.g. megatron:tp4ep8")
    lay.add_argument("--role", choices=["src", "dst"], default="src",
                     help="how to read a layout without framework prefix (src: megatron, dst: vllm)")
    lay.add_argument("--rank", type=int, help="list this rank's tensors (default: a line per rank)")
    lay.add_argument("--json", action="store_true", help="print JSON")

    pl = sub.add_parser("plan", help="compute a refit plan and summarise it", epilog=EPILOG,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arg(pl)
    pl.add_argument("--src", required=True, help="source (trainer) layout, e.g. tp4ep8 or megatron:tp2pp2")
    pl.add_argument("--dst", required=True, help="destination (engine) layout, e.g. tp8 or vllm:tp4ep4")
    pl.add_argument("--placement", choices=["colocated", "disaggregated"], default="colocated",
                    help="colocated: source rank i and destination rank i share GPU i; disaggregated: separate GPUs")
    pl.add_argument("--planner", choices=["p2p", "broadcast"], default="p2p",
                    help="p2p: shard-to-shard (default); broadcast: full-tensor baseline")
    pl.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / MiB,
                    help=f"largest transfer bucket in MiB (default {DEFAULT_BUCKET_BYTES // MiB})")
    pl.add_argument("--phase-layers", type=int, default=0, metavar="N",
                    help="cut the plan into phases of N layers, run one after another so that an engine "
                         "stages one window of layers at a time (each non-layer tensor is a phase of its "
                         "own); 0: one phase (default).  Not with --planner broadcast")
    pl.add_argument("--src-dtype", choices=sorted(CASTABLE), metavar="DTYPE",
                    help="the dtype the trainer holds the model in, when not the model's (verl's FSDP2: "
                         "float32 masters): the plan casts on the way (bfloat16, float16 or float32)")
    dst_dtype_arg(pl)
    pl.add_argument("--json", action="store_true", help="print one JSON object (layouts and summary; with "
                    "--predict the summary gains predicted_seconds, bottleneck and the per-term breakdown)")
    pl.add_argument("--out", help="write the full plan (JSON) to this file")
    pr = pl.add_argument_group(
        "prediction (--predict)",
        "A cost model (refit/predict.py), not a measurement.  Every GPU's bytes of the plan split into "
        "same-GPU copies, NVLink in / out (peers of its host) and NIC in / out (GPUs of other hosts; GPU g "
        "is on host g // GPUs-per-host, placement as --placement says); a GPU's time is the largest of "
        "bytes / rate over those five terms, the refit's the slowest GPU's plus a fixed overhead; a "
        "broadcast plan's gathers (stage 0) are a phase before it, their times added.  Rates are per GPU "
        "and per direction, in GB/s (10^9 bytes/s; a 400 Gb/s NIC is 50 GB/s), calibrated on H200 refits "
        "(bench/RESULTS.md, 'Predicted vs measured').  Not modelled: contention between NVLink and the "
        "NICs beyond the max, CPU time (control plane, launching many small copies) beyond the fixed "
        "term, NCCL's slower small buckets, quantizing or casting on the trainers.")
    pr.add_argument("--predict", action="store_true", help="add a 'predicted' section: the refit's time and "
                    "which GPU and which link set it")
    pr.add_argument("--hardware", choices=sorted(HARDWARE), default=None,
                    help="the machines (default h200-nvl8): " + "; ".join(
                        f"{h.name}: {h.gpus_per_host} GPUs per host, NVLink {h.ipc_link_gbs:.0f} GB/s over "
                        f"ipc, {h.nccl_link_gbs:.0f} over nccl, NIC {h.nic_gbs:.0f} GB/s per GPU, same-GPU "
                        f"{h.same_gpu_gbs:.0f} GB/s, overhead {h.overhead_s * 1e3:.1f} ms" for h in HARDWARE.values()))
    pr.add_argument("--link-gbps", type=float, default=None, metavar="GB/S",
                    help="NVLink rate per GPU per direction in GB/s (gigabytes per second), for either transport")
    pr.add_argument("--nic-gbps", type=float, default=None, metavar="GB/S",
                    help="NIC rate per GPU per direction in GB/s (gigabytes per second: a 400 Gb/s NIC is 50)")
    pr.add_argument("--transport", choices=list(TRANSPORTS), default=None,
                    help="which transport's link rate: ipc (CUDA IPC, the default when the plan's GPUs fit one "
                         "host) or nccl (the default across hosts)")
    pr.add_argument("--engine", choices=sorted(ENGINES), default=None,
                    help="add what a live engine costs around the bytes: " + "; ".join(
                        f"{e.name}: {e.loop_s * 1e3:.2f} ms a refit (the loop's calls and refit's control), "
                        f"{e.phase_s * 1e3:.2f} ms a phase (the landing between phases: a MoE engine on CUDA "
                        f"stages its experts a layer at a time, so plan it with --phase-layers 1)"
                        for e in ENGINES.values()))

    rs = sub.add_parser("reshard", help="convert a checkpoint between layouts, offline and bit-exact",
                        epilog="offline form: one rank-NNNNN.safetensors per rank under the framework's local "
                               "names (Megatron chunks prefixed chunk<c>. when vpp>1); hf: an HF checkpoint directory")
    model_arg(rs)
    rs.add_argument("--src", required=True, help="layout of --in (hf for an HF checkpoint)")
    rs.add_argument("--dst", required=True, help="layout to write (hf writes model.safetensors + config.json)")
    rs.add_argument("--in", dest="in_dir", required=True, help="input directory")
    rs.add_argument("--out", dest="out_dir", required=True, help="output directory (created; published whole "
                    "once complete)")
    dst_dtype_arg(rs)
    rs.add_argument("--force", action="store_true", help="replace --out when it is not empty")
    rs.add_argument("--json", action="store_true", help="print a JSON report")

    st = sub.add_parser("settings", help="list the REFIT_* knobs with their values here (docs/performance.md)",
                        epilog="scope run: member 0's value holds for every member of a run; process: this "
                               "process alone; bench: refit-bench alone")
    st.add_argument("--json", action="store_true", help="print JSON (one object per knob)")
    st.add_argument("--json-schema", nargs="?", const="settings", choices=SCHEMAS, metavar="WHAT",
                    help="print a JSON schema instead: of the REFIT_* settings (default), of a plan file (`plan`: what "
                         "`refit plan --out` writes, `refit.load_plan` reads) or a plan's summary (`summary`: `refit "
                         "plan --json`), or of the vLLM backend's init_info / update_info (what "
                         "init_weight_transfer_engine / update_weights take)")

    ve = sub.add_parser("verify", help="check what a plan's engines hold now against the trainers, moving no weights",
                        description="Ask the coordinator to compare, transfer by transfer, a checksum of what "
                                    "each engine holds with one of what the trainers hold (in the dtypes the "
                                    "wire carries), moving nothing.  Exit 0 when all match, 3 naming each "
                                    "differing tensor, box and both ranks, 2 for a bad request.")
    ve.add_argument("--plan", required=True, help="the plan_id CreatePlan returned (refit.Client.create_plan)")
    ve.add_argument("--coordinator", default=None, help="host:port (default $REFIT_ADDRESS, else 127.0.0.1:50051)")
    ve.add_argument("--token-file", default=None, help="file holding the coordinator's token (default $REFIT_TOKEN)")
    ve.add_argument("--timeout", type=float, default=60.0, help="seconds (default 60)")
    ve.add_argument("--json", action="store_true", help="print one JSON object")
    ve.set_defaults(token=None)  # read_token's last resort is `refit serve`'s --token

    # `refit serve` has its own parser (refit.control.server); listed here so --help shows it.
    sub.add_parser("serve", help="run the refit coordinator (gRPC control plane); see `refit serve --help`",
                   add_help=False)
    return p
