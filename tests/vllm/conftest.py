import pytest


@pytest.fixture(scope="session", autouse=True)
def plugin_patches():
    """Apply the plugin the way vLLM does (its general-plugin entry point)."""
    from vllm_kvbm_plugin import plugin

    plugin.register()
    yield
