"""How kmp writes a loss scale for people, in one place.

The progress bar, `LossScaleMonitor`'s lines and `kmp.diagnose`'s report all
print loss scales; they use `format_scale`, so a scale reads the same
everywhere.
"""

import math


def format_scale(scale):
    """Returns the loss scale as people read it.

    ```
    None                      -> "None"
    an integer below 2**53    -> its digits: 32768, 1, 3
    a power of two below 1    -> "2^-k": 0.125 -> "2^-3"
    anything else             -> "%g": 0.3 -> "0.3", inf -> "inf"
    ```

    Args:
        scale: Float, int or `None`. The loss scale.

    Returns:
        A string.

    Example:

    >>> format_scale(32768.0), format_scale(2.0**-24), format_scale(0.3)
    ('32768', '2^-24', '0.3')
    """
    if scale is None:
        return "None"
    value = float(scale)
    if not math.isfinite(value) or value <= 0:
        return f"{value:g}"
    if value == int(value) and value < 2.0**53:
        return str(int(value))
    mantissa, exponent = math.frexp(value)
    if mantissa == 0.5:
        return f"2^{exponent - 1}"
    return f"{value:g}"
