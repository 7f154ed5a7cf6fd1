"""kmp.Model: a keras.Model whose training applies the precision policy."""

import functools

import keras

from kmp import _keras_internals
from kmp import _registered
from kmp.scaling import _compile as _scaling_compile
from kmp.scaling import _model_step
from kmp.precision import _float8_training
from kmp.precision import _settle as _precision
from kmp import backends
from kmp import export as export_module
from kmp import policy as policy_module
from kmp.precision._float32_layers import _to_float32
from kmp.precision._float32_layers import _unsettled_config

@functools.cache
def _functional_class(cls):
    """The functional class for instances of `cls`, a subclass of kmp.Model
    whose `__init__` calls `super().__init__(inputs, outputs)`.

    Keras rewrites such a `keras.Model` subclass's `__bases__` to put
    `Functional` in them; kmp changes no class it does not own: it makes one
    of its own instead, `cls` and `FunctionalModel` both, with `cls`'s name,
    module and registered name (so a `.keras` file names it as `cls`).
    """
    if issubclass(cls, _keras_internals.Functional):
        return cls
    functional = type(
        cls.__name__,
        (cls, FunctionalModel),
        {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
    )
    registered = keras.saving.get_registered_name(cls)
    if registered != cls.__name__:  # `cls` is registered: so is its functional twin
        package, _, name = registered.rpartition(">")
        keras.saving.register_keras_serializable(package, name)(functional)
    return functional


def _loss_in_float32(loss):
    """`loss` cast to float32, or as it is where it cannot be used here."""
    try:
        return _to_float32(loss)
    except TypeError:
        # A loss a traced step left on its layer (read after `fit`, as
        # Keras' own `losses` returns it): a symbolic tensor of a graph
        # that has ended, which no cast (nor anything else) can use here.
        return loss


def _prepare_train_step(model):
    """What `kmp.Model.make_train_function` does before Keras makes its
    function: float8 layers that would not record are named, every
    optimizer the model holds becomes a scaler where compile's rule says
    so, and a subclass's own `train_step` reports its scalers.

    The reporting step is set on this instance (no class is changed):
    Keras' function and kmp's call `model.train_step`, now with the
    scalers' logs (on TensorFlow a subclass's own step only: kmp's own step
    there reports itself). On TensorFlow once: each `tf.function` Keras
    makes traces it afresh. On JAX a new function for each train function
    (kmp's own step included): `jax.jit` keeps its traces by the Python
    function, and the same one would bring back the step traced for the last
    `compile` (its loss, its metrics, its optimizer) or before a monitor was
    attached.
    """
    # Float8 layers Keras' own quantize("float8") made, that fit would run
    # without training=True, are named before the first step.
    _float8_training.warn_if_not_recording(model)
    trainer = backends.get("trainer")
    _model_step.wrap_optimizers(model, _scaling_compile.scaler_for, _scaling_compile.SETTINGS)
    # Float8 output-gradient histories follow the loss scale.
    _float8_training.follow_loss_scale(model)
    own_wrapper = getattr(vars(model).get("train_step"), "_kmp_reporting", False)
    if "train_step" not in vars(model) or (own_wrapper and trainer.REWRAP_EACH_TRAIN_FUNCTION):
        step = type(model).train_step
        wrapper = trainer.reporting_step(model, step, own=step is Model.train_step)
        if wrapper is not None:  # None: kmp.Model's own step reports itself
            wrapper._kmp_reporting = True
            object.__setattr__(model, "train_step", wrapper)


@keras.saving.register_keras_serializable(package="kmp")
class Model(_keras_internals.ModelBase):
    """A `keras.Model` that trains in mixed precision with loss scaling.

    Use it exactly like `keras.Model`: functional (`kmp.Model(inputs,
    outputs)`) or as the base class of a subclassed model. Inside it:

    - layers compute in the policy's compute dtype (see `kmp.set_policy`),
      with float32 variables;
    - `UnitNormalization`, `Normalization` and the layers named with
      `keep_float32` (see `kmp.set_policy`, `kmp.convert`) compute in float32
      and hand the compute dtype on. This is settled once, on the model's
      own layers, at its first call (or `kmp.convert`): their dtype policies
      say so from then on, for every thread and every caller, so a
      `keras.Model` that shares those layers computes them as this model
      does, as it shares their weights;
    - outputs are float32, so losses, metrics and exported signatures are
      float32;
    - `compile(loss_scale="auto")` wraps the optimizer in a
      `kmp.LossScaleOptimizer` when the model computes in float16, and
      Keras' own loss scaling is turned off (one scaler, never two);
    - each training step scales the loss, unscales and checks the gradients,
      skips non-finite steps, and adds `loss_scale` and `skipped_steps` to
      the logs (so they show in the progress bar and in `History`);
    - on Keras' JAX backend the same holds, through `stateless_call` and a
      stateless train step (see docs/jax.md for what differs);
    - with one replica and one step per call, `fit` and `evaluate` run each
      step without Keras' `tf.experimental.Optional` around its logs, and
      the optimizer counts only steps that had a batch (see
      `kmp.backends.tensorflow.distribute.train_or_test_function`).

    Example:

    ```python
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(2, activation="softmax")(inputs)
    model = kmp.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    history = model.fit(x, y, epochs=2)
    history.history["loss_scale"], history.history["skipped_steps"]
    ```
    """

    def __new__(cls, *args, **kwargs):
        # Keras' rule: only `Model(inputs, outputs)` itself is functional
        # from the start. A subclass's constructor arguments are its own
        # (keras.io's `VAE(encoder, decoder)`, `GAN(discriminator,
        # generator)`); it becomes functional in `__init__` below, if what
        # reaches kmp.Model's `__init__` are inputs and outputs.
        if cls is Model and _keras_internals.functional_init_arguments(args, kwargs):
            cls = FunctionalModel
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, *args, **kwargs):
        if _keras_internals.functional_init_arguments(args, kwargs):
            if not isinstance(self, _keras_internals.Functional):
                # A subclass given inputs and outputs (by its own
                # `__init__`, or by its caller when it has none): this new
                # instance becomes one of kmp's functional class for it.
                # Keras would rewrite the user's class's bases instead, for
                # every instance to come.
                object.__setattr__(self, "__class__", _functional_class(type(self)))
            # Never through keras.Model.__init__, which rewrites class bases
            # up to keras.Model.
            _keras_internals.Trainer.__init__(self)
            _keras_internals.Functional.__init__(self, *args, **kwargs)
        else:
            super().__init__(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        # Precision is settled on the first call (fit's symbolic build is
        # one), once: float32 layers, cast-backs and token ids are the
        # layers' own policies from then on (see kmp/precision/_settle.py).
        _precision.settle_once(self)
        if args and getattr(self, "_kmp_input_dtypes", None) is None:
            # The dtypes of the inputs a subclassed model is built on (int
            # token ids), which Keras does not record: kmp.export serves them.
            object.__setattr__(self, "_kmp_input_dtypes", tuple(
                keras.backend.standardize_dtype(x.dtype) if hasattr(x, "dtype") else None
                for x in keras.tree.flatten(args[0])
            ))
        return _to_float32(super().__call__(*args, **kwargs))

    def stateless_call(self, *args, **kwargs):
        """`keras.Model.stateless_call` (JAX's path for fit, evaluate and
        predict), with the first call's precision settled and float32
        outputs, as `__call__`."""
        _precision.settle_once(self)
        outputs, *rest = super().stateless_call(*args, **kwargs)
        return (_to_float32(outputs), *rest)

    def compile(self, optimizer="rmsprop", *args, loss_scale="auto", overflow_retries="auto",
                skip_nonfinite="auto", skip_spikes=None, compensation="kahan", **kwargs):
        """`keras.Model.compile`, plus loss scaling and the guard's settings.

        Args:
            optimizer: As for `keras.Model.compile`. A
                `kmp.LossScaleOptimizer` is used as given; Keras'
                `LossScaleOptimizer` is replaced by kmp's with the same inner
                optimizer and settings (still the user's scaler: see
                `overflow_retries`). Compiling a trained model again (a
                fine-tune) with an optimizer kmp wraps keeps the loss
                scale and counters of the scaler before; a scaler passed
                here starts as it was made.
            loss_scale: `"auto"` (the default): dynamic loss scaling when the
                model computes in float16, none otherwise. `"dynamic"`: dynamic
                scaling whatever the dtype. A number in (0, float32 max]: a
                fixed scale (non-finite steps are still skipped). `None`: no
                scaling.
            overflow_retries: `"auto"` or an int in [0, 2**31 - 1]. A step
                whose gradients overflow while its loss is finite backs the
                scale off and its batch is redone, up to this many times
                (`retried_steps`), in every mode and on both backends; an
                int makes the host read each step's flag. `"auto"` (the
                default): with the dynamic scaler kmp makes, the first batch
                is redone until the scale has settled (no batch lost while
                it does), then an overflowing batch is skipped, as Keras
                skips it, with no host read. A scaler the user passed,
                gradient accumulation or a subclass's own `train_step`: no
                retries (Keras' semantics). See docs/overflows.md.
            skip_nonfinite: `"auto"`, `True` or `False`. Whether a step whose
                loss or gradients are not finite is skipped (weights, slots,
                `iterations` and the forward pass's state unchanged) and
                counted in `skipped_steps`. `"auto"` (the default): where the
                model computes in bfloat16, and wherever a loss scaler runs;
                under float32, and float16 with `loss_scale=None`, Keras'
                step. Without loss scaling the guard is a
                `kmp.LossScaleOptimizer` whose scale is fixed at 1. `False`
                turns it off (with loss scaling, which needs it, a
                `ValueError`).
            skip_spikes: Optional float > 0. Also skip a step whose loss is
                this many standard deviations above the last 128 finite
                losses' mean (after 64), decided on the device. Defaults to
                `None` (off).
            compensation: `"kahan"` (default) or `"stochastic"`: how 16-bit
                weights are written (see `kmp.LossScaleOptimizer`).
            **kwargs: The other arguments of `keras.Model.compile`.
                `auto_scale_loss=False` means `loss_scale=None`.

        Raises:
            ValueError: if an argument above is not one of its choices,
                `skip_nonfinite=False` meets loss scaling, the model is under
                a `tf.distribute` strategy kmp does not support
                (`kmp/backends/tensorflow/distribute.py`), or, when training
                starts, `overflow_retries` is an int > 0 with a subclass's
                own `train_step`.
            NotImplementedError: on JAX, under a `tf.distribute` strategy's
                scope (use `keras.distribution` there).
        """
        _scaling_compile.check_settings(loss_scale, overflow_retries, skip_nonfinite, skip_spikes,
                                        compensation)
        backends.get("trainer").check_compile(self, overflow_retries)
        if kwargs.pop("auto_scale_loss", True) is False and loss_scale == "auto":
            loss_scale = None
        optimizer = keras.optimizers.get(optimizer) if optimizer is not None else None
        given = optimizer
        optimizer = _scaling_compile.scaler_for(
            optimizer, self, loss_scale, skip_nonfinite, skip_spikes, compensation)
        users_scaler = _scaling_compile.users_scaler(given, optimizer, self)
        previous = getattr(self, "optimizer", None)
        (self._kmp_loss_scale, self._kmp_overflow_retries, self._kmp_skip_nonfinite,
         self._kmp_skip_spikes, self._kmp_compensation) = (
            loss_scale, overflow_retries, skip_nonfinite, skip_spikes, compensation)
        super().compile(optimizer, *args, auto_scale_loss=False, **kwargs)
        # object.__setattr__: Keras would track the optimizer as the model's
        # state. Compared by identity (`_model_step.retries`): an
        # optimizer set later (`kmp.load_model`'s wrapper) is not the user's.
        object.__setattr__(self, "_kmp_users_scaler", users_scaler)
        if optimizer is not given and users_scaler is None:
            # kmp made this scaler: it goes on from the last one.
            _scaling_compile.continue_scaling(self, previous, optimizer)

    def load_weights(self, filepath, *args, **kwargs):
        """`keras.Model.load_weights`. On a compiled model, the optimizers
        its own `compile` set (a GAN's `d_optimizer`) first become the
        scalers the first fit would make, which is what a file saved after a
        fit holds: otherwise Keras would skip their state, its count of
        variables not matching."""
        if self.compiled:
            _model_step.wrap_optimizers(self, _scaling_compile.scaler_for, _scaling_compile.SETTINGS)
        return super().load_weights(filepath, *args, **kwargs)

    def get_compile_config(self):
        return _scaling_compile.with_settings(
            self, super().get_compile_config(), _model_step.is_users_scaler)

    def compile_from_config(self, config):
        if type(self).compile is not Model.compile:  # Keras' rule: a warning, not compiled
            return super().compile_from_config(config)
        _scaling_compile.compile_from_config(self, config)  # ours takes the config's arguments

    def export(self, filepath, format="tf_saved_model", verbose=None, input_signature=None,
               inference_policy=None, **kwargs):
        """Exports the model for inference, computing in `inference_policy`.

        `keras.Model.export` plus `inference_policy` (`"float32"`,
        `"mixed_float16"`, `"mixed_bfloat16"`, `"auto"`, or `None` for the
        training policy); inputs and outputs stay float32. See `kmp.export`.

        Example:

        ```python
        model.export("serving/", inference_policy="float32")
        ```
        """
        return export_module.export(self, filepath, format=format, verbose=verbose,
                                    input_signature=input_signature,
                                    inference_policy=inference_policy, **kwargs)

    @property
    def losses(self):
        """The losses layers added (`add_loss`, regularizers), in float32.

        A layer computing in 16 bits adds 16-bit losses (an
        `activity_regularizer`, say); Keras would sum them with the float32
        compile loss and fail. kmp's promise is a float32 loss.
        """
        return [_loss_in_float32(loss) for loss in super().losses]

    def train_on_batch(self, *args, return_dict=False, **kwargs):
        """`keras.Model.train_on_batch`, returning what Keras returns.

        With `return_dict=True` the dict holds the step's logs, the loss
        scaler's `loss_scale` and `skipped_steps` among them (as in `fit`'s
        History). Without, the list (or the single loss) has exactly the
        values Keras' would, in its order, so that `loss, accuracy =
        model.train_on_batch(x, y)` unpacks as written for Keras.
        """
        logs = super().train_on_batch(*args, return_dict=True, **kwargs)
        if return_dict:
            return logs
        scaler_keys = _model_step.scaler_log_keys(self)
        return _keras_internals.logs_as_list(
            self, {key: value for key, value in logs.items() if key not in scaler_keys})

    def train_step(self, *args, retries_left=None):
        """Keras' train step with kmp's guarded, loss-scaled apply: a
        skipped step kept out of the epoch's logs; the logs carry
        `loss_scale` and `skipped_steps` (see
        `kmp/backends/tensorflow/trainer.py`). kmp's train function passes
        `retries_left` where it may redo the batch (`kmp.scaling._retry`).
        On JAX, `train_step(state, data)` as Keras' JAX trainer calls it
        (see `kmp/backends/jax/trainer.py`)."""
        return backends.get("trainer").train_step(
            self, *args, super().train_step, retries_left=retries_left)

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        _prepare_train_step(self)
        super().make_train_function(force=force)
        # kmp's own around it: the retries, the monitor's values out of the logs.
        self.train_function = backends.get("trainer").train_function(
            self, own_step=type(self).train_step is Model.train_step
        )
        return self.train_function

    def make_test_function(self, force=False):
        if self.test_function is not None and not force:
            return self.test_function
        super().make_test_function(force=force)
        self.test_function = backends.get("trainer").test_function(self)
        return self.test_function

    def _kmp_build_from_iterator(self, iterator, strategy):
        return backends.get("trainer").build_from_iterator(self, iterator, strategy)

    def fit(
        self,
        x=None,
        y=None,
        batch_size=None,
        epochs=1,
        verbose="auto",
        callbacks=None,
        *args,
        **kwargs,
    ):
        """Trains the model, as `keras.Model.fit`, with a readable progress bar.

        Takes every argument of `keras.Model.fit`. When `verbose` is not 0 the
        progress bar shows `loss_scale` as an integer or a power of two and
        `skipped_steps` as an integer, and, unless a
        `kmp.callbacks.LossScaleMonitor` is among `callbacks`, fit ends with
        one line saying how many steps were skipped, if any.

        Returns:
            A `keras.callbacks.History`, as `keras.Model.fit`.
        """
        # Imported here: kmp.callbacks is optional for everything else.
        from kmp import callbacks as kmp_callbacks

        kmp_callbacks._watch_optimizer(self, kmp_callbacks._has_monitor(callbacks))
        callbacks = kmp_callbacks._with_readable_progbar(callbacks, verbose)
        return super().fit(
            x, y, batch_size, epochs, verbose, callbacks, *args, **kwargs
        )


def _with_keep_float32(config, model):
    """`config` plus the model's `keep_float32` rules, when it has any."""
    rules = getattr(model, "_kmp_keep_float32", None)
    if rules:
        config = dict(config, keep_float32=rules.to_config())
    return config


def _restore_keep_float32(model, entries):
    if entries:
        # object.__setattr__: Keras would track the rules as state.
        object.__setattr__(
            model, "_kmp_keep_float32", policy_module._Float32Rules.from_config(entries)
        )
        if getattr(model, "_kmp_settled", False):
            _precision.settle(model, model._kmp_keep_float32)
    return model


@keras.saving.register_keras_serializable(package="kmp", name="FunctionalModel")
class FunctionalModel(Model, _keras_internals.Functional):
    """The class of `kmp.Model(inputs, outputs)`: a functional kmp.Model.

    Its config carries the layers kmp keeps in float32 (`keep_float32` of
    `kmp.convert`), the model's own policy and, for one `kmp.convert` made
    from a `Sequential`, that `layers` lists them as the Sequential did (no
    input layer), so a `.keras` round trip keeps them.
    """

    def __init__(self, *args, **kwargs):
        if type(self) is FunctionalModel and len(args) < 3 and kwargs.get("name") is None:
            # Keras names a model after `type(self).__name__`, which is the
            # registered name (see below): the default stays
            # "functional_model", "functional_model_1", ... as Keras' own
            # counter numbers it.
            uid = keras.backend.get_uid("functional_model")
            kwargs["name"] = "functional_model" if uid == 1 else f"functional_model_{uid - 1}"
        super().__init__(*args, **kwargs)

    @property
    def layers(self):
        layers = super().layers
        if getattr(self, "_kmp_sequential_layers", False):
            # Converted from a Sequential: listed as the Sequential lists them.
            return [layer for layer in layers if not isinstance(layer, keras.layers.InputLayer)]
        return layers

    def get_config(self):
        _registered.keep()  # what saving it writes, loading it must find
        config = _with_keep_float32(
            _unsettled_config(super().get_config()), self
        )
        if getattr(self, "_kmp_sequential_layers", False):
            config["sequential_layers"] = True
        if "layers" in config:  # a functional config, which from_config below reads
            # Keras leaves it out: a loaded functional model would take the
            # global policy of the moment, whatever it was saved with.
            config["dtype"] = keras.dtype_policies.serialize(self.dtype_policy)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        entries = config.pop("keep_float32", None)
        dtype = config.pop("dtype", None)
        sequential_layers = config.pop("sequential_layers", False)
        model = super().from_config(config, custom_objects=custom_objects)
        if sequential_layers:
            object.__setattr__(model, "_kmp_sequential_layers", True)
        if dtype is not None:
            model.dtype_policy = keras.dtype_policies.deserialize(dtype)
        return _restore_keep_float32(model, entries)


# Keras' legacy `.h5` writer records the saved model's class as
# `type(model).__name__` (every object inside it by its registered name), and
# its loader finds a class only under a registered name, in custom_objects or
# among Keras' own layers and models: a file naming "FunctionalModel" would
# load only with `custom_objects`. The class presents its registered name as
# its `__name__`, so `.h5` files name it as `.keras` files do and Keras' own
# lookup finds it; `__qualname__` keeps the Python name (`repr`, pickling)
# and `__init__` keeps the models' default names.
FunctionalModel.__name__ = keras.saving.get_registered_name(FunctionalModel)
