import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Hermetic runs: compiled executables go to a fresh folder, not the user's cache.
import tempfile  # noqa: E402

os.environ.setdefault("DEFERFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="deferfuse-test-cache-"))

# An op first seen at a place in the code runs at once when its inputs are computed
# (eager_unseen_ops): whether a test's ops are deferred would then depend on which tests ran
# before it in the same worker.  Tests record from the first op; tests/test_unseen_ops.py and
# the fresh-process tests that drop this variable check the default.
os.environ.setdefault("DEFERFUSE_EAGER_UNSEEN_OPS", "0")
# Likewise an op whose flushes were lone runs at once at its place in the code (eager_lone_ops):
# a test's loop would stop recording after its first lone flush.  tests/test_unseen_ops.py
# checks it.
os.environ.setdefault("DEFERFUSE_EAGER_LONE_OPS", "0")
# And a place whose defer blocks ran faster at once than deferred runs them at once (eager_blocks):
# a test's loop would stop recording after its first few runs, and whether it did would depend on
# this machine's load.  tests/test_blocks.py checks it, on a fake clock.
os.environ.setdefault("DEFERFUSE_EAGER_BLOCKS", "0")
# A choice it made is kept in the disk cache for later processes (remember_blocks): the suite's
# processes share one folder, so a place would start from another test's choice.  The tests of
# remembering (tests/test_blocks.py) turn it on.
os.environ.setdefault("DEFERFUSE_REMEMBER_BLOCKS", "0")
# And under a default defer mode, the work between two reads of a value (eager_segments), timed
# the same way: tests/test_segments.py checks it, on a fake clock.
os.environ.setdefault("DEFERFUSE_EAGER_SEGMENTS", "0")

# Hypothesis profiles: ``default`` (the normal run, well under a few minutes on 2 cores) and
# ``deep`` (``HYPOTHESIS_PROFILE=deep``, as ``make test-deep`` does).  The program suite in
# test_programs.py has six generating tests: 6 x 45 = 270 programs by default, 6 x 1100 deep.
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "default",
    max_examples=45,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# The default profile is derandomized so CI is deterministic; deep explores new programs each run
# (every failure it finds becomes a pinned test in test_regressions.py).
settings.register_profile("deep", settings.get_profile("default"), max_examples=1100, derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# The settings users run with, made deterministic (tests/user_defaults.py): the eager shortcuts
# this file turns off above are on for the tests that take this fixture.
import pytest  # noqa: E402


@pytest.fixture(params=["deferred", "measuring"], ids=lambda way: f"blocks-{way}")
def user_defaults(request, monkeypatch):
    """Every setting at its default, deterministically (user_defaults.UserDefaults); parametrized
    over the two ways the block tier runs a new place (``indirect`` parametrization picks one)."""
    from user_defaults import UserDefaults, forget_what_was_learned
    from deferfuse import config
    from deferfuse.exec import blocks
    tiers = UserDefaults(request.param)
    monkeypatch.setattr(blocks, "clock", tiers.clock)
    forget_what_was_learned()
    with config.override(**tiers.settings):
        yield tiers
    forget_what_was_learned()


@pytest.fixture(autouse=True)
def _background_compiles_end_with_their_test():
    """A graph a test queued for background compilation finishes before the next test starts:
    otherwise it lands in that test's ``deferfuse.stats()`` (a compile counted after its
    ``reset_stats()``), and what a test counts would depend on which tests ran before it."""
    yield
    executables = sys.modules.get("deferfuse.exec.executables")
    if executables is not None and executables.compiles_pending():
        executables.wait_for_compiles(timeout=300)


@pytest.fixture
def always_compile():
    """Every flush compiled and run on XLA (no eager replay while a graph compiles): for tests of
    a lowering's numbers rather than of the tiers (``pytestmark = usefixtures("always_compile")``)."""
    from deferfuse import config
    with config.override(always_compile=True):
        yield


# Tests left to ``make test-all`` (the ``slow`` mark), so that ``make test`` stays under 10
# minutes on 2 cores: each took over ~2.5 s in a run of the whole suite (``pytest --durations``
# on a loaded machine), and each family keeps a quick case in the default run (one zoo model,
# one damaged entry, one planted pickle, the small parametrizations of grid_sample and the
# selections, the quick OpInfos: tests/test_conformance.py).  Measure again
# with ``make test-all`` and ``--durations=0`` when the suite grows.
SLOW_TESTS = frozenset({
    "tests/test_backend.py::test_dispatch_is_synchronous_by_default",
    "tests/test_backend.py::test_existing_client_is_left_alone",
    "tests/test_backend.py::test_the_users_allocator_settings_are_left_alone",
    "tests/test_backend.py::test_user_choice_keeps_async_dispatch[env0]",
    "tests/test_backend.py::test_user_choice_keeps_async_dispatch[env1]",
    "tests/test_backend.py::test_xla_buffers_are_reused_instead_of_faulted_in_afresh",
    "tests/test_bench_scripts.py::test_loops_times_a_loop_of_changing_lengths_from_its_second_epoch",
    "tests/test_bench_scripts.py::test_loops_times_a_loop_with_no_optimizer_that_reads_at_its_end",
    "tests/test_bench_scripts.py::test_read_cost_times_a_step_and_its_read_in_both_modes",
    "tests/test_bench_scripts.py::test_openmp_teams_times_strict_before_and_after_deferred_steps",
    "tests/test_bench_scripts.py::test_generate_times_compiled_generate_beside_strict_and_checks_its_tokens",
    "tests/test_bench_scripts.py::test_compile_bench_shows_each_candidates_mfu",
    "tests/test_bench_scripts.py::test_xla_flags_times_the_jax_step_beside_strict_in_fresh_processes",
    "tests/test_blocks.py::test_a_damaged_remembered_choice_is_ignored",
    "tests/test_blocks.py::test_a_later_process_starts_a_place_from_its_remembered_choice",
    "tests/test_blocks.py::test_a_process_too_short_to_choose_leaves_its_runs_to_the_next",
    "tests/test_cache.py::test_executables_in_memory_are_bounded_by_the_mappings_they_hold",
    "tests/test_host_kernels.py::test_the_library_make_install_built_is_found_whatever_the_cache_folder",
    "tests/test_host_kernels.py::test_the_disk_cache_round_trip_needs_the_host_kernels",
    "tests/test_host_kernels.py::test_the_zoos_products_give_stricts_bits[gpt2]",
    "tests/test_host_kernels.py::test_the_zoos_products_give_stricts_bits[mixtral]",
    "tests/test_host_kernels.py::test_the_zoos_products_give_stricts_bits[bert]",
    "tests/test_host_kernels.py::test_the_zoos_products_give_stricts_bits[t5]",
    "tests/test_host_kernels.py::test_the_zoos_products_give_stricts_bits[vit]",
    "tests/test_host_kernels.py::test_the_zoos_products_give_stricts_bits[resnet]",
    "tests/test_host_kernels.py::test_the_zoos_products_give_stricts_bits[convnext]",
    "tests/test_cache.py::test_executables_in_memory_are_bounded_in_bytes",
    "tests/test_cache.py::test_executables_in_memory_are_bounded_least_recently_used_first",
    "tests/test_cache.py::test_one_off_graph_never_imports_jax_or_dynamo",
    "tests/test_cache.py::test_one_off_script_runs_as_strict_does",
    "tests/test_cache.py::test_the_metadata_cache_is_bounded",
    "tests/test_cache_security.py::test_a_planted_pickle_never_runs[format_2]",
    "tests/test_cache_security.py::test_a_planted_pickle_never_runs[payload]",
    "tests/test_cache_security.py::test_a_runtime_check_raises_from_an_executable_loaded_from_disk",
    "tests/test_compare.py::test_a_zoo_model_with_a_broken_lowering_names_that_op_and_its_module",
    "tests/test_compare.py::test_the_command_line_compares_a_script[agreeing]",
    "tests/test_compare.py::test_the_command_line_compares_a_script[broken-exp]",
    "tests/test_compare.py::test_the_zoo_model_agrees_when_nothing_is_broken",
    "tests/test_compile.py::test_a_second_process_compiles_and_lowers_nothing",
    "tests/test_compile.py::test_hugging_face_llama_forward_and_backward_equal_eager",
    "tests/test_compile.py::test_importing_deferfuse_registers_no_backend",
    "tests/test_compile.py::test_mlp_forward_and_backward_equal_eager",
    "tests/test_compile.py::test_the_backend_is_found_by_name_in_a_process_that_never_imported_deferfuse",
    "tests/test_compile.py::test_transformer_layer_with_dropout_trains_as_eager_step_by_step",
    "tests/test_conformance.py::test_opinfo_conformance[scatter]",
    "tests/test_debug.py::test_environment_selects_debug_mode_and_nan_check",
    "tests/test_default_settings.py::test_cnn_training[bias-input-with-grad-adamw-deferred]",
    "tests/test_default_settings.py::test_cnn_training[bias-input-with-grad-sgd-momentum-deferred]",
    "tests/test_default_settings.py::test_cnn_training_with_blocks_at_once_between[adamw-measuring]",
    "tests/test_default_settings.py::test_cnn_training_with_blocks_at_once_between[sgd-momentum-measuring]",
    "tests/test_default_settings.py::test_transformer_training[blocks-deferred-encoder-layer]",
    "tests/test_default_settings.py::test_transformer_training[blocks-deferred-sdpa-by-hand]",
    "tests/test_default_settings.py::test_transformer_training[blocks-measuring-encoder-layer]",
    "tests/test_default_settings.py::test_transformer_training[blocks-measuring-sdpa-by-hand]",
    "tests/test_disk_cache.py::test_a_damaged_entry_is_compiled_again[another_format]",
    "tests/test_disk_cache.py::test_a_damaged_entry_is_compiled_again[empty]",
    "tests/test_disk_cache.py::test_a_damaged_entry_is_compiled_again[flip_a_payload_byte]",
    "tests/test_disk_cache.py::test_a_damaged_entry_is_compiled_again[random_bytes]",
    "tests/test_disk_cache.py::test_a_lapack_executable_loads_in_a_second_process",
    "tests/test_disk_cache.py::test_every_op_family_loads_from_disk_in_a_second_process",
    "tests/test_disk_cache.py::test_other_xla_flags_compile_again",
    "tests/test_disk_cache.py::test_stablehlo_of_an_executable_loaded_from_disk",
    "tests/test_disk_cache.py::test_the_tests_never_use_the_users_cache_folder",
    "tests/test_disk_cache.py::test_two_processes_writing_the_same_entries_at_once",
    "tests/test_distributed.py::test_torchrun_script_unchanged[-m",
    "tests/test_distributed.py::test_torchrun_script_unchanged[TORCHTPU_MODE=defer]",
    "tests/test_kernels.py::test_an_edited_kernel_never_runs_an_old_cached_executable",
    "tests/test_kernels.py::test_import_deferfuse_does_not_import_jax",
    "tests/test_kernels.py::test_tiny_llama_with_jax_attention_trains_as_strict",
    "tests/test_lower_attention.py::test_flash_attention_layouts_and_subsets[dtype1]",
    "tests/test_lower_attention.py::test_flash_attention_shapes[dtype0]",
    "tests/test_lower_attention.py::test_flash_attention_shapes[dtype1]",
    "tests/test_lower_attention.py::test_flash_attention_shapes[dtype2]",
    "tests/test_lower_attention.py::test_flash_attention_shapes[dtype3]",
    "tests/test_lower_attention.py::test_llama_attention_block_trains",
    "tests/test_lower_creation.py::test_linspace_matches_torch_bit_for_bit[dtype0]",
    "tests/test_lower_creation.py::test_linspace_matches_torch_bit_for_bit[dtype1]",
    "tests/test_lower_creation.py::test_linspace_matches_torch_bit_for_bit[dtype2]",
    "tests/test_lower_creation.py::test_linspace_matches_torch_bit_for_bit[dtype3]",
    "tests/test_lower_creation.py::test_linspace_matches_torch_bit_for_bit[dtype5]",
    "tests/test_lower_creation.py::test_linspace_of_tensors_bit_for_bit[dtype0]",
    "tests/test_lower_creation.py::test_linspace_of_tensors_bit_for_bit[dtype1]",
    "tests/test_lower_creation.py::test_linspace_of_tensors_bit_for_bit[dtype2]",
    "tests/test_lower_creation.py::test_linspace_of_tensors_bit_for_bit[dtype3]",
    "tests/test_lower_creation.py::test_linspace_of_tensors_bit_for_bit[dtype4]",
    "tests/test_lower_grouped_mm.py::test_mixtral_trains_as_strict_with_no_fallback",
    "tests/test_lower_histogram.py::test_bin_ct[dtype0]",
    "tests/test_lower_histogram.py::test_bin_ct[dtype1]",
    "tests/test_lower_histogram.py::test_bin_ct_awkward_inputs[dtype0]",
    "tests/test_lower_histogram.py::test_bin_ct_awkward_inputs[dtype1]",
    "tests/test_lower_histogram.py::test_bins_tensor[dtype0]",
    "tests/test_lower_histogram.py::test_bins_tensor[dtype1]",
    "tests/test_lower_lce_aa.py::test_linear_cross_entropy_chunked[mean]",
    "tests/test_lower_lce_aa.py::test_linear_cross_entropy_chunked[none]",
    "tests/test_lower_lce_aa.py::test_linear_cross_entropy_chunked[sum]",
    "tests/test_lower_lce_aa.py::test_linear_cross_entropy_chunked_direct_calls",
    "tests/test_lower_lce_aa.py::test_linear_cross_entropy_chunked_errors_match_torch",
    "tests/test_lower_lce_aa.py::test_linear_cross_entropy_chunked_ignore_index[mean]",
    "tests/test_lower_lce_aa.py::test_linear_cross_entropy_chunked_ignore_index[none]",
    "tests/test_lower_lce_aa.py::test_linear_cross_entropy_chunked_ignore_index[sum]",
    "tests/test_lower_lce_aa.py::test_linear_cross_entropy_chunked_shapes",
    "tests/test_lower_lce_aa.py::test_upsample_aa[False-dtype0]",
    "tests/test_lower_lce_aa.py::test_upsample_aa_backward[False]",
    "tests/test_lower_lce_aa.py::test_upsample_aa_backward[True]",
    "tests/test_lower_lce_aa.py::test_upsample_aa_large_downscale",
    "tests/test_lower_lce_aa.py::test_upsample_aa_one_pixel_wide",
    "tests/test_lower_linalg_more.py::test_batched_factorizations_in_one_computation_never_hang",
    "tests/test_lower_linalg_more.py::test_cholesky_errors_match_torch",
    "tests/test_lower_linalg_more.py::test_cholesky_ex_not_positive_definite[128]",
    "tests/test_lower_linalg_more.py::test_cholesky_family[dtype0]",
    "tests/test_lower_linalg_more.py::test_cholesky_family[dtype1]",
    "tests/test_lower_linalg_more.py::test_linalg_lu[dtype0]",
    "tests/test_lower_linalg_more.py::test_linalg_lu[dtype1]",
    "tests/test_lower_linalg_more.py::test_triangular_solve_and_lu_unpack[dtype0]",
    "tests/test_lower_linalg_more.py::test_triangular_solve_and_lu_unpack[dtype1]",
    "tests/test_lower_nn_backward.py::test_adaptive_max_pool_2d",
    "tests/test_lower_nn_backward.py::test_adaptive_max_pool_3d_and_max_pool3d_backward",
    "tests/test_lower_nn_backward.py::test_grid_sample[2-bicubic-border-False]",
    "tests/test_lower_nn_backward.py::test_grid_sample[2-bicubic-border-True]",
    "tests/test_lower_nn_backward.py::test_grid_sample[2-bicubic-reflection-False]",
    "tests/test_lower_nn_backward.py::test_grid_sample[2-bicubic-reflection-True]",
    "tests/test_lower_nn_backward.py::test_grid_sample[2-bicubic-zeros-False]",
    "tests/test_lower_nn_backward.py::test_grid_sample[2-bicubic-zeros-True]",
    "tests/test_lower_nn_backward.py::test_grid_sample[2-bilinear-border-False]",
    "tests/test_lower_nn_backward.py::test_grid_sample[2-bilinear-border-True]",
    "tests/test_lower_nn_backward.py::test_grid_sample[2-bilinear-reflection-False]",
    "tests/test_lower_nn_backward.py::test_grid_sample[2-bilinear-reflection-True]",
    "tests/test_lower_nn_backward.py::test_grid_sample[2-bilinear-zeros-False]",
    "tests/test_lower_nn_backward.py::test_grid_sample[2-bilinear-zeros-True]",
    "tests/test_lower_nn_backward.py::test_grid_sample[2-nearest-reflection-False]",
    "tests/test_lower_nn_backward.py::test_grid_sample[2-nearest-reflection-True]",
    "tests/test_lower_nn_backward.py::test_grid_sample[3-bilinear-border-False]",
    "tests/test_lower_nn_backward.py::test_grid_sample[3-bilinear-border-True]",
    "tests/test_lower_nn_backward.py::test_grid_sample[3-bilinear-reflection-False]",
    "tests/test_lower_nn_backward.py::test_grid_sample[3-bilinear-reflection-True]",
    "tests/test_lower_nn_backward.py::test_grid_sample[3-bilinear-zeros-False]",
    "tests/test_lower_nn_backward.py::test_grid_sample[3-bilinear-zeros-True]",
    "tests/test_lower_nn_backward.py::test_grid_sample[3-nearest-reflection-True]",
    "tests/test_lower_nn_backward.py::test_grid_sample_edges",
    "tests/test_lower_nn_backward.py::test_histc[dtype0]",
    "tests/test_lower_nn_backward.py::test_histc[dtype1]",
    "tests/test_lower_nn_backward.py::test_upsample_1d_backward[dtype0-linear]",
    "tests/test_lower_nn_backward.py::test_upsample_1d_backward[dtype1-linear]",
    "tests/test_lower_nn_backward.py::test_upsample_2d_backward[bicubic]",
    "tests/test_lower_nn_backward.py::test_upsample_2d_backward[bilinear]",
    "tests/test_lower_nn_backward.py::test_upsample_3d_backward[trilinear]",
    "tests/test_lower_pointwise.py::test_activations_forward_and_backward[torch.bfloat16]",
    "tests/test_lower_pointwise.py::test_activations_forward_and_backward[torch.float64]",
    "tests/test_lower_pointwise.py::test_binary[f32_bcast]",
    "tests/test_lower_pointwise.py::test_binary_with_python_scalars[torch.float16]",
    "tests/test_lower_pointwise.py::test_binary_with_python_scalars[torch.float32]",
    "tests/test_lower_pointwise.py::test_binary_with_python_scalars[torch.float64]",
    "tests/test_lower_pointwise.py::test_binary_with_python_scalars[torch.int8]",
    "tests/test_lower_pointwise.py::test_unary[0dim]",
    "tests/test_lower_pointwise.py::test_unary[f32_special]",
    "tests/test_lower_pointwise.py::test_zeta_and_incomplete_gamma[dtype0]",
    "tests/test_lower_pointwise.py::test_zeta_and_incomplete_gamma[dtype1]",
    "tests/test_lower_reduction.py::test_full_median_and_logcumsumexp",
    "tests/test_lower_reduction.py::test_segment_reduce_backward[dtype0]",
    "tests/test_lower_reduction.py::test_segment_reduce_backward[dtype1]",
    "tests/test_lower_reduction.py::test_segment_reduce_backward[dtype2]",
    "tests/test_lower_reduction.py::test_selection_ties_match_torch[f16-kthvalue]",
    "tests/test_lower_reduction.py::test_selection_ties_match_torch[f32_t-kthvalue]",
    "tests/test_lower_reduction.py::test_selection_ties_match_torch[f32_t-mode]",
    "tests/test_lower_reduction.py::test_selection_ties_match_torch[f64-kthvalue]",
    "tests/test_lower_reduction.py::test_selection_ties_match_torch[f64-mode]",
    "tests/test_lower_reduction.py::test_selection_ties_match_torch[i64-kthvalue]",
    "tests/test_lower_reduction.py::test_selection_ties_match_torch[nan16-kthvalue]",
    "tests/test_lower_reduction.py::test_selection_ties_match_torch[nan16-mode]",
    "tests/test_lower_reduction.py::test_selections_random_ties[13]",
    "tests/test_lower_reduction.py::test_selections_random_ties[16]",
    "tests/test_lower_reduction.py::test_selections_random_ties[2]",
    "tests/test_lower_reduction.py::test_selections_random_ties[3]",
    "tests/test_lower_reduction.py::test_selections_random_ties[40]",
    "tests/test_lower_reduction.py::test_selections_random_ties[5]",
    "tests/test_lower_reduction.py::test_selections_random_ties[8]",
    "tests/test_lower_rnn.py::test_direct_calls",
    "tests/test_lower_rnn.py::test_float64_and_projections",
    "tests/test_lower_rnn.py::test_gru",
    "tests/test_lower_rnn.py::test_lstm_bfloat16",
    "tests/test_lower_rnn.py::test_lstm_tagger_trains",
    "tests/test_lower_rnn.py::test_lstm_tagger_trains_with_the_default_settings[blocks-deferred]",
    "tests/test_lower_rnn.py::test_lstm_tagger_trains_with_the_default_settings[blocks-measuring]",
    "tests/test_lower_special.py::test_bessel_j_y_k_and_airy_ai_of_integers_bools_zero_dim_empty_and_views",
    "tests/test_lower_special.py::test_polynomial_out_and_large_n",
    "tests/test_lower_special.py::test_polynomials_broadcast_x_and_n[dtype0]",
    "tests/test_lower_special.py::test_polynomials_broadcast_x_and_n[dtype1]",
    "tests/test_lower_special.py::test_polynomials_nonfinite_and_fractional_n",
    "tests/test_lower_special.py::test_polynomials_of_integers_bools_and_scalars",
    "tests/test_lower_special.py::test_polynomials_zero_dim_and_empty",
    "tests/test_modes.py::test_bad_environment_variable_is_a_clear_error",
    "tests/test_modes.py::test_environment_variable_selects_mode",
    "tests/test_modes.py::test_garbage_from_before_a_defer_block_is_collected_after_it",
    "tests/test_modes.py::test_python_m_gives_the_script_the_main_module_python_gives",
    "tests/test_modes.py::test_python_m_prints_what_python_prints_on_stderr[default]",
    "tests/test_modes.py::test_python_m_prints_what_python_prints_on_stderr[off]",
    "tests/test_modes.py::test_python_m_runs_script_like_python",
    "tests/test_modes.py::test_torch_compile_inside_defer_does_not_trace_the_recorder",
    "tests/test_parameters.py::test_hugging_face_trainer_under_torchtpu_mode_defer",
    "tests/test_processes.py::test_jax_fork_warning_and_jax_ops_in_a_child_forked_after_xla[deferfuse]",
    "tests/test_processes.py::test_jax_fork_warning_and_jax_ops_in_a_child_forked_after_xla[user]",
    "tests/test_protocols.py::test_every_protocol_answers_as_strict[summarized_grad_fn-computed]",
    "tests/test_protocols.py::test_every_protocol_answers_as_strict[summarized_grad_fn-pending]",
    "tests/test_protocols.py::test_every_protocol_answers_as_strict[summarized_grad_fn-plain_written]",
    "tests/test_regressions.py::test_an_inplace_update_loop_leaves_no_cyclic_garbage[eager-first]",
    "tests/test_regressions.py::test_an_inplace_update_loop_leaves_no_cyclic_garbage[xla]",
    "tests/test_steps.py::test_no_program_spans_two_steps",
    "tests/test_steps.py::test_the_compiles_of_a_loop_do_not_depend_on_how_often_it_logs[read-after-forward]",
    "tests/test_steps.py::test_the_compiles_of_a_loop_do_not_depend_on_how_often_it_logs[read-after-step]",
    "tests/test_tokamax.py::test_dot_product_attention_equals_torch[defer]",
    "tests/test_tokamax.py::test_dot_product_attention_equals_torch[strict]",
    "tests/test_tokamax.py::test_gated_linear_unit_equals_torch[strict]",
    "tests/test_tokamax.py::test_importing_the_module_imports_neither_tokamax_nor_jax",
    "tests/test_tokamax.py::test_opcheck_passes_for_every_op",
    "tests/test_tokamax.py::test_tiny_llama_with_tokamax_attention_trains_as_strict_sdpa",
    "tests/test_training.py::test_accumulation_clipping_and_schedule[False]",
    "tests/test_training.py::test_accumulation_clipping_and_schedule[True]",
    "tests/test_training.py::test_accumulation_clipping_and_schedule_with_the_default_settings[measuring]",
    "tests/test_training.py::test_convergence_over_30_steps",
    "tests/test_training.py::test_grad_scaler_under_autocast_matches_strict[xla-adamw-fused]",
    "tests/test_training.py::test_grad_scaler_under_autocast_matches_strict[xla-sgd-fused]",
    "tests/test_training.py::test_grad_scaler_under_autocast_matches_strict[xla-sgd-momentum]",
    "tests/test_training.py::test_optimizer_matches_strict[adam-foreach-xla]",
    "tests/test_training.py::test_optimizer_matches_strict[adam-fused-xla]",
    "tests/test_training.py::test_optimizer_matches_strict[adam-wd-amsgrad-xla]",
    "tests/test_training.py::test_optimizer_matches_strict[adam-xla]",
    "tests/test_training.py::test_optimizer_matches_strict[adamw-foreach-amsgrad-xla]",
    "tests/test_training.py::test_optimizer_matches_strict[adamw-foreach-xla]",
    "tests/test_training.py::test_optimizer_matches_strict[adamw-fused-amsgrad-maximize-xla]",
    "tests/test_training.py::test_optimizer_matches_strict[adamw-fused-xla]",
    "tests/test_training.py::test_optimizer_matches_strict[adamw-xla]",
    "tests/test_training.py::test_optimizer_matches_strict[sgd-momentum-foreach-xla]",
    "tests/test_zoo.py::test_zoo_model_trains_and_generates_as_strict_with_no_fallback[bart]",
    "tests/test_zoo.py::test_zoo_model_trains_and_generates_as_strict_with_no_fallback[bert]",
    "tests/test_zoo.py::test_zoo_model_trains_and_generates_as_strict_with_no_fallback[convnext]",
    "tests/test_zoo.py::test_zoo_model_trains_and_generates_as_strict_with_no_fallback[gemma]",
    "tests/test_zoo.py::test_zoo_model_trains_and_generates_as_strict_with_no_fallback[gpt2]",
    "tests/test_zoo.py::test_zoo_model_trains_and_generates_as_strict_with_no_fallback[gru]",
    "tests/test_zoo.py::test_zoo_model_trains_and_generates_as_strict_with_no_fallback[llama]",
    "tests/test_zoo.py::test_zoo_model_trains_and_generates_as_strict_with_no_fallback[mistral]",
    "tests/test_zoo.py::test_zoo_model_trains_and_generates_as_strict_with_no_fallback[mixtral]",
    "tests/test_zoo.py::test_zoo_model_trains_and_generates_as_strict_with_no_fallback[phi]",
    "tests/test_zoo.py::test_zoo_model_trains_and_generates_as_strict_with_no_fallback[qwen3]",
    "tests/test_zoo.py::test_zoo_model_trains_and_generates_as_strict_with_no_fallback[resnet]",
    "tests/test_zoo.py::test_zoo_model_trains_and_generates_as_strict_with_no_fallback[roberta]",
    "tests/test_zoo.py::test_zoo_model_trains_and_generates_as_strict_with_no_fallback[swin]",
    "tests/test_zoo.py::test_zoo_model_trains_and_generates_as_strict_with_no_fallback[t5]",
    "tests/test_zoo.py::test_zoo_model_trains_and_generates_as_strict_with_no_fallback[vit]",
    "tests/test_zoo.py::test_zoo_model_with_the_default_settings[blocks-deferred-resnet]",
    "tests/test_zoo.py::test_zoo_model_with_the_default_settings[blocks-measuring-llama]",
    "tests/test_zoo.py::test_zoo_model_with_the_default_settings[blocks-measuring-resnet]",
    "tests/test_zoo_bench.py::test_engine_time_splits_each_deferred_step_into_parts_that_add_up",
    "tests/test_zoo_bench.py::test_zoo_bench_writes_equal_results_and_a_chart",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
