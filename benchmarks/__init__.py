"""Side-by-side benchmarks: kmp against Keras' own mixed precision.

Run `python -m benchmarks.run` (`--quick` for a run under two minutes); see
`benchmarks/run.py` for what is measured and how.
"""
