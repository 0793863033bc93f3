"""Kernel specs of check_bwd.py's cases (for precompile_cache.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def specs(sms):
    import check_bwd

    return [s for _, kw in check_bwd.CASES for s in check_bwd.specs_for(kw)]
