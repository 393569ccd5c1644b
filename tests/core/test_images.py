"""core/images.py and core/image_spans.py: images taken in, refused, converted and located."""

from __future__ import annotations

import base64
import hashlib
import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from capture_proxy.core.fronts import InvalidFrontRequest
from capture_proxy.core.fronts.chat import ChatCodec
from capture_proxy.core.fronts.messages import MessagesCodec
from capture_proxy.core.fronts.responses import ResponsesCodec
from capture_proxy.core.image_spans import image_runs, record_images
from capture_proxy.core.images import (
    ImageCollector,
    ImageLimits,
    ImageRefused,
    PendingImage,
    engine_messages,
    joined_content,
    prompt_image,
)
from capture_proxy.core.linking.digests import child_digest, history_digest
from capture_proxy.families.vision import (
    IMAGE_PAD_ID,
    QWEN3_VL_PROCESSOR,
    VISION_END_ID,
    VISION_START_ID,
    image_placeholder,
)


def png(height: int, width: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


LIMITS = ImageLimits(max_bytes=200_000, max_images=3)


def test_a_data_url_becomes_a_canonical_part_keyed_by_the_bytes_sha256():
    data = png(30, 50, 1)
    images = ImageCollector(LIMITS)
    part = images.url(f"data:image/png;base64,{b64(data)}", "p", "user", detail="low")
    sha = hashlib.sha256(data).hexdigest()
    assert part == {
        "type": "image",
        "sha256": sha,
        "media_type": "image/png",
        "width": 50,
        "height": 30,
        "detail": "low",
    }
    found = images.result()
    assert found is not None and found.paths == ("p",) and found.images[sha].data == data


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_the_four_formats_are_known_by_their_bytes(fmt: str):
    image = prompt_image(png(8, 9, 2, fmt), "p")
    assert image.media_type == f"image/{fmt.lower()}" and (image.width, image.height) == (9, 8)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.base64("!!", "image/png", "d", "user"), "'d' is not base64"),
        (lambda c: c.base64(b64(b"hello"), "image/png", "d", "user"), "is not a PNG, JPEG"),
        (
            lambda c: c.base64(b64(png(4, 4)), "image/jpeg", "d", "user"),
            "says 'image/jpeg' but the image is image/png",
        ),
        (lambda c: c.base64(b64(png(300, 300, 3)), "image/png", "d", "user"), "image_max_bytes"),
        (lambda c: c.base64(b64(png(4, 4)), "image/png", "d", "system"), "not in a system"),
        (lambda c: c.url("ftp://x/y.png", "d", "user"), "ftp URLs cannot carry images"),
        (lambda c: c.url("http://x/y.png", "d", "user"), "image_url_schemes: data, https"),
        (lambda c: c.url("https://x/y.png", "d", "user"), "image_fetch_remote is off"),
        (lambda c: c.url("data:image/png,abc", "d", "user"), "only base64 data URLs"),
        (lambda c: c.url(7, "d", "user"), "must be a non-empty string"),
    ],
)
def test_refusals_name_the_field(call, message):
    with pytest.raises(ImageRefused, match=message) as info:
        call(ImageCollector(LIMITS))
    assert info.value.param == "d"


def test_the_count_limit_counts_every_part_and_no_limits_means_no_images():
    images = ImageCollector(LIMITS)
    url = f"data:image/png;base64,{b64(png(4, 4))}"
    for i in range(3):
        images.url(url, f"p{i}", "user")
    with pytest.raises(ImageRefused, match="more than 3 images") as info:
        images.url(url, "p3", "tool")
    assert info.value.param == "p3"
    with pytest.raises(ImageRefused, match="not accepted here"):
        ImageCollector(None).url(url, "p", "user")
    result = images.result()
    assert result is not None and result.count == 3 and len(result.images) == 1


def test_a_remote_url_is_left_pending_when_fetching_is_on():
    limits = ImageLimits(url_schemes=frozenset({"https"}), fetch_remote=True)
    images = ImageCollector(limits)
    part = images.url("https://example.test/a.png", "p", "tool", detail="high")
    assert part == {"type": "image", "url": "https://example.test/a.png", "detail": "high"}
    result = images.result()
    assert result is not None and [p.url for p in result.pending] == ["https://example.test/a.png"]
    pending = result.pending[0]
    assert isinstance(pending, PendingImage)
    fetched = prompt_image(png(5, 6), "p")
    pending.fill(fetched)
    assert part == fetched.part("high")


def test_joined_content_keeps_text_only_content_a_string():
    image = {"type": "image", "sha256": "s"}
    assert joined_content(["a", "b"]) == "a\nb"
    assert joined_content(["a", "b", image, "c"]) == [
        {"type": "text", "text": "a\nb"},
        image,
        {"type": "text", "text": "c"},
    ]


def test_engine_messages_send_the_bytes_as_data_urls():
    data = png(6, 7)
    image = prompt_image(data, "p")
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "t"}, image.part("auto")]},
    ]
    out = engine_messages(messages, {image.sha256: image})
    assert out[0] is messages[0]
    assert out[1]["content"][1] == {
        "type": "image_url",
        "image_url": {"url": f"data:image/png;base64,{b64(data)}", "detail": "auto"},
    }
    assert messages[1]["content"][1]["type"] == "image"  # the canonical messages are kept
    with pytest.raises(KeyError):
        engine_messages(messages, {})


def _prompt(*runs: int) -> np.ndarray:
    ids = [1, 2]
    for n in runs:
        ids += [VISION_START_ID, *[IMAGE_PAD_ID] * n, VISION_END_ID, 3]
    return np.asarray(ids, dtype=np.uint32)


def test_image_runs_are_the_pad_spans_between_vision_markers():
    assert image_runs(_prompt(4, 2)) == [(3, 7), (10, 12)]
    # a vision start followed by something else (a video's pads) is not an image run
    video = np.asarray([VISION_START_ID, 151656, VISION_END_ID], dtype=np.uint32)
    assert image_runs(video) == []


def test_record_images_pair_runs_with_images_in_prompt_order():
    a, b = prompt_image(png(100, 100, 1), "a"), prompt_image(png(64, 96, 2), "b")
    na = image_placeholder(100, 100, QWEN3_VL_PROCESSOR).num_tokens
    nb = image_placeholder(64, 96, QWEN3_VL_PROCESSOR).num_tokens
    messages = [
        {"role": "user", "content": [a.part(), {"type": "text", "text": "x"}]},
        {"role": "tool", "content": [b.part()]},
        {"role": "user", "content": [a.part()]},
    ]
    images = {a.sha256: a, b.sha256: b}
    prompt = _prompt(na, nb, na)
    found = record_images(messages, images, prompt, QWEN3_VL_PROCESSOR)
    assert [e["sha256"] for e in found.entries or []] == [a.sha256, b.sha256, a.sha256]
    assert [(e["prompt_start"], e["prompt_end"]) for e in found.entries or []] == image_runs(prompt)
    assert found.entries[1]["processor"]["image_grid_thw"] == [1, 14, 20]
    assert found.data == {a.sha256: a.data, b.sha256: b.data}
    assert found.diagnostics == () and not found.unaligned
    # one run too few: no spans, flagged
    short = record_images(messages, images, _prompt(na, nb), QWEN3_VL_PROCESSOR)
    assert short.unaligned and short.entries[0]["prompt_start"] is None
    assert [d.kind for d in short.diagnostics] == ["image_spans_unaligned"]
    # a run of another length than the processor gives: kept as found, flagged
    odd = record_images(messages, images, _prompt(na, nb + 1, na), QWEN3_VL_PROCESSOR)
    assert [d.details["image"] for d in odd.diagnostics] == [1]
    assert odd.entries[1]["prompt_end"] - odd.entries[1]["prompt_start"] == nb + 1


def test_image_identity_takes_part_in_the_linking_digests():
    a, b = prompt_image(png(20, 20, 1), "a"), prompt_image(png(20, 20, 2), "b")
    turn = {"role": "assistant", "content": "seen"}

    def history(image):
        return [{"role": "user", "content": [image.part()]}, turn]

    assert history_digest(history(a)) != history_digest(history(b))
    text_only = [{"role": "user", "content": "q"}, turn]
    assert history_digest(text_only) == history_digest([{"role": "user", "content": "r"}, turn])
    # The images after the last turn are in the call's child digest, which its child finds by
    # its own history digest (they stand before the parent's answer there).
    request = [*history(a), {"role": "user", "content": [b.part()]}]
    answer = {"role": "assistant", "content": "next"}
    assert child_digest(request, answer) == history_digest([*request, answer])
    other = [*history(a), {"role": "user", "content": [a.part()]}]
    assert child_digest(other, answer) != child_digest(request, answer)


_IMAGE_JUNK = st.one_of(
    st.text(max_size=40),
    st.binary(max_size=40).map(lambda b: base64.b64encode(b).decode()),
    st.sampled_from(["data:image/png;base64,", "data:,", "data:image/png;base64,@@", "http://"]),
    st.integers(),
    st.none(),
    st.lists(st.integers(), max_size=3),
)


@settings(max_examples=150, deadline=None)
@given(data=_IMAGE_JUNK, media=st.one_of(st.text(max_size=12), st.none(), st.integers()))
def test_hostile_image_fields_are_a_named_400_in_every_front(data, media):
    """Whatever an image field holds, each front parses it or refuses it naming the field
    (``InvalidFrontRequest``, a 400): never another error."""
    limits = ImageLimits(url_schemes=frozenset({"data", "http", "https"}))
    bodies = [
        (
            ChatCodec(),
            {
                "model": "m",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": data, "detail": media}}
                        ],
                    }
                ],
            },
        ),
        (
            ResponsesCodec(),
            {
                "model": "m",
                "input": [
                    {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": data, "detail": media}],
                    }
                ],
            },
        ),
        (
            MessagesCodec(),
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": media, "data": data},
                            }
                        ],
                    }
                ],
            },
        ),
    ]
    for codec, body in bodies:
        try:
            codec.parse(body, images=limits)
        except InvalidFrontRequest as exc:
            assert exc.param
