"""Deployment: serve in a chosen precision, load under another policy.

A model's precision is a property of its layers' dtype policies, not of its
weights: the variables are float32 under every kmp policy but `"bfloat16"`,
which stores them in bfloat16, and a new precision never converts them. So the
precision a model serves or evaluates in can be chosen after training. The
rule that says which layers follow the new precision is written once, in
`_inference_layer_policy`, and used both by `export` and by `load_model`:

```
for each layer (the model itself included, input layers excluded):
    float8 (kmp.float8)                           -> float8 from the new policy
    otherwise quantized, or not floating point    -> left as it is
    normalization or Softmax                      -> float32, over its variables
    computes in float32 under a 16-bit model      -> left in float32 (pinned)
    otherwise                                     -> the new policy, over its variables
```
A layer a `kmp.Model` settled in float32 (kmp's float32 layers, `keep_float32`)
stays in float32 and hands the new compute dtype on (a plain float32 policy
under `"float32"`).

"Over its variables" (`_over_stored`): the policy computes in the new dtype and
names the dtype the layer's variables are stored in. A Keras layer casts its
variables to its compute dtype only when its policy says they are stored in
another dtype, so a layer whose bfloat16 variables a `"float32"` policy
described as float32 would hand a convolution bfloat16 filters and float32
inputs (TensorFlow refuses the mix), and a layer whose float32 variables a
`"bfloat16"` policy described as bfloat16 would compute in float32 without
saying so. And the name is what a `.keras` file records and the layer is
rebuilt with: a bfloat16 layer saved as `"mixed_bfloat16"` would come back with
float32 variables and its optimizer state dropped (Keras' "Skipping variable
loading for optimizer"). So:

```
variables in 16 bits (bfloat16), new compute that dtype  -> "bfloat16"
variables in 16 bits, another compute (float32, float16) -> _Over16BitVariables:
                                                            variables read in
                                                            the compute dtype
variables float32, new policy "bfloat16"                 -> "mixed_bfloat16"
otherwise                                                -> the new policy
```
"""

import contextlib
import functools
import importlib.util
import os
import warnings
import zipfile

import keras

from kmp import _keras_internals
from kmp import _registered
from kmp import loss_scale as loss_scale_module
from kmp import policy as policy_module
from kmp.precision import _float32_layers


def _policy_name(value, argument, caller, none_means):
    """The policy name `value` asks for (`"auto"` resolved), or `None`."""
    policy = policy_module._resolve_policy(value, argument, caller, none_means=none_means)
    return None if policy is None else policy.name


def _inference_layer_policy(layer, model_is_16_bit, policy_name):
    """The dtype policy `layer` gets under `policy_name`, or `None` to keep its own."""
    current = layer.dtype_policy
    if isinstance(layer, keras.layers.InputLayer):
        return None
    if isinstance(current, _float32_layers._Float32Policy):
        compute = keras.DTypePolicy(policy_name).compute_dtype
        if compute == "float32":
            return keras.DTypePolicy("float32")  # nothing to hand on
        return _float32_layers._Float32Policy(
            hands_on=compute if current.hands_on is not None else None,
            reason=current.reason,
        )
    if current.quantization_mode == "float8":
        # Float8 layers keep float32 kernels and quantize them when called:
        # they serve the same float8 quantization, computing in the new dtype.
        return keras.dtype_policies.QuantizedFloat8DTypePolicy(
            "float8",
            source_name=policy_name,
            amax_history_length=current.amax_history_length,
        )
    if current.quantization_mode is not None:
        # The quantized kernels are tied to the policy they were built for.
        return None
    if not keras.backend.is_float_dtype(current.compute_dtype):
        return None
    if isinstance(layer, _float32_layers.FLOAT32_LAYER_CLASSES):
        return _over_stored(layer, "float32")
    if (current.compute_dtype == "float32" and model_is_16_bit
            and not isinstance(current, _Over16BitVariables)):
        # A float32 layer inside a 16-bit model was pinned there on purpose
        # (an output head, a loss-sensitive block): keep the user's choice.
        return None
    return _over_stored(layer, policy_name)


@keras.saving.register_keras_serializable(package="kmp")
class _Over16BitVariables(keras.DTypePolicy):
    """The policy of a layer whose variables are stored in 16 bits and that
    `kmp.export` or `kmp.load_model` makes compute in another dtype.

    Keras has no policy name for float32 (or float16) math over bfloat16
    variables; this one computes in `compute_dtype` and says its variables
    are stored as `name`, so the layer reads them in its compute dtype
    (Keras' autocast) and they stay as they are, 2 bytes each, with their
    optimizer state. `name` is what a saved config records and Keras
    rebuilds the layer with (it keeps a policy's name only): a `.keras`
    round trip keeps the variables' dtype and their optimizer state, and
    computes as stored until `kmp.load_model(..., policy=...)` chooses again.

    Args:
        name: String. The 16-bit dtype the layer's variables are stored in:
            `"bfloat16"` or `"float16"`. Defaults to `"bfloat16"`.
        compute_dtype: String. The dtype the layer computes in, another
            float dtype. Defaults to `"float32"`.
    """

    def __init__(self, name="bfloat16", compute_dtype="float32"):
        if name not in _float32_layers._16_BIT_DTYPES:
            raise ValueError(
                "`name` must be the 16-bit dtype the layer's variables are "
                f"stored in, one of {list(_float32_layers._16_BIT_DTYPES)}. "
                f"Received: name={name!r}"
            )
        allowed = [d for d in ("float32",) + _float32_layers._16_BIT_DTYPES if d != name]
        if compute_dtype not in allowed:
            raise ValueError(
                f"`compute_dtype` must be a float dtype other than name={name!r}, one "
                f"of {allowed}. Received: compute_dtype={compute_dtype!r}"
            )
        super().__init__(name)
        self._computes_in = compute_dtype

    @property
    def compute_dtype(self):
        return self._computes_in

    def get_config(self):
        return {"name": self.name, "compute_dtype": self._computes_in}

    def __repr__(self):
        return (f'<_Over16BitVariables "{self.name}" variables, '
                f'computing in {self._computes_in}>')


def _stored_dtype(layer):
    """The dtype `layer`'s own float variables are stored in (not those of
    layers inside it), or `None` where it has none or they differ."""
    inner = {id(v) for sub in _keras_internals.nested_layers(layer, include_self=False,
                                                               recursive=True)
             for v in sub.weights}
    dtypes = {keras.backend.standardize_dtype(v.dtype) for v in layer.weights
              if id(v) not in inner and keras.backend.is_float_dtype(v.dtype)}
    return dtypes.pop() if len(dtypes) == 1 else None


def _over_stored(layer, policy_name):
    """`policy_name`'s compute dtype, as a policy that names the dtype
    `layer`'s variables are stored in (the module's "over its variables")."""
    stored = _stored_dtype(layer)
    policy = keras.DTypePolicy(policy_name)
    compute = policy.compute_dtype
    if stored is None or stored == policy.variable_dtype:
        return policy_name
    if stored in _float32_layers._16_BIT_DTYPES:
        return stored if compute == stored else _Over16BitVariables(stored, compute)
    if compute == policy.variable_dtype:
        # "bfloat16" over float32 variables: a mixed policy casts them.
        return f"mixed_{compute}"
    return policy_name


def _inference_policies(model, policy_name):
    """Which layers of `model` change policy under `policy_name`, by the module's rule.

    Returns:
        Dict from each layer whose policy changes to its new policy name
        (empty for `policy_name=None`), the model itself first.
    """
    if policy_name is None:
        return {}
    layers = list(_keras_internals.nested_layers(model, include_self=True, recursive=True))
    # Not `model.dtype_policy`: a loaded functional model takes the global
    # policy of the moment it was loaded, whatever its layers were saved with.
    model_is_16_bit = any(
        keras.backend.standardize_dtype(layer.compute_dtype)
        in _float32_layers._16_BIT_DTYPES
        and not isinstance(
            layer, (keras.layers.InputLayer,) + _float32_layers.FLOAT32_LAYER_CLASSES
        )
        for layer in layers[1:]
    )
    changed = {}
    for layer in layers:
        if layer is model:
            # The model's own policy only casts its inputs: always follow.
            new_policy = policy_name
        else:
            new_policy = _inference_layer_policy(layer, model_is_16_bit, policy_name)
        settled = isinstance(layer.dtype_policy, _float32_layers._Float32Policy)
        if new_policy is not None and (settled or _differs(new_policy, layer.dtype_policy)):
            changed[layer] = new_policy
    return changed


def _differs(new_policy, current):
    """Whether `new_policy` (a name or a policy) stores or computes otherwise
    than `current` (the name alone does not say: `_Over16BitVariables`)."""
    if isinstance(new_policy, str):
        new_policy = keras.DTypePolicy(new_policy)
    return (new_policy.name, new_policy.compute_dtype) != (current.name, current.compute_dtype)


@contextlib.contextmanager
def _inference_layers(model, policy_name):
    """`model`'s layers under `policy_name` by the module's rule, while the
    export traces it; the trained policies come back after."""
    with _float32_layers._layer_policies(_inference_policies(model, policy_name)):
        yield


def export(
    model,
    filepath,
    format="tf_saved_model",
    verbose=None,
    input_signature=None,
    inference_policy=None,
    **kwargs,
):
    """Exports any Keras model for inference in a chosen precision.

    The same as `keras.Model.export`, plus `inference_policy`: the served
    graph computes in that precision while the inputs keep their dtypes and
    floating-point outputs are float32. The model itself is left as it was.

    Which layers follow `inference_policy`:

    ```
    normalization layers and Softmax           -> float32 (whatever the policy)
    a float32 layer in a 16-bit model (pinned) -> float32
    float8 layers (kmp.float8)                 -> float8, computing in
                                                  inference_policy's dtype
    other quantized or non-float layers        -> unchanged
    every other layer                          -> inference_policy
    ```
    The weights are served as they are stored: a model trained under
    `"bfloat16"` keeps its bfloat16 weights, and under `"float32"` reads
    them as float32 (float32 math over the same weights).

    So `inference_policy="float32"` exported from a `mixed_float16` model
    gives a graph with no float16 op: the same predictions without float16
    rounding, and several times faster on CPUs, which emulate float16.

    The SavedModel needs neither kmp nor Keras to run: load it with
    `tf.saved_model.load` or convert it with
    `tf.lite.TFLiteConverter.from_saved_model`.

    Args:
        model: A built `keras.Model` (a `kmp.Model` or a plain one, e.g. built
            under `keras.config.set_dtype_policy("mixed_float16")`).
        filepath: String or `pathlib.Path`. Where to write the artifact.
        format: String. As for `keras.Model.export`: `"tf_saved_model"` (the
            default), `"onnx"`, `"openvino"` or `"litert"`. Float32 outputs
            are guaranteed for `"tf_saved_model"`; the other formats trace
            `model` as it is, which for a `kmp.Model` also means float32
            outputs.
        verbose: Optional bool. Whether to print a message about the
            artifact. Defaults to `None` (Keras' default: print).
        input_signature: Optional. As for `keras.Model.export`. Defaults to
            `None`: taken from the model's inputs.
        inference_policy: Optional string or `kmp.Policy`. The precision the
            exported graph computes in: `"float32"`, `"mixed_float16"`,
            `"mixed_bfloat16"`, `"bfloat16"` or `"auto"` (chosen, as by
            `kmp.set_policy("auto")`, for the machine that exports).
            Defaults to `None`: the precision the model computes in now.
        **kwargs: Passed on to Keras' exporter for `format`.

    Returns:
        `None`.

    Raises:
        ValueError: if `inference_policy` is not one of the names above (the
            model is not changed), if a file or folder the SavedModel writes
            inside `filepath` is a symbolic link (nothing is written), or if
            Keras refuses the export (e.g. the model is not built).
        ImportError: if `format` is `"tf_saved_model"` and TensorFlow is not
            installed (on the JAX backend: a SavedModel is a TensorFlow
            graph, which Keras builds with `jax2tf`).

    Example:

    ```python
    kmp.set_policy("mixed_float16")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    ...  # train
    kmp.export(model, "serving/", inference_policy="float32")
    served = tf.saved_model.load("serving/")
    served.serve(x)  # float32 in, float32 out, no float16 op in the graph
    ```
    """
    policy_name = _policy_name(
        inference_policy,
        "inference_policy",
        caller="kmp.export",
        none_means="the model's own policy",
    )
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a `keras.Model`. Received: "
            f"model={model!r} of type {type(model).__name__}"
        )
    if format == "tf_saved_model":
        _check_tensorflow_installed()
        _check_no_link_inside(filepath)
    # The layers are switched in place: the variables are shared, in the
    # dtype they are stored in, so nothing is copied and the export sees
    # exactly the trained weights.
    with _inference_layers(model, policy_name):
        if format != "tf_saved_model":
            keras.Model.export(
                model,
                filepath,
                format=format,
                verbose=verbose,
                input_signature=input_signature,
                **kwargs,
            )
            return
        # Keras' own SavedModel export, with the outputs cast to float32: a
        # plain keras.Model under a 16-bit policy would otherwise serve
        # 16-bit outputs.
        if input_signature is None:
            input_signature = _served_signature(model)

        def serve(*args, **call_kwargs):
            return _float32_layers._to_float32(model(*args, **call_kwargs))

        archive = keras.export.ExportArchive()
        archive.track(model)
        archive.add_endpoint("serve", serve, input_signature, **kwargs)
        archive.write_out(filepath, verbose=True if verbose is None else verbose)


def _served_signature(model):
    """Keras' input signature of `model`, with float32 float inputs.

    A functional or Sequential model's comes from its `Input`s. For a
    subclassed one Keras gives every input the model's compute dtype
    (float16 under mixed_float16, even for token ids, which it would then
    round); kmp takes the dtypes of the model's first call where kmp.Model
    recorded them (int ids stay int), and serves float inputs in float32.
    """
    signature = _keras_internals.get_input_signature(model)
    if isinstance(model, (_keras_internals.Functional, keras.Sequential)):
        return signature
    specs = keras.tree.flatten(signature)
    recorded = getattr(model, "_kmp_input_dtypes", None)
    if recorded is None or len(recorded) != len(specs):
        recorded = [None] * len(specs)
    served = []
    for spec, dtype in zip(specs, recorded):
        dtype = spec.dtype if dtype is None else dtype
        served.append(keras.InputSpec(
            shape=spec.shape,
            dtype="float32" if keras.backend.is_float_dtype(dtype) else dtype,
        ))
    return keras.tree.pack_sequence_as(signature, served)


# What TensorFlow writes inside a SavedModel's folder. It writes into the
# folders it finds there, and through a link at one of them.
_SAVED_MODEL_ENTRIES = ("saved_model.pb", "fingerprint.pb", "variables", "assets", "assets.extra")


def _check_no_link_inside(filepath):
    """Raises a `ValueError`, before anything is written, if one of the
    names TensorFlow writes inside `filepath` is a link: the files would go
    wherever it points, outside the folder. `filepath` itself may be one."""
    for name in _SAVED_MODEL_ENTRIES:
        path = os.path.join(os.fspath(filepath), name)
        if os.path.islink(path):
            raise ValueError(
                f"Cannot export to {os.fspath(filepath)!r}: {path!r} is a symbolic link "
                f"(to {os.readlink(path)!r}), and the SavedModel's files would be "
                "written where it points. Remove it, or export to another folder."
            )


def _check_tensorflow_installed():
    """Raises an error naming TensorFlow when a SavedModel cannot be written.

    Looked up, not imported: on the JAX backend kmp's core imports no
    TensorFlow, and Keras imports it when the export starts.
    """
    try:
        found = importlib.util.find_spec("tensorflow") is not None
    except (ImportError, ValueError):  # a finder that refuses it; a broken entry
        found = False
    if not found:
        raise ImportError(
            'Exporting a SavedModel (format="tf_saved_model", the default) needs '
            'TensorFlow: pip install -e ".[tensorflow]" in your clone of kmp. '
            "It is not installed here, and Keras writes a SavedModel's graph with "
            "TensorFlow on every backend (this process runs "
            f"KERAS_BACKEND={keras.backend.backend()!r}). Received: "
            'format="tf_saved_model"'
        )


def load_model(filepath, policy=None, custom_objects=None, compile=True, safe_mode=True):
    """Loads a `.keras` (or legacy `.h5`) file and makes it compute under `policy`.

    The weights are loaded as the file holds them, in their dtype (float32,
    or bfloat16 for a model trained under `"bfloat16"`, whose compensation
    buffers come back too); the layers' compute dtypes follow `policy` by the
    rule of `kmp.export` (a `mixed_float16` model trained on a GPU evaluates
    in float32 on a CPU, and the other way round; bfloat16 weights loaded
    under `"float32"` are read as float32 and trained on with compensated
    updates). A policy never converts the weights: a float32 file loaded
    under `"bfloat16"` computes in bfloat16 over its float32 weights, as
    under `"mixed_bfloat16"`; `kmp.convert(model, "bfloat16")` stores them in
    bfloat16. The compiled optimizer comes back with its state:
    a `kmp.LossScaleOptimizer` keeps its scale and counters under every
    policy, so a later load under float16 continues with the same scale. A
    model that now computes in float16 but was saved without loss scaling
    gets a `kmp.LossScaleOptimizer` around its loaded optimizer (unless it is
    a `kmp.Model` compiled with `loss_scale=None`).

    A legacy `.h5` file loads as Keras loads it (a functional `kmp.Model`
    comes back as one, with its policies and its loss scale; a subclassed
    model, as for `keras.Model`, only if it is functional and given in
    `custom_objects`). Keras builds the optimizer of an `.h5` model for none
    of its variables, so it restores no slot variables and, in Keras 3.15,
    cannot train on (`fit` raises "Unknown variable"), for `keras.Model`
    alike: prefer `.keras` files.

    Args:
        filepath: String or `pathlib.Path`. A `.keras` file, or a legacy
            `.h5` file.
        policy: Optional string or `kmp.Policy`. `"float32"`,
            `"mixed_float16"`, `"mixed_bfloat16"`, `"bfloat16"` or `"auto"`.
            Defaults to
            `None`: the policies stored in the file.
        custom_objects: Optional dict. As for `keras.saving.load_model`.
        compile: Bool. Whether to compile the model (and restore the
            optimizer). Defaults to `True`.
        safe_mode: Bool. As for `keras.saving.load_model`. Defaults to `True`.

    Returns:
        The loaded model.

    Raises:
        TypeError: if `filepath` is not a str or path-like.
        ValueError: if `policy` is not one of the names above, or if
            `filepath` exists but is not a complete `.keras` archive (a save
            cut short; Keras would report "File not found").

    Example:

    ```python
    model.save("run.keras")                       # trained in mixed_float16
    model32 = kmp.load_model("run.keras", policy="float32")
    model32.evaluate(x, y)                        # float32 math, same weights
    ```
    """
    policy_name = _policy_name(
        policy, "policy", caller="kmp.load_model", none_means="the policies in the file"
    )
    if not isinstance(filepath, (str, os.PathLike)):
        raise TypeError(
            "`filepath` must be the path of a .keras (or .h5) file, a str or "
            f"os.PathLike. Received: filepath={filepath!r} of type {type(filepath).__name__}"
        )
    _check_complete_archive(filepath)
    _registered.keep()  # kmp's classes, whatever cleared Keras' custom objects
    load = functools.partial(keras.saving.load_model, filepath, custom_objects=custom_objects,
                             compile=compile, safe_mode=safe_mode)
    if policy_name is None:
        return _load_with_optimizer_state(load, None)
    # Loaded under float32 so that the global policy cannot leak into the
    # model's own policy: compile() must see the precision the file was saved
    # in, or it would build an optimizer whose variables do not match the
    # saved ones and Keras would drop the optimizer state.
    model = _load_with_optimizer_state(load, "float32")
    for layer, new_policy in _inference_policies(model, policy_name).items():
        layer.dtype_policy = new_policy
    if compile:
        _add_loss_scaling_if_needed(model)
    return model


_SKIPPED_OPTIMIZER = "Skipping variable loading for optimizer"


def _load_with_optimizer_state(load, policy_name):
    """`load()` under `policy_name` (`None`: the active policy), or, where
    Keras skipped the optimizer's saved state, under `"mixed_float16"`, then
    `"float32"`.

    A `keras.Model` saved under Keras' global `mixed_float16` stores no policy
    of its own: its `compile` wrapped the optimizer in Keras' own
    `LossScaleOptimizer` because of that global policy, and loaded under
    another one it builds the bare optimizer, whose variables do not match
    the saved ones (Keras warns and loads none); a float32 file loaded under
    kmp's global `mixed_float16` would get a scaler it never had. Keras'
    warnings of the load kept are shown.
    """
    loaded = []
    for name in dict.fromkeys((policy_name, "mixed_float16", "float32")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with contextlib.nullcontext() if name is None else policy_module.policy_scope(name):
                model = load()
        skipped = any(_SKIPPED_OPTIMIZER in str(w.message) for w in caught)
        loaded.append((model, caught))
        if not skipped:
            break
    # Neither holds the state: Keras' own load, and its warning.
    model, caught = loaded[0] if skipped else loaded[-1]
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return model


_ARCHIVE_ENTRIES = ("config.json", ("model.weights.h5", "model.weights.npz"))


def _check_complete_archive(filepath):
    """Raises a clear error for a `.keras` file whose save was cut short.

    Keras reports a truncated archive as "File not found", and one whose
    writer was interrupted by an exception (which still closes the zip) as
    missing its weights.
    """
    path = os.fspath(filepath)
    if not (path.endswith(".keras") and os.path.isfile(path)):
        return
    problem = None
    if not zipfile.is_zipfile(path):
        problem = "no valid zip directory"
    else:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
        config, weights = _ARCHIVE_ENTRIES
        if config not in names or not names.intersection(weights):
            problem = f"only the entries {sorted(names)}"
    if problem:
        raise ValueError(
            "`filepath` is not a complete .keras archive: it has "
            f"{os.path.getsize(path)} bytes but {problem}, as when a save is "
            "cut short (a process killed or interrupted while writing it in "
            "place; kmp.callbacks.ModelCheckpoint writes atomically). Load an earlier "
            f"checkpoint. Received: filepath={path!r}"
        )


def _add_loss_scaling_if_needed(model):
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return
    if getattr(model, "_kmp_loss_scale", "auto") is None:
        return
    if not _float32_layers._computes_in_float16(model):
        return
    # The loaded optimizer keeps its slots and iterations: Keras optimizers
    # do not rebuild once built, so the wrapper only adds its own state.
    wrapped = loss_scale_module.LossScaleOptimizer(optimizer)
    model.optimizer = wrapped
    compile_arguments = _keras_internals.compile_arguments(model)
    if compile_arguments is not None and "optimizer" in compile_arguments:
        # So that the next save records the optimizer whose state it writes.
        compile_arguments["optimizer"] = wrapped
