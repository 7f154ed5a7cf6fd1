"""`kmp.DiagnosisReport`: what `kmp.diagnose` found, as a table, a dict or JSON."""

import json
import math
import os

from kmp._format import format_scale
from kmp.backup import _atomic_files
from kmp.diagnosis._probe import MIN_SCALE_EXPONENT


class DiagnosisReport:
    """What `kmp.diagnose` found: per-layer ranges, the first failure, advice.

    Prints as a table; `to_dict()` gives the same content as plain Python
    values and `to_json(path)` writes it.

    Attributes:
        policy: String. The reduced-precision policy diagnosed.
        loss_scale: Float. The loss scale the shares of gradient underflow
            and overflow are measured at.
        steps: Int. How many batches were run (0 for static checks only).
        loss: Dict with the loss in `"float32"` and in the reduced dtype.
        layers: List of dicts, one per layer in execution order (see
            `kmp.diagnose` for the keys).
        first_nonfinite: `None`, or a dict with `"layer"`, `"tensor"` and
            `"direction"` (`"forward"` or `"backward"`): where the reduced
            pass first stopped being finite.
        direction: `None`, `"forward"` or `"backward"`.
        first_inaccurate: `None`, or a dict with `"layer"` and `"rel_error"`:
            the first layer, in execution order, whose reduced output is
            finite but more than 10% off float32 (an overflow inside the
            layer that its output hides, such as `x / sqrt(inf)` = 0).
        recommended_loss_scale: Float or `None`: the largest power of two at
            which no float32 gradient overflows float16 (`None` when none in
            `[2**-24, 2**24]` does).
        underflow_at_recommended: Dict with the shares of gradient values that
            still become zero (`"zero"`) or subnormal (`"subnormal"`) there.
        recommended_policy: String. The policy to train with.
        policy_reason: String. Why.
        findings: List of dicts (`"check"`, `"layer"`, `"message"`, `"fix"`)
            from the static checks.
        float8: List of dicts, one per float8 layer (`kmp.float8`):
            `"layer"`, `"float8_error"`, `"sixteen_bit_error"` (relative to
            float32, as `kmp.float8.compare` gives them) and `"flagged"`
            (float8 error above 10%); empty for a model without float8
            layers or without data.
        float8_fix: `None`, or the call that leaves the flagged float8
            layers in 16 bits: `"kmp.float8.enable(model, exclude=[...])"`.
    """

    def __init__(self, **fields):
        self.policy = fields["policy"]
        self.loss_scale = fields["loss_scale"]
        self.steps = fields["steps"]
        self.loss = fields["loss"]
        self.layers = fields["layers"]
        self.first_nonfinite = fields["first_nonfinite"]
        self.first_inaccurate = fields["first_inaccurate"]
        self.recommended_loss_scale = fields["recommended_loss_scale"]
        self.underflow_at_recommended = fields["underflow_at_recommended"]
        self.recommended_policy = fields["recommended_policy"]
        self.policy_reason = fields["policy_reason"]
        self.findings = fields["findings"]
        self.float8 = fields.get("float8", [])

    @property
    def float8_fix(self):
        flagged = [row["layer"] for row in self.float8 if row["flagged"]]
        if not flagged:
            return None
        return f"kmp.float8.enable(model, exclude={flagged!r})"

    @property
    def direction(self):
        return self.first_nonfinite["direction"] if self.first_nonfinite else None

    def layer(self, name):
        """Returns the per-layer dict of the layer called `name`.

        Args:
            name: String. The layer's name.

        Returns:
            A dict with the keys listed in `kmp.diagnose`'s `Returns:`.

        Raises:
            KeyError: if the report has no layer called `name`.
        """
        for row in self.layers:
            if row["name"] == name:
                return row
        raise KeyError(
            f"No layer named {name!r} in the report. Layers: "
            f"{', '.join(row['name'] for row in self.layers)}"
        )

    def to_dict(self):
        """Returns the report as a dict of plain Python values (JSON-ready)."""
        return {
            "policy": self.policy,
            "loss_scale": self.loss_scale,
            "steps": self.steps,
            "loss": dict(self.loss),
            "first_nonfinite": (
                dict(self.first_nonfinite) if self.first_nonfinite else None
            ),
            "direction": self.direction,
            "first_inaccurate": (
                dict(self.first_inaccurate) if self.first_inaccurate else None
            ),
            "recommended_loss_scale": self.recommended_loss_scale,
            "underflow_at_recommended": dict(self.underflow_at_recommended),
            "recommended_policy": self.recommended_policy,
            "policy_reason": self.policy_reason,
            "layers": [dict(row) for row in self.layers],
            "findings": [dict(finding) for finding in self.findings],
            "float8": [dict(row) for row in self.float8],
            "float8_fix": self.float8_fix,
        }

    def to_json(self, path=None, indent=2):
        """Returns the report as JSON, and writes it to `path` if given.

        Infinities and NaNs are written as the strings `"inf"` and `"nan"`,
        so the file is strict JSON.

        Args:
            path: Optional string or path-like. Where to write. Defaults to
                `None` (only return the string).
            indent: Int. JSON indentation. Defaults to `2`.

        Returns:
            The JSON string.
        """
        text = json.dumps(_json_safe(self.to_dict()), indent=indent)
        if path is not None:
            # A new file moved onto `path` (a link there is replaced, not
            # written through), as kmp's other one-shot files are.
            _atomic_files.write_bytes_then_replace(os.fspath(path), (text + "\n").encode())
        return text

    def __repr__(self):
        return (
            f"<kmp.DiagnosisReport policy={self.policy!r} "
            f"direction={self.direction!r} "
            f"recommended_loss_scale={format_scale(self.recommended_loss_scale)} "
            f"recommended_policy={self.recommended_policy!r}>"
        )

    def __str__(self):
        lines = [
            f"kmp.diagnose: {self.policy} against float32, {self.steps} "
            f"step(s), loss scale {format_scale(self.loss_scale)}"
        ]
        if self.steps:
            lines.append(
                f"loss: float32 {_format_number(self.loss['float32'])}, "
                f"{self.policy} {_format_number(self.loss['reduced'])}"
            )
            lines.append("")
            lines.extend(_table(self.layers))
            lines.append("")
            lines.append(
                "ovf%: share of values that overflow float16 (|x| >= 65520); "
                "zero%/sub%: share flushed to zero / made subnormal; "
                "gradients at the loss scale above; rel err: "
                "||y - y_float32|| / ||y_float32||."
            )
            if self.first_nonfinite:
                where = self.first_nonfinite
                lines.append(
                    f"First non-finite: {where['layer']} ({where['tensor']}), "
                    f"{where['direction']}."
                )
            else:
                lines.append("First non-finite: none, every value was finite.")
            if self.first_inaccurate:
                lines.append(
                    f"First inaccurate: {self.first_inaccurate['layer']}, "
                    f"finite but {self.first_inaccurate['rel_error']:.0%} off "
                    "float32 (above 10% it is wrong, not rounded)."
                )
            underflow = self.underflow_at_recommended
            if self.recommended_loss_scale is None:
                lines.append(
                    "Recommended loss scale: none; the float32 gradients "
                    "overflow float16 at every scale down to "
                    f"{format_scale(2.0**MIN_SCALE_EXPONENT)}."
                )
            else:
                lines.append(
                    "Recommended loss scale: "
                    f"{format_scale(self.recommended_loss_scale)} (no gradient "
                    f"overflows; {underflow['zero']:.2%} of gradient values "
                    f"still flush to zero, {underflow['subnormal']:.2%} are "
                    "subnormal)."
                )
        lines.append(
            f"Recommended policy: {self.recommended_policy} ({self.policy_reason})."
        )
        if self.float8:
            lines.extend(_float8_lines(self.float8, self.policy, self.float8_fix))
        if self.findings:
            lines.append("Static checks:")
            for finding in self.findings:
                lines.append(
                    f"- [{finding['check']}] {finding['layer']}: "
                    f"{finding['message']} Fix: {finding['fix']}"
                )
        else:
            lines.append("Static checks: no hazards found.")
        return "\n".join(lines)


_COLUMNS = (
    ("layer", "name", "s"),
    ("dtype", "compute_dtype", "s"),
    ("max|act|", "max_abs_activation", "g"),
    ("act ovf%", "activation_overflow", "%"),
    ("act zero%", "activation_zero", "%"),
    ("max|grad|", "max_abs_gradient", "g"),
    ("grad ovf%", "gradient_overflow", "%"),
    ("grad zero%", "gradient_zero", "%"),
    ("grad sub%", "gradient_subnormal", "%"),
    ("rel err", "rel_error", "g"),
)


def _table(rows):
    cells = [[title for title, _, _ in _COLUMNS]]
    for row in rows:
        line = []
        for _, key, kind in _COLUMNS:
            value = row[key]
            if kind == "s":
                line.append(str(value))
            elif kind == "%":
                line.append(f"{100 * value:.2f}")
            else:
                line.append(_format_number(value))
        cells.append(line)
    widths = [max(len(line[i]) for line in cells) for i in range(len(_COLUMNS))]

    def render(line):
        return "  ".join(
            cell.ljust(width) if i < 2 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(line, widths))
        ).rstrip()

    separator = "  ".join("-" * width for width in widths)
    return [render(cells[0]), separator] + [render(line) for line in cells[1:]]


def _float8_lines(rows, policy, fix):
    """The float8 layers' table and the advice, for `DiagnosisReport.__str__`."""
    cells = [("float8 layer", "float8 err", f"{policy} err", "flagged")] + [
        (row["layer"], _format_number(row["float8_error"]),
         _format_number(row["sixteen_bit_error"]), "yes" if row["flagged"] else "-")
        for row in rows
    ]
    widths = [max(len(line[i]) for line in cells) for i in range(4)]
    table = [
        "  ".join(cell.ljust(width) if i == 0 else cell.rjust(width)
                  for i, (cell, width) in enumerate(zip(line, widths))).rstrip()
        for line in cells
    ]
    lines = [
        f"Float8 layers against {policy} (err: relative to float32, with the "
        "layer's current float8 scales; flagged above 10%):",
        *table,
    ]
    if fix is None:
        lines.append("Float8: every float8 layer stays within 10% of float32.")
    else:
        flagged = [row["layer"] for row in rows if row["flagged"]]
        lines.append(
            f"Float8 loses accuracy in {', '.join(flagged)}: leave "
            f"{'it' if len(flagged) == 1 else 'them'} in 16 bits: build the model "
            f"again and call {fix} before training."
        )
    return lines


def _format_number(value):
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    return f"{value:.3g}"


def _json_safe(value):
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value
