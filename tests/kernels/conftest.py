import pytest


@pytest.fixture
def interpret(monkeypatch):
    """Run Triton kernels on CPU tensors through Triton's interpreter for this test only (the kernels are jitted
    per interpreter mode at call time, so setting the variable here is enough)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
