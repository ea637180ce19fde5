"""The redesign's measures held: no function over 60 lines, no import circle, one function-local import."""

from __future__ import annotations

from tools.code_metrics import LONG, Tree, global_group_readers, reading_path


def test_no_long_function_no_import_circle_and_one_local_import() -> None:
    tree = Tree()
    assert tree.long_functions == [], f"functions over {LONG} lines: {tree.long_functions}"
    assert tree.circles() == []
    assert len(tree.local_imports) <= 1, tree.local_imports


def test_the_readme_reading_path_starts_at_the_entry_script_and_ends_at_the_model() -> None:
    path = reading_path()
    assert path[0] == "pretrain_gpt.py"
    assert path[-1] == "models/gpt/gpt_model.py"
    assert len(path) == len(set(path)) == 10


def test_only_megatrons_own_entry_points_read_the_global_groups() -> None:
    """Everything else takes its groups from the caller, or ``parallel_state.groups_or_default``."""
    readers = {
        module: {call.split(":")[1] for call in calls} for module, calls in global_group_readers().items()
    }
    assert readers == {
        # P2PCommunicator(pp_group): the link groups initialize_model_parallel made for that group
        "core/pipeline_parallel/p2p_communication.py": {
            "model_parallel_is_initialized",
            "get_pipeline_model_parallel_group",
            "get_pipeline_model_parallel_channel_groups",
        },
        # get_forward_backward_func() without sizes (Megatron's older call)
        "core/pipeline_parallel/schedules.py": {
            "model_parallel_is_initialized",
            "get_pipeline_model_parallel_world_size",
            "get_virtual_pipeline_model_parallel_world_size",
        },
        # resolve_tp_group(None): a layer built without its group
        "core/tensor_parallel/utils.py": {"get_tensor_model_parallel_group"},
        # get_batch_on_this_cp_rank(batch) without sizes
        "core/transformer/context_parallel/sharding.py": {
            "get_context_parallel_world_size",
            "get_context_parallel_rank",
        },
    }
