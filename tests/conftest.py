"""Test set-up: the backend, two logical CPUs, GPU memory growth, the
`gpu` and `slow` markers, a clean policy and seed per test.

The suite runs twice: on TensorFlow (the default), and with
`KERAS_BACKEND=jax` on the files in `JAX_TESTS` (kmp's JAX support and the
backend-independent tests); `.ci/run` and the README's test command run both.
"""

import gc
import os

BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")
if BACKEND not in ("tensorflow", "jax"):
    raise RuntimeError(f"kmp's tests run with KERAS_BACKEND=tensorflow or jax, not {BACKEND!r}")
os.environ["KERAS_BACKEND"] = BACKEND
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if BACKEND == "jax":
    # Two host devices for keras.distribution.DataParallel; set before JAX starts.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    ).strip()

# The files the JAX pass runs: kmp on JAX, and the files whose tests hold on
# every backend (the others use TensorFlow itself: tapes, tf.function,
# tf.distribute, TensorFlow's error types and rounding). The TensorFlow pass
# runs every file but those in JAX_ONLY.
JAX_TESTS = (
    "test_jax.py",
    "test_policy.py",
    "test_convert.py",
    "test_built_precision.py",
    "test_format.py",
    "test_ledger.py",
    "test_keras_io_jax.py",
    "test_without_tensorflow.py",
    "test_jax_install.py",
    "test_backends.py",
    "test_float8.py",
    "test_epoch_logs.py",
    "test_guard.py",
    "test_modes.py",
    "test_compensated.py",
    "test_bfloat16_weights.py",
    "test_jax_distributed.py",
)
# The JAX pass's own files, which the TensorFlow pass leaves out.
JAX_ONLY = ("test_jax.py", "test_keras_io_jax.py", "test_without_tensorflow.py", "test_jax_install.py",
            "test_jax_distributed.py")
# Keras' own tests ported to kmp (tests/peers/, see its __init__.py): the files
# whose originals run on every backend run in both passes; the TensorFlow pass
# runs all of them (tf-keras' files, test_tfkeras_*.py, use TensorFlow itself).
# A test of a backend-agnostic file that its original runs on one backend only
# carries `@pytest.mark.backend("tensorflow")` (or "jax") and is deselected, not
# skipped, in the other pass.
PEERS_JAX_TESTS = (
    "test_keras_loss_scale_optimizer.py",
    "test_keras_optimizer_sparse.py",
    "test_keras_trainer.py",
    "test_keras_backup_and_restore.py",
    "test_keras_model_checkpoint.py",
)


def _test_files(folder):
    return [name for name in os.listdir(os.path.join(os.path.dirname(__file__), folder))
            if name.startswith("test_") and name.endswith(".py")]


collect_ignore = (
    [name for name in _test_files(".") if name not in JAX_TESTS]
    + [f"peers/{name}" for name in _test_files("peers") if name not in PEERS_JAX_TESTS]
    if BACKEND == "jax" else list(JAX_ONLY)
)

# TensorFlow reserves nearly all of a GPU's memory in the first process that
# touches it; another pytest worker, or a test's child process, would then
# fail ("cudaSetDevice() on GPU:0 failed. Status: out of memory", or an abort
# inside fit). Growth allocates only what is used. The environment variable
# holds by construction: set before TensorFlow is imported in this worker
# (pytest-xdist starts each worker with this conftest), and inherited by every
# child, whatever touches the GPU first; children that need no GPU are
# started without it (`_helpers.child_env`, `CUDA_VISIBLE_DEVICES=""`). It
# also holds in the JAX pass, where a test that exports a SavedModel or writes
# TensorBoard events imports TensorFlow itself.
os.environ["TF_FORCE_GPU_ALLOW_GROWTH"] = "true"


def _tensorflow_gpus():
    """The GPUs TensorFlow sees, after turning on memory growth and splitting
    the CPU into two logical devices (TensorFlow pass only)."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError:  # initialized already: the environment variable holds
            pass
    # Two logical CPU devices let tf.distribute.MirroredStrategy run two
    # replicas here; this must happen before TensorFlow initializes its devices.
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    return gpus


def _jax_gpus():
    """The GPUs JAX sees. The JAX pass imports no TensorFlow: it runs where
    TensorFlow is not installed (`pip install -e ".[jax]"`, .ci/run)."""
    import jax

    try:
        return jax.devices("gpu")
    except RuntimeError:  # no GPU backend: "Unknown backend gpu"
        return []


# What a `gpu`-marked test needs, as the running backend sees it.
GPUS = _jax_gpus() if BACKEND == "jax" else _tensorflow_gpus()

import keras  # noqa: E402
import pytest  # noqa: E402

import kmp  # noqa: E402,F401


# The slow tier: tests that start processes (real multi-worker clusters,
# SIGKILL, the examples and benchmarks as a user runs them), train every
# keras-hub model, or run every documentation example. `pytest -m "not slow"`
# leaves them out; the README's test command and .ci/run run them too.
# Listed here rather than decorated in each file: a whole file by its name, or
# one test by "file::name" (every parametrization of it); a parametrization
# slow alone carries the mark in its file (`pytest.param(..., marks=pytest.mark.slow)`),
# where pytest checks that it exists.
SLOW = (
    "test_benchmarks.py",
    # Keras' and tf-keras' own tests (tests/peers/): the trainer's and
    # tf-keras' files, each case a fresh model and trace, run in the whole
    # suite; Keras' LossScaleOptimizer and sparse-optimizer ports (seconds)
    # stay in the fast tier.
    "test_keras_trainer.py",
    "test_keras_backup_and_restore.py",
    "test_keras_model_checkpoint.py",
    "test_tfkeras_loss_scale_optimizer.py",
    "test_tfkeras_model.py",
    # XLA compiles of every configuration, and a child process's dump.
    "test_xla_step.py",
    # tf-keras' testClipping restated: 12 strategies-by-clips cases (~3 s each).
    "test_distribute.py::test_clipping",
    "test_distribute.py::test_whole_batch_clipping_takes_sparse_and_mixed_dtype_gradients",
    "test_resume.py::test_a_crash_in_a_later_callback_resumes_where_keras_own_backup_resumes",
    "test_resume.py::test_what_a_later_callback_changes_is_rewritten_into_the_epochs_backup",
    # keras.io's examples and guides, each trained twice (float32, mixed_float16).
    "test_keras_io.py",
    "test_keras_io_jax.py",
    "test_compat.py",
    "test_docs.py::test_every_python_block_runs",
    "test_examples.py",
    "test_cli.py::test_doctor_json_reports_versions_devices_auto_policy_and_speedups",
    "test_cli.py::test_doctor_prints_a_readable_report",
    "test_cli.py::test_doctor_warns_where_keras_json_stores_weights_in_16_bits",
    "test_distribute.py::test_multi_worker_fit_agrees_across_workers_and_with_one_worker",
    "test_distribute.py::test_distributed_benchmark_runs",
    "test_distribute.py::test_multi_worker_example_runs_two_identical_workers",
    "test_export.py::test_saved_model_runs_without_kmp_and_converts_to_tflite",
    "test_resume.py::test_sigkill_mid_save_then_mid_epoch_resumes_bit_identical",
    "test_resume.py::test_keras_backup_killed_mid_save_resumes_from_the_last_complete_backup",
    "test_resume.py::test_two_workers_sharing_one_backup_folder_resume_identical_after_a_kill",
    "test_resume.py::test_two_workers_killed_between_their_saves_resume_from_the_same_backup",
    "test_backup_safety.py::test_a_second_run_on_a_folder_in_use_is_refused_and_a_killed_one_resumes",
    "test_cli.py::test_no_gpu_for_device_gpu_exits_4",
    # Two JAX processes joined by jax.distributed, and eight devices in one:
    # child processes, 5-20 s each on the busy 2-core CPU.
    "test_jax_distributed.py::test_two_processes_train_as_one_and_skip_one_processs_overflow_together",
    "test_jax_distributed.py::test_a_killed_run_resumes_from_one_shared_folder_as_if_uninterrupted",
    "test_jax_distributed.py::test_processes_an_epoch_apart_resume_the_backup_both_hold",
    "test_jax_distributed.py::test_a_folder_another_run_holds_stops_every_process_with_one_error",
    "test_jax_distributed.py::test_model_parallel_keeps_the_layout_map_through_training_saving_and_convert",
    # A child process each: `kmp doctor` on JAX (its benchmark, about 8 s
    # unloaded), and `python -m kmp --help`, which imports TensorFlow.
    "test_cli.py::test_doctor_runs_on_jax_and_reports_what_jax_sees",
    "test_public_paths.py::test_the_console_script_and_python_m_kmp_reach_the_cli",
    "test_scaler_core.py::test_importing_kmp_changes_no_tensorflow_or_keras_attribute",
    # The identity test's stages run in one fresh process (a module fixture);
    # the checks of its snapshot itself stay fast.
    "test_foreign.py::test_the_snapshot_does_not_change_under_plain_keras",
    "test_foreign.py::test_kmp_changes_no_tensorflow_or_keras_attribute",
    "test_foreign.py::test_a_plain_keras_model_beside_kmp_is_as_without_kmp",
    "test_foreign.py::test_models_handed_to_convert_keep_their_attributes",
    "test_foreign.py::test_objects_kmp_was_not_given_to_keep_carry_no_kmp_attribute",
    # Long equivalence runs (each over 10 s on 2 busy cores); a shorter test of
    # the same module stays in the fast tier.
    "test_accumulation.py::test_overflow_discards_the_whole_accumulated_step_once",
    "test_convert_any.py::test_keep_float32_survives_a_keras_file_round_trip",
    "test_custom_steps.py::test_gan_with_one_line_per_loss_matches_keras_own_scaler_recipe",
    "test_custom_steps.py::test_progress_bar_shows_each_scaler_readably",
    "test_devices.py::test_compiled_fit_with_several_steps_per_execution",
    "test_distribute.py::test_jit_and_steps_per_execution_under_mirrored_strategy",
    "test_distribute.py::test_jit_and_steps_per_execution_keep_skip_semantics",
    "test_export.py::test_load_float32_file_under_float16_adds_loss_scaling_keeps_slots",
    "test_resume.py::test_a_flipped_bit_in_a_backup_is_an_error_naming_the_file",
    "test_resume.py::test_double_checkpoint_falls_back_to_the_previous_backup",
    "test_resume.py::test_workers_stop_together_when_their_backups_disagree_or_one_fails",
    "test_resume.py::test_the_chief_deletes_its_own_backups_never_a_worker_folder",
    "test_train_function.py::test_fit_gives_what_keras_gives_for_every_input_kind",
    "test_train_function.py::test_jit_compiled_steps_give_what_keras_gives",
    # The same fit in a TensorFlow and a JAX child process (about 16 s).
    "test_hazards.py::test_an_epoch_without_an_applied_step_logs_the_same_on_tensorflow_and_jax",
    # Two 8-epoch fits per policy (5 s on TensorFlow, 7 s on JAX).
    "test_float8.py::test_float8_training_ends_near_float32",
    # A tiny Transformer trained on the digits, three float32 seeds and float8
    # (33 s on TensorFlow, 36 s on JAX, alone on the busy 2-core CPU, 2026-11-28).
    "test_float8.py::test_float8_transformer_on_the_digits_ends_within_float32s_seed_band",
    # Three float8 fits with a backup written every epoch (18 s on TensorFlow, 24 s on JAX).
    "test_float8.py::test_a_float8_run_resumes_from_backup_and_restore_as_if_uninterrupted",
    # The output-gradient probe of a float8 Transformer block: one probe step and
    # one forward pass, each a compile (2.5 s on TensorFlow, 8 s on JAX, 2026-11-28);
    # the probe inside a MultiHeadAttention stays in the fast tier (1 s, 4 s).
    "test_float8.py::test_the_probe_measures_every_float8_layer_of_a_transformer_block",
    # Two fits of a float8 attention block (with and without the flagged
    # projection), each compared and measured: a compile each (4 s on
    # TensorFlow, 13 s on JAX, 2026-11-28); reading nested layers' inputs
    # stays in the fast tier (1 s and 3 s).
    "test_float8.py::test_compare_flags_the_attention_projection_an_input_outlier_flushes_and_exclude_fixes_it",
    # Keras' own tests (tests/peers/): the parametrized fit loops, each case a
    # fresh model and trace (test_fit_flow and test_on_batch_methods keep
    # fit's and train_on_batch's three modes in the fast tier), and
    # ModelCheckpoint's 15 cases, about 30 .keras files.
    # The guard's fits in every mode beside their controls (each 2-6 s, 2026-12-06): the
    # NaN record under bfloat16, the monitor, a custom step and loop and the
    # spike rule's reference stay in the fast tier.
    "test_guard.py::test_float32_keeps_keras_step_unless_compile_asks_for_the_guard",
    "test_guard.py::test_a_skipped_forward_pass_leaves_batch_norm_statistics_as_they_were",
    "test_guard.py::test_a_loss_spike_is_skipped_on_request_as_if_never_seen",
    "test_guard.py::test_replicas_skip_together_under_mirrored_strategy",
    "test_guard.py::test_several_steps_per_execution_skip_the_same_step",
    "test_guard.py::test_without_a_bad_record_the_guard_changes_nothing",
    "test_guard.py::test_every_optimizer_skips_exactly_under_xla_however_it_writes",
    # bfloat16 weights' fits in every mode beside their controls (3-7 s each,
    # 2026-12-06); the mechanism's tests and the GradientTape loop stay fast.
    "test_bfloat16_weights.py::test_bfloat16_weights_train_as_mixed_bfloat16_and_keras_own_do_not",
    "test_bfloat16_weights.py::test_a_nan_record_leaves_weights_buffers_and_moments_as_without_its_batch",
    "test_bfloat16_weights.py::test_a_keras_file_resumes_bit_for_bit_buffers_included",
    "test_bfloat16_weights.py::test_kmp_backup_and_restore_resumes_bfloat16_weights_exactly",
    "test_bfloat16_weights.py::test_stochastic_rounding_trains_with_no_buffer_the_same_in_every_mode",
    "test_bfloat16_weights.py::test_stochastic_rounding_skips_a_nan_record_and_resumes_from_a_keras_file",
    "test_bfloat16_weights.py::test_gradient_accumulation_trains_bfloat16_weights_as_mixed_bfloat16",
    "test_bfloat16_weights.py::test_bfloat16_weights_train_alike_on_every_replica_of_a_mirrored_strategy",
    "test_bfloat16_weights.py::test_each_optimizer_of_a_multi_optimizer_trains_its_bfloat16_weights",
    # Exports (a SavedModel each; on JAX through jax2tf, ~15 s) and loads under two policies.
    "test_bfloat16_weights.py::test_export_of_bfloat16_weights_serves_float32_in_and_out",
    "test_bfloat16_weights.py::test_load_model_under_another_policy_keeps_the_files_bfloat16_weights_and_trains_on",
    # The differential harness's whole table (the fast rows stay in the fast tier).
    "test_modes.py::test_every_mode_applies_what_the_reference_applies_in_the_whole_table",
    "test_keras_trainer.py::test_fit_with_data_adapter",
    "test_keras_trainer.py::test_fit_with_val_split",
    "test_keras_trainer.py::test_fit_sparse",
    "test_keras_trainer.py::test_evaluate_sparse",
    "test_keras_trainer.py::test_predict_sparse",
    "test_keras_trainer.py::test_steps_per_execution_steps_count",
    "test_keras_trainer.py::test_steps_per_execution_unrolled_steps_steps_count",
    "test_keras_trainer.py::test_steps_per_execution_steps_count_unknown_dataset_size",
    "test_keras_trainer.py::test_steps_per_execution_steps_per_epoch",
    "test_keras_trainer.py::test_steps_per_epoch",
    "test_keras_trainer.py::test_steps_per_execution_steps_per_epoch_unknown_data_size",
    "test_keras_trainer.py::test_loss_scaling_prevents_underflow",
    "test_keras_trainer.py::test_predict_preserve_order",
    "test_keras_trainer.py::test_predict_generator",
    "test_keras_model_checkpoint.py::test_model_checkpoint_options",
    # tf-keras' mixed-precision tests (tests/peers/test_tfkeras_*.py): the
    # application models (up to 7 s each), the 22 save/load cases of
    # test_model, the gradient-checking fits, and the 24 clipping cases.
    "test_tfkeras_model.py::test_application_model",
    "test_tfkeras_model.py::test_model",
    "test_tfkeras_model.py::test_dynamic_loss_scaling",
    "test_tfkeras_model.py::test_save_slot_variables_with_autocast_vars",
    "test_tfkeras_model.py::test_save_model_with_dynamic_loss_scaling",
    "test_tfkeras_model.py::test_advanced_model",
    "test_tfkeras_loss_scale_optimizer.py::testClipping",
    "test_tfkeras_loss_scale_optimizer.py::testCheckpoint",
    "test_tfkeras_loss_scale_optimizer.py::testFixedLossScaleAppliedToLossWithMinimize",
    # Fits and exports of several small models each (2 to 6 s, 2026-11-28),
    # so that the fast tier stays near 2 minutes; the skipped step's batch
    # norm test stays in it.
    "test_convert.py::test_train_on_batch_returns_what_keras_returns",
    "test_model.py::test_losses_can_be_read_after_fit_as_in_keras",
    "test_model.py::test_a_redone_batch_moves_batch_norm_statistics_once",
    "test_export.py::test_a_subclassed_model_serves_float32_inputs_and_its_int_ids",
    # So that the fast tier stays near 2 minutes on the 2-core CPU (142 s at
    # 6516bd2, 2026-12-06): the Reptile comparison with Keras' scaler (5 s);
    # float8's fits that a faster test of the same mechanism keeps in the
    # fast tier (each 1.5-4 s). (Parametrized fits in test_model.py,
    # test_scaler_core.py, test_backup_safety.py and test_float8.py keep a
    # part in the fast tier and mark the rest in their files.)
    "test_output_logits.py::test_kmp_loses_no_more_reptile_steps_than_keras_own_scaler",
    "test_float8.py::test_fit_names_float8_layers_keras_quantize_made_that_would_not_record",
    "test_float8.py::test_monitor_reports_each_epoch_in_history_logs_csv_plot_and_words",
    "test_float8.py::test_stats_and_compare_measure_a_subclassed_model_as_the_same_functional_one",
    "test_float8.py::test_a_float8_model_round_trips_through_a_keras_file",
    "test_float8.py::test_histories_hold_the_scaled_gradients_under_mixed_float16",
    "test_diagnose.py::test_a_float8_attention_projection_that_loses_accuracy_is_named_with_the_fix",
    # TensorFlow's mixed-precision guide: its fit and its custom loop, 5 epochs
    # each (3 s and 5 s); the policy, dtypes and the skipped step stay fast.
    "test_tf_mixed_precision_guide.py::test_model_fit_trains_with_keras_own_loss_scale_optimizer",
    "test_tf_mixed_precision_guide.py::test_the_custom_training_loop_divides_gradients_once_and_trains",
)


def _is_slow(item):
    file = item.path.name
    name = f"{file}::{item.originalname}"
    return file in SLOW or name in SLOW


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "backend(name): the test's original runs on that Keras backend only; "
        "deselected in the other pass (tests/peers/)",
    )


def _other_backend(item):
    marker = item.get_closest_marker("backend")
    return marker is not None and marker.args[0] != BACKEND


def pytest_collection_modifyitems(config, items):
    deselected = [item for item in items if _other_backend(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not _other_backend(item)]
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
    if GPUS:
        return
    seen_by = "jax.devices('gpu')" if BACKEND == "jax" else "tf.config.list_physical_devices('GPU')"
    skip = pytest.mark.skip(reason=f"needs a GPU: {seen_by} is empty")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


# Garbage is collected after each test, among the objects made since the
# test before (see _collect_this_tests_garbage).
_FULL_COLLECTION_EVERY_MB = 1024
_rss_at_full_collection = [0]


def _resident_mb():
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20
    except (OSError, ValueError):  # not Linux: a full collection after every test
        return None


def _collect_this_tests_garbage():
    """Frees the cycles a test left, while they are young, and looks at
    nothing older.

    Keras' fit leaves tf.data iterators in reference cycles (a suspended
    generator's frame). Left to Python's own full collections, they were
    destroyed all at once, seconds to minutes after their test, and
    destroying an iterator that old waited, off the CPU, for its tf.data
    autotuning thread to wake: one such collection took 20 to 60 s (gdb:
    ~RootDataset::Iterator joining Model::OptimizeLoop; 284 s of one worker's
    1,400 in a TensorFlow pass). A full collection after every test costs a
    walk over every object the process holds (about a million): as long as
    the tests themselves. So: a collection after each test, then
    `gc.freeze()`, which sets the survivors aside, so that the next test's
    collection walks only what that test made. What was set aside is walked
    again, and its cycles freed, once the process has grown by
    `_FULL_COLLECTION_EVERY_MB` (a module's cached models, test_compat's
    previous model). A test that checks that an object made before it began
    (by a module fixture) is freed must call `gc.unfreeze()` first: a plain
    `gc.collect()` leaves what was set aside alone.
    """
    grown = _resident_mb()
    if grown is None or grown - _rss_at_full_collection[0] > _FULL_COLLECTION_EVERY_MB:
        gc.unfreeze()
        gc.collect()
        _rss_at_full_collection[0] = _resident_mb() or 0
    else:
        gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _float32_policy_around_each_test():
    kmp.set_policy("float32")
    # Each test draws the same weights whatever ran before it in the process
    # (pytest -n 2 hands tests to workers in varying order).
    keras.utils.set_random_seed(0)
    yield
    kmp.set_policy("float32")
    # Without the full garbage collection Keras runs by default, which
    # walks every object the process holds; _collect_this_tests_garbage
    # frees this test's cycles instead.
    keras.utils.clear_session(free_memory=False)
    _collect_this_tests_garbage()


@pytest.fixture(scope="session")
def mirrored_strategy():
    """One two-replica strategy for the whole session: a second
    MirroredStrategy in the same process can reuse collective instance keys
    with other shapes and fail with "Shape mismatch in the collective"."""
    import tensorflow as tf

    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
