"""Fixtures shared by the test files. Tests write only into temporary folders."""
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (test_gpu.py; skipped without one)")


@pytest.fixture(scope="session")
def embedded_default(tmp_path_factory):
    """(cache folder, SmolLM2 folder, ShareGPT JSONL) of the embedded default, prepared once per test run in a
    temporary folder its pytest-xdist workers share: the first builds it, filelock makes the other wait."""
    import data_dflash
    cache = tmp_path_factory.getbasetemp().parent / "embedded_default"
    return (str(cache), *data_dflash.prepare_embedded_default(str(cache)))
