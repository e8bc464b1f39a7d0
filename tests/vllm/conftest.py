import contextlib

import pytest


@pytest.fixture(scope="session", autouse=True)
def plugin_patches():
    """Apply the plugin the way vLLM does (its general-plugin entry point)."""
    from vllm_kvbm_plugin import plugin

    plugin.register()
    yield


@pytest.fixture
def tiered(request):
    """The test module's `Tiered(...)` (an offloading_drive.Tiered on one of our tiers) as a maker;
    every manager it made is closed after the test, whatever the test left behind."""
    made = []

    def make(*args, **kw):
        made.append(request.module.Tiered(*args, **kw))
        return made[-1]
    yield make
    for t in made:
        with contextlib.suppress(Exception):
            t.close()
