"""Chooses the tests `.ci/run` runs on the Keras minors between the oldest and
the newest: the fewest test functions, weighed by their time, that together run
every line of kmp that the whole set of tests runs on the newest Keras.

The older Keras minors are there to catch what a Keras release moved under
kmp (the private names `kmp/_keras_internals.py` holds, and the public API kmp
calls). Each line of kmp that touches Keras runs in those tests on every
minor; what the tests assert about kmp's own logic is checked on the newest
Keras (the whole suite) and on the oldest (the core files whole).

Writes `.ci/every-keras-tensorflow.txt` (chosen among the fast tier of
`CORE_TESTS`) and `.ci/every-keras-jax.txt` (among `OLDER_JAX_TESTS`, on
JAX), one test function a line. Run it from the repository root on the newest
Keras after adding kmp code or moving tests (about 10 minutes on two
cores); it needs `coverage` and `pytest-cov`, which are not test extras:

    pip install coverage pytest-cov && python .ci/every_keras.py
"""

import collections
import os
import re
import sqlite3
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Among the fast tier, as the minors run it.
SELECTION = ["-m", "not slow", "-k", "not in_the_whole_table"]


def _ci_files(pattern):
    text = open(os.path.join(ROOT, ".ci", "run")).read()
    return re.search(pattern, text, flags=re.MULTILINE).group(1).split()


def _function(node_id):
    return re.sub(r"\[.*$", "", node_id)


def _measure(backend, files, folder):
    """`({test function: set of (kmp file, line)}, {test function: seconds})`."""
    data = os.path.join(folder, f"{backend}.coverage")
    report = os.path.join(folder, f"{backend}.txt")
    env = dict(os.environ, KERAS_BACKEND=backend, COVERAGE_FILE=data)
    with open(report, "w") as out:
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider",
             *files, *SELECTION, "--cov=kmp", "--cov-context=test", "--cov-report=",
             "--durations=0", "--durations-min=0"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, check=True)
    from coverage.numbits import numbits_to_nums

    lines = collections.defaultdict(set)
    with sqlite3.connect(data) as db:
        paths = dict(db.execute("select id, path from file"))
        contexts = dict(db.execute("select id, context from context"))
        for file_id, context_id, numbits in db.execute("select file_id, context_id, numbits from line_bits"):
            context = contexts[context_id]
            test = _function(context.rsplit("|", 1)[0]) if context else ""
            path = os.path.relpath(paths[file_id], ROOT)
            lines[test].update((path, n) for n in numbits_to_nums(numbits))
    seconds = collections.defaultdict(float)
    for line in open(report):
        found = re.match(r"\s*([\d.]+)s (?:setup|call|teardown)\s+(\S+)", line)
        if found:
            seconds[_function(found.group(2))] += float(found.group(1))
    return lines, seconds


def choose(lines, seconds):
    """Greedy weighted set cover: each round takes the test function that
    runs the most lines not yet run, per second. Lines every test runs
    (what importing kmp runs) are not counted."""
    lines = dict(lines)
    imported = lines.pop("", set())
    left = set().union(*lines.values()) - imported
    cost = {test: seconds.get(test, 0.0) + 0.02 for test in lines}
    chosen = []
    while left:
        best = max(lines, key=lambda test: len(lines[test] & left) / cost[test])
        chosen.append(best)
        left -= lines[best]
    return sorted(chosen), sum(cost[test] for test in chosen), sum(cost.values())


def main():
    suites = {
        "tensorflow": _ci_files(r"^CORE_TESTS=\(([^)]*)\)"),
        "jax": _ci_files(r"^OLDER_JAX_TESTS=\(([^)]*)\)"),
    }
    with tempfile.TemporaryDirectory() as folder:
        for backend, files in suites.items():
            chosen, cost, whole = choose(*_measure(backend, files, folder))
            path = os.path.join(ROOT, ".ci", f"every-keras-{backend}.txt")
            with open(path, "w") as out:
                out.write(f"# Written by .ci/every_keras.py ({backend}): {len(chosen)} test functions, "
                          f"{cost:.0f} of the {whole:.0f} test seconds (with coverage) of {' '.join(files)}.\n")
                out.writelines(test + "\n" for test in chosen)
            print(f"{path}: {len(chosen)} test functions, {cost:.0f} of {whole:.0f} s")


if __name__ == "__main__":
    main()
