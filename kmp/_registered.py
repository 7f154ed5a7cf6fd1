"""kmp's serializable classes, kept registered with Keras.

Each registers itself as `kmp>Name` (`keras.saving.register_keras_serializable`)
when `import kmp` imports it. `keras.saving.get_custom_objects().clear()`,
which keras.io's serialization guide calls before registering its own class,
drops those too, and every later load of what kmp saves fails ("Could not
locate class 'kmp>FunctionalModel'"). `keep` puts kmp's own entries back,
and nothing else, whenever kmp serializes a model or an optimizer or loads one.
"""

import keras

_PACKAGE = "kmp>"
_OWN = {}


def remember():
    """Records kmp's registrations; `import kmp` calls it last."""
    _OWN.update({name: obj for name, obj in keras.saving.get_custom_objects().items()
                 if name.startswith(_PACKAGE)})


def keep():
    """Registers again what `remember` recorded and is missing; an entry a
    user registered under one of kmp's names stays theirs."""
    objects = keras.saving.get_custom_objects()
    for name, obj in _OWN.items():
        objects.setdefault(name, obj)
