"""`keep_float32` rules: which layers a user names to compute in float32.

`kmp.set_policy`, `kmp.convert` and a `.keras` file all give them as a list
of layer classes, layer names and `"re:"` name patterns; `_Float32Rules`
parses, checks, stores and matches them. A pattern must match in bounded
time (a `.keras` file carries its model's patterns, and loading one must not
hang), which `_check_pattern_is_bounded` enforces. Which layers the rules put
in float32 is decided in `kmp/precision/_float32_layers.py`.
"""

import re
import warnings

import keras

from kmp import _keras_internals
from kmp import _user_line

# What a `keep_float32` pattern may be, so that matching it cannot stall (a
# `.keras` file carries its model's patterns: loading one must not hang on a
# pattern like `re:(a+)+$`). Python's backtracking matcher is exponential in
# nested repeats (and alternations under a repeat) and polynomial, of degree
# their number, in repeats side by side: three `.*` against 256 characters
# take milliseconds, four against 512 take seconds. So: no repeat or
# alternation inside a repeat, no backreference, at most three repeats of
# more than one character, and names up to 256 characters.
_LONGEST_PATTERN = 200
_MOST_REPEATS = 3
_LONGEST_MATCHED_NAME = 256
# A warning lists at most this many of a model's layer names.
_MOST_NAMES_SHOWN = 30


def _regex_parser():
    try:
        from re import _parser  # Python >= 3.11
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_parse as _parser
    return _parser


def _pattern_problem(parsed, parser, inside_repeat=False, counts=None):
    """Why a parsed pattern could match slowly, or `None`; counts its repeats."""
    repeats = {
        getattr(parser, name)
        for name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
        if hasattr(parser, name)
    }
    references = {
        getattr(parser, name)
        for name in ("GROUPREF", "GROUPREF_EXISTS", "GROUPREF_IGNORE", "GROUPREF_LOC_IGNORE",
                     "GROUPREF_UNI_IGNORE")
        if hasattr(parser, name)
    }
    counts = [0] if counts is None else counts
    for op, argument in parsed:
        if op in references:
            return "a backreference"
        if op == parser.BRANCH and inside_repeat:
            return "an alternation inside a repeat, e.g. (a|aa)*"
        if op in repeats:
            low, high, subpattern = argument
            if high > 1:
                if inside_repeat:
                    return "a repeat inside a repeat, e.g. (a+)+"
                counts[0] += 1
            problem = _pattern_problem(subpattern, parser, inside_repeat or high > 1, counts)
            if problem:
                return problem
            continue
        for item in argument if isinstance(argument, (tuple, list)) else (argument,):
            for part in item if isinstance(item, list) else (item,):
                if isinstance(part, parser.SubPattern):
                    problem = _pattern_problem(part, parser, inside_repeat, counts)
                    if problem:
                        return problem
    if counts[0] > _MOST_REPEATS:
        return f"{counts[0]} repeats (at most {_MOST_REPEATS})"
    return None


def _check_pattern_is_bounded(entry, argument):
    """Raises `ValueError` for a `re:` entry whose matching could stall."""
    pattern = entry[3:]
    if len(pattern) > _LONGEST_PATTERN:
        problem = f"{len(pattern)} characters (at most {_LONGEST_PATTERN})"
    else:
        parser = _regex_parser()
        problem = _pattern_problem(parser.parse(pattern), parser)
    if problem:
        shown = entry if len(entry) <= 80 else entry[:77] + "..."
        raise ValueError(
            f"Each `{argument}` pattern must match in bounded time: no "
            "repeat or alternation inside a repeat, no backreference, at most "
            f"{_MOST_REPEATS} repeats, at most {_LONGEST_PATTERN} characters. "
            f"This one has {problem}. Name the layers, or write a simpler "
            f"pattern. Received: {argument} entry {shown!r}"
        )


class _Float32Rules:
    """`keep_float32` entries, parsed: layer classes, exact names, patterns."""

    def __init__(self, classes=(), names=(), patterns=()):
        self.classes = tuple(classes)
        self.names = tuple(names)
        self.patterns = tuple(patterns)

    @classmethod
    def parse(cls, keep_float32, argument="keep_float32"):
        """Checks the form of `keep_float32` and returns its rules.

        Raises:
            TypeError: for an entry that is neither a string nor a layer class.
            ValueError: for a `"re:"` pattern that does not compile.
        """
        if keep_float32 is None:
            return cls()
        if isinstance(keep_float32, _Float32Rules):
            return keep_float32
        if isinstance(keep_float32, (str, type)):
            keep_float32 = [keep_float32]
        elif not isinstance(keep_float32, (list, tuple, set, frozenset)):
            raise TypeError(
                f"`{argument}` must be None, a layer name, a 're:' name pattern, a "
                "keras.layers.Layer subclass, or a list of them. Received: "
                f"{argument}={keep_float32!r} of type {type(keep_float32).__name__}"
            )
        classes, names, patterns = [], [], []
        for entry in keep_float32:
            if isinstance(entry, type) and issubclass(entry, keras.layers.Layer):
                classes.append(entry)
            elif isinstance(entry, str) and entry.startswith("re:"):
                try:
                    compiled = re.compile(entry[3:])
                except re.error as error:
                    raise ValueError(
                        f"Each `{argument}` pattern must be a valid regular "
                        f"expression after 're:' ({error}). Received: "
                        f"{argument} entry {entry!r}"
                    ) from None
                _check_pattern_is_bounded(entry, argument)
                patterns.append(compiled)
            elif isinstance(entry, str) and entry:
                names.append(entry)
            else:
                raise TypeError(
                    f"Each entry of `{argument}` must be a keras.layers.Layer "
                    "subclass, a layer name, or a name pattern starting with "
                    f"'re:'. Received: {argument} entry {entry!r}"
                )
        return cls(classes, names, patterns)

    def to_config(self):
        """The entries as `parse` takes them back, classes by registered name
        (`"class:..."`): what a `.keras` file stores."""
        return (
            [f"class:{keras.saving.get_registered_name(c)}" for c in self.classes]
            + list(self.names)
            + [f"re:{p.pattern}" for p in self.patterns]
        )

    @classmethod
    def from_config(cls, entries):
        resolved = []
        for entry in entries or ():
            if isinstance(entry, str) and entry.startswith("class:"):
                name = entry[len("class:"):]
                layer_class = keras.saving.get_registered_object(name) or getattr(
                    keras.layers, name, None
                )
                if layer_class is None:
                    raise ValueError(
                        f"keep_float32 names the layer class {name!r}, which is "
                        "not registered: decorate it with "
                        "@keras.saving.register_keras_serializable() before loading."
                    )
                entry = layer_class
            resolved.append(entry)
        return cls.parse(resolved)

    def __bool__(self):
        return bool(self.classes or self.names or self.patterns)

    def __add__(self, other):
        if other is None:
            return self
        return _Float32Rules(
            self.classes + other.classes,
            self.names + other.names,
            self.patterns + other.patterns,
        )

    def match(self, layer):
        """Returns the entry that puts `layer` in float32, as text, or `None`."""
        labels = {layer.name, _layer_label(layer)}
        for cls in self.classes:
            if isinstance(layer, cls):
                return cls.__name__
        for name in self.names:
            if name in labels:
                return repr(name)
        # Bounded: a pattern passed `_check_pattern_is_bounded`, and a label
        # longer than _LONGEST_MATCHED_NAME is never searched.
        searchable = [label for label in labels if len(label) <= _LONGEST_MATCHED_NAME]
        for pattern in self.patterns:
            if any(pattern.fullmatch(label) for label in searchable):
                return repr("re:" + pattern.pattern)
        return None

    def unknown_names(self, model):
        """The exact names no layer of `model` has, and the names it has
        (sorted)."""
        layers = list(_keras_internals.nested_layers(model, include_self=False, recursive=True))
        known = {layer.name for layer in layers} | {_layer_label(layer) for layer in layers}
        return [name for name in self.names if name not in known], sorted(known)

    def check_names(self, model, argument="keep_float32"):
        """Raises `ValueError` for an exact name no layer of `model` has."""
        unknown, known = self.unknown_names(model)
        if unknown:
            raise ValueError(
                f"`{argument}` names layers the model does not have: "
                f"{', '.join(map(repr, unknown))}. Layer names in "
                f"{model.name!r}: {', '.join(known)}. Use a class or "
                "a 're:' pattern to name layers the model may not have."
            )

    def warn_unknown_names(self, model):
        """Warns, at the user's line, for each exact name no layer of `model`
        has: the rules of `kmp.set_policy(..., keep_float32=...)`, which
        every model built under the policy reads, so that a typo ("haed")
        does not leave its layer in 16 bits without a word."""
        unknown, known = self.unknown_names(model)
        if not unknown:
            return
        shown = ", ".join(known[:_MOST_NAMES_SHOWN])
        if len(known) > _MOST_NAMES_SHOWN:
            shown += f", ... ({len(known)} in all)"
        warnings.warn(
            "kmp.set_policy(keep_float32=...) names layers that model "
            f"{model.name!r} does not have: {', '.join(map(repr, unknown))}; they "
            f"stay in the policy's dtype. Layer names in {model.name!r}: {shown}. "
            "Check the spelling, or use a class or a 're:' pattern to name layers "
            "a model may not have.",
            stacklevel=_user_line.stacklevel(),
        )


def _layer_label(layer):
    # Sublayers without weights have no path; their name is all there is.
    return getattr(layer, "path", None) or layer.name
