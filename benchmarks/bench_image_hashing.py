"""Image hashing overhead per request: a 32k-token prompt with 8 images at unit 32.

vLLM's own request block hasher (its default sha256, with the multimodal extra keys, exactly the
function that fills `request.block_hashes`) against our full key computation for the same request,
i.e. `scheduler.unit_keys`: vLLM's extra keys for the units that can have some, `extra_hash`
of each, one `request_keys` call, keys back as Python int pairs.
The same two on the text-only prompt for comparison. Each figure is the best and the median of
`--repeat` single runs (`timing.best(1, ...)` per run; the CPU is shared).

    python benchmarks/bench_image_hashing.py [--tokens 32768] [--unit 32] [--images 8] [--repeat 50]
"""

import argparse
import hashlib
import random
import statistics

from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from vllm_kvbm_plugin import compat
from vllm_kvbm_plugin.connector.scheduler import RequestKeys, unit_keys
from vllm_kvbm_plugin.hashing import Keyer, spec

from timing import best

IMAGE_PAD = 151655  # Qwen2-VL's <|image_pad|>
SECRET = bytes(range(16))  # any tier secret: the timing does not depend on it
KEYER = Keyer(SECRET)
extra_hash = KEYER.extra_hash


def make_request(n_tokens: int, n_images: int, rng: random.Random, with_images: bool) -> Request:
    """n_tokens random text tokens with n_images images of 196..576 placeholder tokens each, spread
    over the prompt and starting mid-unit (identifiers are sha256 hex strings, like vLLM's)."""
    tokens = [rng.randrange(150000) for _ in range(n_tokens)]
    features = []
    stride = n_tokens // n_images
    for k in range(n_images):
        length = rng.randrange(196, 577)
        offset = k * stride + rng.randrange(1, stride - length)
        tokens[offset : offset + length] = [IMAGE_PAD] * length
        ident = hashlib.sha256(f"image-{k}".encode()).hexdigest()
        features.append(MultiModalFeatureSpec(data=None, modality="image", identifier=ident, mm_hash=ident,
                                              mm_position=PlaceholderRange(offset=offset, length=length)))
    return Request("bench", tokens, SamplingParams(max_tokens=1), None,
                   mm_features=features if with_images else None)


def our_keys(pool, req: Request, unit: int, root) -> list:
    """The connector's own key computation (scheduler.unit_keys) for a fresh request."""
    return unit_keys(RequestKeys(req, []), req.num_tokens // unit, unit, root, pool, KEYER)


def extra_keys_only(pool, req: Request, unit: int) -> list:
    """Just the per-unit vLLM extra keys (the walk vLLM's own hasher does too)."""
    out, mm = [], 0
    for u in range(req.num_tokens // unit):
        keys, mm = compat.block_extra_keys(pool, req, u * unit, (u + 1) * unit, mm)
        out.append(keys)
    return out


def timed(repeat: int, fn) -> tuple[float, float]:
    runs = [best(1, fn) for _ in range(repeat)]
    return min(runs), statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--unit", type=int, default=32)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    unit = args.unit
    img = make_request(args.tokens, args.images, random.Random(0), with_images=True)
    txt = make_request(args.tokens, args.images, random.Random(0), with_images=False)
    root = KEYER.root("bench", "bfloat16", "LBHNC", unit)
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=unit)

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    hasher = get_request_block_hasher(unit, fn)

    # correctness first: bit-exact with the plain-Python reference, and the images do fold in
    per_unit = extra_keys_only(pool, img, unit)
    ex = [extra_hash(k) for k in per_unit]
    got = our_keys(pool, img, unit, root)
    assert got == spec.unit_keys(SECRET, img.all_token_ids, unit, root, ex), "numba keys differ from the reference"
    n_img_units = sum(k is not None for k in per_unit)
    assert len(hasher(img)) == len(got) and hasher(img) != hasher(txt)

    r = args.repeat
    t = {
        "vllm_img": timed(r, lambda: hasher(img)),
        "vllm_txt": timed(r, lambda: hasher(txt)),
        "ours_img": timed(r, lambda: our_keys(pool, img, unit, root)),
        "ours_txt": timed(r, lambda: our_keys(pool, txt, unit, root)),
        "extra_keys": timed(r, lambda: extra_keys_only(pool, img, unit)),
        "extra_hash": timed(r, lambda: [extra_hash(k) for k in per_unit if k]),
        "extra_hash_ref": timed(max(5, r // 3), lambda: [spec.extra_hash(SECRET, k) for k in per_unit if k]),
    }

    def ms(name):
        b, m = t[name]
        return f"{b * 1e3:8.3f} ms (median {m * 1e3:8.3f})"

    n = args.tokens // unit
    print(f"{args.tokens} tokens, {n} units of {unit}, {args.images} images covering "
          f"{sum(f.mm_position.length for f in img.mm_features)} tokens in {n_img_units} units; "
          f"best and median of {r} runs")
    print(f"vLLM request hasher (sha256), images: {ms('vllm_img')}")
    print(f"our keys incl. image folding:         {ms('ours_img')}  "
          f"-> {t['ours_img'][0] / t['vllm_img'][0]:.1%} of vLLM's hashing time "
          f"({t['vllm_img'][0] / t['ours_img'][0]:.1f}x faster), bit-exact with the reference")
    print(f"  of which vLLM's per-unit extra keys: {ms('extra_keys')}")
    print(f"  of which extra_hash ({n_img_units} units): {ms('extra_hash')}; with the plain-Python "
          f"reference it would be {ms('extra_hash_ref')}")
    print(f"  image folding (ours with images - ours text-only): "
          f"{(t['ours_img'][0] - t['ours_txt'][0]) * 1e3:8.3f} ms = "
          f"{(t['ours_img'][0] - t['ours_txt'][0]) / t['vllm_img'][0]:.1%} of vLLM's hashing time")
    print(f"text only: vLLM {ms('vllm_txt')}, ours {ms('ours_txt')} "
          f"-> {t['ours_txt'][0] / t['vllm_txt'][0]:.1%} ({t['vllm_txt'][0] / t['ours_txt'][0]:.1f}x faster)")


if __name__ == "__main__":
    main()
