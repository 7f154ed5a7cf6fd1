"""The documentation is tested: every ```python block of README.md and
docs/*.md runs, what it prints is what the guide shows, and every relative
link resolves.

A file's blocks run in order in one namespace (a guide builds on its earlier
blocks), in a fresh Python process started in an empty temporary directory, on
the CPU. `<!-- no-run: why -->` on the line just before a block leaves it out;
the reason is required (a GPU, several workers, a network). A file with
`<!-- backend: jax -->` runs with `KERAS_BACKEND=jax` (docs/jax.md).

`<!-- printed -->` on the line just before a block makes it a transcript: what
the nearest python block above it printed, compared line by line. `...` stands
for what varies from run to run or machine to machine: on a line of its own,
for any number of lines; inside a line, for any text. `<!-- printed: numbers
within 5% -->` lets each number differ by that much (a loss computed with
another CPU's kernels). A plain (unlabelled) block right after a python block
is a transcript unless `<!-- not printed: why -->` says what it is instead.
"""

import ast
import functools
import json
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from _helpers import child_env

_ROOT = pathlib.Path(__file__).parents[1]
_DOCS = sorted([_ROOT / "README.md", *(_ROOT / "docs").glob("*.md")])
_FENCE = re.compile(r"^```(\S*)\s*$")
_NO_RUN = re.compile(r"^<!--\s*no-run(?::\s*(?P<why>.*?))?\s*-->\s*$")
_BACKEND = re.compile(r"^<!--\s*backend:\s*(?P<backend>\w+)\s*-->\s*$", re.MULTILINE)
_PRINTED = re.compile(r"^<!--\s*printed(?::\s*numbers within (?P<band>\d+(?:\.\d+)?)%)?\s*-->\s*$")
_NOT_PRINTED = re.compile(r"^<!--\s*not printed:\s*(?P<why>.+?)\s*-->\s*$")
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?"


def _blocks(path):
    """Yields (line number, language, code, skip reason or None) for each
    fenced block of the markdown file."""
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        if not match:
            index += 1
            continue
        start = index
        end = start + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        no_run = _NO_RUN.match(lines[start - 1].strip()) if start else None
        why = None if no_run is None else (no_run.group("why") or "")
        yield start + 1, match.group(1), "\n".join(lines[start + 1:end]), why
        index = end + 1


def _python_blocks(path):
    return [block for block in _blocks(path) if block[1] == "python"]


def _marker(path, line):
    """The line just before the block that starts at `line` (1-based)."""
    lines = path.read_text().splitlines()
    return lines[line - 2].strip() if line >= 2 else ""


def _transcripts(path):
    """Yields (python block's line, transcript's line, transcript, band) for
    each `<!-- printed -->` block: `band` is the relative difference allowed
    between numbers (`None`: exact)."""
    last_python = None
    for line, language, code, why in _blocks(path):
        if language == "python":
            last_python = line if why is None else None
            continue
        printed = _PRINTED.match(_marker(path, line))
        if printed:
            band = printed.group("band")
            yield last_python, line, code, None if band is None else float(band) / 100


def _line_matches(expected, actual, band):
    """Whether one printed line is the transcript's `expected` line."""
    pieces = expected.split("...")
    if band is None:
        return re.fullmatch(".*".join(map(re.escape, pieces)), actual, re.S) is not None
    numbers, pattern_pieces = [], []
    for piece in pieces:
        parts = re.split(f"({_NUMBER})", piece)
        pattern = ""
        for index, part in enumerate(parts):
            if index % 2:
                numbers.append(float(part))
                pattern += f"({_NUMBER})"
            else:
                pattern += re.escape(part)
        pattern_pieces.append(pattern)
    match = re.fullmatch(".*?".join(pattern_pieces), actual, re.S)
    if match is None:
        return False
    return all(
        abs(float(got) - want) <= band * abs(want)
        for got, want in zip(match.groups(), numbers)
    )


def _transcript_matches(transcript, printed, band=None):
    """Whether `printed` (lines) is `transcript` (lines), `...` lines
    standing for any number of lines."""
    @functools.cache
    def match(i, j):
        if i == len(transcript):
            return j == len(printed)
        if transcript[i].strip() == "...":
            return match(i + 1, j) or (j < len(printed) and match(i, j + 1))
        return (
            j < len(printed)
            and _line_matches(transcript[i], printed[j], band)
            and match(i + 1, j + 1)
        )

    return match(0, 0)


def _name(path):
    return str(path.relative_to(_ROOT))


# What each file's blocks run in: one namespace, each block compiled under its
# file and line so a traceback points into the markdown.
_RUNNER = textwrap.dedent(
    """
    import json, sys
    blocks = json.load(open(sys.argv[1]))
    namespace = {"__name__": "__main__"}
    for block in blocks:
        code = "\\n" * (block["line"]) + block["code"]
        exec(compile(code, block["file"], "exec"), namespace)
        print(f"--- ran {block['file']}:{block['line']}", flush=True)
    """
)


@pytest.mark.parametrize("path", [p for p in _DOCS if _python_blocks(p)], ids=_name)
def test_every_python_block_runs(path, tmp_path):
    blocks = [
        {"file": str(path), "line": line, "code": code}
        for line, _, code, why in _python_blocks(path)
        if why is None
    ]
    if not blocks:
        pytest.skip(f"every python block of {_name(path)} is marked no-run")
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "run_blocks.py").write_text(_RUNNER)
    work = tmp_path / "work"
    work.mkdir()
    env = child_env(gpu=False)
    backend = _BACKEND.search(path.read_text())
    env["KERAS_BACKEND"] = backend.group("backend") if backend else "tensorflow"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    result = subprocess.run(
        [sys.executable, str(tmp_path / "run_blocks.py"), str(tmp_path / "blocks.json")],
        cwd=work, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, (
        f"{_name(path)}: a python block failed\n"
        + result.stdout[-3000:] + result.stderr[-5000:]
    )
    assert result.stdout.count("--- ran ") == len(blocks)
    # What each block printed: the lines before its "--- ran" line.
    printed, lines = {}, []
    for line in result.stdout.splitlines():
        ran = re.fullmatch(r"--- ran .*:(\d+)", line)
        if ran:
            printed[int(ran.group(1))], lines = lines, []
        else:
            lines.append(line)
    wrong = [
        f"{_name(path)}:{transcript_line} shows\n{transcript}\nbut the block at line "
        f"{python_line} printed\n" + "\n".join(printed[python_line])
        for python_line, transcript_line, transcript, band in _transcripts(path)
        if not _transcript_matches(tuple(transcript.splitlines()), tuple(printed[python_line]), band)
    ]
    assert not wrong, "\n\n".join(wrong)


def test_every_no_run_says_why():
    missing = [
        f"{_name(path)}:{line}"
        for path in _DOCS
        for line, _, _, why in _blocks(path)
        if why == ""
    ]
    assert not missing, f"<!-- no-run --> without a reason (write <!-- no-run: why -->): {missing}"


def test_every_transcript_is_checked_or_says_what_it_is():
    # docs/monitoring.md showed "skipped_steps: 0" under a block that prints
    # 8 and 10, and nothing compared them (issue 38).
    unmarked, orphans = [], []
    for path in _DOCS:
        blocks = list(_blocks(path))
        for before, block in zip(blocks, blocks[1:]):
            marker = _marker(path, block[0])
            if (
                before[1] == "python" and before[3] is None and block[1] == ""
                and not _PRINTED.match(marker) and not _NOT_PRINTED.match(marker)
            ):
                unmarked.append(f"{_name(path)}:{block[0]}")
        orphans += [
            f"{_name(path)}:{line}" for python_line, line, _, _ in _transcripts(path)
            if python_line is None
        ]
    assert not unmarked, (
        "plain blocks right after a python block that runs, neither <!-- printed --> nor "
        f"<!-- not printed: why -->: {unmarked}"
    )
    assert not orphans, f"<!-- printed --> blocks with no python block that runs above: {orphans}"
    assert any(True for path in _DOCS for _ in _transcripts(path))


def test_a_transcript_matches_what_was_printed_and_nothing_else():
    printed = ("Epoch 1/2", "8/8 - 1s - 91ms/step - loss: 8.0409 - skipped_steps: 8", "[8.0]")
    assert _transcript_matches(("Epoch 1/2", "8/8 - ... - loss: ... - skipped_steps: 8", "[8.0]"),
                               printed)
    assert _transcript_matches(("...", "[8.0]"), printed)
    assert _transcript_matches(("Epoch 1/2", "...", "[8.0]"), printed)
    assert not _transcript_matches(("Epoch 1/2", "8/8 - ... - skipped_steps: 0", "[8.0]"), printed)
    assert _transcript_matches(("Epoch 1/2", "..."), printed[:1])  # "..." may be no line
    assert not _transcript_matches(("Epoch 1/2",), printed)  # a line the guide leaves out
    within = ("Epoch 1/2", "8/8 - ... - loss: 8.1 - skipped_steps: 8", "[8.0]")
    assert _transcript_matches(within, printed, band=0.05)
    assert not _transcript_matches(within, printed)
    assert not _transcript_matches(("Epoch 1/2", "8/8 - ... - loss: 8.1 - skipped_steps: 9", "[8.0]"),
                                   printed, band=0.05)


def test_no_run_is_the_exception():
    counts = [(why is None) for path in _DOCS for _, _, _, why in _python_blocks(path)]
    assert counts.count(True) >= 3 * counts.count(False), (
        f"{counts.count(False)} of {len(counts)} python blocks are not run"
    )


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation other than
    hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\*", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path):
    anchors, seen = set(), {}
    in_fence = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        match = re.match(r"^#{1,6}\s+(.*)$", line)
        if match and not in_fence:
            slug = _slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(path):
    text = path.read_text()
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # code is not prose
    text = re.sub(r"`[^`\n]*`", "", text)
    for match in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)\)", text):
        yield match.group(1)


def test_slug_matches_github():
    assert _slug("Which steps, and why: `LossScaleMonitor`") == "which-steps-and-why-lossscalemonitor"
    assert _slug("Diagnosing an overflow: `kmp.diagnose`") == "diagnosing-an-overflow-kmpdiagnose"
    assert _slug("An epoch's logs after a skip") == "an-epochs-logs-after-a-skip"


@pytest.mark.parametrize("path", _DOCS, ids=_name)
def test_every_relative_link_resolves(path):
    broken = []
    for target in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
            broken.append(f"{target}: no heading with the anchor #{anchor}")
    assert not broken, f"{_name(path)}: " + "; ".join(broken)


def _conftest_tuple(name):
    conftest = ast.parse((_ROOT / "tests" / "conftest.py").read_text())
    (value,) = [
        ast.literal_eval(node.value) for node in conftest.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name
    ]
    return value


@functools.lru_cache(maxsize=None)  # each file parsed once: a list names up to 16 tests of one
def _functions_of(source):
    """The names of the functions `source` (a test file's path) defines."""
    return {node.name for node in ast.walk(ast.parse(source.read_text()))
            if isinstance(node, ast.FunctionDef)}


def test_the_slow_tier_names_tests_that_exist():
    # tests/conftest.py marks tests slow by file and name: a renamed test
    # would silently join the fast tier.
    SLOW = _conftest_tuple("SLOW")
    missing = []
    for entry in SLOW:
        file, _, name = entry.partition("::")
        # conftest matches a file by its name, in tests/ or tests/peers/.
        sources = [path for path in (_ROOT / "tests" / file, _ROOT / "tests" / "peers" / file)
                   if path.exists()]
        if not sources:
            missing.append(entry)
            continue
        if name and name not in _functions_of(sources[0]):
            missing.append(entry)
    assert not missing, f"tests/conftest.py SLOW names tests that do not exist: {missing}"


def test_the_ci_script_names_test_files_that_exist_and_jax_files_for_its_jax_passes():
    # .ci/run names the files its older-Keras parts and its pass without
    # TensorFlow run: a renamed file would make pytest fail there only, a file
    # of the TensorFlow pass in a JAX list would run nothing on JAX.
    ci = (_ROOT / ".ci" / "run").read_text()
    lists = {name: body.split() for name, body in
             re.findall(r"^([A-Z_]+_TESTS)=\(([^)]*)\)", ci, flags=re.MULTILINE)}
    assert set(lists) == {"CORE_TESTS", "OLDER_JAX_TESTS", "JAX_WITHOUT_TENSORFLOW_TESTS"}, sorted(lists)
    for name, files in lists.items():
        missing = [file for file in files if not (_ROOT / file).is_file()]
        assert files and not missing, (name, missing)
    jax_files = set(_conftest_tuple("JAX_TESTS"))
    for file in lists["JAX_WITHOUT_TENSORFLOW_TESTS"] + lists["OLDER_JAX_TESTS"]:
        assert file.removeprefix("tests/") in jax_files, file
    assert "tests/test_without_tensorflow.py" in lists["JAX_WITHOUT_TENSORFLOW_TESTS"]


@pytest.mark.parametrize("backend, among", [("tensorflow", "CORE_TESTS"), ("jax", "OLDER_JAX_TESTS")])
def test_the_tests_every_keras_minor_runs_exist_in_the_files_they_are_chosen_from(backend, among):
    # .ci/every_keras.py writes them; a renamed test would make pytest fail
    # on the older minors only, or a list emptied by hand run nothing there.
    ci = (_ROOT / ".ci" / "run").read_text()
    files = re.search(rf"^{among}=\(([^)]*)\)", ci, flags=re.MULTILINE).group(1).split()
    chosen = [line for line in (_ROOT / ".ci" / f"every-keras-{backend}.txt").read_text().splitlines()
              if not line.startswith("#")]
    assert len(chosen) >= 10 and len(set(chosen)) == len(chosen)
    for entry in chosen:
        file, _, name = entry.partition("::")
        assert file in files, entry
        assert name in _functions_of(_ROOT / file), f"{entry} is not a test function of {file}"


def test_readme_is_a_front_page():
    readme = (_ROOT / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    # The set-up commands come first: the quickstart, then the whole suite
    # (the TensorFlow pass, then the JAX pass), as .ci/run runs it.
    assert lines[2:6] == [
        "```bash",
        'pip install -e ".[tensorflow,examples]" && python examples/quickstart.py',
        'pip install -e ".[test]" && python -m pytest -q -n 2 --dist loadfile'
        " && KERAS_BACKEND=jax python -m pytest -q -n 2 --dist loadfile",
        "```",
    ]
    ci = (_ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q -n 2 --dist loadfile\n    jax_pass python\n" in ci
    # Nothing in it points outside the repository.
    for path in _DOCS:
        text = path.read_text()
        assert "../shared" not in text, _name(path)
        assert "issue reporter" not in text, _name(path)


def test_every_guide_is_linked_from_the_readme():
    readme = (_ROOT / "README.md").read_text()
    unlinked = [
        _name(path) for path in _DOCS
        if path.name != "README.md" and f"({_name(path)}" not in readme
    ]
    assert not unlinked, f"guides the README does not link: {unlinked}"



# Each third-party module the examples and guides import, and the
# distribution that installs it.
_DISTRIBUTIONS = {
    "sklearn": "scikit-learn",
    "keras_hub": "keras-hub",
    "matplotlib": "matplotlib",
    "tensorflow": "tensorflow",
    "jax": "jax",
}


def _imported_modules(code):
    modules = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module.split(".")[0])
    return modules


def test_the_extras_install_what_the_examples_and_guides_import():
    # keras-hub was in no extra but `test` (issue 38): a user who cloned the
    # repository could not run docs/bringing-models.md or examples/bert_policies.py.
    import tomllib

    project = tomllib.loads((_ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    installed = {
        re.split(r"[<>=!\[ ;]", requirement)[0]
        for name, requirements in extras.items() if name != "test"
        for requirement in requirements
    } | {re.split(r"[<>=!\[ ;]", requirement)[0] for requirement in project["dependencies"]}
    sources = {str(path.relative_to(_ROOT)): path.read_text()
               for path in sorted((_ROOT / "examples").glob("*.py"))}
    sources.update({
        f"{_name(path)}:{line}": code for path in _DOCS for line, _, code, _ in _python_blocks(path)
    })
    missing, unknown = [], []
    for where, code in sources.items():
        for module in _imported_modules(code):
            if module in sys.stdlib_module_names or module in ("kmp", "benchmarks", "keras", "numpy"):
                continue
            if module not in _DISTRIBUTIONS:
                unknown.append(f"{where}: {module}")
            elif _DISTRIBUTIONS[module] not in installed:
                missing.append(f"{where}: {module} ({_DISTRIBUTIONS[module]})")
    assert not unknown, f"add these modules' distributions to _DISTRIBUTIONS: {unknown}"
    assert not missing, f"imported by examples or guides, installed by no extra: {missing}"
