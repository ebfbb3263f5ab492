"""Ground truth from Megatron-Core's *real* code, runnable on a CPU-only box.

Every public function here answers a layout question by executing the code of the
installed ``megatron-core`` package (0.16.1), not by re-deriving the rule:

* ``megatron_rank_coords``            -> ``parallel_state.RankGenerator.get_ranks`` (pure, in process)
* ``megatron_rank_coords_via_initialize`` -> the full ``parallel_state.initialize_model_parallel``
  + ``get_*_rank()`` getters, once per global rank, on torch's in-memory "fake" process-group
  backend (subprocess)                                                        [``ranks.py``]
* ``megatron_layer_ids``              -> ``get_num_layers_to_build`` + ``get_transformer_layer_offset``
  (pure, in process; the flexible ``pipeline_model_parallel_layout`` path needs parallel_state's
  pp-rank setter, which is set and restored around the call)                 [``layers.py``]
* ``megatron_qkv_rows``               -> a real ``SelfAttention`` (local spec) per TP rank, weights
  initialised through Megatron's own CPU master-weight split, then
  ``SelfAttention.get_query_key_value_tensors`` (subprocess)                  [``attention.py``]
* ``megatron_fc1_rows``               -> a real gated ``MLP`` per TP rank, forward through
  ``MLP.forward`` (subprocess)                                                [``mlp.py``]
* ``megatron_fc1_checkpoint_offsets`` -> ``MLP.sharded_state_dict`` / ``apply_swiglu_sharded_factory``
  (where each local fc1 half lands in the dist checkpoint) (subprocess)       [``mlp.py``]
* ``te_spec_param_name``              -> NOT executed: documented local->TE name mapping [``names.py``]
* ``megatron_gpt_param_names``        -> a real tiny ``GPTModel`` (local, non-TE spec) for every
  (global rank, vp chunk), its ``named_parameters``/persistent buffers and its
  ``sharded_state_dict`` (dist-checkpoint keys, global shapes/offsets) (subprocess) [``gpt.py``]

"(subprocess)" work runs in a helper interpreter (``worker.py``: ``python -m tests.harness.megatron
--serve``), inside which the CPU shims and fake process groups of ``cpu.py`` are installed; errors
come back with their builtin exception type, others as ``MegatronError``.
"""

from tests.harness.megatron.attention import megatron_qkv_rows
from tests.harness.megatron.gpt import megatron_gpt_param_names
from tests.harness.megatron.layers import megatron_layer_ids
from tests.harness.megatron.mlp import megatron_fc1_checkpoint_offsets, megatron_fc1_rows
from tests.harness.megatron.names import te_spec_param_name
from tests.harness.megatron.ranks import (
    DEFAULT_ORDER,
    megatron_rank_coords,
    megatron_rank_coords_via_initialize,
)
from tests.harness.megatron.worker import MegatronError

__all__ = [
    "DEFAULT_ORDER",
    "MegatronError",
    "megatron_fc1_checkpoint_offsets",
    "megatron_fc1_rows",
    "megatron_gpt_param_names",
    "megatron_layer_ids",
    "megatron_qkv_rows",
    "megatron_rank_coords",
    "megatron_rank_coords_via_initialize",
    "te_spec_param_name",
]
