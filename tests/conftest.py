"""Shared pytest fixtures."""

import pytest


@pytest.fixture(scope="session")
def default_model_dir():
    """Converted HF directory of the default model (SmolLM2-135M-Instruct).

    Uses the user's $QSPEC_CACHE (default ~/.cache/qspec), so repeated runs reuse one
    conversion; CI points QSPEC_CACHE somewhere of its own.
    """
    from qspec.default_model import default_model_dir as locate

    return locate(progress=False)
