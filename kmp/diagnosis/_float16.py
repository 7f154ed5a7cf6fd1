"""What float16 does to a value: its range and where it rounds to inf, 0 or a subnormal.

`kmp.diagnose` measures values against these thresholds and its static checks
look for constants beyond them.
"""

FLOAT16_MAX = 65504.0
# The smallest normal float16; below it values are subnormal (fewer bits).
FLOAT16_SMALLEST_NORMAL = 2.0**-14
# Round to nearest even: |x| >= 65520 becomes inf, |x| <= 2**-25 becomes 0,
# and |x| < 2**-14 - 2**-25 becomes a subnormal.
OVERFLOW_AT = 65520.0
ZERO_AT_MOST = 2.0**-25
SUBNORMAL_BELOW = 2.0**-14 - 2.0**-25
