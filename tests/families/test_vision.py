"""families/vision.py against transformers' own Qwen-VL image processor (PIL backend)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as hf_qwen2_vl
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from capture_proxy.families import vision
from capture_proxy.families.qwen_vocab import QWEN_ADDED_TOKENS, SPECIAL_START_ID

CONFIGS = {"qwen3_vl": vision.QWEN3_VL_PROCESSOR, "qwen2_5_vl": vision.QWEN2_5_VL_PROCESSOR}
# Small budgets so tiny test images hit both the min_pixels and the max_pixels branches.
SMALL = vision.VisionProcessorConfig(min_pixels=64 * 64, max_pixels=256 * 256)


def hf_processor(config: vision.VisionProcessorConfig) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=config.patch_size,
        merge_size=config.merge_size,
        temporal_patch_size=config.temporal_patch_size,
        size={"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels},
        image_mean=list(config.image_mean),
        image_std=list(config.image_std),
    )


def png(height: int, width: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
        buf, format="PNG"
    )
    return buf.getvalue()


def test_placeholder_token_ids_are_the_qwen_vocabulary_ids() -> None:
    names = {name: SPECIAL_START_ID + i for i, (name, _) in enumerate(QWEN_ADDED_TOKENS)}
    assert (
        (names["<|vision_start|>"], names["<|vision_end|>"], names["<|image_pad|>"])
        == (vision.VISION_START_ID, vision.VISION_END_ID, vision.IMAGE_PAD_ID)
        == (151652, 151653, 151655)
    )


def test_qwen3_vl_known_sizes() -> None:
    # 640x480 -> 640x480 (multiples of 32): grid 1x30x40, 300 image pads.
    ph = vision.image_placeholder(480, 640, vision.QWEN3_VL_PROCESSOR)
    assert (ph.resized_height, ph.resized_width, ph.grid_thw, ph.num_tokens) == (
        480,
        640,
        (1, 30, 40),
        300,
    )
    # 100x100 is below 65536 pixels: scaled up to 256x256, grid 1x16x16, 64 pads.
    small = vision.image_placeholder(100, 100, vision.QWEN3_VL_PROCESSOR)
    assert (small.resized_height, small.grid_thw, small.num_tokens) == (256, (1, 16, 16), 64)
    assert small.token_ids() == [151652, *[151655] * 64, 151653]


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 5000),
    st.integers(1, 5000),
    st.sampled_from(sorted(CONFIGS)),
)
def test_smart_resize_equals_transformers(height: int, width: int, name: str) -> None:
    config = CONFIGS[name]
    factor = config.patch_size * config.merge_size
    if max(height, width) / min(height, width) > 200:
        with pytest.raises(ValueError, match="aspect ratio"):
            vision.smart_resize(height, width, factor, config.min_pixels, config.max_pixels)
        return
    ours = vision.smart_resize(height, width, factor, config.min_pixels, config.max_pixels)
    assert ours == hf_qwen2_vl.smart_resize(
        height, width, factor, config.min_pixels, config.max_pixels
    )


@settings(max_examples=25, deadline=None)
@given(st.integers(8, 400), st.integers(8, 400), st.integers(0, 2**16))
def test_grid_and_pixel_values_equal_the_hf_processor(height: int, width: int, seed: int) -> None:
    if max(height, width) / min(height, width) > 200:
        return
    data = png(height, width, seed)
    ph = vision.image_placeholder(height, width, SMALL)
    with Image.open(io.BytesIO(data)) as img:
        out = hf_processor(SMALL)(images=[img.convert("RGB")], return_tensors="np")
    assert [int(x) for x in out["image_grid_thw"][0]] == list(ph.grid_thw)
    assert out["pixel_values"].shape[0] // SMALL.merge_size**2 == ph.num_tokens
    rebuilt = vision.rebuild_pixel_values(data, ph.processor_params(), "pil")
    assert rebuilt.dtype == np.float32 and rebuilt.shape == out["pixel_values"].shape
    np.testing.assert_allclose(rebuilt, out["pixel_values"], rtol=0, atol=1e-5)


def test_processor_params_round_trip_and_published_config() -> None:
    published = {  # Qwen/Qwen3-VL-*-Instruct preprocessor_config.json
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    config = vision.VisionProcessorConfig.from_preprocessor_config(published)
    assert config == vision.QWEN3_VL_PROCESSOR
    params = vision.image_placeholder(480, 640, config).processor_params()
    assert params["image_grid_thw"] == [1, 30, 40] and params["resized_width"] == 640
    assert vision.processor_config_from_params(params) == config


def test_rebuild_refuses_bytes_of_another_size() -> None:
    params = vision.image_placeholder(480, 640, vision.QWEN3_VL_PROCESSOR).processor_params()
    with pytest.raises(ValueError, match="stored 480x640"):
        vision.rebuild_pixel_values(png(100, 100, 1), params, "pil")


def test_expand_image_pads_repeats_each_image_token_as_the_processor_does() -> None:
    ids = [1, 151652, 151655, 151653, 2, 151652, 151655, 151653]
    sizes = [(100, 100), (480, 640)]
    out = vision.expand_image_pads(ids, sizes, vision.QWEN3_VL_PROCESSOR)
    assert out == [1, 151652, *[151655] * 64, 151653, 2, 151652, *[151655] * 300, 151653]
    with pytest.raises(ValueError, match="more image placeholders than the 1 images"):
        vision.expand_image_pads(ids, sizes[:1], vision.QWEN3_VL_PROCESSOR)
    with pytest.raises(ValueError, match="holds 2 image placeholders for 3 images"):
        vision.expand_image_pads(ids, [*sizes, (9, 9)], vision.QWEN3_VL_PROCESSOR)


def test_image_sizes_read_canonical_parts_and_data_urls() -> None:
    import base64

    url = "data:image/png;base64," + base64.b64encode(png(30, 40, 5)).decode()
    messages = [
        {"role": "user", "content": [{"type": "image", "sha256": "s", "width": 7, "height": 9}]},
        {"role": "tool", "content": [{"type": "image_url", "image_url": {"url": url}}]},
        {"role": "user", "content": "text"},
    ]
    assert vision.image_sizes(messages) == [(9, 7), (30, 40)]
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x"}}]}]
    with pytest.raises(ValueError, match="data: URL"):
        vision.image_sizes(bad)


def test_images_render_as_the_qwen_vl_placeholder_in_our_template() -> None:
    from capture_proxy.families.hf_template import LocalRenderer
    from capture_proxy.families.qwen_vocab import load_chat_template, load_qwen_tokenizer

    renderer = LocalRenderer(
        load_qwen_tokenizer(), load_chat_template("keep_reasoning"), vision.QWEN3_VL_PROCESSOR
    )
    part = {"type": "image", "sha256": "s", "width": 100, "height": 100}
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, part, {"type": "text", "text": "b"}],
        }
    ]
    text = renderer.render_text_sync(messages, None, add_generation_prompt=False)
    assert text == "<|im_start|>user\na<|vision_start|><|image_pad|><|vision_end|>b<|im_end|>\n"
    ids = renderer.render_sync(messages, None, add_generation_prompt=False)
    assert ids.count(vision.IMAGE_PAD_ID) == 64
    text_only = LocalRenderer(load_qwen_tokenizer(), load_chat_template("keep_reasoning"))
    with pytest.raises(Exception, match="no image processor"):
        text_only.render_sync(messages, None, add_generation_prompt=False)
