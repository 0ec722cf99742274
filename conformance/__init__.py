"""OpInfo conformance sweep: every PyTorch OpInfo sample, run under strict PyTorch and under
deferfuse's defer mode (always compiling), compared value for value.

    .venv/bin/python -m conformance.sweep --subset fast          # the CI subset
    make conformance                                             # the full sweep -> docs/conformance.md
"""
