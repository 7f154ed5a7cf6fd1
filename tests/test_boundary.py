"""kmp reaches into Keras and TensorFlow in one module only: kmp/_keras_internals.py.

Every private Keras/TensorFlow name kmp uses is a break waiting for the next
release; when they all live in one module that says why, that module is the
only one to mend. The scan is static (AST), so it cannot know an object's type.
It works with names instead:

- a *foreign* private name is one Keras or TensorFlow define or use on their
  own objects (`def _x`, `self._x`, or an attribute of one of their public
  classes);
- kmp's own private names are `_kmp_*`, names only kmp defines, attributes of
  `self` in kmp classes that do not derive from Keras or TensorFlow, and
  attributes of kmp's own modules and classes;
- an *override* is a private method of a class deriving from a Keras or
  TensorFlow class whose name is foreign.

Outside kmp/_keras_internals.py every use of a foreign private name (attribute,
`getattr`/`setattr`/`hasattr`/`delattr` with a string, a string that is one),
every override of one,
and every import of or attribute path into a private module (`keras.src`,
`tensorflow.python`, `tf.__internal__`, `tf.compat.v1`, ...) fails the test,
which lists them as file:line:name.
"""

import ast
import functools
import importlib
import importlib.util
import inspect
import pathlib
import re

import keras
import tensorflow as tf

import kmp

PACKAGE = pathlib.Path(kmp.__file__).parent
BOUNDARY = "kmp/_keras_internals.py"
# At least this many modules in kmp/ and its subfolders: a glob that stops
# finding them fails instead of checking nothing.
MODULES = 85
FOREIGN_ROOTS = ("keras", "tensorflow", "tf_keras")
PRIVATE_MODULES = (
    "keras.src",
    "tensorflow.python",
    "tensorflow.core",
    "tensorflow.compiler",
    "tensorflow.tsl",
    "tensorflow.lite.python",
)
# Attribute paths of the public `tf` and `keras` modules that lead into
# internals: `tf.__internal__.distribute...`, `tf.compat.v1.get_default_graph`.
PRIVATE_PATHS = ("__internal__", "compat.v1", "src")
ATTRIBUTE_FUNCTIONS = {"getattr", "setattr", "hasattr", "delattr"}
# TensorFlow's function attributes (`tf.function(experimental_attributes=...)`)
# are read by its C++ runtime: no Python source of TensorFlow defines them.
TENSORFLOW_FUNCTION_ATTRIBUTES = {"_noinline", "_XlaMustCompile", "_implements", "_input_shapes"}
# Python's own API that starts with an underscore (namedtuple's methods).
PYTHON_PRIVATE_API = {"_replace", "_asdict", "_make", "_fields", "_field_defaults"}

# Where Keras and TensorFlow define or use a private name: a method or
# function, any attribute of `self`/`cls` (read or set, so that attributes set
# by tuple assignment or in a loop count too), or `setattr(self, "_x", ...)`.
_DEFINITION = re.compile(
    r"\bdef\s+(_[A-Za-z0-9]\w*)"
    r"|\b(?:self|cls)\.(_[A-Za-z0-9]\w*)"
    r"|\bsetattr\(\s*(?:self|cls)\s*,\s*[\"'](_[A-Za-z0-9]\w*)[\"']"
)


def _is_private(name):
    return name.startswith("_") and not name.startswith("__") and len(name) > 1


def _is_own(name):
    return name.startswith("_kmp_")


@functools.lru_cache(maxsize=None)
def foreign_private_names():
    """Private names Keras or TensorFlow define, from their installed sources
    and from the attributes of their public classes (class attributes too)."""
    names = set(TENSORFLOW_FUNCTION_ATTRIBUTES)
    for root in FOREIGN_ROOTS:
        spec = importlib.util.find_spec(root)
        if spec is None or not spec.submodule_search_locations:
            continue
        for folder in spec.submodule_search_locations:
            for path in pathlib.Path(folder).rglob("*.py"):
                text = path.read_text(errors="replace")
                for match in _DEFINITION.finditer(text):
                    names.add(next(group for group in match.groups() if group))
    for cls in _public_foreign_classes():
        for klass in cls.__mro__:
            names.update(name for name in vars(klass) if _is_private(name))
    return frozenset(names)


def _public_foreign_classes():
    modules = [keras, tf, tf.distribute, tf.distribute.experimental, tf.data, tf.train, tf.saved_model]
    seen = set()
    while modules:
        module = modules.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for name in dir(module):
            if name.startswith("_"):
                continue
            try:
                value = getattr(module, name)
            except Exception:
                continue
            if inspect.isclass(value):
                yield value
            elif inspect.ismodule(value) and value.__name__.startswith("keras"):
                modules.append(value)


def _dotted(node):
    """`a.b.c` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _private_module(module):
    return next(
        (private for private in PRIVATE_MODULES if module == private or module.startswith(private + ".")),
        None,
    )


class _Scanner(ast.NodeVisitor):
    """Collects (line, name) for each foreign private name a module uses."""

    def __init__(self, foreign, foreign_classes):
        self.foreign = foreign
        # Classes of this module that derive from Keras/TensorFlow -> the
        # private names their Keras/TensorFlow bases define.
        self.foreign_classes = foreign_classes
        self.found = []
        self.own_modules = set()  # names bound to kmp modules
        self.foreign_modules = {}  # names bound to keras/tensorflow modules -> module
        self.own_classes = set()  # classes of this module that are kmp's alone
        # Per class being visited: None for a kmp class, else the private
        # names its foreign bases define.
        self.class_stack = []
        # Per function being visited: local names bound to kmp objects
        # (`policy = cls.__new__(cls)`, `ledger = Ledger(...)`).
        self.own_locals = [set()]
        self.handled_strings = set()

    # imports -------------------------------------------------------------
    def visit_Import(self, node):
        for alias in node.names:
            self._check_module(node, alias.name)
            bound = alias.asname or alias.name.split(".")[0]
            if alias.name.split(".")[0] == "kmp":
                self.own_modules.add(bound)
            elif alias.name.split(".")[0] in FOREIGN_ROOTS:
                self.foreign_modules[bound] = alias.name if alias.asname else alias.name.split(".")[0]

    def visit_ImportFrom(self, node):
        module = node.module or ""
        if node.level or module == "kmp" or module.startswith("kmp."):
            for alias in node.names:
                self.own_modules.add(alias.asname or alias.name)
            return
        private = self._check_module(node, module)
        for alias in node.names:
            if _is_private(alias.name) and alias.name in self.foreign and module.split(".")[0] in FOREIGN_ROOTS:
                self.found.append((node.lineno, f"{module}.{alias.name}"))
            if module.split(".")[0] in FOREIGN_ROOTS:
                if not private:  # `from tensorflow import python`
                    self._check_module(node, f"{module}.{alias.name}")
                self.foreign_modules.setdefault(alias.asname or alias.name, f"{module}.{alias.name}")

    def _check_module(self, node, module):
        private = _private_module(module)
        if private:
            self.found.append((node.lineno, f"import {module}"))
        return private

    # classes and functions -------------------------------------------------
    def visit_ClassDef(self, node):
        if not self.class_stack and node.name in self.foreign_classes:
            defined = self.foreign_classes[node.name]
        elif any(self._foreign_base(base) for base in node.bases):
            defined = self.foreign  # a nested class: its bases are not importable
        else:
            defined = None
            self.own_classes.add(node.name)
        self.class_stack.append(defined)
        for statement in node.body:
            if (
                defined is not None
                and isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef))
                and _is_private(statement.name)
                and not _is_own(statement.name)
                and statement.name in defined
            ):
                self.found.append((statement.lineno, f"override {node.name}.{statement.name}"))
        self.generic_visit(node)
        self.class_stack.pop()

    def _foreign_base(self, base):
        dotted = _dotted(base) or ""
        root = dotted.split(".")[0]
        return root in self.foreign_modules or root in self.foreign_classes

    def visit_FunctionDef(self, node):
        self.own_locals.append(set())
        self.generic_visit(node)
        self.own_locals.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node):
        if isinstance(node.value, ast.Call) and self._makes_own_object(node.value.func):
            self.own_locals[-1].update(target.id for target in node.targets if isinstance(target, ast.Name))
        self.generic_visit(node)

    def _makes_own_object(self, function):
        dotted = _dotted(function) or ""
        if dotted.endswith(".__new__"):
            dotted = dotted[: -len(".__new__")]
        if dotted == "cls":
            return not self.class_stack or self.class_stack[-1] is None
        return dotted in self.own_classes

    # attributes ----------------------------------------------------------
    def visit_Constant(self, node):
        # A foreign private name kept in a string: `METHOD = "_all_reduce_sum_gradients"`.
        if (
            isinstance(node.value, str)
            and id(node) not in self.handled_strings
            and _is_private(node.value)
            and not _is_own(node.value)
            and node.value not in PYTHON_PRIVATE_API
            and node.value in self.foreign
        ):
            self.found.append((node.lineno, repr(node.value)))

    def visit_Attribute(self, node):
        dotted = _dotted(node)
        if dotted:
            root, _, path = dotted.partition(".")
            module = self.foreign_modules.get(root)
            if module and module.split(".")[0] in ("tensorflow", "keras"):
                for private in PRIVATE_PATHS:
                    if path == private or path.startswith(private + "."):
                        self.found.append((node.lineno, f"{root}.{private}"))
                        break
        if _is_private(node.attr):
            self._check_attribute(node, node.value, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node):
        function = node.func.id if isinstance(node.func, ast.Name) else None
        if (
            function in ATTRIBUTE_FUNCTIONS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
        ):
            self._check_attribute(node, node.args[0], node.args[1].value)
            self.handled_strings.add(id(node.args[1]))
        name = _dotted(node.func) or ""
        if name.split(".")[-1] in ("import_module", "__import__") and node.args:
            argument = node.args[0]
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                self._check_module(node, argument.value)
        self.generic_visit(node)

    def _check_attribute(self, node, owner, name):
        if _is_own(name) or name in PYTHON_PRIVATE_API or name not in self.foreign:
            return
        if isinstance(owner, ast.Name):
            if owner.id in self.own_modules or owner.id in self.own_classes or owner.id in self.own_locals[-1]:
                return
            if owner.id in ("self", "cls") and self.class_stack:
                defined = self.class_stack[-1]
                if defined is None or name not in defined:
                    return
        self.found.append((node.lineno, name))


def _foreign_class_names(module_name, tree):
    """Top-level classes of a kmp module that derive from a Keras or
    TensorFlow class -> the private names those bases define."""
    module = importlib.import_module(module_name)
    classes = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            cls = getattr(module, node.name, None)
            bases = [
                klass
                for klass in (cls.__mro__[1:] if inspect.isclass(cls) else ())
                if klass.__module__.split(".")[0] in FOREIGN_ROOTS
            ]
            if bases:
                classes[node.name] = frozenset().union(*map(_names_defined_by, bases))
    return classes


@functools.lru_cache(maxsize=None)
def _names_defined_by(klass):
    # Cached: kmp's classes share a few Keras bases, and `inspect.getsource`
    # of each took most of the scan's time (134 calls, about 7 s).
    names = {name for name in vars(klass) if _is_private(name)}
    try:
        source = inspect.getsource(klass)
    except (OSError, TypeError):
        return frozenset(names)
    for match in _DEFINITION.finditer(source):
        names.add(next(group for group in match.groups() if group))
    return frozenset(names)


def scan_source(source, foreign, foreign_classes=None):
    """Sorted (line, name) of each foreign private name `source` uses;
    `foreign_classes` maps the names of its classes deriving from Keras or
    TensorFlow to the private names their bases define."""
    foreign_classes = foreign_classes or {}
    scanner = _Scanner(foreign, foreign_classes)
    tree = ast.parse(source)
    # Classes first, so that `ClassName._x` on a kmp class anywhere in the file is known as kmp's.
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name not in foreign_classes:
            scanner.own_classes.add(node.name)
    scanner.visit(tree)
    return sorted(set(scanner.found))


@functools.lru_cache(maxsize=None)
def _scan_package():
    found = {}
    paths = sorted(PACKAGE.rglob("*.py"))
    assert len(paths) >= MODULES, [path.name for path in paths]
    for path in paths:
        relative = path.relative_to(PACKAGE.parent)
        module_name = ".".join(relative.with_suffix("").parts)
        tree = ast.parse(path.read_text())
        foreign_classes = _foreign_class_names(module_name, tree)
        # By the path, not the name: `step.py` and `__init__.py` are in several folders.
        found[relative.as_posix()] = [
            f"{relative.as_posix()}:{line}:{name}"
            for line, name in scan_source(path.read_text(), foreign_private_names(), foreign_classes)
        ]
    return found


def scan_package():
    """file:line:name for each foreign private name used in kmp, per file
    (keyed by its path from the project root, `kmp/backends/jax/step.py`).

    Scanned once per process (both tests read it; kmp's sources do not change
    during a run), and handed out as a fresh dict of lists.
    """
    return {path: list(entries) for path, entries in _scan_package().items()}


def test_keras_and_tensorflow_private_names_are_used_in_the_boundary_module_only():
    outside = [entry for name, entries in scan_package().items() if name != BOUNDARY for entry in entries]
    assert outside == [], (
        f"{len(outside)} uses of Keras/TensorFlow internals outside {BOUNDARY}; "
        "move each behind a function there (and say why):\n" + "\n".join(outside)
    )


def undocumented(entries, docstring):
    """The entries (file:line:name) whose name `docstring` does not mention."""
    missing = []
    for entry in entries:
        name = entry.split(":", 2)[2]
        if name.startswith("import "):
            continue  # the imports are the module's own code, each named there
        key = name.split()[-1].split(".")[-1].strip("'")  # `override C._x`, `tf.__internal__`, `'_x'`
        if key not in docstring:
            missing.append(entry)
    return missing


def test_the_boundary_module_names_each_private_name_it_uses():
    # The module's docstring is the list of what kmp touches and why: a name
    # used there but not in the docstring is a dependency nobody wrote down.
    from kmp import _keras_internals

    missing = undocumented(scan_package()[BOUNDARY], _keras_internals.__doc__ or "")
    assert missing == [], "add these to kmp/_keras_internals.py's docstring, with why:\n" + "\n".join(missing)


def test_undocumented_names_each_entry_the_docstring_lacks():
    entries = ["kmp/a.py:1:_loss_tracker", "kmp/a.py:2:override Model._save_model", "kmp/a.py:3:tf.__internal__",
               "kmp/a.py:4:'_noinline'", "kmp/a.py:5:import keras.src.models"]
    docstring = "`Model._loss_tracker`: the loss metric; `tf.__internal__...`: no merge call"
    assert undocumented(entries, docstring) == ["kmp/a.py:2:override Model._save_model", "kmp/a.py:4:'_noinline'"]


# The scanner itself: each kind of use is found, kmp's own names are not.
_FOREIGN = frozenset({"_loss_tracker", "_iterations", "_maybe_symbolic_build", "_flatten_layers", "_name", "_helper"})
# What the example's `Model` inherits from Keras (`_helper` is defined elsewhere in Keras, not there).
_MODEL_BASES = frozenset({"_loss_tracker", "_maybe_symbolic_build", "_flatten_layers", "_name"})

_EXAMPLE = """
import keras
import tensorflow as tf
from keras.src.models import functional
import tensorflow.python.eager.context
from tensorflow.python import pywrap_tfe as pywrap
from kmp.monitor import _ledger

class Model(keras.Model):
    def _maybe_symbolic_build(self, *args):
        return self._loss_tracker

    def _helper(self):
        self._kmp_state = 1
        return self._own_attribute, self._helper

class Plain:
    def __init__(self):
        self._name = "kmp's own"

    def read(self, model):
        return self._name, model._name

    @classmethod
    def make(cls):
        plain = cls.__new__(cls)
        plain._name = "kmp's own too"
        other = Plain()
        return other._name, state._replace(name=1)

METHOD = "_flatten_layers"

def outside(model, optimizer):
    getattr(optimizer, "_iterations")
    setattr(model, "_kmp_ok", 1)
    hasattr(model, "_flatten_layers")
    tf.__internal__.distribute.strategy_supports_no_merge_call()
    tf.compat.v1.get_default_graph()
    tf.compat.v2.constant(1)
    keras.src.backend
    _ledger._name
    Plain._name
    return model._kmp_state, plain._name
"""


def test_the_scanner_finds_each_kind_of_use_and_no_own_name():
    found = scan_source(_EXAMPLE, _FOREIGN, {"Model": _MODEL_BASES})
    assert found == [
        (4, "import keras.src.models"),
        (5, "import tensorflow.python.eager.context"),
        (6, "import tensorflow.python"),
        (10, "override Model._maybe_symbolic_build"),
        (11, "_loss_tracker"),
        (22, "_name"),
        (31, "'_flatten_layers'"),
        (34, "_iterations"),
        (36, "_flatten_layers"),
        (37, "tf.__internal__"),
        (38, "tf.compat.v1"),
        (40, "keras.src"),
        # `plain` is kmp's in `make`, not here: a local name, not a type.
        (43, "_name"),
    ]


def test_foreign_names_come_from_keras_and_tensorflow_sources_and_classes():
    names = foreign_private_names()
    # A method of Keras' Layer, an attribute Keras' Model sets in __init__,
    # TensorFlow's optimizer reduction, a class attribute of a public class.
    for name in ("_flatten_layers", "_loss_tracker", "_all_reduce_sum_gradients", "_maybe_symbolic_build", "_noinline"):
        assert name in names
    assert not any(_is_own(name) for name in names)

